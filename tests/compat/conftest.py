"""What the compatibility surfaces' tests share: a record of the commands their routes send."""

from __future__ import annotations

from typing import Any

import pytest

from broker.actor import QueueActor


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``(queue, command type)`` of each command sent to a queue's actor with ``request``, in order: a
    route's round trips to the actors (clear it before the request a test counts)."""
    commands: list[tuple[str, str]] = []
    request = QueueActor.request

    async def recorded(actor: QueueActor, command: Any, **options: Any) -> Any:
        commands.append((actor.core.name, type(command).__name__))
        return await request(actor, command, **options)

    monkeypatch.setattr(QueueActor, "request", recorded)
    return commands
