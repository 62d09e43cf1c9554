"""Benchmarks over HTTP against a real ``broker serve`` subprocess on 127.0.0.1.

Client processes are forked with ``multiprocessing``; their timestamps come from ``time.perf_counter``,
which on Linux reads CLOCK_MONOTONIC, one clock for every process on the machine, so a start taken in
the publisher and an end taken in a consumer can be subtracted.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import queue
import resource
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.report import Result, failed, median, percentile, quiet, repetitions
from bench.server import BenchError, Connection, Server, create_queue, delete_queue, running_server

BATCH = 100
PAYLOAD_TEXT = "x" * 198  # 200 bytes once JSON-encoded


def distinct_payload(number: int) -> str:
    """``PAYLOAD_TEXT`` with ``number`` in its first ten characters: as long, and unlike any other."""
    return f"{number:010d}{PAYLOAD_TEXT[10:]}"


DRAIN = {
    "full": {"messages": 100_000, "consumers": 8, "repeats": 3},
    "quick": {"messages": 10_000, "consumers": 8, "repeats": 1},
}
LATENCY = {
    "full": {"claims": 2_000, "warmup": 200, "repeats": 3},
    "quick": {"claims": 300, "warmup": 50, "repeats": 1},
}
LONGPOLL = {
    "full": {"rounds": 200, "warmup": 10, "repeats": 3},
    "quick": {"rounds": 30, "warmup": 5, "repeats": 1},
}

DRAIN_TARGET = 15_000.0  # messages/s, first publish to last ack
CLAIM_P50_TARGET = 1.5  # ms
CLAIM_P99_TARGET = 5.0  # ms
WAKE_P50_TARGET = 5.0  # ms

#: Bounds on one drain run: client set-up, and the whole run once started.
SETUP_TIMEOUT = 60.0
RUN_TIMEOUT = 300.0
#: How long a consumer's claim long-polls; it only matters at the end, when a consumer finds nothing.
CONSUMER_WAIT = 1.0
#: The pause between sending a long-poll claim and publishing; see ``_longpoll_once``.
PARK_PAUSE = 0.02

_fork = multiprocessing.get_context("fork")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- client processes ----------------------------------------------------------------------------------


def _publisher(
    host: str,
    port: int,
    token: str | None,
    path: str,
    messages: int,
    start: multiprocessing.synchronize.Barrier,
    published_all: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Publish ``messages`` in batches of ``BATCH``, one request at a time, on one connection."""
    try:
        connection = Connection(host, port, token=token)
        connection.call("GET", "/healthz")
        # Every message distinct, as users' are (the journal writes a value that a batch's messages
        # share once); the bodies are made before the clock starts.
        batches = [range(first, first + BATCH) for first in range(0, messages - messages % BATCH, BATCH)]
        bodies = [orjson.dumps({"messages": [{"payload": distinct_payload(n)} for n in b]}) for b in batches]
        messages_path = f"{path}/messages"
        start.wait(SETUP_TIMEOUT)
        started = time.perf_counter()
        for body in bodies:
            connection.send("POST", messages_path, body)
            status, data = connection.receive()
            if status != 201:
                raise BenchError(f"publish answered {status}: {data[:300]!r}")
        finished = time.perf_counter()
        published_all.set()
        results.put({"role": "publisher", "started": started, "finished": finished, "published": messages})
    except BaseException as exc:
        published_all.set()
        results.put({"role": "publisher", "error": f"{type(exc).__name__}: {exc}"})


