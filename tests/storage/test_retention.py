"""Journal retention after snapshots, and the snapshots that trigger it (by time, by journal size, on
demand), taken in a child process."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio

from broker.config import Settings
from broker.server import open_broker
from broker.storage.restore import restore
from broker.storage.retention import Retention, SegmentFacts, prunable_until, prune
from broker.storage.segments import MAGIC, read_entries, segment_name, segments
from broker.storage.snapshots import JOURNAL_DIR, SNAPSHOTS_DIR, list_snapshots
from broker.storage.store import SnapshotFailed, Snapshotter, open_data_dir
from tests.conftest import Client

NOW = 1_000_000.0
DAY = 86400.0


def facts(*segments: tuple[int, int, float]) -> list[SegmentFacts]:
    return [SegmentFacts(*segment) for segment in segments]


# -- the policy ---------------------------------------------------------------------------------------


def test_only_segments_that_the_oldest_snapshot_covers_may_go() -> None:
    listed = facts((1, 100, 0.0), (11, 100, 0.0), (21, 100, 0.0), (31, 100, 0.0))
    everything = Retention(max_bytes=0, max_age=0.0)
    assert prunable_until(listed, covered_lsn=9, retention=everything, now=NOW) == 0  # 1-10 is not covered
    assert prunable_until(listed, covered_lsn=10, retention=everything, now=NOW) == 10
    assert prunable_until(listed, covered_lsn=25, retention=everything, now=NOW) == 20
    # The newest segment is being written: never deleted, whatever covers it.
    assert prunable_until(listed, covered_lsn=1000, retention=everything, now=NOW) == 30


def test_by_size_the_oldest_go_until_the_journal_fits() -> None:
    listed = facts((1, 400, NOW), (11, 300, NOW), (21, 200, NOW), (31, 100, NOW))  # 1,000 bytes
    by_size = Retention(max_bytes=650, max_age=None)
    assert prunable_until(listed, covered_lsn=1000, retention=by_size, now=NOW) == 10  # 600 left
    assert prunable_until(listed, covered_lsn=1000, retention=Retention(300, None), now=NOW) == 20
    assert prunable_until(listed, covered_lsn=1000, retention=Retention(1000, None), now=NOW) == 0


def test_by_age_segments_last_written_longer_ago_go() -> None:
    listed = facts((1, 10, NOW - 9 * DAY), (11, 10, NOW - 8 * DAY), (21, 10, NOW - 2 * DAY), (31, 10, NOW))
    week = Retention(max_bytes=None, max_age=7 * DAY)
    assert prunable_until(listed, covered_lsn=1000, retention=week, now=NOW) == 20
    # Either limit is enough to delete: size keeps going where age stopped.
    assert prunable_until(listed, covered_lsn=1000, retention=Retention(15, 7 * DAY), now=NOW) == 30


def test_with_no_limit_the_journal_is_kept_whole() -> None:
    listed = facts((1, 10**12, 0.0), (11, 10, NOW))
    assert prunable_until(listed, covered_lsn=1000, retention=Retention(None, None), now=NOW) == 0


# -- on a running broker --------------------------------------------------------------------------------


async def publish(client: Client, count: int, tag: str) -> None:
    for n in range(count):
        body = {"messages": [{"payload": {"tag": tag, "n": n, "pad": "x" * 200}}]}
        assert (await client.post("/v1/queues/jobs/messages", json=body)).status_code == 201


async def snapshot(client: Client) -> dict[str, object]:
    response = await client.post("/v1/admin/snapshots")
    assert response.status_code in (200, 201), await response.get_data()
    snapshot: dict[str, object] = (await response.get_json())["snapshot"]
    return snapshot


async def test_snapshots_prune_the_journal_they_cover_and_every_kept_snapshot_still_restores(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        journal_segment_bytes=2000,  # about 7 records per segment
        journal_retention=Retention(max_bytes=0, max_age=None),  # keep nothing the snapshots cover
    )
    journal = tmp_path / JOURNAL_DIR
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for round in range(4):
            await publish(client, 20, f"round-{round}")
            await snapshot(client)
        kept = list_snapshots(tmp_path)
        assert len(kept) == 3  # the oldest of four was dropped, and the journal it alone needed
        first_kept = segments(journal)[0].first_lsn
        assert 1 < first_kept <= kept[-1].lsn + 1  # nothing the oldest kept snapshot needs is gone
        await publish(client, 5, "after")
    # Every kept snapshot still restores, with the journal after it.
    expected = 85
    opened = open_data_dir(tmp_path)
    try:
        assert opened.recovered.queues["jobs"].depth == expected
    finally:
        opened.release()
    oldest = list_snapshots(tmp_path)[-1]
    restored = restore(tmp_path, snapshot_id=oldest.id)
    assert restored.snapshot.id == oldest.id


async def test_a_journal_within_its_retention_is_kept_whole(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, journal_segment_bytes=2000)  # defaults: 4 GiB, a week
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for round in range(4):
            await publish(client, 20, f"round-{round}")
            await snapshot(client)
    assert segments(tmp_path / JOURNAL_DIR)[0].first_lsn == 1
    assert next(iter(read_entries(tmp_path / JOURNAL_DIR))).lsn == 1


async def test_old_segments_go_by_age(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, journal_segment_bytes=2000)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for round in range(3):
            await publish(client, 20, f"round-{round}")
            await snapshot(client)
    journal = tmp_path / JOURNAL_DIR
    listed = segments(journal)
    for segment in listed[:3]:  # last written eight days ago
        os.utime(segment.path, (NOW, NOW))
    deleted = prune(journal, list_snapshots(tmp_path)[-1].lsn, Retention(None, 7 * DAY), NOW + 8 * DAY)
    assert deleted == [segment.path for segment in listed[:3]]


async def test_a_journal_that_grew_by_snapshot_bytes_is_snapshotted_before_the_interval(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path, snapshot_interval=3600, snapshot_bytes=4000)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        assert list_snapshots(tmp_path) == []
        assert broker.snapshots is not None
        await publish(client, 20, "grow")  # ~5 KB of journal
        with trio.fail_after(30):
            await broker.snapshots.wait_taken(0)
        assert list_snapshots(tmp_path)[0].lsn >= 2


async def test_journal_written_while_a_snapshot_is_taken_counts_towards_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size trigger was re-armed after a snapshot ended, from the journal's size then: a burst
    written while a snapshot was taken was never counted, and waited for the interval (an hour here)."""
    settings = Settings(data_dir=tmp_path, snapshot_interval=3600, snapshot_bytes=4000)
    begun, release = trio.Event(), trio.Event()
    compact = Snapshotter._compact

    async def slow_compact(self: Snapshotter, until: int) -> Any:
        begun.set()
        await release.wait()
        return await compact(self, until)

    monkeypatch.setattr(Snapshotter, "_compact", slow_compact)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        assert broker.snapshots is not None
        await publish(client, 20, "grow")  # ~5 KB of journal: a snapshot begins
        with trio.fail_after(30):
            await begun.wait()
            await publish(client, 20, "during")  # ~5 KB more while it is taken
            release.set()
            await broker.snapshots.wait_taken(1)  # a second one, with nothing written since
        first_lsn = list_snapshots(tmp_path)[-1].lsn
        assert list_snapshots(tmp_path)[0].lsn > first_lsn


