"""End to end: what a slow or greedy client can hold (docs/operations.md, "Slow clients").

A real ``broker serve`` with ``keep_alive_timeout`` set to half a second, so that the tests wait a
second or two rather than the default's 20 s. A connection that has not sent a whole request head
within it is closed; a request whose head is in is not cut by it, however long its body, its long poll
or its push stream takes. An oversized head gets 431.
"""

from __future__ import annotations

import select
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.http.observe import MAX_HEAD_BYTES
from tests.e2e.test_serve import HTTP_TIMEOUT, START_TIMEOUT, Server, ServerProcess

pytestmark = pytest.mark.e2e

TIMEOUT = 0.5  # the server's keep_alive_timeout, in seconds
BURST = 400  # connections at once: four times Hypercorn's default listen backlog
LONGER = 3 * TIMEOUT  # a pause the timeout would have cut, were it running


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "broker.toml"
    config.write_text(f'keep_alive_timeout = "{int(TIMEOUT * 1000)}ms"\n')
    process = ServerProcess(tmp_path / "data", args=["--config", str(config)])
    try:
        url = process.wait_for_event("listening", START_TIMEOUT)["url"]
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
            assert http.put("/v1/queues/jobs", json={}).status_code == 201
        yield Server(process, url)
    finally:
        process.stop()


def connect(server: Server) -> socket.socket:
    url = httpx.URL(server.url)
    assert url.port is not None
    return socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT)


def read_until_closed(connection: socket.socket) -> bytes:
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed before {marker!r}; got {received!r}"
        received += chunk
    return received


def test_a_connection_that_stalls_halfway_through_its_head_is_closed(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: broker\r\nX-Half: ")
        started = time.monotonic()
        assert read_until_closed(connection) == b"", "closed without an answer"
        elapsed = time.monotonic() - started
    assert TIMEOUT * 0.8 <= elapsed < TIMEOUT + 5, elapsed


def test_an_idle_kept_alive_connection_is_closed(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: broker\r\n\r\n")
        assert read_until(connection, b'{"status":"ok"}').startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert read_until_closed(connection) == b""
        assert time.monotonic() - started < TIMEOUT + 5


def test_a_slow_body_is_not_cut_once_its_head_is_in(server: Server) -> None:
    body = b'{"payload": "slow but steady"}'
    with connect(server) as connection:
        connection.sendall(
            b"POST /v1/queues/jobs/messages HTTP/1.1\r\nHost: broker\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        for start in range(0, len(body), 16):
            time.sleep(LONGER)
            connection.sendall(body[start : start + 16])
        assert read_until(connection, b"}]}").startswith(b"HTTP/1.1 201")


def test_a_long_poll_outlasts_the_timeout(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        started = time.monotonic()
        claimed = http.post("/v1/queues/jobs/claim", json={"consumer": "patient", "wait": LONGER})
        elapsed = time.monotonic() - started
    assert claimed.status_code == 200 and claimed.json() == {"messages": [], "ready": 0}
    assert elapsed >= LONGER


def test_a_push_stream_outlasts_the_timeout(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(
            b"GET /v1/queues/jobs/work?consumer=streamer HTTP/1.1\r\nHost: broker\r\n"
            b"Accept: text/event-stream\r\n\r\n"
        )
        assert read_until(connection, b": stream open").startswith(b"HTTP/1.1 200")
        time.sleep(LONGER)  # the client sends nothing more, as a worker reading its stream
        with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
            assert http.post("/v1/queues/jobs/messages", json={"payload": "late"}).status_code == 201
        assert b'"payload":"late"' in read_until(connection, b'"payload":"late"')


def test_a_head_beyond_the_limit_gets_431_with_the_contract_error_body(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        assert http.get("/healthz", headers={"X-Padding": "x" * (MAX_HEAD_BYTES - 1024)}).status_code == 200
        answer = http.get("/healthz", headers={"X-Padding": "x" * (MAX_HEAD_BYTES + 1024)})
        assert answer.status_code == 431
        assert answer.json()["error"]["code"] == "request_headers_too_large"
        assert set(answer.json()["error"]) == {"code", "message"}


def test_a_head_that_keeps_growing_is_refused_by_the_server_with_431(server: Server) -> None:
    """Past twice the limit, Hypercorn stops reading and answers 431 itself, with an empty body."""
    with connect(server) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: broker\r\n")
        for _ in range(4 * MAX_HEAD_BYTES // 1024):
            try:
                connection.sendall(b"X-Padding: " + b"x" * 1010 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = read_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 431"), answer


def test_a_burst_of_connections_while_the_broker_is_busy_is_held_for_it(server: Server) -> None:
    """Hypercorn's listen backlog of 100: a fleet of workers reconnecting at once lost its handshakes
    past the 100th, and each waited out SYN retransmits, some for a minute. The broker is stopped
    (SIGSTOP) for the burst, so that the kernel alone completes the handshakes, as it does while the
    event loop is busy."""
    url = httpx.URL(server.url)
    assert url.port is not None
    connections: list[socket.socket] = []
    server.process.process.send_signal(signal.SIGSTOP)
    try:
        for _ in range(BURST):
            connection = socket.socket()
            connection.setblocking(False)
            connection.connect_ex((url.host, url.port))
            connections.append(connection)
        deadline = time.monotonic() + 2.0
        waiting = list(connections)
        while waiting and time.monotonic() < deadline:
            _, writable, _ = select.select([], waiting, [], 0.1)
            waiting = [c for c in waiting if c not in writable]
        failed = [c for c in connections if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)]
        assert (len(waiting), len(failed)) == (0, 0), "handshakes the kernel did not complete"
    finally:
        server.process.process.send_signal(signal.SIGCONT)
    for connection in connections[:3]:  # and once it runs again, it serves them
        connection.setblocking(True)
        connection.settimeout(HTTP_TIMEOUT)
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n")
        assert read_until_closed(connection).startswith(b"HTTP/1.1 200")
    for connection in connections:
        connection.close()
