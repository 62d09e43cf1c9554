"""One queue's webhook push: a consumer that claims messages and POSTs each to the queue's URL.

The dispatcher is a client of its queue's actor like any other: it claims under a lease (consumer
``push``) and settles through ``Ack``, ``Nack``, ``Defer`` and ``Extend``, so the queue's
``max_attempts``, ``retry_backoff``, ``rate_limit`` and ``dead_letter`` apply as they do to every
consumer. It holds no queue state of its own beyond what it has in hand.

Flow: while fewer than ``concurrency`` pushes are in hand, it claims as many as there is room for
(a long poll, so a publish wakes it at once) with a lease of ``timeout`` plus a margin, and starts one
task per message. The task POSTs the signed envelope (``request.py``) and settles by the answer:

* 2xx: standard mode acks; ack mode extends the lease to ``ack_timeout`` (plus the margin) and waits
  for the message's callback (``acks.py``), then applies ``ack_timeout_action`` (a nack, retryable for
  ``retry``, not for ``dead``). The message holds its slot until then: in ack mode ``concurrency``
  bounds the work in progress at the receiver, not just the requests. A slot is a delivery's (its
  lease's), not a message's: a callback that comes before the 2xx settles the message, which may be
  pushed again while the first request is still open, and each push holds its slot until it ends.
* 429, 503, 529: defer for ``Retry-After`` (60 s when absent); no attempt is spent.
* 401, 403: the receiver refuses the broker, a configuration problem no retry fixes: the message is
  deferred (no attempt spent) and the queue's push pauses for 60 s, doubling to 15 min while it lasts,
  logged as an error each time and shown in ``status()``. The first push after a pause is the probe.
* anything else, a timeout or no connection: a failed attempt, nacked with the queue's backoff, so it
  is dead-lettered once ``max_attempts`` are used up. When no connection could be made (refused,
  unreachable, no such name, TLS), the queue's push also waits before its next push, 1 s doubling to
  30 s while it lasts, then probes with one: a receiver that is down would otherwise take every message
  through its attempts as fast as the backoff allows (with the default backoff of 0, thousands a second,
  each a nack in the journal).
* not sent at all, because this host could not open a connection (out of file descriptors, memory or
  ports: ``transport.LocalError``): not the receiver's fault, so no attempt is spent; the message is
  released at once and the queue's push waits 1 s.

Requests go through a ``transport.ConnectionPool`` of the dispatcher's own (HTTP/1.1 over Trio
streams, one keep-alive connection per request in flight); the push's ``timeout`` is a cancel scope
around the whole request. Acks are gathered: the pushes that finish while an ``Ack`` is with the
actor (or in the same scheduling round) are acked together by the next one, a single command for
many leases, so the actor and the journal see one request per batch rather than one per message.

When the dispatcher stops (push removed, queue deleted, broker shutting down) every lease it holds is
released at once, so the messages are claimable again rather than at lease expiry.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import structlog
import trio

from broker.actor import QueueActor
from broker.clock import Clock, format_time
from broker.core.commands import Ack, Claim, Command, Defer, Extend, Nack, Release
from broker.core.config import PushConfig, url_origin
from broker.core.model import ClaimOutcome, Delivery
from broker.errors import BrokerError, QueueNotFound, StorageUnavailable
from broker.push import request
from broker.push.acks import AckBook, Waiting
from broker.push.history import History
from broker.push.request import Attempt, Outcome
from broker.push.transport import (
    ConnectError,
    ConnectionPool,
    LocalError,
    PrivateAddress,
    Transport,
    TransportError,
)

log = structlog.get_logger("broker.push")

#: The consumer name push claims under (it shows in the message's history).
CONSUMER = "push"
#: Seconds a push's lease outlives the request's timeout (or the ack timeout), so the dispatcher
#: settles before the core could notice the lease expire.
LEASE_MARGIN = 10.0
#: The longest a claim long-polls before the dispatcher looks at its config again.
CLAIM_WAIT = 5.0
#: The pause after a 401 or 403, doubling each time in a row, up to ``PAUSE_MAX``.
PAUSE_FIRST = 60.0
PAUSE_MAX = 900.0
#: The pause after a push that could not connect to the receiver, doubling each time in a row.
UNREACHABLE_FIRST = 1.0
UNREACHABLE_MAX = 30.0
#: The pause after a push this host could not send (``LocalError``).
LOCAL_PAUSE = 1.0
#: The longest a stopping dispatcher waits for room in its queue's inbox to give its leases back; past
#: it they expire as any lease does.
RELEASE_TIMEOUT = 10.0
#: An ack-mode callback → the status counter it counts in.
_CALLBACK_COUNTERS = {"ack": "acked_total", "nack": "failed_total", "defer": "deferred_total"}


class _AckBatch:
    """Leases waiting for one ``Ack`` command; ``done`` is set when it was carried out (``ok``) or not."""

    __slots__ = ("done", "leases", "ok")

    def __init__(self) -> None:
        self.leases: list[str] = []
        self.done = trio.Event()
        self.ok = False


class Dispatcher:
    """Push for one queue (one actor: a queue deleted and made again gets a new dispatcher)."""

    def __init__(
        self,
        queue: str,
        actor: QueueActor,
        clock: Clock,
        acks: AckBook,
        transport: Transport | None = None,
    ) -> None:
        """``transport``: where requests go (tests inject a fake); by default a ``ConnectionPool`` of
        the dispatcher's own, closed when it stops. An injected one is left open."""
        self.queue = queue
        self.actor = actor
        self._clock = clock
        self._acks = acks
        self._transport = transport
        self.history = History()
        self.cancel_scope = trio.CancelScope()
        #: Around the claims alone: cancelled by ``stop_claiming``, when the broker begins to stop.
        self._claiming = trio.CancelScope()
        # Lease id → message id, for every delivery in hand (its push task not yet done): one slot each.
        # By lease, not message: a message settled by its callback before its 2xx came is pushed again
        # while the first push still runs, and both pushes hold a slot until each ends.
        self._held: dict[str, str] = {}
        self._slot_freed = trio.Event()
        self._paused_until = -math.inf  # Trio time
        self._pause_reason: str | None = None
        self._refusals_in_a_row = 0
        self._unreachable_in_a_row = 0  # pushes in a row that could not connect (``ConnectError``)
        self._probing = False  # after a pause: one push at a time until one is not refused
        self._paused_with: PushConfig | None = None  # the push config the latest pause began under
        self._config_changed = trio.Event()  # set by ``notice_config`` during a pause
        self._ack_batch: _AckBatch | None = None  # the leases the next Ack carries
        self._ack_wanted = trio.Event()
        self._private_logged = False  # a refused private address is logged once until a push gets through
        self.counters = dict.fromkeys(
            (
                "pushed_total",
                "acked_total",
                "deferred_total",
                "failed_total",
                "refused_total",
                "ack_timeouts_total",
            ),
            0,
        )

    # -- what others may ask ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The push's state for the API: running or paused (and why, until when), what is in hand,
        and counters since the dispatcher started."""
        paused = self._paused_until > trio.current_time()
        config = self.actor.config.push
        return {
            "state": "paused" if paused else "running",
            "paused_until": (
                format_time(self._clock.now() + self._paused_until - trio.current_time()) if paused else None
            ),
            "pause_reason": self._pause_reason if paused else None,
            "in_flight": len(self._held),
            "concurrency": None if config is None else config.concurrency,
            **self.counters,
        }

    def stop(self) -> None:
        self.cancel_scope.cancel()

    def stop_claiming(self) -> None:
        """Claim nothing more (the broker begins a graceful stop): the pushes in flight go on until
        ``stop``, which releases what is still in hand. A claim waiting is dropped; messages the actor
        had leased to it meanwhile are released with their attempt refunded (``QueueActor.request``)."""
        self._claiming.cancel()

    # -- the claim loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Push until cancelled (``stop``), push is removed from the config, or the queue is deleted."""
        transport = self._transport if self._transport is not None else ConnectionPool()
        with self.cancel_scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ack_loop)
                    with self._claiming:
                        await self._claim_loop(transport, nursery)
                    if self._claiming.cancelled_caught:  # the broker stops: pushes in flight go on
                        await trio.sleep_forever()
                    nursery.cancel_scope.cancel()
            finally:
                await self._release_held()
                if transport is not self._transport:
                    transport.close()

    async def _claim_loop(self, transport: Transport, nursery: trio.Nursery) -> None:
        while True:
            config = self.actor.config.push
            if config is None:
                return
            if self._paused_until > trio.current_time():
                await self._sit_out_pause()
                continue
            room = (1 if self._probing else config.concurrency) - len(self._held)
            if room <= 0:
                with trio.move_on_after(CLAIM_WAIT):  # then look at the config again
                    await self._slot_freed.wait()
                continue
            if isinstance(transport, ConnectionPool):
                transport.max_idle = config.concurrency
            lease = min(config.timeout + LEASE_MARGIN, 43200.0)
            try:
                outcome: ClaimOutcome = await self.actor.request(
                    Claim(CONSUMER, min(room, 1000), lease, wait=CLAIM_WAIT)
                )
            except QueueNotFound:
                return
            except BrokerError as error:  # e.g. storage trouble: try again shortly
                log.warning("push_claim_failed", queue=self.queue, error=error.message)
                await trio.sleep(1.0)
                continue
            # The claim may have waited seconds: push with the config as it is now (a PUT may have
            # changed the URL or secret meanwhile), or give the messages back if push was removed.
            config = self.actor.config.push
            if outcome.deliveries and (config is None or self._paused_until > trio.current_time()):
                # Paused or unconfigured while the claim waited: back unpushed, their attempt refunded.
                leases = [claimed.lease_id for claimed, _ in outcome.deliveries]
                await self._request(Release(leases, refund_attempt=True))
                continue
            if config is None:
                return
            for delivery in outcome.deliveries:
                claimed = delivery[0]
                self._held[claimed.lease_id] = claimed.id
                nursery.start_soon(self._push_one, transport, config, delivery)
            # No sleep for a rate limit's ``retry_after``: the claim long-polled, and the actor wakes
            # it as soon as the window frees; sleeping out the window would also leave a config change
            # (a rate limit raised or removed) unread for as long as ``per``.

    def _free_slot(self, lease_id: str) -> None:
        self._held.pop(lease_id, None)
        self._slot_freed.set()
        self._slot_freed = trio.Event()

    async def _release_held(self) -> None:
        """Give back the leases of pushes still in flight, their attempts refunded: the broker cut them
        off (push removed, shutdown), not the receiver, so a message on its last attempt is pushed again
        rather than dead-lettered. Runs as the dispatcher is cancelled, so shielded; it waits for room
        in a full inbox (a dropped ``Release`` would hold the messages until their leases expire), but
        not for long."""
        if not self._held:
            return
        for lease_id, message_id in self._held.items():
            self._acks.take(message_id, lease_id, "stopped")  # a late callback learns why
        # A delivery its callback settled while its push still ran has a stale lease: the core skips it.
        leases = list(self._held)
        self._held.clear()
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(RELEASE_TIMEOUT),
            # A queue deleted under us has closed its inbox: its messages, leases and all, are gone.
            contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError),
        ):
            await self.actor.post(Release(leases, refund_attempt=True))

    # -- one push ------------------------------------------------------------------------------------

    async def _push_one(self, transport: Transport, config: PushConfig, delivery: Delivery) -> None:
        claimed, _ = delivery
        message_id, lease_id = claimed.id, claimed.lease_id
        waiting: Waiting | None = None
        cancelled = False
        if config.mode == "ack":  # entered first: the receiver may call back before its 2xx reaches us
            waiting = Waiting(self.queue, self.actor, lease_id)
            self._acks.enter(message_id, waiting)
        try:
            status, error, retry_header, duration, failure = await self._post(transport, config, delivery)
            outcome = request.outcome_of(status if error is None else None)
            if not isinstance(failure, LocalError):  # that one was not sent
                self.counters["pushed_total"] += 1
            if status is not None:
                self._unreachable_in_a_row = 0
            # A probe that got through (even to a failure the receiver answered, or a timeout) resumes
            # full speed; one refused, not connected or not sent keeps the queue's push to one at a time.
            if outcome is not Outcome.REFUSED and not isinstance(failure, ConnectError | LocalError):
                self._probing = False
            if waiting is not None:
                # A callback that came first and is still being carried out decides: settled, or
                # failed (then the delivery goes on below as if it had not come).
                await waiting.callback_ended()
            if waiting is not None and waiting.verb is not None and waiting.settled.is_set():  # called back
                self._record(delivery, status, error, duration, f"settled by {waiting.verb}")
                self._count_callback(waiting.verb)
                return
            if outcome is Outcome.DONE:
                self._refusals_in_a_row = 0
                if waiting is None:
                    self._record(delivery, status, error, duration, "acked")
                    if await self._ack(lease_id):
                        self.counters["acked_total"] += 1
                else:
                    self._record(delivery, status, error, duration, "awaiting_ack")
                    await self._await_callback(config, message_id, claimed.attempt, waiting)
                return
            if waiting is not None and self._acks.take(message_id, lease_id, "push_failed") is None:
                self._record(delivery, status, error, duration, f"settled by {waiting.verb}")
                return
            await self._settle_failure(
                config, delivery, outcome, status, error, retry_header, duration, failure
            )
        except trio.Cancelled:
            cancelled = True  # the dispatcher stops: its lease stays in ``_held`` to be released
            raise
        finally:
            if not cancelled:
                if waiting is not None:
                    self._acks.leave(message_id, waiting)
                self._free_slot(lease_id)

    async def _post(
        self, transport: Transport, config: PushConfig, delivery: Delivery
    ) -> tuple[int | None, str | None, str | None, float, Exception | None]:
        """POST the envelope: ``(status, error, Retry-After, seconds taken, failure)``; ``error`` set (and
        the status dropped) when no answer came within the timeout, ``failure`` the transport's error
        that says why, if one did."""
        max_attempts = self.actor.config.max_attempts
        body, headers = request.build(self.queue, config, delivery, max_attempts, self._clock.now())
        status: int | None = None
        retry_header: str | None = None
        error: str | None = None
        failure: Exception | None = None
        started = trio.current_time()
        with trio.move_on_after(config.timeout) as scope:  # connect, send and the whole answer
            try:
                answer = await transport.post(config.url, body, headers, allow_private=config.allow_private)
                status, retry_header = answer.status, answer.retry_after
            except (TransportError, OSError) as raised:
                failure = raised
                error = f"{type(raised).__name__}: {raised}" if str(raised) else type(raised).__name__
                if isinstance(raised, PrivateAddress):
                    self._log_private_address(config, raised)
            else:
                self._private_logged = False
        if scope.cancelled_caught:
            error = f"timeout after {config.timeout:g}s"
        return status, error, retry_header, trio.current_time() - started, failure

    def _log_private_address(self, config: PushConfig, failure: PrivateAddress) -> None:
        if self._private_logged:  # every retry of every message would say the same
            return
        self._private_logged = True
        log.error(
            "push_private_address_refused",
            queue=self.queue,
            host=url_origin(config.url),  # never the user-info, path or query: they may hold a credential
            error=str(failure),
            hint="pushes to this URL fail until push.allow_private is set or the name resolves elsewhere",
        )

    # -- batched acks ----------------------------------------------------------------------------------

    async def _ack(self, lease_id: str) -> bool:
        """Ack ``lease_id`` with the next batch; True once it was carried out."""
        batch = self._ack_batch
        if batch is None:
            batch = self._ack_batch = _AckBatch()
            self._ack_wanted.set()
        batch.leases.append(lease_id)
        await batch.done.wait()
        return batch.ok

    async def _ack_loop(self) -> None:
        """Send each batch as one ``Ack``: the leases gathered since the last one was answered (so at
        most one scheduling round of delay when the actor is idle, and big batches when it is busy)."""
        while True:
            await self._ack_wanted.wait()
            self._ack_wanted = trio.Event()
            batch, self._ack_batch = self._ack_batch, None
            if batch is None:  # pragma: no cover - ``_ack_wanted`` is set only with a batch
                continue
            batch.ok = await self._request(Ack(batch.leases))
            batch.done.set()

    async def _await_callback(
        self, config: PushConfig, message_id: str, attempt: int, waiting: Waiting
    ) -> None:
        """Ack mode after a 2xx: hold the lease until the callback, or ``ack_timeout``."""
        if not waiting.settled.is_set():
            await self._request(Extend([waiting.lease_id], min(config.ack_timeout + LEASE_MARGIN, 43200.0)))
        with trio.move_on_after(config.ack_timeout):
            await waiting.settled.wait()
        await waiting.callback_ended()  # one being carried out as the timeout passes decides
        if waiting.settled.is_set():
            if waiting.verb in _CALLBACK_COUNTERS:
                self.history.settled(message_id, f"settled by {waiting.verb}")
                self._count_callback(waiting.verb)
            return
        if self._acks.take(message_id, waiting.lease_id, "ack_timeout") is None:
            return  # unreachable: a delivery neither settled nor being settled is still the one waiting
        retry = config.ack_timeout_action == "retry"
        log.info(
            "push_ack_timeout", queue=self.queue, message_id=message_id, action=config.ack_timeout_action
        )
        self.counters["ack_timeouts_total"] += 1
        self.history.add(
            message_id,
            Attempt(self._clock.now(), attempt, None, "ack_timeout", 0.0, "ack_timeout", waiting.lease_id),
        )
        await self._settle(
            Nack([waiting.lease_id], reason="push: ack_timeout", retryable=retry), "failed_total"
        )

    def _count_callback(self, verb: str) -> None:
        counter = _CALLBACK_COUNTERS.get(verb)
        if counter is not None:  # not the dispatcher's own ends (push_failed, stopped, ack_timeout)
            self.counters[counter] += 1

    async def _settle_failure(
        self,
        config: PushConfig,
        delivery: Delivery,
        outcome: Outcome,
        status: int | None,
        error: str | None,
        retry_header: str | None,
        duration: float,
        failure: Exception | None,
    ) -> None:
        lease_id = delivery[0].lease_id
        what = f"HTTP {status}" if error is None else error
        if isinstance(failure, LocalError):  # nothing was sent: this host's trouble, not the receiver's
            self._record(delivery, status, error, duration, "not_sent")
            if self._hold(config, LOCAL_PAUSE, f"this broker could not open a connection: {failure}"):
                log.error(
                    "push_not_sent",
                    queue=self.queue,
                    error=str(failure),
                    paused_for=LOCAL_PAUSE,
                    hint="the broker ran out of file descriptors, memory or local ports (raise its "
                    "open files limit, LimitNOFILE, or lower push concurrency), or this host has no "
                    "address of the receiver's family (IPv6 disabled: give the URL an IPv4 address)",
                )
            await self._request(Release([lease_id], refund_attempt=True))
        elif outcome is Outcome.DEFER:
            seconds = request.retry_after(retry_header, self._clock.now())
            self._record(delivery, status, error, duration, "deferred")
            await self._settle(Defer([lease_id], seconds, f"push: {what}"), "deferred_total")
        elif outcome is Outcome.REFUSED:
            seconds = self._pause(config, what)
            self._record(delivery, status, error, duration, "refused")
            await self._settle(Defer([lease_id], seconds, f"push: {what} (push paused)"), "refused_total")
        else:
            self._record(delivery, status, error, duration, "failed")
            if isinstance(failure, ConnectError):
                self._back_off_unreachable(config, what)
            await self._settle(Nack([lease_id], reason=f"push: {what}"), "failed_total")

    def notice_config(self, config: PushConfig | None) -> None:
        """The supervisor's look at the queue's push config (every 0.5 s): one other than the config the
        pause began under ends the pause here, not when the claim loop next looks (a claim long-polls up
        to ``CLAIM_WAIT``), and its first push is the probe (``_probing`` stays). A new URL or secret is
        the operator's fix for a refusal or a dead receiver (a pause after refusals in a row held the fix
        back up to 15 minutes)."""
        paused = self._paused_until > trio.current_time()
        if paused and config != self._paused_with:
            self._paused_until = -math.inf
            self._refusals_in_a_row = self._unreachable_in_a_row = 0
            self._config_changed.set()  # wakes ``_sit_out_pause``
            log.info("push_resumed", queue=self.queue, reason="the push config changed")

    async def _sit_out_pause(self) -> None:
        """Wait for the pause to end, or for ``notice_config`` to end it."""
        self.notice_config(self.actor.config.push)  # changed before this wait began
        with trio.move_on_at(self._paused_until):
            await self._config_changed.wait()
        self._config_changed = trio.Event()

    def _hold(self, config: PushConfig, seconds: float, reason: str) -> bool:
        """Pause the queue's push for ``seconds``, then send one push as the probe, unless a pause runs
        already (another push in flight met the same cause): True when this one started. ``config`` is
        the push config of the push that met the cause: a new one ends the pause."""
        now = trio.current_time()
        if self._paused_until > now:
            return False
        self._paused_with = config
        self._config_changed = trio.Event()
        self._paused_until = now + seconds
        self._probing = True
        self._pause_reason = reason
        return True

    def _back_off_unreachable(self, config: PushConfig, what: str) -> None:
        """Pause the queue's push after a push that could not connect: 1 s, doubling while it lasts."""
        seconds = min(UNREACHABLE_FIRST * 2.0**self._unreachable_in_a_row, UNREACHABLE_MAX)
        host = url_origin(config.url)  # never the user-info, path or query: they may hold a credential
        if self._hold(config, seconds, f"the receiver at {host} cannot be reached: {what}"):
            self._unreachable_in_a_row += 1
            log.warning("push_unreachable", queue=self.queue, host=host, error=what, paused_for=seconds)

    def _pause(self, config: PushConfig, what: str) -> float:
        """Pause the queue's push after a 401/403: seconds until the next try."""
        now = trio.current_time()
        if self._paused_until > now:  # another push of the same pause
            return self._paused_until - now
        seconds = min(PAUSE_FIRST * 2.0**self._refusals_in_a_row, PAUSE_MAX)
        self._refusals_in_a_row += 1
        host = url_origin(config.url)  # never the user-info, path or query: they may hold a credential
        reason = f"the receiver at {host} answered {what}: check the URL and its credentials"
        self._hold(config, seconds, reason)
        log.error(
            "push_paused",
            queue=self.queue,
            host=host,
            answer=what,
            paused_for=seconds,
            hint="the receiver refuses the broker (401/403); push resumes with one try after the pause",
        )
        return seconds

    def _record(
        self, delivery: Delivery, status: int | None, error: str | None, duration: float, what: str
    ) -> None:
        claimed, _ = delivery
        started = self._clock.now() - duration
        attempt = Attempt(started, claimed.attempt, status, error, duration, what, claimed.lease_id)
        self.history.add(claimed.id, attempt)

    async def _settle(self, command: Command, counter: str) -> None:
        if await self._request(command):
            self.counters[counter] += 1

    async def _request(self, command: Command) -> bool:
        """Send a settling command; False when it could not be carried out (the lease then expires
        and the message comes back, which at-least-once allows)."""
        try:
            await self.actor.request(command)
        except QueueNotFound:  # deleted with its messages: there is nothing left to settle
            return False
        except StorageUnavailable:
            # Carried out: the queue keeps the change and journals it once the disk recovers (docs/api.md,
            # 503 storage_unavailable); only its journaling is late, and the journal logs that fault.
            return True
        except BrokerError as error:
            log.warning(
                "push_settle_failed", queue=self.queue, command=type(command).__name__, error=error.message
            )
            return False
        return True
