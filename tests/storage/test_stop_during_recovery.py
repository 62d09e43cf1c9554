"""A stop asked for while a start reads the data directory (SIGTERM from a service manager during a long
recovery): the start gives up between two chunks of the snapshot or two runs of journal records, having
changed nothing, and ``broker serve`` exits 0 without listening (docs/operations.md, "Running as a
service")."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio

from broker import server
from broker.config import Settings
from broker.server import open_broker, serve
from broker.storage import snapshots, store
from broker.storage.snapshots import JOURNAL_DIR, list_snapshots
from broker.storage.store import StoppedDuringRecovery, open_data_dir
from tests.conftest import drop_snapshot


class StopAfter(threading.Event):
    """A stop that is asked for once it has been looked at ``looks`` times: mid-way, deterministically."""

    def __init__(self, looks: int) -> None:
        super().__init__()
        self.looks = looks
        self.seen = 0

    def is_set(self) -> bool:
        self.seen += 1
        return self.seen > self.looks or super().is_set()


async def a_data_dir(data_dir: Path, messages: int, *, snapshot: bool) -> None:
    """``messages`` published in batches of 100; the snapshot of the clean stop kept if ``snapshot``."""
    async with open_broker(Settings(data_dir=data_dir)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for start in range(0, messages, 100):
            batch = {"messages": [{"payload": n} for n in range(start, start + 100)]}
            assert (await client.post("/v1/queues/jobs/messages", json=batch)).status_code == 201
    if not snapshot:
        for info in list_snapshots(data_dir):
            drop_snapshot(data_dir, info.id)


def files_of(data_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(data_dir)): path.read_bytes() for path in sorted(data_dir.rglob("*"))}


@pytest.mark.parametrize("reading", ["snapshot", "journal"])
async def test_a_stop_while_the_data_dir_is_read_changes_nothing_and_a_later_start_has_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reading: str
) -> None:
    monkeypatch.setattr(snapshots, "CHUNK", 100)  # the snapshot's 2,000 messages in 20 chunks
    await a_data_dir(tmp_path, 2_000, snapshot=reading == "snapshot")
    monkeypatch.setattr(store, "STOP_CHECK_RECORDS", 5)  # the journal's 20 publishes in 4 runs
    journal = files_of(tmp_path / JOURNAL_DIR)
    stop = StopAfter(looks=3)
    with pytest.raises(StoppedDuringRecovery):
        open_data_dir(tmp_path, stop=stop)
    assert stop.seen == 4, "it gave up at the first look after the stop, mid-way"
    assert files_of(tmp_path / JOURNAL_DIR) == journal, "nothing was cut, added or reserved"
    opened = open_data_dir(tmp_path)  # the directory's lock was let go
    try:
        assert len(opened.recovered.queues["jobs"].message_ids()) == 2_000
    finally:
        opened.release()


async def test_a_sigterm_while_the_data_dir_is_read_ends_serve_at_once_without_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``open_data_dir`` stands in for a recovery that would take longer than anyone waits: it returns
    only once the SIGTERM's stop is set. Before the fix the start went on to the end, listened, and only
    then stopped (a 278 MB data directory: 4.9 s from the signal to the exit, now 0.06 s)."""
    await a_data_dir(tmp_path, 100, snapshot=True)
    reading = trio.Event()
    real = server.open_data_dir

    def a_long_recovery(data_dir: Path, *, stop: threading.Event | None = None, **options: Any) -> Any:
        trio.from_thread.run_sync(reading.set)
        assert stop is not None and stop.wait(timeout=30), "the signal never reached the recovery"
        return real(data_dir, stop=stop, **options)

    monkeypatch.setattr(server, "open_data_dir", a_long_recovery)
    with trio.fail_after(30), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, Settings(data_dir=tmp_path, port=0))
            await reading.wait()
            signal.raise_signal(signal.SIGTERM)
    events = [line["event"] for line in logs]
    assert "stopped_during_recovery" in events
    assert "listening" not in events and "recovered" not in events
    opened = open_data_dir(tmp_path)
    try:
        assert len(opened.recovered.queues["jobs"].message_ids()) == 100
    finally:
        opened.release()
