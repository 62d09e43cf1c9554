"""End to end: a §7 push stream whose client stops reading, over a real socket to ``broker serve``.

The client connects with a tiny receive buffer and never reads, so the broker's write of the first
deliveries (megabytes of payload) waits on a full socket while the stream's leases expire. Checking that
something does *not* happen takes waiting: a few lease periods of a 1 s lease, every wait bounded.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.test_serve import Server
from tests.e2e.test_stream_e2e import server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e

WAIT = 10.0
LEASE = 1.0
BIG = "x" * 900_000  # six of them outgrow the socket buffers on both ends


def test_a_stream_whose_client_never_reads_leases_each_message_once(server: Server) -> None:  # noqa: F811
    with server.client() as http:
        http.put("/v1/queues/jobs", json={"lease": LEASE, "max_attempts": 2})
        http.post("/v1/queues/jobs/messages", json={"messages": [{"payload": BIG} for _ in range(12)]})
        address = urlsplit(server.url)
        stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting, or it is ignored
        stuck.connect((address.hostname, address.port))
        try:
            stuck.sendall(
                b"GET /v1/queues/jobs/work?consumer=stuck&max=6 HTTP/1.1\r\nHost: broker\r\n"
                b"Accept: text/event-stream\r\n\r\n"
            )
            deadline = time.monotonic() + WAIT
            while http.get("/v1/queues/jobs").json()["stats"]["in_flight"] < 6:
                assert time.monotonic() < deadline, "the stream never took its six"
                time.sleep(0.05)
            while (stats := http.get("/v1/queues/jobs").json()["stats"])["in_flight"] > 0:
                assert time.monotonic() < deadline, "the stream's six leases never ended"
                time.sleep(0.05)
            # Those a write started on (the first, and as many more as the socket buffers took) expire
            # as seen; the others never left the broker: released, their attempt refunded.
            expired = stats["lease_expired_total"]
            assert 1 <= expired < 6, expired
            time.sleep(3 * LEASE)  # before the fix, the same six were leased again every second
            stats = http.get("/v1/queues/jobs").json()["stats"]
            assert (stats["lease_expired_total"], stats["dead_lettered_total"]) == (expired, 0)
            assert (stats["ready"], stats["in_flight"]) == (12, 0)
            claimed = http.post("/v1/queues/jobs/claim", json={"consumer": "other", "max": 12}).json()
            assert len(claimed["messages"]) == 12, "the stuck stream holds nothing"
            assert sorted(m["attempt"] for m in claimed["messages"]) == [1] * (12 - expired) + [2] * expired
        finally:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stuck.close()


def _stuck_stream(url: str, query: str) -> socket.socket:
    """A stream's connection whose client reads nothing after the response's head (tiny buffer)."""
    address = urlsplit(url)
    stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting, or it is ignored
    stuck.connect((address.hostname, address.port))
    stuck.settimeout(WAIT)
    stuck.sendall(
        f"GET /v1/queues/jobs/work?{query} HTTP/1.1\r\n"
        "Host: broker\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    return stuck


def _wait_for_stats(http: httpx.Client, done: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT
    while not done(stats := http.get("/v1/queues/jobs").json()["stats"]):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return stats


def test_a_stalled_stream_never_writes_what_went_stale_while_its_write_waited(server: Server) -> None:  # noqa: F811
    with server.client() as http:
        http.put("/v1/queues/jobs", json={"lease": LEASE})
        http.post("/v1/queues/jobs/messages", json={"messages": [{"payload": BIG} for _ in range(8)]})
        stuck = _stuck_stream(server.url, "consumer=stuck&max=8")
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                head += stuck.recv(1)
            stream_id = re.search(rb"\r\nstream-id: ([^\r]+)\r\n", head)
            assert stream_id is not None, head
            _wait_for_stats(http, lambda stats: stats["in_flight"] == 8, "the stream never took its eight")
            # The leases end while the first write waits: the deliveries behind it go back unseen.
            stats = _wait_for_stats(http, lambda stats: stats["in_flight"] == 0, "the leases never ended")
            claimed = http.post("/v1/queues/jobs/claim", json={"consumer": "other", "max": 8}).json()
            assert len(claimed["messages"]) == 8
            leases = [message["lease_id"] for message in claimed["messages"]]
            assert http.post("/v1/queues/jobs/ack", json={"leases": leases}).json()["acked"] == 8
            stopped = http.post(f"/v1/queues/jobs/work/{stream_id[1].decode()}/stop")
            assert stopped.status_code == 200, stopped.text
            received = b""
            while b"event: stopped" not in received:  # after every delivery handed to the stream
                data = stuck.recv(1 << 20)
                assert data, "the stream ended without its stopped event"
                received += data
            # Only what a write had started on (and whose lease then expired as seen) reaches the client;
            # writing the others would hand it work another consumer had already finished.
            written = received.count(b"event: message\n")
            assert written == stats["lease_expired_total"] >= 1, (written, stats)
        finally:
            stuck.close()


def test_a_client_that_leaves_during_a_waiting_write_costs_only_that_write_an_attempt(server: Server) -> None:  # noqa: F811
    with server.client() as http:
        http.put("/v1/queues/jobs", json={"lease": 30, "max_attempts": 1})
        http.post("/v1/queues/jobs/messages", json={"messages": [{"payload": BIG} for _ in range(6)]})
        stuck = _stuck_stream(server.url, "consumer=stuck&max=6")
        try:
            _wait_for_stats(http, lambda stats: stats["in_flight"] == 6, "the stream never took its six")
        finally:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stuck.close()  # a reset: the write waiting on the full socket fails
        stats = _wait_for_stats(http, lambda stats: stats["in_flight"] == 0, "the leases were never released")
        # Those a write started on may have reached the client: their attempt counts, and with
        # max_attempts 1 they are dead-lettered. The others never left the broker: refunded, ready.
        dead = stats["dead_lettered_total"]
        assert 1 <= dead < 6, stats
        assert stats["ready"] == 6 - dead, stats
