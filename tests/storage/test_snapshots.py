"""Snapshots: taken from the journal while the broker serves, used by recovery, checked by checksum."""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
import structlog
import trio

from broker.config import Settings
from broker.core import FinishedHistory, NewMessage, QueueCore, State
from broker.core.commands import Ack, Claim, Defer, Extend, Nack, Publish, UpdateConfig
from broker.core.config import QueueConfig
from broker.core.queue import MESSAGE_FIELDS
from broker.core.records import QueueCreated
from broker.errors import MessageNotFound
from broker.server import open_broker
from broker.storage import snapshots
from broker.storage.codec import cbor_dumps, cbor_loads
from broker.storage.format import FRAME_OVERHEAD, encode_frames
from broker.storage.recovery import Recovered
from broker.storage.restore import RestoreError, restore, verify
from broker.storage.segments import HEADER_SIZE, JournalGap, SegmentWriter, segments
from broker.storage.snapshots import (
    JOURNAL_DIR,
    SNAPSHOTS_DIR,
    CorruptSnapshot,
    _shared,
    compact,
    list_snapshots,
    read_snapshot,
    write_snapshot,
)
from broker.storage.store import Snapshotter, open_data_dir
from tests.conftest import drop_snapshot, start_refusal


async def view(client: Any) -> dict[str, Any]:
    """What a restart must give back: each queue's config and counters, and every message."""
    queues = (await (await client.get("/v1/queues")).get_json())["queues"]
    seen: dict[str, Any] = {}
    for queue in queues:
        queue["stats"].pop("oldest_ready_age")
        messages = (await (await client.get(f"/v1/queues/{queue['name']}/messages")).get_json())["messages"]
        seen[queue["name"]] = (queue, messages)
    return seen


async def load(client: Any, rounds: int, tag: str) -> None:
    for n in range(rounds):
        batch = {"messages": [{"payload": [n, i], "key": f"{tag}-{n}-{i}"} for i in range(5)]}
        assert (await client.post("/v1/queues/jobs/messages", json=batch)).status_code == 201
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 3})).get_json()
        leases = [m["lease_id"] for m in claimed["messages"]]
        await client.post("/v1/queues/jobs/ack", json={"leases": leases[:1]})
        await client.post("/v1/queues/jobs/nack", json={"leases": leases[1:2], "retryable": False})


async def two_snapshots(settings: Settings) -> dict[str, Any]:
    """Serve a load, snapshot it, serve more, stop (a second snapshot): what a restart must give back."""
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await load(client, 2, "a")
        assert (await client.post("/v1/admin/snapshots")).status_code == 201
        await load(client, 2, "b")
        return await view(client)


async def test_a_snapshot_taken_while_serving_plus_the_journal_after_it_rebuild_every_queue(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={"max_attempts": 2})
        await load(client, 3, "a")
        refused = await client.post("/v1/admin/snapshots", json={"queues": ["jobs"]})
        assert refused.status_code == 400, "it takes no body: a field it does not know must not pass"
        response = await client.post("/v1/admin/snapshots")
        assert response.status_code == 201, await response.get_data()
        taken = (await response.get_json())["snapshot"]
        assert taken["queues"] == 2 and taken["messages"] > 0
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", taken["taken_at"])  # §2: RFC 3339
        await load(client, 2, "b")  # after the snapshot: recovery replays these from the journal
        before = await view(client)
        listed = await (await client.get("/v1/admin/snapshots")).get_json()
        assert [s["id"] for s in listed["snapshots"]] == [taken["id"]]
    # A clean shutdown took another snapshot; drop it to make recovery use the first plus the journal.
    [newest, first] = list_snapshots(tmp_path)
    assert first.id == taken["id"] and newest.lsn > first.lsn
    drop_snapshot(tmp_path, newest.id)
    opened = open_data_dir(tmp_path)
    try:
        assert opened.recovered.records == newest.lsn - first.lsn  # only what came after the snapshot
    finally:
        opened.release()
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        assert await view(app.test_client()) == before