async def test_a_snapshot_the_disk_has_no_room_for_is_refused_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the snapshot process ran, and LMDB, whose file is mapped, left pages the file
    system could not back: reading them killed the snapshot process and then the broker (SIGBUS, on a
    full tmpfs). Now no snapshot is started without room for twice the last one, and a graceful stop
    that cannot take its snapshot says so and still exits cleanly (the journal holds everything)."""
    from broker.storage import durable

    settings = Settings(data_dir=tmp_path)
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            await publish(client, 5, "before")
            assert (await client.post("/v1/admin/snapshots")).status_code == 201
            [last] = list_snapshots(tmp_path)
            await publish(client, 5, "after")
            monkeypatch.setattr(durable, "free_bytes", lambda _: 2 * last.bytes)  # less than it needs
            response = await client.post("/v1/admin/snapshots")
            error = (await response.get_json())["error"]
            assert response.status_code == 503 and error["code"] == "storage_unavailable"
            assert f"{2 * last.bytes} bytes are free on the data directory's disk" in error["message"]
            assert list_snapshots(tmp_path) == [last]
    # Logged when asked for (an operator's alert must not wait for the stop), and at the stop.
    failed = [
        (log["at"], "bytes are free" in log["detail"]) for log in logs if log["event"] == "snapshot_failed"
    ]
    assert failed == [("request", True), ("shutdown", True)]


async def test_a_snapshot_that_fails_answers_503_with_the_reason_and_the_broker_serves_on(
    tmp_path: Path,
) -> None:
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await publish(client, 1, "before")
        (tmp_path / SNAPSHOTS_DIR).mkdir()
        (tmp_path / SNAPSHOTS_DIR / "data.mdb").mkdir()  # LMDB cannot open a directory as its file
        response = await client.post("/v1/admin/snapshots")
        assert response.status_code == 503
        error = (await response.get_json())["error"]
        assert error["code"] == "storage_unavailable"
        assert "snapshot" in error["message"] and "Is a directory" in error["message"]
        assert (await client.get("/v1/admin/snapshots")).status_code == 503
        await publish(client, 1, "after")
        (tmp_path / SNAPSHOTS_DIR / "data.mdb").rmdir()
        assert (await client.post("/v1/admin/snapshots")).status_code == 201


async def test_a_journal_that_cannot_be_pruned_fails_neither_the_snapshot_nor_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot was written, then retention's delete raised (a journal directory made read-only, a
    segment another process holds): the bare OSError came out of ``POST /v1/admin/snapshots`` as 500
    ``internal_error``, "the broker hit a bug". An OSError anywhere else in a snapshot is a 503."""
    from broker.storage import store

    def refused(*_: Any) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(tmp_path / JOURNAL_DIR))

    with structlog.testing.capture_logs() as logs:
        async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            await publish(client, 1, "before")
            monkeypatch.setattr(store, "prune", refused)
            response = await client.post("/v1/admin/snapshots")
            assert response.status_code == 201
            assert (await response.get_json())["snapshot"]["id"] == list_snapshots(tmp_path)[0].id
            await publish(client, 1, "after")
            monkeypatch.setattr(store, "_hold_snapshot_lock", refused)
            response = await client.post("/v1/admin/snapshots")
            error = (await response.get_json())["error"]
            assert (response.status_code, error["code"]) == (503, "storage_unavailable")
            assert "Permission denied" in error["message"]
            monkeypatch.undo()
    [prune_failed] = [log for log in logs if log["event"] == "journal_prune_failed"]
    assert "Permission denied" in prune_failed["detail"] and prune_failed["log_level"] == "error"


