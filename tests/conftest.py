"""Shared fixtures: a broker running in process (actors, registry, app) under the test's Trio run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from quart.typing import TestClientProtocol as Client  # aliased: pytest would collect "Test…" names

from broker.config import Settings
from broker.server import Broker, open_broker


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with open_broker(Settings(in_memory=True)) as running:
        yield running


@pytest.fixture
async def client(broker: Broker) -> AsyncIterator[Client]:
    async with broker.app.test_app() as test_app:
        yield test_app.test_client()


async def make_queue(client: Client, name: str = "jobs", **config: Any) -> dict[str, Any]:
    response = await client.put(f"/v1/queues/{name}", json=config)
    assert response.status_code == 201, await response.get_data()
    body: dict[str, Any] = await response.get_json()
    return body
