"""End to end: a real ``broker serve`` process on port 0, driven over HTTP with httpx.

These are plain synchronous tests (the process is the concurrency). Every wait is bounded, and the
server is always stopped in the fixture's teardown.
"""

from __future__ import annotations

import itertools
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

START_TIMEOUT = 30.0  # seconds for the process to log "listening"
EXIT_TIMEOUT = 15.0  # seconds for the process to exit after a signal
HTTP_TIMEOUT = 10.0


class ServerProcess:
    """A ``broker serve`` subprocess and the JSON log lines it writes to stderr."""

    def __init__(self, data_dir: Path, port: int = 0, args: Sequence[str] = ()) -> None:
        self.data_dir = data_dir
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=data_dir.parent,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_event(self, event: str, timeout: float) -> dict[str, Any]:
        """The first log record with this ``event``; fails if the process ends or time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no {event!r} log line within {timeout} s; stderr so far: {self.seen}")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"the server ended before logging {event!r}; stderr: {self.seen}")
            self.seen.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                return record

    def wait_for_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout} s; stderr so far: {self.seen}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=EXIT_TIMEOUT)
        self._reader.join(timeout=EXIT_TIMEOUT)
        assert self.process.stderr is not None
        self.process.stderr.close()


class Server:
    def __init__(self, process: ServerProcess, url: str) -> None:
        self.process = process
        self.url = url

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    process = ServerProcess(tmp_path / "data")
    try:
        listening = process.wait_for_event("listening", START_TIMEOUT)
        url = listening["url"]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0"), url
        yield Server(process, url)
    finally:
        process.stop()


def test_the_readme_session(server: Server) -> None:
    with server.client() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        created = http.put("/v1/queues/emails", json={"lease": 30})
        assert created.status_code == 201
        assert created.json()["config"]["lease"] == 30

        published = http.post("/v1/queues/emails/messages", json={"payload": {"to": "ada@example.com"}})
        assert published.status_code == 201
        [ref] = published.json()["messages"]

        claimed = http.post("/v1/queues/emails/claim", json={"consumer": "worker-1", "max": 10})
        assert claimed.status_code == 200
        body = claimed.json()
        assert body["ready"] == 0
        [delivery] = body["messages"]
        assert (delivery["id"], delivery["attempt"]) == (ref["id"], 1)
        assert delivery["payload"] == {"to": "ada@example.com"}

        acked = http.post("/v1/queues/emails/ack", json={"leases": [delivery["lease_id"]]})
        assert acked.json() == {"acked": 1, "skipped": []}

        stats = http.get("/v1/queues/emails").json()["stats"]
        assert (stats["ready"], stats["in_flight"], stats["acked_total"]) == (0, 0, 1)


def test_errors_over_the_wire_have_the_contract_shape(server: Server) -> None:
    with server.client() as http:
        missing = http.post("/v1/queues/ghost/messages", json={"payload": 1})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "queue_not_found"
        http.put("/v1/queues/jobs", json={})
        bad = http.post(
            "/v1/queues/jobs/messages", content=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_request"
        too_big = http.post("/v1/queues/jobs/messages", content=b"x" * (16 * 1024 * 1024 + 1))
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "payload_too_large"


def test_a_long_poll_is_woken_by_a_publish_from_another_connection(server: Server) -> None:
    with server.client() as setup:
        assert setup.put("/v1/queues/jobs", json={}).status_code == 201

    sent = threading.Event()

    def long_poll() -> tuple[dict[str, Any], float]:
        with httpx.Client(
            base_url=server.url, timeout=30, event_hooks={"request": [lambda request: sent.set()]}
        ) as http:
            response = http.post("/v1/queues/jobs/claim", json={"consumer": "waiter", "wait": 20})
            return response.json(), time.monotonic()

    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(long_poll)
        assert sent.wait(timeout=HTTP_TIMEOUT), "the long poll was never sent"
        # If the publish overtakes the claim, the claim finds the message at once: the same answer,
        # so the outcome never depends on the race; usually the claim is already parked by now.
        with server.client() as producer:
            published_at = time.monotonic()
            response = producer.post("/v1/queues/jobs/messages", json={"payload": "wake up"})
            assert response.status_code == 201
        body, answered_at = waiting.result(timeout=25)

    assert [m["payload"] for m in body["messages"]] == ["wake up"]
    assert answered_at - published_at < 10, "answered long before its wait of 20 s ran out"


def test_a_long_poll_answers_empty_after_its_wait(server: Server) -> None:
    with server.client() as http:
        http.put("/v1/queues/jobs", json={})
        start = time.monotonic()
        body = http.post("/v1/queues/jobs/claim", json={"wait": "500ms"}).json()
        elapsed = time.monotonic() - start
    assert body == {"messages": [], "ready": 0}
    assert 0.5 <= elapsed < HTTP_TIMEOUT


def test_a_long_poll_whose_client_hangs_up_does_not_swallow_the_next_message(server: Server) -> None:
    with server.client() as http:
        assert http.put("/v1/queues/jobs", json={}).status_code == 201
    url = httpx.URL(server.url)
    assert url.port is not None
    body = b'{"consumer": "gone", "wait": 20}'
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT) as gone:
        gone.sendall(
            b"POST /v1/queues/jobs/claim HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.5)  # parked by now: on loopback it takes well under a millisecond
    time.sleep(0.5)  # the server has noticed the hang-up and withdrawn the claim
    with server.client() as http:
        assert http.post("/v1/queues/jobs/messages", json={"payload": "next"}).status_code == 201
        claimed = http.post("/v1/queues/jobs/claim", json={"consumer": "present"}).json()
    assert [m["payload"] for m in claimed["messages"]] == ["next"]


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_cleanly(server: Server, signal_number: int) -> None:
    with server.client() as http:
        assert http.put("/v1/queues/jobs", json={}).status_code == 201
        assert http.post("/v1/queues/jobs/messages", json={"payload": 1}).status_code == 201
    server.process.process.send_signal(signal_number)
    assert server.process.wait_for_exit(EXIT_TIMEOUT) == 0
    server.process.wait_for_event("shutting_down", EXIT_TIMEOUT)
    with pytest.raises(httpx.TransportError), server.client() as http:
        http.get("/healthz")


@pytest.mark.parametrize(
    "request_line", [b"POST /v1/queues/jobs/nosuchroute", b"PUT /v1/queues/jobs/ack"], ids=["404", "405"]
)
def test_a_body_answered_unread_leaves_the_connection_to_the_next_request(
    server: Server, request_line: bytes
) -> None:
    """An answer given before the body was read (a 404, a 405) ends the app's body reader. When the
    reader was stopped just after it took bytes off the socket, they were lost, and skipping the rest of
    the body then swallowed the next request: it was never answered."""
    with server.client() as http:
        assert http.put("/v1/queues/jobs", json={}).status_code == 201
    url = httpx.URL(server.url)
    assert url.port is not None
    body = b"x" * 70_000  # more than one read: the reader is stopped between two
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT) as connection:
        connection.sendall(
            request_line + b" HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answers = connection.makefile("rb")
        first = answers.readline()
        assert first.split()[1] in (b"404", b"405"), first
        length = 0
        while (line := answers.readline()) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        answers.read(length)
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n")
        assert answers.readline() == b"HTTP/1.1 200 \r\n"


def test_a_second_signal_cuts_off_what_still_runs_and_the_stop_still_flushes_and_exits_0(
    server: Server,
) -> None:
    """A push stream whose client stopped reading holds a graceful stop for its 10 s. An operator's
    second SIGTERM used to kill the process at once (the signal's default, exit 143), with no word in
    the log; a second SIGINT was ignored."""
    payload = "x" * 900_000
    with server.client() as http:
        assert http.put("/v1/queues/big", json={}).status_code == 201
        batch = {"messages": [{"payload": payload} for _ in range(16)]}
        assert http.post("/v1/queues/big/messages", json=batch).status_code == 201
    url = httpx.URL(server.url)
    assert url.port is not None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((url.host, url.port))
        stalled.sendall(
            b"GET /v1/queues/big/work?consumer=stalled&max=16 HTTP/1.1\r\nHost: broker\r\n"
            b"Accept: text/event-stream\r\n\r\n"
        )  # and never read: its writes wait
        with server.client() as http:
            deadline = time.monotonic() + HTTP_TIMEOUT
            while http.get("/v1/queues/big").json()["stats"]["in_flight"] < 16:
                assert time.monotonic() < deadline, "the stream never took the messages"
                time.sleep(0.05)
        server.process.process.send_signal(signal.SIGTERM)
        server.process.wait_for_event("shutting_down", EXIT_TIMEOUT)
        server.process.process.send_signal(signal.SIGTERM)
        server.process.wait_for_event("stopping_now", EXIT_TIMEOUT)
        server.process.wait_for_event("journal_closed", EXIT_TIMEOUT)
        assert server.process.wait_for_exit(EXIT_TIMEOUT) == 0


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_while_the_broker_closes_lets_it_flush_snapshot_and_exit_0(
    server: Server, signal_number: int
) -> None:
    """Ctrl-C twice: on an idle broker the requests are done at once, so the second signal lands while
    the journal is closed and the shutdown snapshot is made (in a child process, which takes a few
    hundred milliseconds at least). The watch had ended by then: SIGTERM killed the process (143) and
    SIGINT raised KeyboardInterrupt through the snapshot, both without one."""
    with server.client() as http:
        assert http.put("/v1/queues/jobs", json={}).status_code == 201
        assert http.post("/v1/queues/jobs/messages", json={"payload": 1}).status_code == 201
    server.process.process.send_signal(signal_number)
    server.process.wait_for_event("journal_closed", EXIT_TIMEOUT)
    server.process.process.send_signal(signal_number)
    server.process.wait_for_event("stopping_now", EXIT_TIMEOUT)
    server.process.wait_for_event("snapshot_taken", EXIT_TIMEOUT)
    assert server.process.wait_for_exit(EXIT_TIMEOUT) == 0


def test_a_third_ctrl_c_ends_the_process_at_once_without_a_traceback(server: Server) -> None:
    """Once a second signal was taken, Trio's own SIGINT handler came back: a third Ctrl-C raised
    KeyboardInterrupt through the shutdown snapshot, a traceback of exception groups and exit 1."""
    with server.client() as http:
        assert http.put("/v1/queues/jobs", json={}).status_code == 201
        assert http.post("/v1/queues/jobs/messages", json={"payload": 1}).status_code == 201
    server.process.process.send_signal(signal.SIGINT)
    server.process.wait_for_event("journal_closed", EXIT_TIMEOUT)
    server.process.process.send_signal(signal.SIGINT)
    server.process.wait_for_event("stopping_now", EXIT_TIMEOUT)
    server.process.process.send_signal(signal.SIGINT)  # during the snapshot, or after the exit
    status = server.process.wait_for_exit(EXIT_TIMEOUT)
    server.process.stop()
    assert status in (-signal.SIGINT, 0)  # ended by the signal, as documented (0: the snapshot won)
    assert not any("Traceback" in line for line in server.process.seen + list(drain(server.process)))


def drain(process: ServerProcess) -> Iterator[str]:
    """The log lines not read yet, once the process has ended."""
    while (line := process.lines.get(timeout=EXIT_TIMEOUT)) is not None:
        yield line


def busy_port() -> tuple[socket.socket, int]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


def serve_on(port: int, data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        cwd=data_dir.parent,
    )


def test_a_busy_port_is_a_non_zero_exit(tmp_path: Path) -> None:
    listener, port = busy_port()
    with listener:
        result = serve_on(port, tmp_path / "data")
    assert result.returncode != 0
    assert '"listening"' not in result.stderr


def test_a_busy_port_is_reported_in_one_line(tmp_path: Path) -> None:
    listener, port = busy_port()
    with listener:
        result = serve_on(port, tmp_path / "data")
    *logged, last = result.stderr.strip().splitlines()
    assert last.startswith("broker: ") and str(port) in last, result.stderr
    events = [json.loads(line)["event"] for line in logged]  # log lines only: no traceback
    assert events == ["open_files_limit", "recovered"], result.stderr
    assert result.returncode == 1


@pytest.mark.parametrize("damage", ["snapshots", "journal"])
def test_an_unusable_data_directory_is_a_cannot_start_naming_it_not_a_listen_failure(
    tmp_path: Path, damage: str
) -> None:
    """Storage errors at start read 'cannot serve on 127.0.0.1:PORT: …', as if the address were the
    problem (an LMDB error or a file error is an OSError, which the command took for the bind's)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if damage == "snapshots":
        (data_dir / "snapshots.lmdb").mkdir()
        (data_dir / "snapshots.lmdb" / "data.mdb").write_bytes(b"not an LMDB file, " * 512)
        expected = f"broker: cannot start: the snapshots in {data_dir / 'snapshots.lmdb'} cannot be read: "
    else:
        (data_dir / "journal").write_text("a file where the journal's directory belongs")
        expected = f"broker: cannot start: {data_dir / 'journal'}: "
    result = serve_on(0, data_dir)
    *_, last = result.stderr.strip().splitlines()
    assert last.startswith(expected), result.stderr
    assert "Traceback" not in result.stderr and result.returncode == 1


def test_a_data_directory_held_by_a_running_broker_is_refused_in_one_line(server: Server) -> None:
    result = serve_on(0, server.process.data_dir)
    *_, last = result.stderr.strip().splitlines()
    assert last.startswith("broker: cannot start: the data directory") and "in use by pid" in last
    assert "Traceback" not in result.stderr
    assert result.returncode == 1


def test_a_sigterm_under_load_loses_nothing_acknowledged_and_leaves_nothing_to_replay(tmp_path: Path) -> None:
    data = tmp_path / "data"
    process = ServerProcess(data)
    try:
        url = process.wait_for_event("listening", START_TIMEOUT)["url"]
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
            assert http.put("/v1/queues/jobs", json={}).status_code == 201
        published: list[str] = []  # ids whose publish answered 201
        acked: list[str] = []  # ids whose ack answered 200
        unknown: list[str] = []  # ids whose ack got no answer: applied or not, the client cannot tell
        stop = threading.Event()

        def publish(worker: int) -> None:
            with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
                for n in itertools.count():
                    if stop.is_set():
                        return
                    batch = {"messages": [{"payload": [worker, n, i]} for i in range(10)]}
                    try:
                        answer = http.post("/v1/queues/jobs/messages", json=batch)
                    except httpx.TransportError:
                        return  # the server is going: this batch's fate is unknown, which is allowed
                    if answer.status_code != 201:
                        return
                    published.extend(ref["id"] for ref in answer.json()["messages"])

        def consume() -> None:
            with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
                while not stop.is_set():
                    try:
                        claimed = http.post("/v1/queues/jobs/claim", json={"max": 20, "wait": 0.2}).json()
                    except (httpx.TransportError, ValueError):
                        return
                    leases = {m["lease_id"]: m["id"] for m in claimed.get("messages", [])}
                    if not leases:
                        continue
                    try:
                        answer = http.post("/v1/queues/jobs/ack", json={"leases": list(leases)})
                    except httpx.TransportError:
                        unknown.extend(leases.values())
                        return
                    if answer.status_code == 200:
                        acked.extend(leases.values())

        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = [pool.submit(publish, 0), pool.submit(publish, 1), pool.submit(consume)]
            deadline = time.monotonic() + 30
            while len(published) < 300 and time.monotonic() < deadline:
                time.sleep(0.01)  # load builds up; the signal comes while requests are in flight
            process.process.send_signal(signal.SIGTERM)
            assert process.wait_for_exit(EXIT_TIMEOUT) == 0
            stop.set()
            for future in futures:
                future.result(timeout=HTTP_TIMEOUT)
        process.wait_for_event("snapshot_taken", EXIT_TIMEOUT)
    finally:
        process.stop()
    assert len(published) >= 300
    restarted = ServerProcess(data)
    try:
        recovered = restarted.wait_for_event("recovered", START_TIMEOUT)
        assert recovered["records"] == 0  # the shutdown snapshot covered everything
        url = restarted.wait_for_event("listening", START_TIMEOUT)["url"]
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
            live: set[str] = set()
            after = 0
            while True:  # every page of live messages
                path = f"/v1/queues/jobs/messages?state=all&limit=1000&after={after}"
                page = http.get(path).json()["messages"]
                if not page:
                    break
                live |= {m["id"] for m in page}
                after = page[-1]["seq"]
    finally:
        restarted.stop()
    assert set(published) - set(acked) - set(unknown) <= live, "a message whose publish got 201 is gone"
    assert not (set(acked) & live), "a message whose ack got 200 came back"