async def test_segments_deleted_before_a_prune_failed_are_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.storage import store
    from broker.storage.segments import PartlyDeleted

    gone = tmp_path / JOURNAL_DIR / segment_name(1)

    def half_way(*_: Any) -> list[Path]:
        raise PartlyDeleted(OSError(5, "Input/output error"), [gone])

    monkeypatch.setattr(store, "prune", half_way)
    with structlog.testing.capture_logs() as logs:
        async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            await publish(client, 1, "before")
            assert (await client.post("/v1/admin/snapshots")).status_code == 201
    events = [(log["event"], log.get("segments")) for log in logs if log["event"].startswith("journal_prune")]
    assert events[:2] == [("journal_pruned", [gone.name]), ("journal_prune_failed", None)]


class Committed:
    """The one thing a ``Snapshotter`` asks of its journal when taking a snapshot."""

    def __init__(self, lsn: int) -> None:
        self.committed_lsn = lsn


async def test_a_snapshot_whose_child_process_fails_raises_its_reason_and_writes_nothing(
    tmp_path: Path,
) -> None:
    journal = tmp_path / JOURNAL_DIR
    journal.mkdir()
    start = struct.pack("<4sIQ", MAGIC, 99, 1)  # a segment of a format version this broker cannot read
    (journal / segment_name(1)).write_bytes(start + struct.pack("<I", zlib.crc32(start)))
    snapshots = Snapshotter(tmp_path, Committed(5))  # type: ignore[arg-type]
    with pytest.raises(SnapshotFailed, match=r"the snapshot failed: UnsupportedVersion: .* version 99"):
        await snapshots.take()
    assert list_snapshots(tmp_path) == []


def test_the_compactor_says_how_to_call_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "broker.storage.compactor"], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("usage: python -m broker.storage.compactor DATA_DIR UNTIL_LSN")
