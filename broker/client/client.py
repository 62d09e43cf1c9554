"""``Client`` (blocking) and ``AsyncClient`` (trio or asyncio, through anyio) for the broker's HTTP API.
Both send the calls of ``calls.py`` and raise the errors of ``errors.py``. ``Client`` sends through
``wire.Wire`` (``http.client``, a third of httpx's CPU per request), ``AsyncClient`` through
``wire.AsyncWire`` (its own HTTP/1.1 on anyio's streams, a worker's push stream included), unless
given a transport or a proxy applies (and for ``AsyncClient``, an https URL): then through httpx."""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import httpx

from broker.client import calls, codec, wire
from broker.client.calls import Call, Leases
from broker.client.errors import error_from
from broker.client.models import (
    ClaimResult,
    Delivery,
    Message,
    Published,
    Settled,
    WorkerStats,
    message_body,
)
from broker.client.worker import run_blocking, work

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8080"
#: Seconds for connecting, and for an answer beyond the wait a call asks for.
DEFAULT_TIMEOUT = 10.0


#: What a token may hold: printable ASCII, no spaces. Anything else cannot go in an HTTP header, and
#: http.client and httpx would refuse it with an error quoting the whole header, the token included.
_TOKEN = re.compile(r"[\x21-\x7e]*")


def sendable_token(token: str) -> bool:
    """Whether ``token`` can be sent as ``Authorization: Bearer <token>``."""
    return _TOKEN.fullmatch(token) is not None


def holds_user_info(url: str) -> bool:
    """Whether ``url`` may hold a user name or password: any "@", also one that NFKC makes of "\\uff20" (as
    urllib does, whose refusal of it then quoted the URL)."""
    return "@" in unicodedata.normalize("NFKC", url)


def _settings(url: str | None, token: str | None) -> tuple[str, dict[str, str]]:
    url = url or os.environ.get("BROKER_URL") or DEFAULT_URL
    if holds_user_info(url):
        # Any "@", not only one in what urlsplit takes for the host: a password holding "/", "?" or "#"
        # ends the host there (``http://ops:pa/ss@host`` is host "ops", port "pa"), and urllib's error
        # then quotes it; curl's ``ops:pw@host`` has no "//" at all. No path of the broker's holds one.
        # Never quote the URL: this message ends up in logs. The broker takes a token only; httpx would
        # send user-info as Basic auth instead.
        raise ValueError(
            "the URL holds an '@', as a user name or password does (user:password@host), which the "
            "broker does not take: authenticate with token= or $BROKER_TOKEN"
        )
    token = token if token is not None else os.environ.get("BROKER_TOKEN")
    headers = {"Accept": "application/json"}
    if token:
        if not sendable_token(token):
            # Never quote the token: this message ends up in tracebacks and logs.
            raise ValueError(
                "the token holds a character an HTTP header cannot carry "
                "(a token is printable ASCII, without spaces or control characters)"
            )
        headers["Authorization"] = f"Bearer {token}"
    return url, headers


def _answer(call: Call[T], status: int, content: bytes) -> T:
    if status >= 400:
        try:
            body = codec.loads(content)
        except ValueError:  # not JSON: orjson's error, or the standard library's for a run of digits
            body = None
        raise error_from(status, body)
    data = codec.loads(content) if content else None  # not JSON: a ValueError
    try:
        return call.read((status, data) if call.read_status else data)
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        # JSON, but not shaped as the broker answers: another server, or a proxy's page.
        raise ValueError(
            f"{call.method} {call.path} answered {status} with JSON the broker does not send "
            f"({type(error).__name__}: {error})"
        ) from None


def _httpx_body(call: Call[Any]) -> dict[str, Any]:
    """The body arguments of an httpx request: encoded as ``Wire`` requests are, so both refuse and
    encode the same values."""
    if call.json is None:
        return {}
    return {"content": codec.dumps(call.json), "headers": {"Content-Type": "application/json"}}


def _timeout(timeout: float, call: Call[Any]) -> httpx.Timeout:
    return httpx.Timeout(timeout, read=timeout + call.wait)