async def test_after_a_restart_get_one_shows_every_message_with_its_history_and_the_finished_ones(
    tmp_path: Path,
) -> None:
    """§6: an acked message answers with its history for a while (bounded by ``finished_history``),
    across a restart too; past ``finished_history_bytes`` without its payload. A clean stop takes a
    snapshot of everything, so the restart replays nothing: what get-one shows after it came from the
    snapshot."""
    settings = Settings(data_dir=tmp_path, finished_history=FinishedHistory(count=3, payload_bytes=2))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        batch = {"messages": [{"payload": n} for n in range(7)]}
        published = await (await client.post("/v1/queues/jobs/messages", json=batch)).get_json()
        ids = [message["id"] for message in published["messages"]]
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 6})).get_json()
        leases = [message["lease_id"] for message in claimed["messages"]]
        for settle, body in (
            ("ack", {"leases": leases[:3]}),
            ("nack", {"leases": leases[3:4], "retryable": False}),
            ("nack", {"leases": leases[4:5], "delay": 60, "reason": "later"}),
            ("extend", {"leases": leases[5:6], "lease": 120}),
        ):
            assert (await client.post(f"/v1/queues/jobs/{settle}", json=body)).status_code == 200
        before = [await get_one(client, message_id) for message_id in ids]
    # Four finished, three kept: the oldest acked one is gone, before the restart and after it.
    assert [status for status, _ in before] == [404] + [200] * 6
    assert [shown["state"] for _, shown in before[1:]] == [
        "acked",
        "acked",
        "dead_lettered",
        "delayed",
        "in_flight",
        "ready",
    ]
    assert [len(shown["history"]) for _, shown in before[1:]] == [3, 3, 4, 3, 3, 1]
    # Payloads of one byte each, two bytes kept: the oldest finished message kept let its payload go.
    assert [(shown["payload"], shown.get("payload_dropped")) for _, shown in before[1:4]] == [
        (None, True),
        (2, None),
        (3, None),
    ]
    # The snapshot process was told the bound too: it kept three, where its default keeps 10,000.
    [newest, *_] = list_snapshots(tmp_path)
    kept = read_snapshot(tmp_path, newest, history=FinishedHistory(count=100)).queues["jobs"]
    assert sum(len(block[0]) for block in kept.dump().finished) == 3
    opened = open_data_dir(tmp_path)
    try:
        assert opened.recovered.records == 0
    finally:
        opened.release()
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert [await get_one(client, message_id) for message_id in ids] == before


async def get_one(client: Any, message_id: str) -> tuple[int, Any]:
    response = await client.get(f"/v1/queues/jobs/messages/{message_id}")
    return response.status_code, await response.get_json()


async def test_a_snapshot_that_fails_its_checksum_is_skipped_for_the_one_before(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    before = await two_snapshots(settings)
    newest, _ = list_snapshots(tmp_path)
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = f"s/{newest.id}/q/000000/m/00000000".encode()
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01  # one flipped bit
        txn.put(key, bytes(value))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        assert await view(app.test_client()) == before


def test_a_snapshot_that_fails_its_checksum_and_that_nothing_else_reaches_is_refused(tmp_path: Path) -> None:
    """After a restore, the snapshot it wrote is the only copy of its state (the journal was moved
    aside). Were it damaged, the start skipped it and served a broker with no queue at all."""
    core = QueueCore("jobs", QueueConfig(), "j-")
    core.publish([NewMessage(b"1")], 1_000.0)
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=9, last_at=1_000.0))
    (tmp_path / JOURNAL_DIR).mkdir()
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = b"s/00000000000000000009/q/000000/m/00000000"
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value))
    with pytest.raises(JournalGap) as refused:
        open_data_dir(tmp_path)
    assert str(refused.value).startswith(
        "snapshot 00000000000000000009 covers lsns up to 9, but the journal and the snapshots that can be "
        "read reach lsn 0 only: lsns 1-9 would be lost. Nothing was changed. Snapshot 00000000000000000009 "
        "skipped: snapshot 00000000000000000009 fails its checksum"
    )
    assert not any((tmp_path / JOURNAL_DIR).iterdir()), "nothing was written"


