"""The root nursery: it owns every queue actor and the HTTP server, and shuts them down in order."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio
from hypercorn.trio import serve as hypercorn_serve
from quart_trio import QuartTrio

from broker.clock import Clock, format_time
from broker.config import Settings
from broker.errors import StorageUnavailable
from broker.http import connection, create_app
from broker.http.compat_cloudflare import register as register_cloudflare
from broker.http.compat_qhook import register as register_qhook
from broker.http.compat_simpleq import register as register_simpleq
from broker.http.observe import MAX_HEAD_BYTES
from broker.http.operations import install as install_operations
from broker.http.push_routes import register as register_push_routes
from broker.push import PushSupervisor
from broker.registry import Registry
from broker.storage import InMemoryJournal, Journal
from broker.storage.store import Snapshotter, StoppedDuringRecovery, new_boot, open_data_dir

log = structlog.get_logger("broker.server")


@dataclass(frozen=True, slots=True)
class Broker:
    """The running parts of one broker, for the server and for tests that run it in process."""

    app: QuartTrio
    registry: Registry
    journal: Journal
    clock: Clock
    snapshots: Snapshotter | None = None
    push: PushSupervisor | None = None


@asynccontextmanager
async def _serving(
    nursery: trio.Nursery,
    registry: Registry,
    settings: Settings,
    snapshots: Snapshotter | None,
    push_options: Mapping[str, Any] | None,
) -> AsyncIterator[Broker]:
    """What every broker runs over its registry, in memory or durable: the configured queues, webhook
    push, and the app with every surface's routes. On leaving, push stops and waits until its
    dispatchers have released their leases (through the actors, which still run), then every actor
    stops."""
    await declare_queues(registry, settings.queues)
    await registry.freeze_when_waiting()
    push = PushSupervisor(registry, registry.clock, **(push_options or {}))
    await nursery.start(push.run)
    app = create_app(registry, settings.limits, snapshots, push.status)
    register_push_routes(app, registry, push, settings.limits)
    register_qhook(app, registry, settings.limits)
    register_cloudflare(app, registry, settings.limits)
    register_simpleq(app, registry, push, settings.limits)
    install_operations(app, registry, settings.tokens)
    yield Broker(app, registry, registry.journal, registry.clock, snapshots, push)
    await push.aclose()
    registry.stop_all()


@asynccontextmanager
async def open_broker(
    settings: Settings,
    *,
    push_options: Mapping[str, Any] | None = None,
    stop: threading.Event | None = None,
) -> AsyncIterator[Broker]:
    """Recover the queues from the data directory (unless ``in_memory``), start them and the journal's
    writer, and yield. Leaving the block stops webhook push and waits until its dispatchers have
    released the leases they held (their releases go through the actors), then stops every actor, then
    flushes and closes the journal. ``StoppedDuringRecovery`` when ``stop`` is set while the data
    directory is read (``open_data_dir``).

    ``push_options`` go to the ``PushSupervisor`` (tests: a mock transport, a shorter poll)."""
    clock = Clock()
    if settings.in_memory:
        async with trio.open_nursery() as nursery:
            registry = Registry(nursery, InMemoryJournal(), clock, history=settings.finished_history)
            async with _serving(nursery, registry, settings, None, push_options) as broker:
                yield broker
        return
    opened = await trio.to_thread.run_sync(
        partial(
            open_data_dir,
            settings.data_dir,
            segment_bytes=settings.journal_segment_bytes,
            history=settings.finished_history,
            stop=stop,
        )
    )
    journal = opened.journal
    if opened.recovered.last_lsn:
        last_at = opened.recovered.last_at
        behind = clock.not_before(last_at + 0.001)
        if behind:
            log.warning(
                "clock_behind_journal",
                seconds=round(behind, 3),
                journal_last_at=format_time(last_at),
                detail="the host's clock reads earlier than the journal's last record: the broker's clock "
                "starts from that record instead, and runs that far ahead of the host's",
            )
    snapshots = Snapshotter(
        settings.data_dir, journal, settings.journal_retention, history=settings.finished_history
    )
    try:
        boot = await trio.to_thread.run_sync(new_boot, settings.data_dir, int(clock.now() * 1000))
        async with trio.open_nursery() as storage:
            await storage.start(journal.run)
            await storage.start(snapshots.run, settings.snapshot_interval, settings.snapshot_bytes)
            async with trio.open_nursery() as nursery:
                registry = Registry(nursery, journal, clock, history=settings.finished_history, boot=boot)
                registry.adopt(opened.recovered)
                async with _serving(nursery, registry, settings, snapshots, push_options) as broker:
                    yield broker
            storage.cancel_scope.cancel()  # every actor is done: nothing more will be appended
        await journal.close()
        if journal.committed_lsn == journal.last_lsn:  # the journal holds everything
            # So the next start replays nothing; a failure (a full disk) is logged by ``take``, and the
            # journal has it all.
            with trio.CancelScope(shield=True), suppress(StorageUnavailable, OSError):
                await snapshots.take(at="shutdown")
        else:  # the journal could not be written (a full disk) until the end: never acknowledged, lost
            log.error(
                "journal_unwritten_at_shutdown",
                committed_lsn=journal.committed_lsn,
                lost_lsns=f"{journal.committed_lsn + 1}-{journal.last_lsn}",
                detail="changes answered 503 (storage_unavailable) while the journal could not be written",
            )
    finally:
        opened.release()


async def declare_queues(registry: Registry, queues: Mapping[str, Mapping[str, Any]]) -> None:
    """Create the queues the config declares, or update the config of those that exist."""
    for name, changes in queues.items():
        created, _ = await registry.put(name, changes)
        log.info("queue_declared", queue=name, created=created)


#: Connections the kernel completes and holds for the broker to accept (capped by the kernel's
#: ``net.core.somaxconn``, 4,096 by default since Linux 5.4). Hypercorn's default, 100, is less than a
#: fleet of workers reconnecting at once after a restart: past it the kernel drops their handshakes,
#: and each waits out its SYN retransmits (1, 3, 7 … s), some for a minute (docs/operations.md).
LISTEN_BACKLOG = 4096


def _hypercorn_config(settings: Settings) -> connection.ServerConfig:
    """Hypercorn's settings, with the limits that keep a slow or greedy client from holding a
    connection (docs/operations.md, "Slow clients").

    - ``keep_alive_timeout`` runs while a connection has no request in hand: between requests, and
      from a connection's first byte until its request head is whole. So a client that sends half a
      head and stalls is closed after it. It stops once the head is in, so it never cuts a slow body,
      a long poll or a push stream. (A body is bounded in time by Quart's ``BODY_TIMEOUT``, which the
      fast path applies too: 408 after 60 s.)
    - ``read_timeout`` stays unset: Hypercorn applies it to every pause in what the *client* sends,
      also while the client waits for an answer, so any value would cut long polls longer than it and
      every push stream (whose client sends nothing after its request; heartbeats go the other way).
    - The request head is checked at ``observe.MAX_HEAD_BYTES`` with a contract error body; Hypercorn's
      own limit, at twice that, only stops a head that keeps growing (an empty 431)."""
    config = connection.ServerConfig()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = settings.keep_alive_timeout
    config.read_timeout = None
    config.h11_max_incomplete_size = 2 * MAX_HEAD_BYTES
    config.h2_max_header_list_size = 2 * MAX_HEAD_BYTES
    config.graceful_timeout = 10
    config.backlog = LISTEN_BACKLOG
    return config


async def serve(
    settings: Settings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until SIGINT or SIGTERM, then stop accepting, finish requests, and stop the actors."""
    if not settings.in_memory:  # in memory, nothing goes on disk: not even an empty data directory
        prepare_data_dir(settings.data_dir)
    connection.install()
    signals = _Signals()
    async with trio.open_nursery() as watching:
        await watching.start(signals.watch)
        try:
            await _serve_broker(settings, signals, task_status)
        except StoppedDuringRecovery:
            log.info("stopped_during_recovery", data_dir=str(settings.data_dir))
        watching.cancel_scope.cancel()


