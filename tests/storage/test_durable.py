"""The durable journal's group commit and its storage faults, through the ``FaultyDisk`` seam, and
recovery of a whole broker from its data directory."""

from __future__ import annotations

import gc
import shutil
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import structlog
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families as parse_metrics

from broker import clock as clock_module
from broker.config import Settings
from broker.core import FinishedHistory
from broker.core.records import Acked, Published, QueueCreated
from broker.errors import BrokerError, StorageUnavailable
from broker.server import open_broker
from broker.storage import durable
from broker.storage.durable import DurableJournal, FaultyDisk, SegmentDisk
from broker.storage.restore import parse_time
from broker.storage.segments import RESERVE_BYTES, read_entries
from broker.storage.store import DataDirectoryInUse, lock_data_dir
from tests.conftest import Client


class Waiter:
    """A commit waiter a test can await (the flush runs in a worker thread, which Trio's
    ``wait_all_tasks_blocked`` does not wait for)."""

    def __init__(self) -> None:
        self.resolved = False
        self.error: BrokerError | None = None
        self.done = trio.Event()

    def resolve(self) -> None:
        self.resolved = True
        self.done.set()

    def fail(self, error: BrokerError) -> None:
        self.error = error
        self.done.set()


def published(n: int) -> Published:
    return Published(f"m-{n}", n, b'"x"', False, None, None, 0, 1.0, None)


@pytest.fixture
def disk(tmp_path: Path) -> FaultyDisk:
    return FaultyDisk(SegmentDisk(tmp_path / "journal"))


class HeldDisk(FaultyDisk):
    """A disk whose first write waits until the test lets it go on (it runs in the writer thread)."""

    def __init__(self, disk: SegmentDisk) -> None:
        super().__init__(disk)
        self.writing = threading.Event()
        self.go_on = threading.Event()

    def write(self, data: bytes, first_lsn: int, last_lsn: int) -> None:
        if self.writes == 0:
            self.writing.set()
            self.go_on.wait(10)
        super().write(data, first_lsn, last_lsn)


async def test_records_appended_while_a_flush_is_on_the_disk_go_out_together(tmp_path: Path) -> None:
    disk = HeldDisk(SegmentDisk(tmp_path / "journal"))
    journal = DurableJournal(disk, directory=tmp_path / "journal")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        waiters = []
        for n in range(1, 101):
            lsn = journal.append("jobs", 1.0, [published(n)])
            waiter = Waiter()
            journal.commit_then(lsn, waiter)
            waiters.append(waiter)
            if n == 1:
                await trio.to_thread.run_sync(disk.writing.wait, 10)  # the first flush is on the disk
        assert not any(w.resolved for w in waiters)  # nothing is acknowledged before its fsync
        disk.go_on.set()
        for waiter in waiters:
            await waiter.done.wait()
        assert all(w.resolved for w in waiters)
        # The 99 records appended during the first flush went out in one write, with one fsync.
        assert (journal.stats.flushes, journal.stats.records, disk.writes) == (2, 100, 2)
        assert journal.stats.records_histogram.count == 2
        nursery.cancel_scope.cancel()
    await journal.close()
    assert [entry.record for entry in read_entries(tmp_path / "journal")] == [
        published(n) for n in range(1, 101)
    ]


async def test_a_full_disk_acknowledges_nothing_and_the_journal_heals_when_it_clears(
    disk: FaultyDisk, tmp_path: Path
) -> None:
    journal = DurableJournal(disk, directory=tmp_path / "journal")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        first = Waiter()
        journal.commit_then(journal.append("jobs", 1.0, [published(1)]), first)
        await first.done.wait()
        assert first.resolved

        disk.fail_with()
        second = Waiter()
        journal.commit_then(journal.append("jobs", 1.0, [published(2)]), second)
        await second.done.wait()
        assert isinstance(second.error, StorageUnavailable) and not second.resolved
        assert "No space left on device" in second.error.message
        assert not journal.healthy
        during = Waiter()
        journal.commit_then(journal.append("jobs", 1.0, [published(3)]), during)
        assert isinstance(during.error, StorageUnavailable)  # refused at once while the fault lasts

        disk.heal()
        with trio.fail_after(10):
            await journal.wait_healthy()  # the writer retries on its own
        assert journal.committed_lsn == 3
        after = Waiter()
        journal.commit_then(journal.append("jobs", 1.0, [published(4)]), after)
        await after.done.wait()
        assert after.resolved
        nursery.cancel_scope.cancel()
    await journal.close()
    # The torn writes were rolled back and retried: the journal holds every record once, in order.
    assert [entry.lsn for entry in read_entries(tmp_path / "journal")] == [1, 2, 3, 4]


