"""Webhook push throughput: ``python -m bench.push [--quick]``.

Against a real ``broker serve`` with a data directory (durable queue, fsynced journal): a queue is
filled with N messages (published in batches of 100, no push configured yet), then given a ``push``
config (standard mode, ``concurrency`` 64) pointing at a receiver in a separate process, and the
queue's ``acked_total`` is polled every 20 ms until all N are acked. The rate is the messages acked
per second from the first ack seen to the last (the supervisor's start-up, up to 0.5 s after the PUT,
is left out; the rate including it is in the details).

The receiver is a raw asyncio HTTP/1.1 server (``asyncio.Protocol``, keep-alive, answers ``200 {}``
at once without parsing the body), forked into its own process: it costs far less CPU per request than
an ASGI app under Hypercorn, so it is not the bottleneck (its CPU per request is reported). It counts
the requests and the distinct ``x-broker-message-id`` values; the count must equal N + retries (the
push status' failed and deferred totals).

Also reported: the server's CPU per message pushed (its user + system time during the drain / N).

Latency, publish → receiver: after the drain, on the same queue with push still on and nothing queued,
``LATENCY_SAMPLES`` messages are published one at a time (a short pause between them, so each finds the
dispatcher idle, long-polling its claim). The publisher notes when it sent each publish and the id the
answer gives; the receiver notes when each request arrived, by ``x-broker-message-id``; both read
``time.perf_counter`` (CLOCK_MONOTONIC, one clock for the whole host). The first ``LATENCY_WARMUP``
are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson

from bench.http_api import process_cpu_seconds
from bench.report import (
    RESULTS_DIR,
    CpuWatch,
    Result,
    failed,
    machine,
    median,
    percentile,
    repetitions,
    table,
    write_json,
)
from bench.server import HOST, BenchError, Connection, Server, create_queue, delete_queue, running_server

GROUP = "push"
THROUGHPUT_TARGET = 5_000.0
CONCURRENCY = 64
BATCH = 100
POLL = 0.02
SCALES: dict[str, dict[str, int]] = {
    "full": {"messages": 50_000, "repeats": 3},
    "quick": {"messages": 5_000, "repeats": 1},
}
PAYLOAD = {"job": "render", "args": {"id": 12345, "size": "large"}, "note": "x" * 64}
LATENCY_SAMPLES = {"full": 500, "quick": 200}
LATENCY_WARMUP = 20
#: Seconds between two latency publishes: the push of one is done before the next is published.
LATENCY_GAP = 0.005

_fork = multiprocessing.get_context("fork")

_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
_ID_HEADER = b"\r\nx-broker-message-id:"


# -- the receiver ------------------------------------------------------------------------------------


class _Counts:
    def __init__(self) -> None:
        self.requests = 0
        self.ids: set[bytes] = set()
        self.arrivals: dict[bytes, float] = {}  # message id → perf_counter when its request arrived


class _ReceiverProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive: enough of it for httpx's requests (Content-Length bodies)."""

    def __init__(self, counts: _Counts) -> None:
        self.counts = counts
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        arrived = time.perf_counter()
        self.buffer += data
        out = []
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buffer[:end].lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            if len(self.buffer) < end + 4 + length:
                break
            self.buffer = self.buffer[end + 4 + length :]
            if head.startswith(b"get /__count"):
                body = orjson.dumps({"requests": self.counts.requests, "distinct": len(self.counts.ids)})
                out.append(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            if head.startswith(b"get /__arrivals"):  # and forget them
                body = orjson.dumps({key.decode(): at for key, at in self.counts.arrivals.items()})
                self.counts.arrivals.clear()
                out.append(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            self.counts.requests += 1
            at = head.find(_ID_HEADER)
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                message_id = head[at + len(_ID_HEADER) : stop if stop >= 0 else len(head)].strip()
                self.counts.ids.add(message_id)
                self.counts.arrivals.setdefault(message_id, arrived)
            out.append(_RESPONSE)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


def _receiver_main(ready: multiprocessing.connection.Connection) -> None:
    async def serve() -> None:
        counts = _Counts()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _ReceiverProtocol(counts), HOST, 0, backlog=1024)
        ready.send(server.sockets[0].getsockname()[1])
        ready.close()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


@contextlib.contextmanager
def running_receiver() -> Iterator[tuple[int, int]]:
    """The receiver in a forked process; yields ``(port, pid)``; always killed at the end."""
    parent, child = _fork.Pipe(duplex=False)
    process = _fork.Process(target=_receiver_main, args=(child,), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(15):
            raise BenchError("the receiver did not start")
        port = parent.recv()
        assert process.pid is not None
        yield port, process.pid
    finally:
        process.kill()
        process.join(10)


def receiver_counts(port: int) -> dict[str, int]:
    connection = Connection(HOST, port, timeout=10)
    try:
        result: dict[str, int] = connection.call("GET", "/__count")
        return result
    finally:
        connection.close()


def receiver_arrivals(port: int) -> dict[str, float]:
    """When each message id first arrived since the last call (``time.perf_counter``, the receiver's)."""
    connection = Connection(HOST, port, timeout=10)
    try:
        result: dict[str, float] = connection.call("GET", "/__arrivals")
        return result
    finally:
        connection.close()


# -- one repetition ------------------------------------------------------------------------------------


def push_once(
    server: Server, receiver_port: int, receiver_pid: int, messages: int, latency_samples: int
) -> dict[str, Any]:
    name = f"push-bench-{time.monotonic_ns()}"
    path = create_queue(server, name)
    connection = Connection(server.host, server.port)
    try:
        batch = {"messages": [{"payload": PAYLOAD}] * BATCH}
        for _ in range(0, messages, BATCH):
            connection.call("POST", f"{path}/messages", batch)
        stats = connection.call("GET", path)["stats"]
        if stats["ready"] != messages:
            raise BenchError(f"{stats['ready']} ready after publishing {messages}")

        before = receiver_counts(receiver_port)
        cpu0 = process_cpu_seconds(server.pid)
        receiver_cpu0 = process_cpu_seconds(receiver_pid)
        url = f"http://{HOST}:{receiver_port}/hook"
        config = {"push": {"url": url, "mode": "standard", "concurrency": CONCURRENCY}}
        put_at = time.perf_counter()
        connection.call("PUT", path, config)
        deadline = put_at + max(60.0, messages / 200)
        first_ack_at: float | None = None
        acked_at_first = 0
        while True:
            now = time.perf_counter()
            stats = connection.call("GET", path)["stats"]
            acked = stats["acked_total"]
            if first_ack_at is None and acked > 0:
                first_ack_at, acked_at_first = now, acked
            if acked >= messages:
                break
            if now > deadline:
                raise BenchError(f"only {acked} of {messages} acked after {now - put_at:.0f} s")
            time.sleep(POLL)
        done_at = time.perf_counter()
        server_cpu = process_cpu_seconds(server.pid) - cpu0
        receiver_cpu = process_cpu_seconds(receiver_pid) - receiver_cpu0
        status = connection.call("GET", f"{path}/push")["status"] or {}
        after = receiver_counts(receiver_port)
        latency = latency_once(connection, path, receiver_port, latency_samples)
    finally:
        connection.close()
    delete_queue(server, name)

    assert first_ack_at is not None
    requests = after["requests"] - before["requests"]
    retries = int(status.get("failed_total", 0)) + int(status.get("deferred_total", 0))
    measured = max(done_at - first_ack_at, 1e-9)
    return {
        "messages": messages,
        "rate": (messages - acked_at_first) / measured,
        "rate_from_put": messages / max(done_at - put_at, 1e-9),
        "drain_seconds": round(done_at - put_at, 3),
        "startup_seconds": round(first_ack_at - put_at, 3),
        "receiver_requests": requests,
        "receiver_distinct_ids": after["distinct"] - before["distinct"],
        "retries": retries,
        "requests_match": requests == messages + retries,
        "server_cpu_seconds": round(server_cpu, 3),
        "server_cpu_us_per_message": server_cpu * 1e6 / messages,
        "receiver_cpu_us_per_request": receiver_cpu * 1e6 / max(requests, 1),
        "push_status": status,
        "final_stats": stats,
        "latency": latency,
    }


def latency_once(connection: Connection, path: str, receiver_port: int, samples: int) -> dict[str, Any]:
    """Publish → receiver on an idle push queue (see the module's docstring): milliseconds."""
    acked_before = connection.call("GET", path)["stats"]["acked_total"]
    receiver_arrivals(receiver_port)  # forget the drain's
    body = {"payload": PAYLOAD}
    sent: dict[str, float] = {}
    order: list[str] = []
    for _ in range(samples + LATENCY_WARMUP):
        started = time.perf_counter()
        message_id = connection.call("POST", f"{path}/messages", body)["messages"][0]["id"]
        sent[message_id] = started
        order.append(message_id)
        time.sleep(LATENCY_GAP)
    deadline = time.perf_counter() + 30
    while connection.call("GET", path)["stats"]["acked_total"] < acked_before + len(order):
        if time.perf_counter() > deadline:
            raise BenchError("the latency messages were not all acked within 30 s")
        time.sleep(POLL)
    arrivals = receiver_arrivals(receiver_port)
    missing = [message_id for message_id in order if message_id not in arrivals]
    if missing:
        raise BenchError(f"{len(missing)} latency messages never reached the receiver")
    latencies = [(arrivals[message_id] - sent[message_id]) * 1000 for message_id in order[LATENCY_WARMUP:]]
    return {
        "samples": len(latencies),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies),
    }


# -- the group -----------------------------------------------------------------------------------------


def run_push(scale: str) -> list[Result]:
    settings = SCALES[scale]
    messages = settings["messages"]
    name = f"push drain, {messages:,} msgs, concurrency {CONCURRENCY}, standard, durable"
    cpu_name = "push: server CPU per message"
    count_name = "push: |receiver requests - (N + retries)|"
    p50_name = "push: publish → receiver on an idle queue p50"
    p99_name = "push: publish → receiver on an idle queue p99"
    runs: list[dict[str, Any]] = []
    try:
        with running_receiver() as (port, pid), running_server(durable=True) as server:
            for _ in repetitions(settings["repeats"]):
                runs.append(push_once(server, port, pid, messages, LATENCY_SAMPLES[scale]))
    except Exception as error:
        return [
            failed(GROUP, name, "msg/s", f"{type(error).__name__}: {error}"),
            failed(GROUP, cpu_name, "µs", f"{type(error).__name__}: {error}"),
            failed(GROUP, p50_name, "ms", f"{type(error).__name__}: {error}"),
            failed(GROUP, p99_name, "ms", f"{type(error).__name__}: {error}"),
        ]
    rates = [run["rate"] for run in runs]
    cpus = [run["server_cpu_us_per_message"] for run in runs]
    mismatch = [abs(run["receiver_requests"] - run["messages"] - run["retries"]) for run in runs]
    p50s = [run["latency"]["p50_ms"] for run in runs]
    p99s = [run["latency"]["p99_ms"] for run in runs]
    details = {"runs": runs, "receiver": "raw asyncio HTTP/1.1 server in a forked process"}
    return [
        Result(GROUP, name, median(rates), "msg/s", THROUGHPUT_TARGET, samples=rates, details=details),
        Result(GROUP, cpu_name, round(median(cpus), 1), "µs", samples=cpus),
        Result(
            GROUP,
            count_name,
            float(max(mismatch)),
            "requests",
            0.0,
            False,
            [float(m) for m in mismatch],
        ),
        Result(GROUP, p50_name, median(p50s), "ms", samples=p50s),
        Result(GROUP, p99_name, median(p99s), "ms", samples=p99s),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.push", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, one repetition")
    args = parser.parse_args(argv)
    scale = "quick" if args.quick else "full"
    started = datetime.now(UTC)
    watch = CpuWatch()
    results = run_push(scale)
    cpu = watch.summary()
    document: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "command": " ".join(
            [sys.executable, "-m", "bench.push", *(argv if argv is not None else sys.argv[1:])]
        ),
        "scale": scale,
        "machine": machine(),
        "groups": {GROUP: cpu},
        "results": [result.to_json() for result in results],
    }
    path = RESULTS_DIR / f"{started.strftime('%Y%m%dT%H%M%SZ')}-push.json"
    write_json(path, document)
    print(table(results))
    for index, run in enumerate(results[0].details.get("runs", [])):
        print(
            f"run {index + 1}: {run['rate']:,.0f} msg/s ({run['rate_from_put']:,.0f} from the PUT), "
            f"drain {run['drain_seconds']} s, receiver {run['receiver_requests']} requests "
            f"({run['receiver_distinct_ids']} distinct ids), retries {run['retries']}, "
            f"server CPU {run['server_cpu_us_per_message']:.0f} µs/msg, "
            f"receiver CPU {run['receiver_cpu_us_per_request']:.0f} µs/request; "
            f"publish → receiver p50 {run['latency']['p50_ms']:.2f} ms, p99 {run['latency']['p99_ms']:.2f} ms"
        )
    print(f"\nother tenants of the machine used {cpu['other_tenants_cores']:.2f} cores on average meanwhile")
    print(f"results written to {path}")
    return 0 if all(result.passed is not False for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
