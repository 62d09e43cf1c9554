"""The side-by-side benchmark's harness (bench/peers/clients.py, runner.py, servers.py) on in-memory fakes
of the servers: what is measured, and what each adapter sends. No server is started here."""

from __future__ import annotations

import queue
import shutil
import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.peers import clients, runner, servers
from bench.server import BenchError

#: How long a fake waits for what the code under test should do before giving up on it: reached only
#: when that code is wrong, so that a wrong harness fails the test instead of hanging it.
GIVE_UP = 5.0


# -- a fake server and its adapter, for the drain and the latency loop ------------------------------------


class FakeServer:
    """A queue in memory whose "CPU" grows by one per message published, claimed and acked, and by
    ``TAIL_COST`` for each empty claim made once everything is acked (a consumer's last, long wait)."""

    TAIL_COST = 1000.0

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.cpu = 0.0
        self.ready: deque[str] = deque()
        self.acked = 0
        self.changed = threading.Condition()
        #: Set when the CPU is read after the last ack: only then do the consumers' final claims return.
        self.read_after_drain = threading.Event()
        #: What the adapters did, in order: ("publish", n), ("claim", n) or ("ack", n).
        self.calls: list[tuple[str, int]] = []

    def read_cpu(self, pid: int) -> float:
        with self.changed:
            if self.acked == self.messages:
                self.read_after_drain.set()
            return self.cpu


class FakePeer:
    batch = clients.BATCH

    def __init__(self, address: dict[str, Any], queue_name: str, consumer: str) -> None:
        self.server: FakeServer = address["server"]
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        with self.server.changed:
            self.server.ready.extend(payloads)
            self.server.cpu += len(payloads)
            self.server.calls.append(("publish", len(payloads)))
            self.server.changed.notify_all()

    def claim(self, max_count: int, wait: float) -> list[Any]:
        server = self.server
        with server.changed:
            if wait:
                server.changed.wait_for(lambda: server.ready or server.acked == server.messages, GIVE_UP)
            taken = [server.ready.popleft() for _ in range(min(max_count, len(server.ready)))]
            server.cpu += len(taken)
            server.calls.append(("claim", len(taken)))
        if not taken and wait:
            server.read_after_drain.wait(GIVE_UP)
            with server.changed:
                server.cpu += FakeServer.TAIL_COST
            self.empty_claim_queries += 1
        return taken

    def ack(self, handles: list[Any]) -> None:
        with self.server.changed:
            self.server.acked += len(handles)
            self.server.cpu += len(handles)
            self.server.calls.append(("ack", len(handles)))
            self.server.changed.notify_all()

    def close(self) -> None:
        pass


