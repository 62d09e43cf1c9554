"""End to end: a §7 push stream whose client stops reading, over a real socket to ``broker serve``.

The client connects with a tiny receive buffer and never reads, so the broker's write of the first
deliveries (megabytes of payload) waits on a full socket while the stream's leases expire. Checking that
something does *not* happen takes waiting: a few lease periods of a 1 s lease, every wait bounded.
"""

from __future__ import annotations

import socket
import struct
import time
from urllib.parse import urlsplit

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
