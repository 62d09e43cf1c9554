"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog


def configure(level: str = "info") -> None:
    """JSON lines (orjson, a line per ``write``) when stderr is not a terminal; readable lines when it is.

    A request logs one line (``http/observe.py``), so the JSON path is on every request's way: orjson
    renders it in ~2 µs against ~10 µs for the standard library's ``json``."""
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    factory: Any
    if sys.stderr.isatty():
        processors.append(structlog.dev.ConsoleRenderer())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    else:
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
