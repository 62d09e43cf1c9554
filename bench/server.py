"""A real ``broker serve`` subprocess on 127.0.0.1, and the HTTP client the benchmarks use.

The client is the standard library's ``http.client`` over one keep-alive connection per process: it
adds the least work per request on the client side (no connection pool, no async loop, no header
models), so on a two-core machine more of the CPU is left to the server being measured. Bodies are
encoded and decoded with orjson, as the broker does.
"""

from __future__ import annotations

import contextlib
import http.client
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
JSON_HEADERS = {"Content-Type": "application/json"}


class BenchError(RuntimeError):
    pass


class Server:
    """A running ``python -m broker serve --port 0`` and where it listens; with tokens configured, the
    one its clients send (``token``) and the admin one that creates and deletes queues."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        host: str,
        port: int,
        log_path: Path,
        token: str | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.log_path = log_path
        self.token = token
        self.admin_token = admin_token

    @property
    def pid(self) -> int:
        return self.process.pid


def tokens_config(count: int) -> tuple[str, str, str]:
    """A config file's ``[[tokens]]`` for ``count`` tokens, and the secrets of two of them: the first
    (admin, for setting up) and the last (``publish:*``, ``consume:*``, ``read:*``: what the clients send,
    so the gate also matches scope globs). Between them, tokens for other queues: the gate compares a
    request's token with every one of them. With one token, the admin one is also the clients'."""
    entries = []
    for index in range(count):
        if index == 0:
            scopes = '["admin"]'
        elif index == count - 1:
            scopes = '["publish:*", "consume:*", "read:*"]'
        else:
            scopes = f'["publish:other-{index}-*", "consume:other-{index}-*"]'
        entries.append(
            f'[[tokens]]\nname = "bench-{index}"\nsecret = "{_secret(index)}"\nscopes = {scopes}\n'
        )
    return "".join(entries), _secret(0), _secret(count - 1)


def _secret(index: int) -> str:
    return f"bench-token-secret-{index:06d}"


@contextlib.contextmanager
def running_server(
    module_args: list[str] | None = None,
    *,
    python: str | None = None,
    durable: bool = False,
    data_dir: Path | None = None,
    tokens: int = 0,
) -> Iterator[Server]:
    """Start ``python -m broker serve`` on a free port with a temporary data directory (or ``python -m
    <module_args>``, which must log the same "listening" line); always stop it (SIGTERM, then SIGKILL).

    The broker keeps its journal in memory unless ``durable`` (then it journals to the temporary
    directory, or to ``data_dir`` when given). ``python`` is the interpreter to run it with (default:
    this one); another checkout's virtualenv serves that checkout's broker. With ``tokens``, the broker
    is configured with that many (``tokens_config``) and every request of the benchmarks sends one."""
    with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        token = admin_token = None
        config_args: list[str] = []
        if tokens:
            text, admin_token, token = tokens_config(tokens)
            config = Path(tmp) / "broker.toml"
            config.write_text(text)
            config_args = ["--config", str(config)]
        args = module_args or [
            "broker",
            "serve",
            "--host",
            HOST,
            "--port",
            "0",
            "--data-dir",
            str(data_dir or Path(tmp) / "data"),
            *([] if durable else ["--in-memory"]),
            *config_args,
        ]
        with log_path.open("wb") as log:
            # The log goes to a file rather than a pipe so that the server can never block on a full pipe.
            process = subprocess.Popen(
                [python or sys.executable, "-m", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=tmp if module_args is None else Path(__file__).resolve().parent.parent,
            )
        try:
            host, port = _wait_until_listening(process, log_path)
            yield Server(process, host, port, log_path, token, admin_token)
        finally:
            stop(process)


def _wait_until_listening(process: subprocess.Popen[bytes], log_path: Path) -> tuple[str, int]:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for line in log_path.read_bytes().splitlines():
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("event") == "listening":
                url = urlsplit(event["url"])
                if url.hostname != HOST or url.port is None:
                    raise BenchError(f"the broker listens on {event['url']}, not on {HOST}")
                return url.hostname, url.port
        if process.poll() is not None:
            raise BenchError(f"the broker exited {process.returncode}: {log_path.read_text()[-500:]}")
        time.sleep(0.05)
    raise BenchError(f"the broker did not log 'listening' within {START_TIMEOUT:g} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (graceful), then SIGKILL if it is still there after ``STOP_TIMEOUT``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Connection:
    """One keep-alive HTTP/1.1 connection to the broker, speaking JSON.

    ``send`` and ``receive`` are separate so that a caller can have a request outstanding on one
    connection (a long-poll claim) while it sends on another.
    """

    def __init__(self, host: str, port: int, timeout: float = 60.0, token: str | None = None) -> None:
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._json_headers = {**JSON_HEADERS, **self._headers}
        self._connection = http.client.HTTPConnection(host, port, timeout=timeout)
        self._connection.connect()
        sock = self._connection.sock
        assert sock is not None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def socket(self) -> socket.socket:
        sock = self._connection.sock
        assert sock is not None
        return sock

    def send(self, method: str, path: str, body: bytes | None = None) -> None:
        # http.client writes the headers, then the body: TCP_NODELAY (set above) keeps Nagle's algorithm
        # from holding the body back until the server acknowledges the headers.
        self._connection.request(
            method, path, body, self._json_headers if body is not None else self._headers
        )

    def receive(self) -> tuple[int, bytes]:
        response = self._connection.getresponse()
        return response.status, response.read()

    def call(self, method: str, path: str, body: Any = None, expect: tuple[int, ...] = (200, 201)) -> Any:
        """Send, wait for the answer, check its status, and decode it."""
        self.send(method, path, None if body is None else orjson.dumps(body))
        status, data = self.receive()
        if status not in expect:
            raise BenchError(f"{method} {path} answered {status}: {data[:300]!r}")
        return orjson.loads(data) if data else None

    def close(self) -> None:
        self._connection.close()


def create_queue(server: Server, name: str, config: dict[str, Any] | None = None) -> str:
    """Create (or reset the config of) a queue; return its path prefix, ``/v1/queues/<name>``."""
    connection = Connection(server.host, server.port, token=server.admin_token)
    try:
        connection.call("PUT", f"/v1/queues/{name}", config or {})
    finally:
        connection.close()
    return f"/v1/queues/{name}"


def delete_queue(server: Server, name: str) -> None:
    connection = Connection(server.host, server.port, token=server.admin_token)
    try:
        connection.call("DELETE", f"/v1/queues/{name}", expect=(204, 404))
    finally:
        connection.close()