async def _serve_broker(
    settings: Settings, signals: _Signals, task_status: trio.TaskStatus[list[str]]
) -> None:
    """Open the broker, serve until ``signals`` says stop, and close it."""
    async with open_broker(settings, stop=signals.reading_data_dir) as broker:
        signals.attach(broker.registry, broker.push)
        async with trio.open_nursery() as nursery:
            signals.serving = nursery.cancel_scope
            binds = await nursery.start(
                lambda task_status: hypercorn_serve(
                    broker.app,
                    _hypercorn_config(settings),
                    shutdown_trigger=signals.stop.wait,
                    task_status=task_status,
                )
            )
            for bind in binds:
                data_dir = None if settings.in_memory else str(settings.data_dir)
                log.info("listening", url=bind, data_dir=data_dir)
            task_status.started(binds)
            await signals.stop.wait()
            log.info("shutting_down")
            # Hypercorn returns once its requests are done; then nothing else needs to run.
            nursery.cancel_scope.deadline = trio.current_time() + 15
        signals.serving = None  # the broker closes: its journal is flushed, its snapshot taken


def prepare_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` if needed. ``StorageUnavailable`` naming it when that fails (a file in the
    way, no permission), rather than a bare ``OSError`` that reads as a failure to listen."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = "it exists and is not a directory" if isinstance(error, FileExistsError) else error.strerror
        raise StorageUnavailable(f"cannot use the data directory {str(data_dir)!r}: {reason}") from error


class _Signals:
    """SIGINT and SIGTERM, watched from before the broker opens until it has closed (journal flushed,
    snapshot taken). The first starts a graceful stop; a second cuts off the requests still running
    (``serving``), if any still run, and is otherwise absorbed, so that the flush and the snapshot go
    on; a third ends the process at once, by that signal."""

    def __init__(self) -> None:
        self.stop = trio.Event()
        #: Set with ``stop``, for the thread that reads the data directory before the broker opens.
        self.reading_data_dir = threading.Event()
        #: The scope of the requests being served, while they are.
        self.serving: trio.CancelScope | None = None
        self._registry: Registry | None = None
        self._push: PushSupervisor | None = None

    def attach(self, registry: Registry, push: PushSupervisor | None) -> None:
        self._registry = registry
        self._push = push
        if self.stop.is_set():  # a signal came while the broker was opening
            self._begin_shutdown()

    def _begin_shutdown(self) -> None:
        """Before Hypercorn hears of the stop: a request that starts from here on is refused whole
        (http/drain.py); push streams end with an error event and release their leases; webhook push
        claims nothing more, its pushes in flight going on until the broker closes."""
        if self._registry is not None:
            self._registry.begin_shutdown()
        if self._push is not None:
            self._push.stop_claiming()

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        signals_seen = 0
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            task_status.started()
            async for number in received:
                signals_seen += 1
                if signals_seen == 1:
                    self._begin_shutdown()
                    self.reading_data_dir.set()
                    self.stop.set()
                elif signals_seen == 2:
                    log.warning("stopping_now", detail="a second signal: requests still running are cut off")
                    if self.serving is not None:
                        self.serving.cancel()
                else:
                    # The third ends the process at once, by the signal itself. (Left to Trio's own
                    # handler, a SIGINT is a KeyboardInterrupt raised through whatever runs, the flush or
                    # the snapshot: a traceback; and the receiver, once closed, hands it the ones it held.)
                    signal.signal(number, signal.SIG_DFL)
                    os.kill(os.getpid(), number)