def _consumer(
    index: int,
    host: str,
    port: int,
    token: str | None,
    path: str,
    start: multiprocessing.synchronize.Barrier,
    published_all: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Claim up to ``BATCH``, ack them all in one call, until the publisher is done and nothing is left."""
    try:
        connection = Connection(host, port, token=token)
        connection.call("GET", "/healthz")
        claim_path, ack_path = f"{path}/claim", f"{path}/ack"
        claim_body = orjson.dumps({"consumer": f"consumer-{index}", "max": BATCH, "wait": CONSUMER_WAIT})
        acked = claims = empty_claims = 0
        last_ack = None
        start.wait(SETUP_TIMEOUT)
        give_up_at = time.perf_counter() + RUN_TIMEOUT
        while True:
            if time.perf_counter() > give_up_at:
                raise BenchError(f"consumer {index} gave up after {RUN_TIMEOUT:g} s with {acked} acked")
            # Read before claiming: an empty answer to a claim sent after the last publish means done.
            publisher_done = published_all.is_set()
            connection.send("POST", claim_path, claim_body)
            status, data = connection.receive()
            if status != 200:
                raise BenchError(f"claim answered {status}: {data[:300]!r}")
            claims += 1
            delivered = orjson.loads(data)["messages"]
            if not delivered:
                empty_claims += 1
                if publisher_done:
                    break
                continue
            connection.send("POST", ack_path, orjson.dumps({"leases": [m["lease_id"] for m in delivered]}))
            status, data = connection.receive()
            if status != 200 or orjson.loads(data)["acked"] != len(delivered):
                raise BenchError(f"ack answered {status}: {data[:300]!r}")
            acked += len(delivered)
            last_ack = time.perf_counter()
        results.put(
            {
                "role": "consumer",
                "acked": acked,
                "last_ack": last_ack,
                "claims": claims,
                "empty_claims": empty_claims,
            }
        )
    except BaseException as exc:
        results.put({"role": "consumer", "error": f"{type(exc).__name__}: {exc}"})


def run_clients(targets: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """Fork one process per target, release them together, collect one result from each.

    Every process is joined, or killed if it outlives the run's time bound.
    """
    start = _fork.Barrier(len(targets) + 1)
    published_all = _fork.Event()
    results: multiprocessing.Queue[dict[str, Any]] = _fork.Queue()
    processes = [
        _fork.Process(target=target, args=(*args, start, published_all, results), daemon=True)
        for target, args in targets
    ]
    collected: list[dict[str, Any]] = []
    try:
        for process in processes:
            process.start()
        start.wait(SETUP_TIMEOUT)
        deadline = time.monotonic() + RUN_TIMEOUT + 30
        while len(collected) < len(processes):
            try:
                collected.append(results.get(timeout=max(deadline - time.monotonic(), 0.1)))
            except queue.Empty:
                raise BenchError(f"the clients did not finish within {RUN_TIMEOUT + 30:g} s") from None
            if time.monotonic() > deadline:
                raise BenchError(f"the clients did not finish within {RUN_TIMEOUT + 30:g} s")
    finally:
        # After a complete run every process is exiting on its own; after an error, do not wait for them.
        grace = 5.0 if len(collected) == len(processes) else 0.0
        for process in processes:
            process.join(grace)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
    errors = [result["error"] for result in collected if "error" in result]
    if errors:
        raise BenchError("; ".join(errors[:3]))
    return collected


# -- drain and publish ---------------------------------------------------------------------------------


def drain_once(server: Server, queue_name: str, messages: int, consumers: int) -> dict[str, Any]:
    """One publisher and ``consumers`` consumers; returns rates and what the server's CPU did."""
    path = create_queue(server, queue_name)
    address = (server.host, server.port, server.token, path)
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (_consumer, (index, *address)) for index in range(consumers)
    ]
    targets.append((_publisher, (*address, messages)))
    server_cpu, clients_cpu, wall = (
        process_cpu_seconds(server.pid),
        children_cpu_seconds(),
        time.perf_counter(),
    )
    try:
        collected = run_clients(targets)
    finally:
        server_cpu = process_cpu_seconds(server.pid) - server_cpu
        clients_cpu = children_cpu_seconds() - clients_cpu
        wall = time.perf_counter() - wall
    delete_queue(server, queue_name)
    publisher = next(result for result in collected if result["role"] == "publisher")
    consumer_results = [result for result in collected if result["role"] == "consumer"]
    acked = sum(result["acked"] for result in consumer_results)
    if acked != messages:
        raise BenchError(f"the consumers acked {acked} of {messages} messages")
    last_ack = max(result["last_ack"] for result in consumer_results if result["last_ack"] is not None)
    elapsed = last_ack - publisher["started"]
    return {
        "messages": messages,
        "consumers": consumers,
        "drain_seconds": round(elapsed, 4),
        "drain_per_second": messages / elapsed,
        "publish_seconds": round(publisher["finished"] - publisher["started"], 4),
        "publish_per_second": messages / (publisher["finished"] - publisher["started"]),
        "claims": sum(result["claims"] for result in consumer_results),
        "empty_claims": sum(result["empty_claims"] for result in consumer_results),
        "acked_by_consumer": [result["acked"] for result in consumer_results],
        "server_cpu_seconds": round(server_cpu, 3),
        "server_cpu_microseconds_per_message": server_cpu / messages * 1e6,
        "clients_cpu_seconds": round(clients_cpu, 3),
        "wall_seconds_including_setup": round(wall, 3),
    }