def damage_every_lmdb_page(data_dir: Path) -> None:
    """Flip bytes in the header of every page but the two meta pages: LMDB's B-tree no longer reads
    (MDB_CORRUPTED), where a flipped value byte is only a snapshot checksum failure."""
    path = data_dir / SNAPSHOTS_DIR / "data.mdb"
    data = bytearray(path.read_bytes())
    for offset in range(2 * 4096, len(data), 4096):
        data[offset + 10] ^= 0xFF
        data[offset + 11] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_a_snapshot_file_lmdb_cannot_read_is_503_and_a_stop_still_exits_cleanly(tmp_path: Path) -> None:
    """MDB_CORRUPTED from damaged pages escaped the storage seam as lmdb.CorruptedError: the snapshot
    calls answered 500, and the snapshot a graceful stop takes failed it (exit 1, 'cannot start')."""
    settings = Settings(data_dir=tmp_path)
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            await load(client, 1, "a")
            assert (await client.post("/v1/admin/snapshots")).status_code == 201
            damage_every_lmdb_page(tmp_path)
            await load(client, 1, "b")
            for answer in (await client.get("/v1/admin/snapshots"), await client.post("/v1/admin/snapshots")):
                error = (await answer.get_json())["error"]
                assert answer.status_code == 503 and error["code"] == "storage_unavailable", error
                assert "MDB_CORRUPTED" in error["message"]
    # The stop's snapshot failed, and said so; the journal holds everything, for the next start.
    (failed,) = [log for log in logs if log["event"] == "snapshot_failed" and log.get("at") == "shutdown"]
    assert "MDB_CORRUPTED" in failed["detail"]
    with pytest.raises(snapshots.SnapshotStoreError, match="MDB_CORRUPTED"):
        list_snapshots(tmp_path)


async def test_an_in_memory_broker_has_no_snapshots(tmp_path: Path) -> None:
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as app:
        response = await app.test_client().post("/v1/admin/snapshots")
        assert response.status_code == 409
        assert (await response.get_json())["error"]["code"] == "conflict"


