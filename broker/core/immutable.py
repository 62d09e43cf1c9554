"""Immutable value classes that are cheap to make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def immutable(cls: type[_T]) -> type[_T]:
    """A value class: immutable to the type checker, a plain slotted dataclass at run time.

    The core makes one record per message on the publish, claim and ack paths, and the HTTP layer one
    ``NewMessage`` per published message; a ``frozen=True`` dataclass costs about four times as much to
    construct (3.3 µs against 0.8 µs for nine fields, measured on this project's machine), so
    immutability is enforced by mypy instead of at run time.
    """
    make: Callable[[type[_T]], type[_T]] = dataclass(slots=True)
    return make(cls)