@pytest.fixture
def fake_system(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(clients.PEERS, "fake", FakePeer)
    monkeypatch.setitem(clients.CLIENT_MODULES, "fake", [])
    return "fake"


def run_in_threads(targets: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """``bench.http_api.run_clients`` with threads for processes, so that the clients share the fakes."""
    start = threading.Barrier(len(targets) + 1)
    published_all = threading.Event()
    results: queue.Queue[dict[str, Any]] = queue.Queue()
    threads = [
        threading.Thread(target=target, args=(*arguments, start, published_all, results), daemon=True)
        for target, arguments in targets
    ]
    for thread in threads:
        thread.start()
    start.wait(GIVE_UP)
    collected = [results.get(timeout=4 * GIVE_UP) for _ in threads]
    errors = [result["error"] for result in collected if "error" in result]
    if errors:
        raise BenchError("; ".join(errors))
    return collected


def test_drain_reads_the_server_cpu_at_the_last_ack(
    fake_system: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = FakeServer(messages=1_000)
    monkeypatch.setattr(runner, "run_clients", run_in_threads)
    monkeypatch.setattr(servers, "tree_cpu_seconds", server.read_cpu)
    instance = servers.Instance(fake_system, 0, {"server": server}, [])
    counts = {"messages": server.messages, "consumers": 4, "budget": 60.0}

    run = runner.drain(fake_system, instance, {"server": server}, counts)

    assert run["messages"] == 1_000
    # published, claimed and acked once each; the consumers' final empty claims came after the reading
    assert run["server_cpu_seconds"] == 3 * 1_000
    # each consumer's final empty claims (one, or two if it began before the publisher was done)
    final_claims = (server.cpu - 3 * 1_000) / FakeServer.TAIL_COST
    assert 4 <= final_claims <= 8
    assert run["empty_claim_queries"] == final_claims


def test_drain_progress_is_drained_when_the_acks_reach_the_published_count_in_either_order() -> None:
    acked_first = clients.DrainProgress()
    acked_first.add_acked(60)
    acked_first.add_acked(40)
    assert not acked_first.drained.is_set()  # the publisher may not be done
    acked_first.add_published(100)
    assert acked_first.drained.is_set()

    published_first = clients.DrainProgress()
    published_first.add_published(100)
    published_first.add_acked(99)
    assert not published_first.drained.is_set()
    published_first.add_acked(1)
    assert published_first.drained.is_set()


def test_run_measuring_until_reads_once_drained_or_when_the_run_ends() -> None:
    cpu = [0.0]
    drained = threading.Event()

    def run() -> str:
        cpu[0] = 5.0
        drained.set()
        while not reader_done.is_set():  # the reading is taken by the other thread
            reader_done.wait(GIVE_UP)
        cpu[0] = 9.0  # the tail after the last ack: not counted
        return "ran"

    reader_done = threading.Event()

    def read_cpu() -> float:
        value = cpu[0]
        if drained.is_set():
            reader_done.set()
        return value

    assert runner.run_measuring_until(drained, read_cpu, run) == ("ran", 5.0)

    never = threading.Event()
    cpu[0] = 0.0

    def failed_run() -> str:
        cpu[0] = 2.0
        raise BenchError("a consumer failed")

    with pytest.raises(BenchError, match="a consumer failed"):
        runner.run_measuring_until(never, read_cpu, failed_run)


def test_claim_latency_acks_each_message_before_the_next_claim(fake_system: str) -> None:
    server = FakeServer(messages=130)

    milliseconds = clients.claim_latency(fake_system, {"server": server}, "latency", 100, 30, 60.0)

    assert len(milliseconds) == 100
    after_publishing = [call for call in server.calls if call[0] != "publish"]
    assert after_publishing == [("claim", 1), ("ack", 1)] * 130
    assert server.acked == 130


def _claim_forever(*arguments: Any) -> list[float]:
    threading.Event().wait(4 * GIVE_UP)  # a server that stopped answering, for longer than the deadline
    raise AssertionError("the latency process was not stopped at its deadline")


def test_call_in_child_stops_a_blocked_call_at_its_deadline() -> None:
    with pytest.raises(BenchError, match=r"did not finish within 0\.5 s"):
        runner.call_in_child(_claim_forever, (), 0.5)


def test_call_in_child_returns_the_result_or_the_error() -> None:
    assert runner.call_in_child(sorted, ([3, 1, 2],), GIVE_UP) == [1, 2, 3]
    with pytest.raises(BenchError, match="ZeroDivisionError"):
        runner.call_in_child(divmod, (1, 0), GIVE_UP)


def test_latency_runs_the_claims_in_a_child_with_a_deadline(
    fake_system: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "claim_latency", _claim_forever)
    monkeypatch.setattr(runner, "LATENCY_TIMEOUT", 0.25)
    monkeypatch.setattr(runner, "LATENCY_GRACE", 0.25)
    with pytest.raises(BenchError, match=r"within 0\.5 s"):
        runner.latency(fake_system, {}, {"claims": 10, "warmup": 0})


# -- Redis: a blocking wait topped up to a batch, by a script ---------------------------------------------


class FakeRedis:
    """The few list commands the adapter sends, and its move script. ``arriving`` is pushed when a
    ``BLMOVE`` blocks on an empty list, as a publish that wakes it."""

    def __init__(self, **connection: Any) -> None:
        self.lists: dict[str, deque[bytes]] = {}
        self.arriving: list[bytes] = []
        self.round_trips = 0
        self.scripts: list[str] = []

    def _lmove(self, source: str, destination: str) -> bytes | None:
        items = self.lists.setdefault(source, deque())
        if not items:
            return None
        value = items.popleft()
        self.lists.setdefault(destination, deque()).append(value)
        return value

    def blmove(self, source: str, destination: str, timeout: float, where: str, to: str) -> bytes | None:
        self.round_trips += 1
        if not self.lists.get(source):
            self.lists.setdefault(source, deque()).extend(self.arriving)
            self.arriving = []
        return self._lmove(source, destination)

    def register_script(self, text: str) -> Callable[..., list[bytes]]:
        self.scripts.append(text)

        def run(keys: list[str], args: list[int]) -> list[bytes]:  # what MOVE_SCRIPT does in the server
            self.round_trips += 1
            moved = []
            for _ in range(args[0]):
                value = self._lmove(keys[0], keys[1])
                if value is None:
                    break
                moved.append(value)
            return moved

        return run

    def close(self) -> None:
        pass


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # A module of its own rather than a patch of redis-py's: `make test` does not install the bench
    # extras (redis, psycopg, greenstalk), only `make bench-peers` does.
    monkeypatch.setitem(sys.modules, "redis", types.SimpleNamespace(Redis=FakeRedis))
    yield


def test_redis_claim_tops_up_a_blocking_wait_to_a_batch(fake_redis: None) -> None:
    peer = clients.RedisPeer({"host": "-", "port": 0}, "q", "consumer-0")
    fake = peer._redis
    assert isinstance(fake, FakeRedis)
    assert fake.scripts == [clients.MOVE_SCRIPT]
    fake.arriving = [f"m{number}".encode() for number in range(150)]

    claimed = peer.claim(100, 1.0)

    assert claimed == [f"m{number}".encode() for number in range(100)]
    assert fake.round_trips == 3  # the empty move, the BLMOVE, the top-up
    assert peer.empty_claim_queries == 1
    assert list(fake.lists["q:processing:consumer-0"]) == claimed


def test_redis_claim_counts_a_wait_that_times_out(fake_redis: None) -> None:
    peer = clients.RedisPeer({"host": "-", "port": 0}, "q", "consumer-0")
    assert peer.claim(100, 1.0) == []
    assert peer.empty_claim_queries == 2  # the move and the BLMOVE


def test_the_move_script_stops_at_the_first_empty_lmove() -> None:
    script = clients.MOVE_SCRIPT
    assert "LMOVE" in script and "if not value then break end" in script


# -- PostgreSQL: polling, each empty claim counted ---------------------------------------------------------


class FakePostgres:
    """A connection whose table fills after ``fills_after`` claims. Counts the claim queries."""

    def __init__(self, fills_after: int) -> None:
        self.rows: list[tuple[int, str]] = []
        self.claims = 0
        self.fills_after = fills_after

    def execute(self, statement: str, parameters: Any = None) -> FakeCursor:
        if statement.lstrip().startswith("UPDATE"):
            self.claims += 1
            if self.claims == self.fills_after:
                self.rows = [(number, f"payload {number}") for number in range(1, 51)]
            taken, self.rows = self.rows[: parameters["max"]], self.rows[parameters["max"] :]
            return FakeCursor(taken)
        raise AssertionError(f"unexpected statement {statement!r}")

    def close(self) -> None:
        pass


class FakeCursor:
    def __init__(self, rows: list[tuple[int, str]]) -> None:
        self._rows = rows
        self.rowcount = len(rows)

    def fetchall(self) -> list[tuple[int, str]]:
        return self._rows


def test_postgres_claim_polls_and_counts_each_empty_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    connection = FakePostgres(fills_after=3)
    fake_psycopg = types.SimpleNamespace(connect=lambda dsn, **options: connection)
    monkeypatch.setitem(sys.modules, "psycopg", fake_psycopg)  # as fake_redis: no bench extras here
    naps: list[float] = []
    monkeypatch.setattr(clients.time, "sleep", naps.append)
    peer = clients.PostgresPeer({"dsn": "-"}, "drain", "consumer-0")

    assert peer.claim(100, 5.0) == list(range(1, 51))
    assert (connection.claims, peer.empty_claim_queries) == (3, 2)
    assert naps == [clients.POLL_INTERVAL] * 2


# -- finding PostgreSQL -----------------------------------------------------------------------------------


def test_newest_postgres_is_chosen_by_version_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("9.6", "15", "13"):
        directory = tmp_path / version / "bin"
        directory.mkdir(parents=True)
        (directory / "postgres").touch()
        (directory / "initdb").touch()
    monkeypatch.setattr(servers, "POSTGRES_INSTALLS", str(tmp_path / "*" / "bin"))
    monkeypatch.setattr(shutil, "which", lambda name: None)

    assert servers._postgres_bin_dir() == tmp_path / "15" / "bin"