async def test_bit_rot_under_a_snapshot_costs_nothing_after_it_and_the_journal_goes_on_in_a_new_segment(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await load(client, 3, "a")
        taken = (await (await client.post("/v1/admin/snapshots")).get_json())["snapshot"]
        await load(client, 2, "b")  # after the snapshot: only the journal holds these
        before = await view(client)
    [newest, first] = list_snapshots(tmp_path)
    drop_snapshot(tmp_path, newest.id)  # recovery must use the first + the journal
    (segment,) = segments(tmp_path / JOURNAL_DIR)
    before_restart_lsn = newest.lsn
    data = bytearray(segment.path.read_bytes())
    data[HEADER_SIZE + FRAME_OVERHEAD + 20] ^= 0x40  # inside lsn 1, which the snapshot covers
    segment.path.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            assert await view(client) == before
            await load(client, 1, "c")
            after = await view(client)
    (damage,) = [log for log in logs if log["event"] == "journal_damage_under_snapshot"]
    assert damage["snapshot_lsn"] == first.lsn and "fails its checksum" in damage["detail"]
    # The damaged segment is kept for audits; the journal went on in a new one.
    assert [s.first_lsn for s in segments(tmp_path / JOURNAL_DIR)] == [1, before_restart_lsn + 1]
    assert taken["lsn"] == first.lsn
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        assert await view(app.test_client()) == after


async def journal_in_segments_and_an_older_snapshot(data_dir: Path) -> tuple[dict[str, Any], int, list[Any]]:
    """A journal of ~2 KB segments, and a snapshot taken part-way through it (the one taken at
    shutdown is dropped): what a restart must give back, the snapshot's lsn, and the segments."""
    settings = Settings(data_dir=data_dir, journal_segment_bytes=2000)  # about 7 records per segment
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await load(client, 2, "a")
        await client.post("/v1/queues/jobs/messages", json={"payload": "one more"})  # mid-segment
        assert (await client.post("/v1/admin/snapshots")).status_code == 201
        await load(client, 3, "b")  # after the snapshot: only the journal holds these
        before = await view(client)
    [newest, first] = list_snapshots(data_dir)
    drop_snapshot(data_dir, newest.id)
    return before, first.lsn, segments(data_dir / JOURNAL_DIR)


async def test_a_damaged_header_of_the_segment_the_snapshot_ends_in_costs_nothing_after_it(
    tmp_path: Path,
) -> None:
    """The segment holding the snapshot's lsn holds records after it too. A bad header there was cut
    with everything after it (records that still passed their checksums), and the broker then wrote
    lsn snapshot + 1 behind the journal's last lsn, a gap in its own journal. The frames carry their
    own checksums and lsns: the start steps over the header as over other damage the snapshot covers."""
    before, snapshot_lsn, listed = await journal_in_segments_and_an_older_snapshot(tmp_path)
    (holding,) = [
        s for s, after in itertools.pairwise(listed) if s.first_lsn <= snapshot_lsn < after.first_lsn - 1
    ]
    data = bytearray(holding.path.read_bytes())
    data[5] ^= 0x01  # in the header
    holding.path.write_bytes(bytes(data))
    settings = Settings(data_dir=tmp_path, journal_segment_bytes=2000)
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            assert await view(client) == before
            await load(client, 1, "c")
            after = await view(client)
    (damage,) = [log for log in logs if log["event"] == "journal_damage_under_snapshot"]
    assert "fails its checksum" in damage["detail"] and holding.path.name in damage["detail"]
    assert not [log for log in logs if log["event"] == "journal_tail_cut"]
    problems = verify(tmp_path).journal_problem
    assert problems is not None and problems.startswith("damage under snapshot") and "cuts" not in problems
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            assert await view(app.test_client()) == after
    assert not [log for log in logs if log["event"] == "journal_tail_cut"]


async def test_a_cut_that_ends_the_journal_below_the_snapshot_goes_on_after_the_snapshot(
    tmp_path: Path,
) -> None:
    """With the segments after the snapshot's lsn gone, the start recovers the snapshot and cuts what
    no longer joins up; the journal it writes then goes on from the snapshot's lsn in a new segment,
    never behind the older records (which a later start or audit would read as a gap, and cut)."""
    _, snapshot_lsn, listed = await journal_in_segments_and_an_older_snapshot(tmp_path)
    holding = [s for s in listed if s.first_lsn <= snapshot_lsn + 1][-1]
    holding.path.unlink()  # the records just after the snapshot are lost, and later ones cannot join
    settings = Settings(data_dir=tmp_path, journal_segment_bytes=2000)
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await load(client, 1, "c")
            after = await view(client)
    (cut,) = [log for log in logs if log["event"] == "journal_tail_cut"]
    assert cut["next_lsn"] == snapshot_lsn + 1
    assert snapshot_lsn + 1 in [s.first_lsn for s in segments(tmp_path / JOURNAL_DIR)]
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            assert await view(app.test_client()) == after
    assert not [log for log in logs if log["event"] == "journal_tail_cut"]


def a_queue_of_every_kind_of_message() -> QueueCore:
    """A backlog of 30 plain messages, then one with headers and a key, one delayed, two in flight."""
    core = a_backlog(30)
    now = 1_000.0
    core.apply(Publish([NewMessage(b"\x00", binary=True, headers={"h": "v"}, key="k", priority=3)]), now)
    core.apply(Publish([NewMessage(b'"later"', delay=60.0)]), now)
    core.apply(Claim("worker", max_count=2), now)
    return core


def a_backlog(count: int, name: str = "jobs") -> QueueCore:
    core = QueueCore(name, QueueConfig(), "p0")
    core.apply(Publish([NewMessage(f'"job {n}"'.encode()) for n in range(count)]), 1_000.0)
    return core


def chunks_of(data_dir: Path) -> list[list[Any]]:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), readonly=True, lock=False) as env, env.begin() as txn:
        return [cbor_loads(bytes(value)) for key, value in txn.cursor() if b"/m/" in bytes(key)]


def test_a_value_every_message_of_a_chunk_shares_is_written_once_and_every_message_reads_back(
    tmp_path: Path,
) -> None:
    backlog, mixed = a_backlog(30, "backlog"), a_queue_of_every_kind_of_message()
    write_snapshot(
        tmp_path, Recovered(queues={"backlog": backlog, "jobs": mixed}, last_lsn=40, last_at=1_000.0)
    )
    backlog_chunk, mixed_chunk = chunks_of(tmp_path)
    # A backlog's messages differ in id, seq and payload only: every other column is one value.
    assert [len(column) for column in backlog_chunk] == [30, 30, 30] + [1] * 13
    assert [len(column) for column in mixed_chunk] == [32] * 7 + [1] + [32] * 8  # one time of publishing
    (info,) = list_snapshots(tmp_path)
    assert info.version == snapshots.SNAPSHOT_VERSION
    loaded = read_snapshot(tmp_path, info).queues
    assert loaded["backlog"].dump() == backlog.dump()
    assert loaded["jobs"].dump() == mixed.dump()