def publish_once(server: Server, queue_name: str, messages: int) -> dict[str, Any]:
    """One publisher, no consumers: the publish rate alone."""
    path = create_queue(server, queue_name)
    server_cpu = process_cpu_seconds(server.pid)
    try:
        (publisher,) = run_clients([(_publisher, (server.host, server.port, server.token, path, messages))])
    finally:
        server_cpu = process_cpu_seconds(server.pid) - server_cpu
    delete_queue(server, queue_name)
    elapsed = publisher["finished"] - publisher["started"]
    return {
        "messages": messages,
        "publish_seconds": round(elapsed, 4),
        "publish_per_second": messages / elapsed,
        "server_cpu_seconds": round(server_cpu, 3),
    }


def run_http(scale: str) -> list[Result]:
    counts = DRAIN[scale]
    messages, consumers = counts["messages"], counts["consumers"]
    drain_name = f"HTTP drain, {messages:,} msgs, 1 pub + {consumers} cons"
    names = (drain_name, "HTTP publish rate during the drain", "HTTP publish alone (1 publisher)")
    try:
        with running_server() as server:
            drains, publishes = [], []
            for rep in repetitions(counts["repeats"]):
                drains.append(drain_once(server, f"drain-{rep}", messages, consumers))
                quiet.wait()
                publishes.append(publish_once(server, f"publish-{rep}", messages))
    except Exception as exc:
        return [failed("http", name, "msg/s", f"{type(exc).__name__}: {exc}") for name in names]
    drain_samples = [run["drain_per_second"] for run in drains]
    during_samples = [run["publish_per_second"] for run in drains]
    alone_samples = [run["publish_per_second"] for run in publishes]
    return [
        Result(
            "http",
            names[0],
            median(drain_samples),
            "msg/s",
            DRAIN_TARGET,
            samples=drain_samples,
            details={"runs": drains},
        ),
        Result("http", names[1], median(during_samples), "msg/s", samples=during_samples),
        Result(
            "http",
            names[2],
            median(alone_samples),
            "msg/s",
            samples=alone_samples,
            details={"runs": publishes},
        ),
    ]


# -- latency -------------------------------------------------------------------------------------------


def claim_latency_once(server: Server, queue_name: str, claims: int, warmup: int) -> dict[str, Any]:
    """Time ``claims`` single-message claims (max 1, no wait) on a queue that already holds them."""
    path = create_queue(server, queue_name)
    connection = Connection(server.host, server.port, token=server.token)
    try:
        total = claims + warmup
        for offset in range(0, total, BATCH):
            count = min(BATCH, total - offset)
            connection.call("POST", f"{path}/messages", {"messages": [{"payload": PAYLOAD_TEXT}] * count})
        claim_path = f"{path}/claim"
        claim_body = orjson.dumps({"consumer": "latency", "max": 1})
        perf_counter = time.perf_counter
        milliseconds: list[float] = []
        leases: list[str] = []
        server_cpu = process_cpu_seconds(server.pid)
        give_up_at = perf_counter() + RUN_TIMEOUT
        for index in range(total):
            if perf_counter() > give_up_at:
                raise BenchError(f"{index} claims took more than {RUN_TIMEOUT:g} s")
            started = perf_counter()
            connection.send("POST", claim_path, claim_body)
            status, data = connection.receive()
            elapsed = perf_counter() - started
            if status != 200:
                raise BenchError(f"claim answered {status}: {data[:300]!r}")
            (delivery,) = orjson.loads(data)["messages"]
            leases.append(delivery["lease_id"])
            if index >= warmup:
                milliseconds.append(elapsed * 1000)
        server_cpu = process_cpu_seconds(server.pid) - server_cpu
        for offset in range(0, len(leases), 1000):  # untimed
            connection.call("POST", f"{path}/ack", {"leases": leases[offset : offset + 1000]})
    finally:
        connection.close()
    delete_queue(server, queue_name)
    return {**_latency_summary(milliseconds), "server_cpu_ms_per_claim": server_cpu / total * 1000}


def _latency_summary(milliseconds: list[float]) -> dict[str, Any]:
    return {
        "count": len(milliseconds),
        "p50_ms": percentile(milliseconds, 0.50),
        "p90_ms": percentile(milliseconds, 0.90),
        "p99_ms": percentile(milliseconds, 0.99),
        "max_ms": max(milliseconds),
        "min_ms": min(milliseconds),
    }


