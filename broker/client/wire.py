"""The blocking client's HTTP/1.1: keep-alive connections from the standard library's ``http.client``.

httpx spends about 3.5 times the CPU of ``http.client`` per request (660 µs against 190 µs for a claim
on the development VM, client side), and a consumer's CPU is taken from the broker it shares a machine
with. So ``Client`` sends its calls through ``Wire`` unless it was given an httpx transport, or the URL
would go through a proxy (``$HTTP_PROXY`` and friends), which httpx honours and this does not.

``Wire`` keeps a small pool of idle connections, so one ``Client`` may be used from several threads
(each request takes a connection of its own). An idle connection that the server closed meanwhile
(it closes them after 75 s) is noticed before it is reused, so a request is never sent on a dead
connection and never sent twice. Failures are raised as httpx's exceptions, the ones ``Client``
raised before: ``httpx.ConnectError``, ``httpx.ConnectTimeout``, ``httpx.ReadTimeout``,
``httpx.RemoteProtocolError``, ``httpx.ReadError`` and ``httpx.WriteError``, all ``TransportError``.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlencode, urlsplit

import httpx

#: Idle connections kept for reuse; more may be open while as many threads send at once.
MAX_IDLE = 8


def usable(url: str) -> bool:
    """Whether ``Wire`` can carry requests to ``url``: http or https, and no proxy in the way."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


class Wire:
    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._headers = {**headers, "Host": parts.netloc, "Accept-Encoding": "identity"}
        self._context = ssl.create_default_context() if self._https else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: Mapping[str, str] | None,
        connect_timeout: float,
        read_timeout: float,
    ) -> tuple[int, bytes]:
        """Send one request and read its whole answer: ``(status, body)``."""
        target = self._base + path
        if params:
            target += "?" + urlencode(params)
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection = self._take() or self._connect(connect_timeout)
        try:
            sock = connection.sock
            if sock is not None:
                sock.settimeout(read_timeout)
            try:
                connection.request(method, target, body, headers)
            except OSError as error:
                raise httpx.WriteError(str(error) or type(error).__name__) from error
            try:
                response = connection.getresponse()
                data = response.read()
            except TimeoutError as error:
                raise httpx.ReadTimeout(f"no answer within {read_timeout:g} s") from error
            except (http.client.RemoteDisconnected, http.client.IncompleteRead) as error:
                raise httpx.RemoteProtocolError(str(error) or type(error).__name__) from error
            except http.client.HTTPException as error:
                raise httpx.RemoteProtocolError(str(error) or type(error).__name__) from error
            except OSError as error:
                raise httpx.ReadError(str(error) or type(error).__name__) from error
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            self._give_back(connection)
        return response.status, data

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=self._context
            )
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            connection.connect()
        except TimeoutError as error:
            raise httpx.ConnectTimeout(
                f"could not connect to {self._host}:{self._port} within {timeout:g} s"
            ) from error
        except OSError as error:
            raise httpx.ConnectError(str(error) or type(error).__name__) from error
        if connection.sock is not None:
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    def _take(self) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed, or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            sock = connection.sock
            if sock is not None:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                if not poller.poll(0):
                    return connection  # nothing to read: still open (EOF or stray bytes would be readable)
            connection.close()

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(connection)
                return
        connection.close()