def test_equal_floats_of_other_signs_are_not_one_shared_value() -> None:
    assert _shared([0.0, -0.0]) == [0.0, -0.0]
    assert _shared([-0.0, -0.0]) == [-0.0]
    assert _shared([{"h": "v"}, {"h": "v"}]) == [{"h": "v"}, {"h": "v"}]  # maps are written per message


#: How versions 2 and 3 wrote a chunk: no history column, every value written out (2) or a value all
#: of a chunk's messages share written once (3).
OLDER_CHUNKS = {
    2: lambda columns, lsn, queue: cbor_dumps(list(columns[:-1])),
    3: lambda columns, lsn, queue: cbor_dumps([_shared(column) for column in columns[:-1]]),
}


@pytest.mark.parametrize("version", sorted(OLDER_CHUNKS))
def test_a_snapshot_of_an_older_version_still_reads_its_messages_without_their_histories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    core = a_queue_of_every_kind_of_message()
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "SNAPSHOT_VERSION", version)
        patch.setattr(snapshots, "_chunk", OLDER_CHUNKS[version])
        write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=1_000.0))
    (info,) = list_snapshots(tmp_path)
    [chunk] = chunks_of(tmp_path)
    assert info.version == version and len(chunk) == len(MESSAGE_FIELDS) - 1
    if version == 2:
        assert all(len(column) == 32 for column in chunk)
    image = core.dump()
    [block] = image.messages
    *columns, histories = block
    assert any(histories)
    unrecorded = image._replace(messages=[[*columns, (None,) * len(histories)]])
    assert read_snapshot(tmp_path, info).queues["jobs"].dump() == unrecorded


def lease_of(core: QueueCore, seq: int) -> str:
    [lease] = [m.lease_id for m in core.browse(State.IN_FLIGHT, 100, 0, 1_000.0)[0] if m.seq == seq]
    assert lease is not None
    return lease


def a_queue_with_histories() -> tuple[QueueCore, list[str]]:
    """Five messages that did one thing each after being published, and one that only was; and the
    ids of all six."""
    core = a_backlog(6)
    ids = core.message_ids()
    core.apply(UpdateConfig({"max_attempts": 2}), 1_000.0)
    core.apply(Claim("worker", max_count=5, lease=30.0), 1_001.0)
    core.apply(Ack([lease_of(core, 1)]), 1_002.0)  # acked: finished
    core.apply(Nack([lease_of(core, 2)], delay=60.0, reason="later"), 1_003.0)  # delayed again
    core.apply(Nack([lease_of(core, 3)], retryable=False), 1_004.0)  # dead-lettered: finished
    core.apply(Extend([lease_of(core, 4)], lease=90.0), 1_005.0)  # in flight, extended
    core.apply(Defer([lease_of(core, 5)], retry_after=5.0), 1_006.0)
    return core, ids


def test_a_snapshot_keeps_every_message_history_and_the_finished_messages_get_one_shows(
    tmp_path: Path,
) -> None:
    core, ids = a_queue_with_histories()
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=1_010.0))
    (info,) = list_snapshots(tmp_path)
    loaded = read_snapshot(tmp_path, info).queues["jobs"]
    assert loaded.dump() == core.dump()
    shown = [loaded.get(message_id, 1_010.0)[0] for message_id in ids]
    assert shown == [core.get(message_id, 1_010.0)[0] for message_id in ids]
    assert [view.state for view in shown] == [
        State.ACKED,
        State.DELAYED,
        State.DEAD_LETTERED,
        State.IN_FLIGHT,
        State.DELAYED,
        State.READY,
    ]
    # Published, claimed and what came of it; a nack that cannot be retried is two records.
    assert [len(view.history) for view in shown] == [3, 3, 4, 3, 3, 1]
    # A broker that keeps fewer finished messages than the one that wrote the snapshot keeps the newest.
    fewer = read_snapshot(tmp_path, info, history=FinishedHistory(count=1)).queues["jobs"]
    with pytest.raises(MessageNotFound):
        fewer.get(ids[0], 1_010.0)
    assert fewer.get(ids[2], 1_010.0)[0] == shown[2]


