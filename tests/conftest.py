"""Shared fixtures: a broker running in process (actors, registry, app) under the test's Trio run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from quart.typing import TestClientProtocol as Client  # aliased: pytest would collect "Test…" names

from broker.config import Settings
from broker.server import Broker, open_broker
from broker.storage.snapshots import SNAPSHOTS_DIR


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


def drop_snapshot(data_dir: Path, snapshot_id: str) -> None:
    """Delete a snapshot's header behind the broker's back, so that recovery (or a restore) uses an
    older one and replays more journal: e.g. the snapshot a clean shutdown took."""
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        assert txn.delete(f"s/{snapshot_id}/meta".encode()), f"no snapshot {snapshot_id} to drop"


def start_refusal(data_dir: Path) -> str:
    """The line ``broker serve`` refuses ``data_dir`` with, run as the operator runs it: its last line
    on stderr, after the log lines a start writes before it reads the data directory, with no
    traceback and exit status 1."""
    served = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--port", "0", "--data-dir", str(data_dir)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
    return served.stderr.splitlines()[-1].removeprefix("broker: ")
