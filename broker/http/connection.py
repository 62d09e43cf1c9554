"""Hypercorn's per-connection handler on Trio, without the costs it pays around each request.

Hypercorn's Trio worker serves each TCP connection with a ``hypercorn.trio.tcp_server.TCPServer``.
On the benchmark machine a bare ASGI request through it costs ~2.0M instructions of server CPU, and
~0.9M of them are spent on things around the request rather than in it:

- **The keep-alive timer.** Hypercorn closes a connection that has had no request in hand for
  ``keep_alive_timeout``. It does so with a task per idle spell: every request stops the task and
  every answer starts a new one (``Nursery.start``, a lock, a cancel scope), ~0.5M instructions.
  Here one task per connection keeps the timer, and an answer only moves its deadline (to ``now +
  keep_alive_timeout``); a request in hand is never cut by it.
- **Each write's lock.** Every piece of a response (head, body, and h11's zero-length end of a
  message with a known length) is written under a ``trio.Lock`` and a shielded cancel scope, and
  taking the lock is a checkpoint: a pass through Trio's scheduler even when no other task holds it,
  ~0.4M instructions per request. Here the lock is taken without a checkpoint when it is free (it still
  makes a second writer wait, and the write itself stays shielded), and an empty write is skipped.
- **Checkpoints that wait for nothing.** Each request's body reaches its app task through a memory
  channel, and each end of the channel checkpoints per message, even when the message is there or there
  is room: four passes through the scheduler for a POST (~0.1M instructions each way on a GET). Here a
  request's inbox (``AppInbox``) only waits when it must, and so does each read from the socket when
  Hypercorn's ``read_timeout`` is unset (as the broker leaves it), which needs no cancel scope per read.
- **Two writes per answer.** Hypercorn writes a response's head as soon as the app starts the
  response, then its body: two sends, each a pass through Trio's scheduler and a TCP segment of its
  own. The head of a response with a ``content-length`` (every answer but a stream's) is held here
  and written with the body's first part; any other event (the end of the message, the connection
  closing) writes a held head first. A head without a length (a push stream) goes out at once.
- **Trio's socket calls.** Each of Trio's socket reads and writes passes through the scheduler once
  it has succeeded, and through a handful of context managers; a read that follows a wait for the
  socket to be readable passes twice. On a plain (not TLS) connection on POSIX the handler reads and
  writes the socket's descriptor itself: a write puts what fits in the socket's buffer with no pass (the rest,
  if any, goes through Trio's stream), and a read that follows a wait makes no second pass.
- **h11, and a task per request.** Hypercorn parses HTTP/1.1 with h11, careful pure Python that was
  ~14% of the server's CPU in a drain, and runs each request's app in a task of its own, its body
  passed through a channel. On a plain connection on POSIX the handler reads requests of the everyday
  shape itself and runs their app in its own task, one request after the other (``express.py``,
  ``_serve_express``); the first request of any other shape, and everything after it on that
  connection, goes to Hypercorn and h11 as before. While the app runs, the connection is read only
  when the app asks (for its body, then whether the client left; a request pipelined behind it, read
  meanwhile, is kept for after it).
- **The headers of every answer.** Hypercorn formats the ``date`` header anew for each answer;
  ``ServerConfig``, the settings ``server.py`` gives Hypercorn, makes them once a second.

What a client sees is unchanged: the same bytes (``tests/http/test_express.py`` compares them with
h11's), the same timeout (``docs/operations.md``, "Slow
clients"), an idle connection closed at once when the server shuts down, and a busy one closed as soon
as its answer is out. ``install`` puts the class where Hypercorn's Trio worker builds its handlers
(``hypercorn.trio.run.TCPServer``); it relies on ``TCPServer``'s internals, which is why
``pyproject.toml`` bounds Hypercorn's version. See docs/benchmarks.md for what it saves.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import hypercorn.trio.run
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import AppWrapper, ASGIReceiveEvent, ASGISendEvent, ConnectionState, Scope
from hypercorn.utils import parse_socket_addr

from broker.http import express

#: Whether ``os.read`` and ``os.write`` work on a socket's descriptor (not on Windows, whose sockets are
#: handles): if not, every read and write goes through Trio's stream.
_DESCRIPTORS_ARE_SOCKETS = os.name == "posix"
#: The most of a request's body that the express lane reads past when its app answered without it
#: (a 404, a 413), to keep the connection, if it arrives within ``keep_alive_timeout``; past either
#: the connection is closed (as Hypercorn does at once).
_SKIPPED_BODY_LIMIT = 16 * 1024 * 1024

#: The scope extension that tells an app whether its answer still reaches the client: ``{"link":
#: ClientLink}`` (ASGI extensions are dicts).
CLIENT_LINK = "broker.client_link"


class ClientLink:
    """Whether a connection's writes still reach its client: ``lost`` is set once one failed (the client
    left or reset the connection) or the server gave up on it. Hypercorn's ``send`` returns as if all
    were well then, and so does every later one, at once: an app that writes without waiting for
    anything else (a push stream's pump, ``broker/http/stream.py``) would go on "sending" into a dead
    connection until some other wait let its task see the client leave. Shared by the requests of one
    connection, in the scope's ``extensions`` under ``CLIENT_LINK`` (``client_link`` reads it)."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        self.lost = False


def client_link(scope: Scope) -> ClientLink:
    """The ``ClientLink`` of the request's connection; a link never lost when the server gives none
    (another ASGI server, a test's)."""
    extensions = cast(dict[str, Any], scope).get("extensions") or {}
    link = extensions.get(CLIENT_LINK, {}).get("link")
    return link if isinstance(link, ClientLink) else ClientLink()


class ConnectionHandler(TCPServer):
    """One TCP connection, as Hypercorn's ``TCPServer`` serves it, with a cheap timer and writes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._timer = KeepAliveTimer(self)  # in place of Hypercorn's ``idle_task``, which is not used
        self._hold_next = False  # the next write is a response head to hold for its body
        self._held = b""
        # The socket whose descriptor this handler reads and writes itself: plain TCP, on POSIX.
        self._plain_socket: trio.socket.SocketType | None = None
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._connection_state = ConnectionState(self.state)
        # The shielded scope of a write waiting for room in the socket's buffer, and whether the server
        # gave up on the connection (``abort_writes``).
        self._write_scope: trio.CancelScope | None = None
        self._aborted = False
        self._link = ClientLink()
        self._link_extension = {"link": self._link}  # one per connection, as the link is

    async def run(self) -> None:
        # ``TCPServer.run``, with ``AppTaskGroup`` for Hypercorn's ``TaskGroup`` and this timer.
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # Handshake failed
            alpn_protocol = self.stream.selected_alpn_protocol()
            socket = self.stream.transport_stream.socket
            ssl = True
        except AttributeError:  # Not SSL
            alpn_protocol = "http/1.1"
            socket = self.stream.socket
            ssl = False
            if _DESCRIPTORS_ARE_SOCKETS:
                self._plain_socket = socket

        try:
            client = self._client = parse_socket_addr(socket.family, socket.getpeername())
            server = self._server = parse_socket_addr(socket.family, socket.getsockname())

            async with AppTaskGroup(self._link_extension) as task_group:
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    self._connection_state,
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                    alpn_protocol,
                )
                if isinstance(self.protocol.protocol, H11Protocol):
                    self._hold_heads(self.protocol.protocol)
                await self.protocol.initiate()
                self._timer.start(task_group)
                await self._read_data()
                self._timer.stop()  # nothing more will be read: the timer has nothing left to close
        except OSError:
            pass
        finally:
            await self._close()

    async def _read_data(self) -> None:
        if self.config.read_timeout or self._plain_socket is None:
            await super()._read_data()
            return
        # ``TCPServer._read_data`` reading the socket itself (``_receive``), and serving the requests of
        # the everyday shape itself (``_serve_express``) until the first that is not.
        handle = self.protocol.handle
        if self._express_allowed():
            data = await self._serve_express()
            if data is None:
                await handle(Closed())
                return
            await handle(RawData(data))
        while True:
            data = await self._receive()
            await handle(RawData(data))
            if data == b"":
                break
        await handle(Closed())

    async def _receive(self) -> bytes:
        """What the client sent next; ``b""`` once it has gone or the connection is closed. Without a
        cancel scope per read (it is ``fail_after(inf)`` in ``TCPServer``), and without the extra pass
        through the scheduler that Trio makes after a read that did not wait, when this task has just
        waited for the socket to be readable."""
        socket = self._plain_socket
        assert socket is not None
        waited = False
        while True:
            descriptor = socket.fileno()
            if descriptor == -1:
                return b""  # closed by the server: a timeout, a shutdown
            try:
                data = os.read(descriptor, MAX_RECV)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(descriptor)
                except trio.ClosedResourceError:
                    return b""
                waited = True
                continue
            except OSError:  # reset by the client
                return b""
            if not waited:
                # Data was there at once: let the other tasks run first, but never cancelled here, with
                # the data taken off the socket (a cancelled body read would lose it, and the skip of
                # the unread body would then take the next request for the rest of it).
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    def _express_allowed(self) -> bool:
        """Whether this connection starts on the express lane (``express.py``): HTTP/1.1 served by h11,
        with none of the Hypercorn settings the lane does not implement."""
        config = self.config
        return (
            type(self.protocol.protocol) is H11Protocol
            and not config.server_names
            and config.max_requests is None
        )

    async def _serve_express(self) -> bytes | None:
        """Serve requests of the everyday shape one after the other, in this task. Returns what was read
        from the first request that is not of that shape on (for h11), or ``None`` once the connection
        is done with."""
        config = self.config
        limit = config.h11_max_incomplete_size
        buffer = b""
        searched = 0  # how much of ``buffer`` parse_head saw without finding the head's end
        served = 0
        while True:
            try:
                head = express.parse_head(buffer, limit, searched)
            except express.NotExpress:
                self.protocol.protocol.keep_alive_requests = served
                return buffer
            if head is None:
                data = await self._receive()
                if not data:
                    return None
                searched = len(buffer)
                buffer += data
                continue
            self._timer.update(idle=False)
            served += 1
            exchange = express.ExpressRequest(
                head,
                buffer[head.size :],
                read=self._receive,
                write=self._send_data,
                extensions={CLIENT_LINK: self._link_extension},
                config=config,
                client=self._client,
                server=self._server,
                state=self._connection_state,
                last=served >= config.keep_alive_max_requests,
            )
            await self.context.mark_request()
            await exchange.serve(self.app)
            if 0 < exchange.unread <= _SKIPPED_BODY_LIMIT:
                with trio.move_on_after(config.keep_alive_timeout):  # a client that stalls is closed
                    await exchange.skip_body()
            if not exchange.reusable or self.context.terminated.is_set():
                return None
            buffer = exchange.rest
            searched = 0
            self._timer.update(idle=True)
            if buffer:
                # A request pipelined behind this one is already here: let the other tasks run first, as
                # a read that did not wait does (an app that never waits would otherwise keep the loop).
                await trio.lowlevel.checkpoint()

    def _hold_heads(self, protocol: H11Protocol) -> None:
        """Have the head of each response with a ``content-length`` written with the body's first part,
        in one write instead of two: the body of such a response comes straight after its head."""
        stream_send = protocol.stream_send

        async def send_holding_heads(event: StreamEvent) -> None:
            if type(event) is Response and event.status_code >= 200 and _has_length(event.headers):
                self._hold_next = True
                try:
                    await stream_send(event)
                finally:
                    self._hold_next = False
            else:
                await stream_send(event)

        protocol.stream_send = send_holding_heads  # type: ignore[method-assign]

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData:
            data = event.data
            if self._hold_next:
                self._held = data
                return
            if self._held:
                data, self._held = self._held + data, b""
            if data:  # h11's end of a message whose length was announced is empty: nothing to write
                await self._send_data(data)
            return
        if self._held:
            data, self._held = self._held, b""
            await self._send_data(data)
        if type(event) is Updated:
            self._timer.update(idle=event.idle)
        else:
            await super().protocol_send(event)

    async def _send_data(self, data: bytes) -> None:
        lock = self.send_lock
        try:
            lock.acquire_nowait()  # no checkpoint when the lock is free
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await self._write(data)
        finally:
            lock.release()

    async def _write(self, data: bytes) -> None:
        remaining: bytes | memoryview = data
        socket = self._plain_socket
        if socket is not None and not socket.did_shutdown_SHUT_WR:
            descriptor = socket.fileno()
            try:
                # What fits in the socket's buffer now (Trio made it non-blocking), with no pass through
                # the scheduler; the rest, if any, as Trio sends it.
                sent = os.write(descriptor, data) if descriptor != -1 else 0
            except OSError:  # BlockingIOError: the buffer is full; else Trio's send reports the error
                sent = 0
            if sent == len(data):
                return
            remaining = memoryview(data)[sent:]
        if not self._aborted:
            try:
                # Shielded, so that a request task cancelled mid-write leaves no half answer on a
                # connection that lives on; ``abort_writes`` lifts the shield when the server gives up.
                with trio.CancelScope(shield=True) as self._write_scope:
                    await self.stream.send_all(remaining)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._link.lost = True
                await self.protocol.handle(Closed())
                return
            finally:
                self._write_scope = None
            if not self._aborted:
                return
        self._link.lost = True
        await trio.aclose_forcefully(self.stream)
        await self.protocol.handle(Closed())

    def abort_writes(self) -> None:
        """The server gives up on this connection (its graceful timeout passed while the connection was
        busy): a write waiting for a client that stopped reading ends, and so does any later one, with
        the connection closed. Without this, such a write would hold the server's shutdown for ever."""
        self._aborted = True
        scope = self._write_scope
        if scope is not None:
            scope.shield = False
            scope.cancel()


def _has_length(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"content-length" for name, _ in headers)


class AppInbox:
    """What Hypercorn hands a request's app task (the body, then ``http.disconnect``): a bounded memory
    channel whose ends checkpoint only when they must wait, for a message or for room."""

    __slots__ = ("_receive", "_send")

    def __init__(self, size: int) -> None:
        self._send, self._receive = trio.open_memory_channel[ASGIReceiveEvent](size)

    async def put(self, message: ASGIReceiveEvent) -> None:
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            await self._send.send(message)

    async def get(self) -> ASGIReceiveEvent:
        try:
            return self._receive.receive_nowait()
        except trio.WouldBlock:
            return await self._receive.receive()


class AppTaskGroup(TaskGroup):
    """Hypercorn's ``TaskGroup``, whose request tasks get an ``AppInbox``, and their connection's
    ``ClientLink`` in their scope."""

    def __init__(self, link_extension: dict[str, Any]) -> None:
        super().__init__()
        self._link_extension = link_extension

    async def spawn_app(
        self,
        app: AppWrapper,
        config: Config,
        scope: Scope,
        send: Callable[[ASGISendEvent | None], Awaitable[None]],
    ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        inbox = AppInbox(config.max_app_queue_size)
        extensions = cast(dict[str, Any], scope).get("extensions")  # HTTP and WebSocket scopes have them
        if extensions is not None:
            extensions[CLIENT_LINK] = self._link_extension
        assert self._nursery is not None
        self._nursery.start_soon(
            _handle, app, config, scope, inbox.get, send, trio.to_thread.run_sync, trio.from_thread.run
        )
        return inbox.put


class KeepAliveTimer:
    """Closes its connection once it has been idle (no request in hand) for ``keep_alive_timeout``, or
    as soon as it is idle after the server began to shut down: what Hypercorn's ``TrioSingleTask`` and
    ``TCPServer._idle_timeout`` do, with one task for the connection's life instead of one per request."""

    def __init__(self, connection: ConnectionHandler) -> None:
        self._connection = connection
        self._timeout: float = connection.config.keep_alive_timeout
        self._busy = False
        # Entered by ``_watch``; its deadline is the timer. A scope may be given a deadline before it is
        # entered, so ``update`` works from the start.
        self._scope = trio.CancelScope(deadline=math.inf)
        self._stopped = False

    def start(self, task_group: TaskGroup) -> None:
        """Start the timer: the connection is idle from now."""
        self.update(idle=True)
        task_group.spawn(self._watch)

    def stop(self) -> None:
        """The connection has stopped reading (the client left, or the server closed it): end the timer
        without closing anything, so that the connection's task group can finish."""
        self._stopped = True
        self._scope.cancel()

    def update(self, *, idle: bool) -> None:
        """A request began (``idle=False``) or ended (``idle=True``). A request leaves the deadline
        where it is (moving a deadline costs about as much as the rest of this timer): should the
        request outlast it, ``_watch`` wakes once, finds the connection busy and waits on."""
        self._busy = not idle
        if not idle:
            return
        if self._connection.context.terminated.is_set():
            self._scope.cancel()  # shutting down: an idle connection closes now
        else:
            self._scope.deadline = trio.current_time() + self._timeout

    async def _watch(self) -> None:
        try:
            await self._watch_until_idle()
        except trio.Cancelled:  # the server's graceful timeout passed with the connection still busy
            self._connection.abort_writes()
            raise

    async def _watch_until_idle(self) -> None:
        terminated = self._connection.context.terminated
        while True:
            with self._scope:
                await terminated.wait()
                if self._busy:
                    await trio.sleep_forever()  # until the answer is out: ``update`` cancels the scope
            if self._stopped:
                return
            if not self._busy:
                break
            # The deadline passed while a request was in hand: keep watching, from that request's end.
            self._scope = trio.CancelScope(deadline=math.inf)
        with trio.CancelScope(shield=True):
            await self._connection._initiate_server_close()


class ServerConfig(Config):
    """Hypercorn's ``Config``, whose headers for every answer (``date``, ``server``) are made once a
    second and then copied, rather than made per answer: formatting the date alone took ~1% of a
    request's CPU. ``date`` has a resolution of one second, so its text is the same either way."""

    _headers_second = -1
    _headers: dict[str, list[tuple[bytes, bytes]]]

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        second = int(time.time())
        if second != self._headers_second:
            self._headers_second, self._headers = second, {}
        headers = self._headers.get(protocol)
        if headers is None:
            headers = self._headers[protocol] = super().response_headers(protocol)
        return list(headers)  # callers own what they get


#: Where Hypercorn's Trio worker looks up the class it serves each connection with.
_WORKER_MODULE, _HANDLER_NAME = hypercorn.trio.run, "TCPServer"


def install() -> None:
    """Make Hypercorn's Trio worker serve connections with ``ConnectionHandler``. Idempotent."""
    current = getattr(_WORKER_MODULE, _HANDLER_NAME)
    if current is ConnectionHandler:
        return
    if current is not TCPServer:
        raise RuntimeError(
            f"hypercorn.trio.run.TCPServer is {current!r}, not Hypercorn's own: not replacing it"
        )
    setattr(_WORKER_MODULE, _HANDLER_NAME, ConnectionHandler)