def test_finished_messages_whose_payload_was_let_go_stay_bare_through_a_snapshot(tmp_path: Path) -> None:
    history = FinishedHistory(count=100, payload_bytes=len(b'"payload 0"'))
    core = QueueCore("jobs", QueueConfig(), "m-", history=history)
    refs, _ = core.publish([NewMessage(f'"payload {n}"'.encode()) for n in range(3)], 1_000.0)
    ids = [message_id for message_id, _, _ in refs]
    claimed, _ = core.claim("worker", 3, None, 1_001.0)
    core.ack([record.lease_id for record, _ in claimed.deliveries], 1_002.0)
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=1_010.0))
    (info,) = list_snapshots(tmp_path)
    loaded = read_snapshot(tmp_path, info, history=history).queues["jobs"]
    assert loaded.dump() == core.dump()
    shown = [loaded.get(message_id, 1_010.0)[0] for message_id in ids]
    assert shown == [core.get(message_id, 1_010.0)[0] for message_id in ids]
    assert [(view.state, view.payload) for view in shown] == [
        (State.ACKED, None),
        (State.ACKED, None),
        (State.ACKED, b'"payload 2"'),
    ]
    # A broker that keeps fewer finished messages keeps the newest, bare or not.
    fewer = read_snapshot(tmp_path, info, history=FinishedHistory(count=2)).queues["jobs"]
    with pytest.raises(MessageNotFound):
        fewer.get(ids[0], 1_010.0)
    assert [fewer.get(message_id, 1_010.0)[0].payload for message_id in ids[1:]] == [None, b'"payload 2"']


def test_a_history_that_is_not_journal_records_makes_the_snapshot_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, _ = a_queue_with_histories()
    encode_entry = snapshots.encode_entry

    def rumour(lsn: int, at: float, queue: str, record: Any) -> bytes:
        if isinstance(record, QueueCreated):  # the queue's head stays sound: its histories are not
            return encode_entry(lsn, at, queue, record)
        return cbor_dumps({"type": "rumour"})

    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "encode_entry", rumour)
        write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=1_010.0))
    (info,) = list_snapshots(tmp_path)
    # The live messages' chunk is read first (``QueueCore.load`` takes them before the finished ones).
    with pytest.raises(CorruptSnapshot, match=r"s/0+40/q/000000/m/00000000: a message's history: .*'type'"):
        read_snapshot(tmp_path, info)


def test_a_chunk_whose_columns_differ_in_length_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = a_queue_of_every_kind_of_message()
    with monkeypatch.context() as patch:
        patch.setattr(
            snapshots, "_shared", lambda values: values[:-1] if isinstance(values[0], bytes) else values
        )
        write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=1_000.0))
    (info,) = list_snapshots(tmp_path)
    with pytest.raises(
        CorruptSnapshot, match=r"s/0+40/q/000000/m/00000000: column 2 holds 31 values for 32 messages"
    ):
        read_snapshot(tmp_path, info)


def a_journal_after_a_snapshot_of_a_newer_format(data_dir: Path) -> bytes:
    """A snapshot of 5 messages at lsn 6 marked as the next format version (as a newer broker might write),
    and the journal after it: the lsns it covers were pruned. Returns the journal segment's bytes."""
    core = a_backlog(5)
    write_snapshot(data_dir, Recovered(queues={"jobs": core}, last_lsn=6, last_at=1_000.0))
    _, records = core.apply(Claim("worker", max_count=2), 1_001.0)
    writer = SegmentWriter(data_dir / JOURNAL_DIR, last_lsn=6)
    writer.write(b"".join(encode_frames(7, 1_001.0, "jobs", records)), 7, 6 + len(records))
    writer.sync()
    writer.close()
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR)) as env, env.begin(write=True) as txn:
        for key, value in list(txn.cursor()):
            if bytes(key).endswith(b"/meta"):
                meta = {**cbor_loads(bytes(value)), "version": snapshots.SNAPSHOT_VERSION + 1}
                meta["meta_crc"] = snapshots._meta_crc(meta)  # a sound header, of a newer format
                txn.put(bytes(key), cbor_dumps(meta))
    (segment,) = segments(data_dir / JOURNAL_DIR)
    return segment.path.read_bytes()


