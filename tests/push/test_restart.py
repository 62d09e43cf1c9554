"""Push across a broker crash: a real ``broker serve`` is SIGKILLed while pushes are in flight to a slow
receiver, restarted on the same data directory, and every message still reaches the receiver and ends
acked (the pushes that were in flight are retried once their lease runs out).

The receiver is a threaded ``http.server`` on loopback that sleeps before answering 200, so that pushes
are reliably in flight when the broker is killed. Every wait is bounded (polling with a deadline).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_serve import START_TIMEOUT, ServerProcess

pytestmark = pytest.mark.e2e

MESSAGES = 50
CONCURRENCY = 10
SLOW = 0.5  # seconds the receiver takes to answer
PUSH_TIMEOUT = 2  # the push timeout: the dispatcher's lease is this plus 10 s
SETTLE_WITHIN = 60.0  # seconds for all messages to be acked after the restart


class SlowReceiver:
    """Records each push's message id; answers 200 after ``SLOW`` seconds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: Counter[str] = Counter()
        self.in_progress: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                message_id = json.loads(body)["id"]
                with receiver.lock:
                    receiver.received[message_id] += 1
                    receiver.in_progress.add(message_id)
                try:
                    time.sleep(SLOW)
                    self.send_response(200)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except OSError:
                    pass  # the broker was killed while waiting for this answer
                finally:
                    with receiver.lock:
                        receiver.in_progress.discard(message_id)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def snapshot(self) -> tuple[Counter[str], set[str]]:
        with self.lock:
            return Counter(self.received), set(self.in_progress)


@pytest.fixture
def receiver() -> Iterator[SlowReceiver]:
    receiver = SlowReceiver()
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def wait_for(condition: Callable[[], Any], within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within} s")
        time.sleep(0.05)


def started(process: ServerProcess) -> httpx.Client:
    url = process.wait_for_event("listening", START_TIMEOUT)["url"]
    return httpx.Client(base_url=url, timeout=10)


def test_pushes_in_flight_at_a_crash_are_retried_after_the_restart(
    tmp_path: Path, receiver: SlowReceiver
) -> None:
    data = tmp_path / "data"
    first = ServerProcess(data)
    try:
        with started(first) as http:
            push = {"url": receiver.url, "concurrency": CONCURRENCY, "timeout": PUSH_TIMEOUT}
            assert http.put("/v1/queues/jobs", json={"push": push}).status_code == 201
            published = http.post(
                "/v1/queues/jobs/messages",
                json={"messages": [{"payload": {"n": n}} for n in range(MESSAGES)]},
            )
            assert published.status_code == 201
            ids = [ref["id"] for ref in published.json()["messages"]]
            assert len(ids) == MESSAGES

            # Kill once some pushes have been answered and a full window is at the receiver.
            def mid_push() -> set[str] | None:
                received, in_progress = receiver.snapshot()
                if sum(received.values()) > CONCURRENCY and len(in_progress) >= CONCURRENCY // 2:
                    return in_progress
                return None

            in_flight = wait_for(mid_push, 20, "pushes in flight")
            first.process.kill()
            first.process.wait(timeout=15)
        received_before, _ = receiver.snapshot()
        assert sum(received_before.values()) < MESSAGES, "everything was pushed before the crash"
    finally:
        first.stop()

    second = ServerProcess(data)
    try:
        with started(second) as http:

            def settled() -> dict[str, Any] | None:
                stats = http.get("/v1/queues/jobs").json()["stats"]
                received, _ = receiver.snapshot()
                everything_received = all(received[message_id] >= 1 for message_id in ids)
                nothing_left = (stats["ready"], stats["in_flight"], stats.get("delayed", 0)) == (0, 0, 0)
                return stats if everything_received and nothing_left else None

            wait_for(settled, SETTLE_WITHIN, "every message received and acked after the restart")
            states = {
                message_id: http.get(f"/v1/queues/jobs/messages/{message_id}").json()["state"]
                for message_id in ids
            }
    finally:
        second.stop()

    received, _ = receiver.snapshot()
    assert set(received) == set(ids)
    assert states == dict.fromkeys(ids, "acked")
    # The pushes the crash cut off were sent again by the restarted broker.
    assert in_flight and all(received[message_id] >= 2 for message_id in in_flight), (in_flight, received)