async def test_a_fault_answers_503_over_http_and_the_broker_keeps_serving_reads(
    tmp_path: Path,
) -> None:
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.put("/v1/queues/jobs", json={})).status_code == 201
        faulty = FaultyDisk(broker.journal._disk)  # type: ignore[attr-defined]
        broker.journal._disk = faulty  # type: ignore[attr-defined]
        assert (await client.get("/readyz")).status_code == 200
        faulty.fail_with()
        response = await client.post("/v1/queues/jobs/messages", json={"payload": 1})
        assert response.status_code == 503
        assert (await response.get_json())["error"]["code"] == "storage_unavailable"
        assert (await client.get("/v1/queues/jobs")).status_code == 200
        assert (await client.get("/readyz")).status_code == 503
        # While the fault lasts, publishes are refused before they are taken: clients retrying through
        # a long fault do not pile messages up in memory.
        refused = await client.post("/v1/queues/jobs/messages", json={"payload": "refused"})
        assert refused.status_code == 503
        assert "nothing was taken" in (await refused.get_json())["error"]["message"]
        faulty.heal()
        with trio.fail_after(10):
            await broker.journal.wait_healthy()  # type: ignore[attr-defined]
        response = await client.post("/v1/queues/jobs/messages", json={"payload": 2})
        assert response.status_code == 201
        browsed = await (await client.get("/v1/queues/jobs/messages")).get_json()
        # The first 503 came from the flush that failed: that publish was taken, and kept (api.md).
        assert [view["payload"] for view in browsed["messages"]] == [1, 2]
        assert await (await client.get("/readyz")).get_json() == {"status": "ready"}


async def test_readyz_answers_503_while_the_journals_disk_is_too_full_for_its_next_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without traffic no write fails, so the journal stays healthy on a full disk; /readyz looks at the
    free space too, so a load balancer moves writes away before they fail."""
    free = {"bytes": RESERVE_BYTES}
    monkeypatch.setattr(durable, "free_bytes", lambda directory: free["bytes"])
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.get("/readyz")).status_code == 200
        free["bytes"] = RESERVE_BYTES - 1
        response = await client.get("/readyz")
        assert response.status_code == 503
        error = (await response.get_json())["error"]
        assert (error["code"], error["message"]) == (
            "storage_unavailable",
            "the journal's disk is full: durable writes would fail; reads still work",
        )
        assert broker.journal.healthy, "nothing failed: only the probe sees it"
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
        gauges = {sample.name: sample.value for family in parse_metrics(metrics) for sample in family.samples}
        assert gauges["broker_journal_disk_free_bytes"] == RESERVE_BYTES - 1
        free["bytes"] = 10 * RESERVE_BYTES
        assert (await client.get("/readyz")).status_code == 200


def test_the_free_space_is_that_of_the_journals_filesystem(tmp_path: Path) -> None:
    journal = DurableJournal(SegmentDisk(tmp_path / "journal"), directory=tmp_path / "journal")
    assert journal.free_bytes() == shutil.disk_usage(tmp_path).free
    assert DurableJournal(SegmentDisk(tmp_path / "other")).free_bytes() is None


async def test_a_restart_recovers_every_queue_as_it_was(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client: Client = app.test_client()
        await client.put("/v1/queues/jobs", json={"lease": 60})
        body = {"messages": [{"payload": n, "key": f"k{n}"} for n in range(4)]}
        await client.post("/v1/queues/jobs/messages", json=body)
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 2})).get_json()
        leases = [m["lease_id"] for m in claimed["messages"]]
        await client.post("/v1/queues/jobs/ack", json={"leases": leases[:1]})
        before = await (await client.get("/v1/queues/jobs/messages")).get_json()
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        after = await (await client.get("/v1/queues/jobs/messages")).get_json()
        assert after == before  # same messages, states, attempts and the lease still in flight
        late = await client.post("/v1/queues/jobs/ack", json={"leases": leases[1:]})
        assert await late.get_json() == {"acked": 1, "skipped": []}  # leases survive a clean restart
        again = await client.post("/v1/queues/jobs/messages", json={"payload": 9, "key": "k0"})
        assert (await again.get_json())["messages"][0]["duplicate"] is True  # keys too
        # New messages take this boot's id prefix: a message a consumer saw before a crash may be gone
        # from the journal, and its id must never name another message.
        fresh = await (await client.post("/v1/queues/jobs/messages", json={"payload": 10})).get_json()
        new_id = fresh["messages"][0]["id"]
        assert all(not new_id.startswith(m["id"].rsplit("-", 1)[0] + "-") for m in before["messages"])
        kinds = [type(entry.record) for entry in broker.journal.entries()]
        assert kinds[0] is QueueCreated and Acked in kinds


async def test_a_start_on_a_host_clock_behind_the_journal_starts_from_the_journal_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's clock stepped back an hour between two runs: a lease held across the restart ran an
    hour late (and a delay, a TTL, a dedup window as much), and new records were timed before the old."""
    settings = Settings(data_dir=tmp_path)
    hour_ahead = types.SimpleNamespace(
        time=lambda: time.time() + 3600, strftime=time.strftime, gmtime=time.gmtime
    )
    with monkeypatch.context() as patched:
        patched.setattr(clock_module, "time", hour_ahead)
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client: Client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            await client.post("/v1/queues/jobs/messages", json={"messages": [{"payload": 1}]})
            claimed = await (await client.post("/v1/queues/jobs/claim", json={"lease": 30})).get_json()
            [delivery] = claimed["messages"]
    last_at = max(entry.at for entry in read_entries(tmp_path / "journal"))
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            shown = await (await client.get(f"/v1/queues/jobs/messages/{delivery['id']}")).get_json()
            assert shown["state"] == "in_flight"
            remaining = parse_time(shown["lease_deadline"]) - broker.clock.now()
            assert 0 < remaining <= 30  # not an hour and 30 s
            answer = await client.post("/v1/queues/jobs/messages", json={"messages": [{"payload": 2}]})
            [published] = (await answer.get_json())["messages"]
            new = await (await client.get(f"/v1/queues/jobs/messages/{published['id']}")).get_json()
            assert parse_time(new["published_at"]) > last_at
    [warning] = [log for log in logs if log["event"] == "clock_behind_journal"]
    assert 3590 < warning["seconds"] < 3610 and warning["log_level"] == "warning"


