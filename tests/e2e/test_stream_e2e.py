"""End to end: §7 push streams and the client's worker loop against a real ``broker serve`` process.

Each stream is read by a thread into a queue of events; every wait on it is bounded.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.client import Client, Delivery, Message
from broker.client.sse import Comment, Event, EventParser
from tests.e2e.test_serve import EXIT_TIMEOUT, START_TIMEOUT, Server, ServerProcess

pytestmark = pytest.mark.e2e

WAIT = 10.0


class InMemoryServerProcess(ServerProcess):
    """``broker serve --in-memory`` (the parent's reader and waits, another command line)."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker",
                "serve",
                "--port",
                "0",
                "--in-memory",
                "--data-dir",
                str(data_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=data_dir,
        )
        self.lines = queue.Queue()
        self.seen = []
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True)
        self._reader.start()


def started(process: ServerProcess) -> Server:
    return Server(process, process.wait_for_event("listening", START_TIMEOUT)["url"])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    process = InMemoryServerProcess(tmp_path / "data")
    try:
        yield started(process)
    finally:
        process.stop()


class StreamReader:
    """A ``/work`` stream read by a thread: ``items`` gets its events and comments as they arrive."""

    def __init__(self, url: str, queue_name: str = "jobs", **params: Any) -> None:
        self.items: queue.Queue[Event | Comment | None] = queue.Queue()
        self.status: int | None = None
        self._http = httpx.Client(base_url=url, timeout=httpx.Timeout(WAIT, read=60))
        self._closing = threading.Event()
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, args=(queue_name, params), daemon=True)
        self._thread.start()

    def _read(self, queue_name: str, params: dict[str, Any]) -> None:
        parser = EventParser()
        try:
            with self._http.stream(
                "GET", f"/v1/queues/{queue_name}/work", params=params, headers={"Accept": "text/event-stream"}
            ) as response:
                self._response = response
                self.status = response.status_code
                for chunk in response.iter_raw():
                    for item in parser.feed(chunk):
                        self.items.put(item)
        except (httpx.HTTPError, RuntimeError):
            if not self._closing.is_set():
                raise
        finally:
            self.items.put(None)

    def next(self) -> Event | Comment | None:
        return self.items.get(timeout=WAIT)

    def messages(self, count: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < count:
            item = self.next()
            assert item is not None, "the stream ended"
            if isinstance(item, Event):
                assert item.event == "message", item
                out.append(json.loads(item.data))
        return out

    def close(self) -> None:
        """Hang up: shut the connection's socket down under the reader (closing the httpx client from
        another thread would leave the socket open until the reader next wakes)."""
        self._closing.set()
        if self._response is not None:
            network_stream = self._response.extensions["network_stream"]
            # The reader closed it already when the broker ended the response (EBADF): nothing to do.
            with contextlib.suppress(OSError):
                network_stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        self._thread.join(WAIT)
        self._http.close()


def test_refill_on_ack_and_release_on_disconnect_within_100_ms(server: Server) -> None:
    with server.client() as http:
        http.put("/v1/queues/jobs", json={})
        http.post("/v1/queues/jobs/messages", json={"messages": [{"payload": n} for n in range(4)]})
        leaving = StreamReader(server.url, consumer="leaving", max=2)
        assert leaving.next() == Comment("stream open")
        first = leaving.messages(2)
        assert [m["payload"] for m in first] == [0, 1]
        assert http.get("/v1/queues/jobs").json()["stats"]["in_flight"] == 2, "backpressure at max"
        http.post("/v1/queues/jobs/ack", json={"leases": [first[0]["lease_id"]]})
        [refill] = leaving.messages(1)
        assert refill["payload"] == 2
        staying = StreamReader(server.url, consumer="staying", max=5)
        assert staying.next() == Comment("stream open")
        [last] = staying.messages(1)
        assert last["payload"] == 3
        closed_at = time.monotonic()
        leaving.close()
        released = staying.messages(2)
        elapsed = time.monotonic() - closed_at
        staying.close()
    assert sorted(m["payload"] for m in released) == [1, 2]
    assert all(m["attempt"] == 2 for m in released)
    assert elapsed < 0.1, f"the released messages took {elapsed * 1000:.1f} ms to reach the other stream"


def test_stream_errors_over_the_wire(server: Server) -> None:
    with server.client() as http:
        http.put("/v1/queues/jobs", json={})
        assert http.get("/v1/queues/jobs/work").status_code == 406
        missing = http.get("/v1/queues/ghost/work", headers={"Accept": "text/event-stream"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "queue_not_found")
        bad = http.get("/v1/queues/jobs/work?max=0", headers={"Accept": "text/event-stream"})
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_request")
        stream = StreamReader(server.url)
        assert stream.next() == Comment("stream open")
        assert http.delete("/v1/queues/jobs").status_code == 204
        event = stream.next()
        assert isinstance(event, Event) and event.event == "error"
        assert json.loads(event.data)["code"] == "queue_not_found"
        assert stream.next() is None, "the response ends after the error event"
        stream.close()


def test_sigterm_ends_streams_with_an_error_and_releases_their_leases(tmp_path: Path) -> None:
    process = ServerProcess(tmp_path / "data")
    try:
        server = started(process)
        with server.client() as http:
            http.put("/v1/queues/jobs", json={})
            [ref] = http.post("/v1/queues/jobs/messages", json={"payload": "held"}).json()["messages"]
        stream = StreamReader(server.url, max=1)
        assert stream.messages(1)[0]["id"] == ref["id"]
        process.process.send_signal(signal.SIGTERM)
        event = stream.next()
        assert isinstance(event, Event) and event.event == "error", event
        assert json.loads(event.data)["code"] == "shutting_down"
        stream.close()
        assert process.wait_for_exit(EXIT_TIMEOUT) == 0
    finally:
        process.stop()
    restarted = ServerProcess(tmp_path / "data")
    try:
        server = started(restarted)
        with server.client() as http:
            message = http.get(f"/v1/queues/jobs/messages/{ref['id']}").json()
    finally:
        restarted.stop()
    # Leases survive a clean restart (the shutdown snapshot keeps them), so a message still leased to
    # the stream would come back in flight: ready means its release was journaled before the snapshot.
    assert (message["state"], message["attempt"], message["lease_id"]) == ("ready", 1, None)


def test_the_blocking_worker_loop_against_a_real_server(server: Server) -> None:
    stop = threading.Event()
    seen: list[Any] = []

    def handle(delivery: Delivery) -> None:
        seen.append(delivery.payload)
        if len(seen) == 100:
            stop.set()

    with Client(server.url) as broker:
        broker.create_queue("jobs")
        broker.publish_batch("jobs", [Message(n) for n in range(100)])
        stats = broker.work("jobs", handle, concurrency=8, stop=stop, handle_signals=False)
        assert sorted(seen) == list(range(100))
        assert (stats.acked, stats.mode) == (100, "stream")
        queue_stats = broker.stats("jobs")
    assert (queue_stats["acked_total"], queue_stats["in_flight"]) == (100, 0)
