"""Snapshots: taken from the journal while the broker serves, used by recovery, checked by checksum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import structlog

from broker.config import Settings
from broker.server import open_broker
from broker.storage.format import FRAME_OVERHEAD
from broker.storage.segments import HEADER_SIZE, segments
from broker.storage.snapshots import JOURNAL_DIR, SNAPSHOTS_DIR, list_snapshots
from broker.storage.store import open_data_dir


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


async def test_a_snapshot_taken_while_serving_plus_the_journal_after_it_rebuild_every_queue(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={"max_attempts": 2})
        await load(client, 3, "a")
        response = await client.post("/v1/admin/snapshots")
        assert response.status_code == 201, await response.get_data()
        taken = (await response.get_json())["snapshot"]
        assert taken["queues"] == 2 and taken["messages"] > 0
        await load(client, 2, "b")  # after the snapshot: recovery replays these from the journal
        before = await view(client)
        listed = await (await client.get("/v1/admin/snapshots")).get_json()
        assert [s["id"] for s in listed["snapshots"]] == [taken["id"]]
    # A clean shutdown took another snapshot; drop it to make recovery use the first plus the journal.
    [newest, first] = list_snapshots(tmp_path)
    assert first.id == taken["id"] and newest.lsn > first.lsn
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        assert txn.delete(f"s/{newest.id}/meta".encode())
    opened = open_data_dir(tmp_path)
    try:
        assert opened.recovered.records == newest.lsn - first.lsn  # only what came after the snapshot
    finally:
        opened.release()
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        assert await view(app.test_client()) == before


async def test_a_snapshot_that_fails_its_checksum_is_skipped_for_the_one_before(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await load(client, 2, "a")
        assert (await client.post("/v1/admin/snapshots")).status_code == 201
        await load(client, 2, "b")
        before = await view(client)
    newest, _ = list_snapshots(tmp_path)
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = f"s/{newest.id}/q/000000/m/00000000".encode()
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01  # one flipped bit
        txn.put(key, bytes(value))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        assert await view(app.test_client()) == before


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
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        assert txn.delete(f"s/{newest.id}/meta".encode())  # recovery must use the first + the journal
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