async def test_starts_on_a_host_clock_behind_the_journal_never_repeat_an_id_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock starts from the journal's last record: starts that journal nothing between them all
    started at the same millisecond, so minted the same ids, and a claim answered but lost in a crash
    would share its lease id with the next start's delivery of that message."""
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        await app.test_client().put("/v1/queues/jobs", json={})
    monkeypatch.setattr(
        clock_module,
        "time",
        types.SimpleNamespace(time=lambda: time.time() - 3600, strftime=time.strftime, gmtime=time.gmtime),
    )
    prefixes = []
    for _ in range(4):
        async with open_broker(settings) as broker:
            prefixes.append(broker.registry.get("jobs").core.id_prefix)
    assert len(set(prefixes)) == 4, prefixes


async def test_a_restart_keeps_as_many_finished_messages_as_the_settings_say(tmp_path: Path) -> None:
    """The finished-history bound is the one this boot was given, not the one the data was written with."""
    async with open_broker(Settings(data_dir=tmp_path)) as broker, broker.app.test_app() as app:
        client: Client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        body = {"messages": [{"payload": n} for n in range(2)]}
        published = await (await client.post("/v1/queues/jobs/messages", json=body)).get_json()
        ids = [m["id"] for m in published["messages"]]
        claimed = await (await client.post("/v1/queues/jobs/claim", json={"max": 2})).get_json()
        leases = [m["lease_id"] for m in claimed["messages"]]
        await client.post("/v1/queues/jobs/ack", json={"leases": leases})
    settings = Settings(data_dir=tmp_path, finished_history=FinishedHistory(count=1))
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        assert (await client.get(f"/v1/queues/jobs/messages/{ids[0]}")).status_code == 404
        newest = await (await client.get(f"/v1/queues/jobs/messages/{ids[1]}")).get_json()
        assert newest["state"] == "acked"


async def test_a_data_directory_is_held_by_one_process_at_a_time(tmp_path: Path) -> None:
    held = lock_data_dir(tmp_path)
    try:
        with pytest.raises(DataDirectoryInUse, match="in use by pid"):
            async with open_broker(Settings(data_dir=tmp_path)):
                pass
    finally:
        held.close()
    async with open_broker(Settings(data_dir=tmp_path)):
        pass


async def test_close_flushes_what_is_left_and_answers_every_waiter(tmp_path: Path) -> None:
    journal = DurableJournal(SegmentDisk(tmp_path / "journal"), directory=tmp_path / "journal")
    waiter = Waiter()
    journal.commit_then(journal.append("jobs", 1.0, [published(1), published(2)]), waiter)
    await journal.close()  # its writer never ran: close writes the records itself
    assert waiter.resolved and journal.committed_lsn == 2
    assert [entry.lsn for entry in read_entries(tmp_path / "journal")] == [1, 2]


async def test_a_queue_recovered_at_start_is_freed_once_deleted(tmp_path: Path) -> None:
    """Recovery builds the queues with the collector frozen, and its result lived as long as the
    broker: a recovered queue, deleted, kept its every message in memory for good."""
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await client.post("/v1/queues/jobs/messages", json={"messages": [{"payload": n} for n in range(10)]})
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        core = weakref.ref(broker.registry.get("jobs").core)
        assert (await client.delete("/v1/queues/jobs")).status_code == 204
        await trio.testing.wait_all_tasks_blocked()  # the actor has closed
        gc.collect()
        assert core() is None
