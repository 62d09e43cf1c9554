"""One repeat of the whole set: for each mode, each contender on a fresh server of its own: the drain
(1 publisher + 8 consumers, forked), then the single-message claim latency (one consumer, forked too,
so that a server that stops answering cannot hold the harness past a deadline)."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

from bench.http_api import children_cpu_seconds, run_clients
from bench.peers import clients, servers
from bench.report import percentile
from bench.server import BenchError


class Counts(TypedDict):
    """How much one repeat does (``SCALES``; ``--repeats`` overrides ``repeats``)."""

    messages: int  # published in the drain
    consumers: int  # consumer processes of the drain
    repeats: int
    claims: int  # timed single-message claims
    warmup: int  # untimed claims before them
    budget: float  # seconds the publisher may take


SCALES: dict[str, Counts] = {
    "full": {
        "messages": 100_000,
        "consumers": 8,
        "repeats": 3,
        "claims": 2_000,
        "warmup": 200,
        "budget": 60.0,
    },
    "quick": {"messages": 10_000, "consumers": 8, "repeats": 1, "claims": 300, "warmup": 50, "budget": 20.0},
}
#: Beyond the publisher's budget, how long consumers may take to drain what it published.
DRAIN_GRACE = 120.0
#: How long the timed claims may take (checked between claims), and beyond that how long the latency
#: process may take in all (publishing included) before it is killed: greenstalk and psycopg set no
#: socket timeout, so a stopped server would block a claim forever.
LATENCY_TIMEOUT = 120.0
LATENCY_GRACE = 60.0
MODES = ("durable", "default")

_fork = multiprocessing.get_context("fork")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Contender:
    """A system as configured for one mode: what the table calls it and how to start it."""

    key: str
    system: str
    label: str
    start: Callable[[str], contextlib.AbstractContextManager[servers.Instance]]
    modes: tuple[str, ...] = MODES
    #: For the broker: which client (``clients.BROKER_PEERS``); None: ``clients.BROKER_CLIENT``.
    broker_client: str | None = None
    #: The table's name for it in a mode where ``label`` alone would mislead.
    mode_labels: tuple[tuple[str, str], ...] = ()

    def labels(self) -> dict[str | tuple[str, str], str]:
        """For ``summary.format_table``: ``{key: label, (mode, key): label in that mode, ...}``."""
        return {self.key: self.label, **{(mode, self.key): label for mode, label in self.mode_labels}}


class Setup:
    """Binaries found or installed, and the PostgreSQL template cluster; closed at the end."""

    def __init__(self, systems: set[str]) -> None:
        needed = [
            name
            for name, system in (
                ("beanstalkd", "beanstalkd"),
                ("redis-server", "redis"),
                ("postgres", "postgres"),
            )
            if system in systems
        ]
        self.binaries = servers.ensure_installed(needed)
        self.template: servers.PostgresTemplate | None = None
        if "postgres" in systems:
            self.template = servers.PostgresTemplate(servers._postgres_bin_dir() or _missing("postgres"))

    def versions(self) -> dict[str, str]:
        return {name: servers.version(path) for name, path in self.binaries.items()}

    def close(self) -> None:
        if self.template is not None:
            self.template.close()


def _missing(name: str) -> Any:
    raise BenchError(f"{name} is not installed")


def contenders(setup: Setup) -> list[Contender]:
    """Every contender. ``broker`` is driven by ``broker.client`` (``--broker-client``), ``broker-http``
    by ``bench.server.Connection`` (http.client: a tenth of the client CPU), shown for information. In the
    default mode both journal to disk but answer before the fsync (``durable: false``), like PostgreSQL
    with ``synchronous_commit=off``; ``broker-memory`` (``--in-memory``: no journal) keeps nothing on
    disk, like beanstalkd without ``-b``, and is shown for information."""
    binaries = setup.binaries

    def broker_journaling(mode: str) -> contextlib.AbstractContextManager[servers.Instance]:
        return servers.broker(durable_server=True)

    def broker_in_memory(mode: str) -> contextlib.AbstractContextManager[servers.Instance]:
        return servers.broker(durable_server=False)

    def postgres(mode: str) -> contextlib.AbstractContextManager[servers.Instance]:
        assert setup.template is not None
        return servers.postgres(setup.template, durable=mode == "durable")

    return [
        Contender("broker", "broker", "broker", broker_journaling),
        Contender(
            "broker-http", "broker", "broker, http.client", broker_journaling, broker_client="connection"
        ),
        Contender("broker-memory", "broker", "broker --in-memory", broker_in_memory, modes=("default",)),
        Contender(
            "postgres",
            "postgres",
            "PostgreSQL SKIP LOCKED",
            postgres,
            # synchronous_commit=off is not PostgreSQL's default (on): the table says so
            mode_labels=(("default", "PostgreSQL SKIP LOCKED, async commit"),),
        ),
        Contender(
            "redis",
            "redis",
            "Redis lists (LMOVE)",
            lambda mode: servers.redis(binaries["redis-server"], durable=mode == "durable"),
        ),
        Contender(
            "beanstalkd",
            "beanstalkd",
            "beanstalkd",
            lambda mode: servers.beanstalkd(binaries["beanstalkd"], durable=mode == "durable"),
        ),
    ]


#: Broker queue config per mode.
BROKER_QUEUE = {"durable": {"durable": True}, "default": {"durable": False}}
#: The contender the other rows of a mode are compared with.
BROKER_OF_MODE = {"durable": "broker", "default": "broker"}
#: The same comparison for the broker driven by the lightest client, for information.
LIGHT_BROKER_OF_MODE = {"durable": "broker-http", "default": "broker-http"}


def run_contender(contender: Contender, mode: str, repeat: int, counts: Counts) -> dict[str, Any]:
    """A fresh server; its drain, then its claim latency; the server stopped. Never raises: a failure is
    recorded in the run."""
    run: dict[str, Any] = {"contender": contender.key, "mode": mode, "repeat": repeat}
    try:
        with contender.start(mode) as instance:
            address = dict(instance.address)
            if contender.system == "broker":
                address["queue_config"] = BROKER_QUEUE[mode]
                address["broker_client"] = contender.broker_client
            run["server"] = {"command": instance.command, "settings": instance.settings}
            run.update(drain(contender.system, instance, address, counts))
            run.update(latency(contender.system, address, counts))
    except Exception as exc:
        run["error"] = f"{type(exc).__name__}: {exc}"
    return run


def drain(
    system: str, instance: servers.Instance, address: dict[str, Any], counts: Mapping[str, Any]
) -> dict[str, Any]:
    queue = "drain"
    clients.prepare(system, address, queue)
    timeout = counts["budget"] + DRAIN_GRACE
    progress = clients.DrainProgress()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (clients.consumer, (system, address, queue, index, timeout, progress))
        for index in range(counts["consumers"])
    ]
    targets.append(
        (clients.publisher, (system, address, queue, counts["messages"], counts["budget"], progress))
    )
    clients_cpu = children_cpu_seconds()
    try:
        collected, server_cpu = run_measuring_until(
            progress.drained, lambda: servers.tree_cpu_seconds(instance.pid), lambda: run_clients(targets)
        )
    finally:
        clients_cpu = children_cpu_seconds() - clients_cpu
    publisher = next(result for result in collected if result["role"] == "publisher")
    consumers = [result for result in collected if result["role"] == "consumer"]
    published = publisher["published"]
    acked = sum(result["acked"] for result in consumers)
    if acked != published:
        raise BenchError(f"the consumers acked {acked} of {published} messages")
    last_ack = max(result["last_ack"] for result in consumers if result["last_ack"] is not None)
    elapsed = last_ack - publisher["started"]
    publish_seconds = publisher["finished"] - publisher["started"]
    return {
        "messages": published,
        "requested_messages": counts["messages"],
        "drain_seconds": round(elapsed, 4),
        "drain_per_second": published / elapsed,
        "publish_seconds": round(publish_seconds, 4),
        "publish_per_second": published / publish_seconds,
        "claims": sum(result["claims"] for result in consumers),
        "empty_claims": sum(result["empty_claims"] for result in consumers),
        "empty_claim_queries": sum(result["empty_claim_queries"] for result in consumers),
        "acked_by_consumer": [result["acked"] for result in consumers],
        "server_cpu_seconds": round(server_cpu, 3),
        "server_cpu_until": "last ack",  # runs before 2026-11-24's harness fixes: until the clients exited
        "server_cpu_us_per_message": server_cpu / published * 1e6,
        "clients_cpu_seconds": round(clients_cpu, 3),
        "clients_cpu_us_per_message": clients_cpu / published * 1e6,
    }


def run_measuring_until(
    drained: Any, read_cpu: Callable[[], float], run: Callable[[], Result]
) -> tuple[Result, float]:
    """``run()``'s result, and how much ``read_cpu()`` grew from before ``run`` until ``drained`` (an
    event) was set: the server's CPU up to the last ack, read by a thread while the consumers still make
    their final empty claims, and the same for every system. If ``run`` ends without ``drained`` set (a
    failed drain), the reading is taken then."""
    started = read_cpu()
    readings: list[float] = []
    failures: list[BaseException] = []

    def read_when_drained() -> None:
        drained.wait()
        try:
            readings.append(read_cpu())
        except BaseException as exc:  # the server gone: re-raised below, in the caller's thread
            failures.append(exc)

    reader = threading.Thread(target=read_when_drained, name="server CPU at the last ack", daemon=True)
    reader.start()
    try:
        result = run()
    finally:
        drained.set()  # wakes the reader if the clients never got there
        reader.join()
    if failures:
        raise failures[0]
    return result, readings[0] - started


def latency(system: str, address: dict[str, Any], counts: Mapping[str, Any]) -> dict[str, Any]:
    queue = "latency"
    clients.prepare(system, address, queue)
    milliseconds = call_in_child(
        clients.claim_latency,
        (system, address, queue, counts["claims"], counts["warmup"], LATENCY_TIMEOUT),
        LATENCY_TIMEOUT + LATENCY_GRACE,
    )
    return {
        "claims_timed": len(milliseconds),
        "p50_ms": percentile(milliseconds, 0.50),
        "p90_ms": percentile(milliseconds, 0.90),
        "p99_ms": percentile(milliseconds, 0.99),
        "max_ms": max(milliseconds, default=math.nan),
    }


def call_in_child(function: Callable[..., Result], arguments: tuple[Any, ...], deadline: float) -> Result:
    """``function(*arguments)`` in a forked process, its result (or its error, as a ``BenchError``) sent
    back; the process is killed when it has not answered within ``deadline`` seconds."""
    receiving, sending = _fork.Pipe(duplex=False)
    process = _fork.Process(target=_answer, args=(sending, function, arguments), daemon=True)
    process.start()
    sending.close()
    answered = False
    try:
        if not receiving.poll(deadline):
            raise BenchError(f"{function.__name__} did not finish within {deadline:g} s")
        try:
            failed, value = receiving.recv()
        except EOFError:
            raise BenchError(f"{function.__name__} exited without an answer") from None
        answered = True
    finally:
        receiving.close()
        process.join(5.0 if answered else 0)  # an answered process is exiting on its own
        if process.is_alive():
            process.kill()
            process.join()
    if failed:
        raise BenchError(value)
    result: Result = value
    return result


def _answer(
    sending: multiprocessing.connection.Connection,
    function: Callable[..., Any],
    arguments: tuple[Any, ...],
) -> None:
    try:
        answer = (False, function(*arguments))
    except BaseException as exc:
        answer = (True, f"{type(exc).__name__}: {exc}")
    sending.send(answer)
    sending.close()


def run_repeat(
    selected: list[Contender], modes: list[str], repeat: int, counts: Counts
) -> Iterator[dict[str, Any]]:
    """Every selected contender in every mode, the order rotated by ``repeat`` so that no system always
    runs first (or last) while the machine drifts."""
    for mode in modes:
        order = [contender for contender in selected if mode in contender.modes]
        shift = repeat % len(order) if order else 0
        for contender in order[shift:] + order[:shift]:
            started = time.monotonic()
            run = run_contender(contender, mode, repeat, counts)
            _progress(run, time.monotonic() - started)
            yield run


def _progress(run: dict[str, Any], seconds: float) -> None:
    where = f"  repeat {run['repeat'] + 1} {run['mode']:<7} {run['contender']:<13}"
    if "error" in run:
        print(f"{where} ERROR {run['error']}", file=sys.stderr, flush=True)
        return
    print(
        f"{where} published {run['publish_per_second']:>8,.0f}/s drained {run['drain_per_second']:>8,.0f}/s "
        f"({run['messages']:,} msgs) p50 {run['p50_ms']:.2f} ms p99 {run['p99_ms']:.2f} ms "
        f"server {run['server_cpu_us_per_message']:.0f} µs/msg "
        f"clients {run['clients_cpu_us_per_message']:.0f} µs/msg "
        f"empty claims {run['empty_claim_queries']:,} [{seconds:.0f} s]",
        file=sys.stderr,
        flush=True,
    )