def test_a_journal_that_does_not_go_on_from_a_readable_snapshot_is_refused_and_left_as_it_is(
    tmp_path: Path,
) -> None:
    journal = a_journal_after_a_snapshot_of_a_newer_format(tmp_path)
    with pytest.raises(JournalGap) as refused:
        open_data_dir(tmp_path)
    assert str(refused.value).startswith(
        "the journal starts at lsn 7, and no snapshot covers the lsns before it: lsns 1-6 are gone"
    )
    assert "Nothing was changed. Snapshot 00000000000000000006 skipped:" in str(refused.value)
    assert f"format version {snapshots.SNAPSHOT_VERSION + 1}" in str(refused.value)
    assert segments(tmp_path / JOURNAL_DIR)[0].path.read_bytes() == journal
    # The operator's command says the same, without a traceback, and exits 1.
    assert start_refusal(tmp_path).startswith("cannot start: the journal starts at lsn 7, and no snapshot")
    with pytest.raises(RestoreError, match=r"cannot restore as of .*: the journal starts at lsn 7"):
        restore(tmp_path, until=2_000.0)
    assert segments(tmp_path / JOURNAL_DIR)[0].path.read_bytes() == journal
    # Nor is a snapshot made of what is left (a running broker's snapshots all turned unreadable): it
    # held the later records alone, no queue, and retention then deleted the rest of the journal.
    last_lsn = segments(tmp_path / JOURNAL_DIR)[0].first_lsn + 1
    with pytest.raises(JournalGap, match=r"No snapshot was written\. Snapshot 00000000000000000006 skipped"):
        compact(tmp_path, last_lsn)
    assert [info.id for info in list_snapshots(tmp_path)] == ["00000000000000000006"]


def test_a_snapshot_written_again_at_its_lsn_holds_only_what_was_written_last(tmp_path: Path) -> None:
    """A restore writes the state it read at that state's lsn, over the snapshot it may have read it
    from, with fewer values when it kept fewer finished messages: the values the first wrote and the
    second did not stayed under the id, and the snapshot failed its checksum (the next start then
    skipped it, and with the journal moved aside by the restore, served nothing)."""
    jobs, mail = QueueCore("jobs", QueueConfig(), "j-"), QueueCore("mail", QueueConfig(), "m-")
    for core in (jobs, mail):
        core.publish([NewMessage(b"1")], 1_000.0)
    write_snapshot(tmp_path, Recovered(queues={"jobs": jobs, "mail": mail}, last_lsn=9, last_at=1_000.0))
    write_snapshot(tmp_path, Recovered(queues={"jobs": jobs}, last_lsn=9, last_at=1_000.0))
    (info,) = list_snapshots(tmp_path)
    assert list(read_snapshot(tmp_path, info).queues) == ["jobs"]


# -- calls at once --------------------------------------------------------------------------------------


class Committed:
    """The one thing a ``Snapshotter`` asks of its journal when taking a snapshot."""

    def __init__(self, lsn: int) -> None:
        self.committed_lsn = lsn