class Client:
    """A blocking client. ``url`` defaults to ``$BROKER_URL`` or ``http://127.0.0.1:8080``, ``token``
    to ``$BROKER_TOKEN``. Use it as a context manager, or call ``close()``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, self._headers = _settings(url, token)
        self.timeout = timeout
        self._token = token
        self._wire: wire.Wire | None = None
        self._http: httpx.Client | None = None
        if transport is None and wire.usable(self.url):
            self._wire = wire.Wire(self.url, self._headers)
        else:
            self._http = httpx.Client(base_url=self.url, headers=self._headers, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._http is not None:
            self._http.close()

    def send(self, call: Call[T]) -> T:
        if self._wire is not None:
            body = None if call.json is None else codec.dumps(call.json)
            read_timeout = self.timeout + call.wait
            status, content = self._wire.request(
                call.method, call.path, body, call.params, self.timeout, read_timeout
            )
            return _answer(call, status, content)
        assert self._http is not None
        response = self._http.request(
            call.method,
            call.path,
            params=call.params,
            timeout=_timeout(self.timeout, call),
            **_httpx_body(call),
        )
        return _answer(call, response.status_code, response.content)

    # -- queues (§3) -------------------------------------------------------------------------------

    def create_queue(self, name: str, **config: Any) -> dict[str, Any]:
        """Create the queue, or update its config if it exists (``PUT``): its description."""
        return self.put_queue(name, **config)[1]

    update_queue = create_queue

    def put_queue(self, name: str, **config: Any) -> tuple[bool, dict[str, Any]]:
        """``create_queue``, also saying whether the queue was created (rather than updated)."""
        return self.send(calls.put_queue(name, config))

    def get_queue(self, name: str) -> dict[str, Any]:
        """``{"name", "config", "stats"}``."""
        return self.send(calls.get_queue(name))

    def stats(self, name: str) -> dict[str, Any]:
        stats: dict[str, Any] = self.get_queue(name)["stats"]
        return stats

    def list_queues(self) -> list[dict[str, Any]]:
        return self.send(calls.list_queues())

    def delete_queue(self, name: str) -> None:
        self.send(calls.delete_queue(name))

    def purge(self, name: str) -> int:
        return self.send(calls.purge(name))

    # -- publishing (§4) ---------------------------------------------------------------------------

    def publish(
        self,
        queue: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | str | None = None,
        priority: int | None = None,
        on_duplicate: str | None = None,
    ) -> Published:
        body = message_body(payload, headers, key, delay, priority, on_duplicate)
        return self.send(calls.publish(queue, body))

    def publish_batch(self, queue: str, messages: Iterable[Message | Mapping[str, Any]]) -> list[Published]:
        """Publish up to 1000 messages in one request (all or none): ``Message`` objects or dicts."""
        return self.send(calls.publish_batch(queue, messages))

    # -- claiming and settling (§5) ----------------------------------------------------------------

    def claim(
        self,
        queue: str,
        *,
        consumer: str | None = None,
        max: int = 1,
        lease: float | str | None = None,
        wait: float | str | None = None,
    ) -> ClaimResult:
        return self.send(calls.claim(queue, consumer, max, lease, wait))

    def ack(self, queue: str, leases: Leases) -> Settled:
        return self.send(calls.ack(queue, leases))

    def nack(
        self,
        queue: str,
        leases: Leases,
        *,
        delay: float | str | None = None,
        retryable: bool = True,
        reason: str | None = None,
    ) -> Settled:
        return self.send(calls.nack(queue, leases, delay, retryable, reason))

    def defer(
        self, queue: str, leases: Leases, retry_after: float | str = 0, *, reason: str | None = None
    ) -> Settled:
        return self.send(calls.defer(queue, leases, retry_after, reason))

    def extend(self, queue: str, leases: Leases, lease: float | str) -> Settled:
        return self.send(calls.extend(queue, leases, lease))

    def stop_stream(self, queue: str, stream_id: str) -> int:
        """Stop the ``/work`` stream ``stream_id`` (its ``stream-id`` header) taking new deliveries; it
        keeps its leases until they are settled or it closes. Returns how many it still holds."""
        return self.send(calls.stop_stream(queue, stream_id))

    # -- inspection and dead letters (§6) ----------------------------------------------------------

    def browse(
        self, queue: str, *, state: str = "all", limit: int = 100, after: int = 0
    ) -> list[dict[str, Any]]:
        return self.send(calls.browse(queue, state, limit, after))

    def get_message(self, queue: str, message_id: str) -> dict[str, Any]:
        return self.send(calls.get_message(queue, message_id))

    def delete_message(self, queue: str, message_id: str) -> None:
        self.send(calls.delete_message(queue, message_id))

    def redrive(
        self, queue: str, ids: Iterable[str] | None = None, *, to: str | None = None
    ) -> dict[str, Any]:
        """Move messages out of a dead-letter queue: ``ids``, or all of them when ``None``."""
        return self.send(calls.redrive(queue, ids, to))

    # -- the worker loop ---------------------------------------------------------------------------

    def work(self, queue: str, handler: Callable[[Delivery], Any], **options: Any) -> WorkerStats:
        """Run ``handler`` on the queue's messages until stopped (SIGINT, SIGTERM, or ``stop`` set);
        see ``broker.client.worker.work`` for the options. The handler runs in worker threads, at most
        ``concurrency`` at a time, so it must be a plain function: an async one raises ``TypeError``
        (run it with ``AsyncClient.work``)."""
        return run_blocking(self.url, self._token, self.timeout, queue, handler, options)


class AsyncClient:
    """An async client for trio or asyncio (anyio underneath). Use ``async with``, or ``aclose()``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, self._headers = _settings(url, token)
        self.timeout = timeout
        self._transport = transport
        self._wire: wire.AsyncWire | None = None
        if transport is None and wire.usable_async(self.url):
            self._wire = wire.AsyncWire(self.url, self._headers)
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._wire is not None:
            await self._wire.aclose()
        if self._http is not None:
            await self._http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """The httpx client, made on first use: it carries every call (and the worker loop's stream)
        when the client was given a transport, or the URL is https or goes through a proxy."""
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url,
                headers=self._headers,
                transport=self._transport,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
            )
        return self._http

    def open_stream(
        self, path: str, params: Mapping[str, str], headers: Mapping[str, str], read_timeout: float
    ) -> AbstractAsyncContextManager[wire.StreamedAnswer | httpx.Response]:
        """``GET path``, its answer's body read as it arrives (the worker loop's push stream): an
        ``async with`` block whose value has ``status_code``, ``headers``, ``aread()``, ``json()`` and
        ``aiter_raw()``. ``read_timeout`` bounds each wait for more of the body."""
        if self._wire is not None:
            return self._wire.stream(path, params, headers, self.timeout, read_timeout)
        timeout = httpx.Timeout(self.timeout, read=read_timeout)
        return self.http.stream("GET", path, params=params, headers=headers, timeout=timeout)

    async def send(self, call: Call[T]) -> T:
        if self._wire is not None:
            body = None if call.json is None else codec.dumps(call.json)
            status, content = await self._wire.request(
                call.method, call.path, body, call.params, self.timeout, self.timeout + call.wait
            )
            return _answer(call, status, content)
        response = await self.http.request(
            call.method,
            call.path,
            params=call.params,
            timeout=_timeout(self.timeout, call),
            **_httpx_body(call),
        )
        return _answer(call, response.status_code, response.content)

    async def create_queue(self, name: str, **config: Any) -> dict[str, Any]:
        """Create the queue, or update its config if it exists (``PUT``): its description."""
        return (await self.put_queue(name, **config))[1]

    update_queue = create_queue

    async def put_queue(self, name: str, **config: Any) -> tuple[bool, dict[str, Any]]:
        """``create_queue``, also saying whether the queue was created (rather than updated)."""
        return await self.send(calls.put_queue(name, config))

    async def get_queue(self, name: str) -> dict[str, Any]:
        return await self.send(calls.get_queue(name))

    async def stats(self, name: str) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.get_queue(name))["stats"]
        return stats

    async def list_queues(self) -> list[dict[str, Any]]:
        return await self.send(calls.list_queues())

    async def delete_queue(self, name: str) -> None:
        await self.send(calls.delete_queue(name))

    async def purge(self, name: str) -> int:
        return await self.send(calls.purge(name))

    async def publish(
        self,
        queue: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | str | None = None,
        priority: int | None = None,
        on_duplicate: str | None = None,
    ) -> Published:
        body = message_body(payload, headers, key, delay, priority, on_duplicate)
        return await self.send(calls.publish(queue, body))

    async def publish_batch(
        self, queue: str, messages: Iterable[Message | Mapping[str, Any]]
    ) -> list[Published]:
        return await self.send(calls.publish_batch(queue, messages))

    async def claim(
        self,
        queue: str,
        *,
        consumer: str | None = None,
        max: int = 1,
        lease: float | str | None = None,
        wait: float | str | None = None,
    ) -> ClaimResult:
        return await self.send(calls.claim(queue, consumer, max, lease, wait))

    async def ack(self, queue: str, leases: Leases) -> Settled:
        return await self.send(calls.ack(queue, leases))

    async def nack(
        self,
        queue: str,
        leases: Leases,
        *,
        delay: float | str | None = None,
        retryable: bool = True,
        reason: str | None = None,
    ) -> Settled:
        return await self.send(calls.nack(queue, leases, delay, retryable, reason))

    async def defer(
        self, queue: str, leases: Leases, retry_after: float | str = 0, *, reason: str | None = None
    ) -> Settled:
        return await self.send(calls.defer(queue, leases, retry_after, reason))

    async def extend(self, queue: str, leases: Leases, lease: float | str) -> Settled:
        return await self.send(calls.extend(queue, leases, lease))

    async def stop_stream(self, queue: str, stream_id: str) -> int:
        """Stop the ``/work`` stream ``stream_id`` (its ``stream-id`` header) taking new deliveries; it
        keeps its leases until they are settled or it closes. Returns how many it still holds."""
        return await self.send(calls.stop_stream(queue, stream_id))

    async def browse(
        self, queue: str, *, state: str = "all", limit: int = 100, after: int = 0
    ) -> list[dict[str, Any]]:
        return await self.send(calls.browse(queue, state, limit, after))

    async def get_message(self, queue: str, message_id: str) -> dict[str, Any]:
        return await self.send(calls.get_message(queue, message_id))

    async def delete_message(self, queue: str, message_id: str) -> None:
        await self.send(calls.delete_message(queue, message_id))

    async def redrive(
        self, queue: str, ids: Iterable[str] | None = None, *, to: str | None = None
    ) -> dict[str, Any]:
        return await self.send(calls.redrive(queue, ids, to))

    async def work(
        self, queue: str, handler: Callable[[Delivery], Awaitable[Any]], **options: Any
    ) -> WorkerStats:
        """Run the async ``handler`` on the queue's messages until stopped; see
        ``broker.client.worker.work`` for the options."""
        return await work(self, queue, handler, **options)