def run_latency(scale: str) -> list[Result]:
    counts = LATENCY[scale]
    names = ("claim latency p50 (max 1, one consumer)", "claim latency p99 (max 1, one consumer)")
    try:
        with running_server() as server:
            runs = [
                claim_latency_once(server, f"latency-{rep}", counts["claims"], counts["warmup"])
                for rep in repetitions(counts["repeats"])
            ]
    except Exception as exc:
        return [failed("latency", name, "ms", f"{type(exc).__name__}: {exc}") for name in names]
    return _percentile_results("latency", names, runs, CLAIM_P50_TARGET, CLAIM_P99_TARGET, {})


def _percentile_results(
    group: str,
    names: tuple[str, str],
    runs: list[dict[str, Any]],
    p50_target: float | None,
    p99_target: float | None,
    details: dict[str, Any],
) -> list[Result]:
    """The p50 and p99 rows of a latency benchmark: medians over its repetitions."""
    p50s = [run["p50_ms"] for run in runs]
    p99s = [run["p99_ms"] for run in runs]
    return [
        Result(
            group,
            names[0],
            median(p50s),
            "ms",
            p50_target,
            at_least=False,
            samples=p50s,
            details={**details, "runs": runs},
        ),
        Result(group, names[1], median(p99s), "ms", p99_target, at_least=False, samples=p99s),
    ]


# -- long-poll wake ------------------------------------------------------------------------------------


def longpoll_once(server: Server, queue_name: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Per round: park a ``wait: 10`` claim on the empty queue, publish one message on another
    connection, and time from sending the publish until the claim's answer has arrived."""
    path = create_queue(server, queue_name)
    waiter = Connection(server.host, server.port, token=server.token)
    publisher = Connection(server.host, server.port, token=server.token)
    try:
        claim_path, messages_path, ack_path = f"{path}/claim", f"{path}/messages", f"{path}/ack"
        claim_body = orjson.dumps({"consumer": "waiter", "max": 1, "wait": 10})
        publish_body = orjson.dumps({"payload": PAYLOAD_TEXT})
        perf_counter = time.perf_counter
        milliseconds: list[float] = []
        give_up_at = perf_counter() + RUN_TIMEOUT
        for index in range(rounds + warmup):
            if perf_counter() > give_up_at:
                raise BenchError(f"{index} rounds took more than {RUN_TIMEOUT:g} s")
            waiter.send("POST", claim_path, claim_body)
            # A fixed pause so that the claim has reached the queue's actor and is parked there before
            # the publish is sent (on loopback it takes well under a millisecond). Crude, but this is a
            # benchmark: the check below catches a claim that answered early instead of waiting.
            time.sleep(PARK_PAUSE)
            readable, _, _ = select.select([waiter.socket], [], [], 0)
            if readable:
                raise BenchError("a long-poll claim on an empty queue answered before anything was published")
            started = perf_counter()
            publisher.send("POST", messages_path, publish_body)
            status, data = waiter.receive()
            elapsed = perf_counter() - started
            publish_status, publish_data = publisher.receive()
            if status != 200 or publish_status != 201:
                raise BenchError(f"claim answered {status}, publish {publish_status}: {publish_data[:300]!r}")
            delivered = orjson.loads(data)["messages"]
            if len(delivered) != 1:
                raise BenchError(f"the woken claim got {len(delivered)} messages, not 1")
            waiter.call("POST", ack_path, {"leases": [delivered[0]["lease_id"]]})  # untimed
            if index >= warmup:
                milliseconds.append(elapsed * 1000)
    finally:
        waiter.close()
        publisher.close()
    delete_queue(server, queue_name)
    return _latency_summary(milliseconds)


def run_longpoll(scale: str) -> list[Result]:
    counts = LONGPOLL[scale]
    names = ("long-poll wake latency p50", "long-poll wake latency p99")
    try:
        with running_server() as server:
            runs = [
                longpoll_once(server, f"longpoll-{rep}", counts["rounds"], counts["warmup"])
                for rep in repetitions(counts["repeats"])
            ]
    except Exception as exc:
        return [failed("longpoll", name, "ms", f"{type(exc).__name__}: {exc}") for name in names]
    return _percentile_results(
        "longpoll", names, runs, WAKE_P50_TARGET, None, {"park_pause_seconds": PARK_PAUSE}
    )