async def test_snapshot_calls_at_once_read_the_snapshot_file_side_by_side_instead_of_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/admin/snapshots, POST's "nothing new" answer and the periodic snapshot each read the
    snapshot file in a worker thread; py-lmdb refuses a second open of one environment in a process,
    which answered 503 on a healthy disk. The first read is held open while the others run."""
    write_snapshot(tmp_path, Recovered(queues={"jobs": a_backlog(3)}, last_lsn=4, last_at=1_000.0))
    inside, release = threading.Event(), threading.Event()
    decode = snapshots._decode
    held = []

    def hold_the_first(data: bytes, where: str) -> Any:
        if not held:  # the first header read waits, its transaction open, until the others are done
            held.append(where)
            inside.set()
            release.wait()
        return decode(data, where)

    monkeypatch.setattr(snapshots, "_decode", hold_the_first)
    snapshotter = Snapshotter(tmp_path, Committed(4))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(snapshotter.list)
        await trio.to_thread.run_sync(inside.wait)
        try:
            assert [info.lsn for info in await snapshotter.list()] == [4]
            assert await snapshotter.take() is None  # the newest covers lsn 4: nothing new
        finally:
            release.set()
    assert held == ["s/00000000000000000004/meta"]


async def test_snapshots_posted_and_listed_at_once_all_answer(tmp_path: Path) -> None:
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        answers: list[tuple[str, int]] = []

        async def call(method: str) -> None:
            if method == "POST":
                await client.post("/v1/queues/jobs/messages", json={"payload": 1})
            response = await client.open("/v1/admin/snapshots", method=method)
            answers.append((method, response.status_code))

        async with trio.open_nursery() as nursery:
            for method in ["POST", "GET"] * 3:
                nursery.start_soon(call, method)
    assert sorted(answers) == [("GET", 200)] * 3 + sorted(answers)[3:]
    assert {status for method, status in answers if method == "POST"} <= {200, 201}


# -- damaged headers ------------------------------------------------------------------------------------


def put_meta(data_dir: Path, snapshot_id: str, value: bytes) -> None:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        txn.put(f"s/{snapshot_id}/meta".encode(), value)


def meta_of(data_dir: Path, snapshot_id: str) -> dict[str, Any]:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin() as txn:
        meta: dict[str, Any] = cbor_loads(bytes(txn.get(f"s/{snapshot_id}/meta".encode())))
        return meta


def not_cbor(meta: dict[str, Any]) -> bytes:
    return b"\xff\xff\x00garbage"


def lsn_moved(meta: dict[str, Any]) -> bytes:
    return cbor_dumps({**meta, "lsn": meta["lsn"] + 32})  # still a map; one bit of the lsn flipped


def time_moved(meta: dict[str, Any]) -> bytes:
    return cbor_dumps({**meta, "at": meta["at"] - 3600.0})  # decodes, and the id says nothing of it


def lsn_moved_in_a_header_written_before_its_checksum(meta: dict[str, Any]) -> bytes:
    old = {key: value for key, value in meta.items() if key != "meta_crc"}
    return cbor_dumps({**old, "lsn": meta["lsn"] + 32})


def not_a_header(meta: dict[str, Any]) -> bytes:
    return cbor_dumps([meta["lsn"]])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (not_cbor, "meta: the body is not valid CBOR"),
        (lsn_moved, "header fails its checksum"),
        (time_moved, "header fails its checksum"),
        (lsn_moved_in_a_header_written_before_its_checksum, "not the lsn of its id"),
        (not_a_header, "meta: the header is not a map"),
    ],
)
async def test_a_snapshot_whose_header_is_damaged_is_reported_and_skipped_for_the_one_before(
    tmp_path: Path, damage: Any, problem: str
) -> None:
    settings = Settings(data_dir=tmp_path)
    before = await two_snapshots(settings)
    newest, older = list_snapshots(tmp_path)
    put_meta(tmp_path, newest.id, damage(meta_of(tmp_path, newest.id)))
    verified = verify(tmp_path)
    results, journal_problem = verified.snapshots, verified.journal_problem
    assert [(result.snapshot.id, result.problem is None) for result in results] == [
        (newest.id, False),
        (older.id, True),
    ]
    assert problem in str(results[0].problem) and journal_problem is None
    assert list_snapshots(tmp_path) == [older]  # never served, nor listed as sound
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            assert await view(app.test_client()) == before
    (skipped,) = [log for log in logs if log["event"] == "snapshot_skipped"]
    assert skipped["detail"].startswith(f"snapshot {newest.id} skipped: ") and problem in skipped["detail"]
    (recovered,) = [log for log in logs if log["event"] == "recovered"]
    assert recovered["snapshot"] == older.id  # the one before, plus a longer replay


def test_a_header_written_before_its_checksum_still_reads(tmp_path: Path) -> None:
    core = a_backlog(5)
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=6, last_at=1_000.0))
    (info,) = list_snapshots(tmp_path)
    old = {key: value for key, value in meta_of(tmp_path, info.id).items() if key != "meta_crc"}
    put_meta(tmp_path, info.id, cbor_dumps(old))
    assert list_snapshots(tmp_path) == [info]
    assert read_snapshot(tmp_path, info).queues["jobs"].dump() == core.dump()
