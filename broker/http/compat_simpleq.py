"""SimpleQ's job API, under ``/compat/simpleq`` (docs/compat.md): a SimpleQ client, and a SimpleQ webhook
receiver, work against this broker once the client's API base URL is ``http://<broker>/compat/simpleq``.

A SimpleQ queue is a broker queue whose push config has ``format: "simpleq"``: the push machinery
(``broker/push/``) delivers its jobs in SimpleQ's envelope, signed with ``x-simpleq-signature``
(``request.build``). Each route translates onto the native operations; nothing here keeps queue state:

* ``POST /v1/queues``, ``GET /v1/queues``, ``GET|PUT|DELETE /v1/queues/{name}`` → the queue's config
  (``QueueConfig.updated`` with SimpleQ's camelCase fields mapped onto the native ones, ``template``
  included), ``registry.create`` / ``UpdateConfig`` / ``registry.delete``.
* ``POST /v1/queues/{name}/jobs`` → ``Publish`` (``idempotencyKey`` is the message key).
* ``GET /v1/jobs/{id}`` → ``GetMessage`` on the queue that has the job, with its attempts from the
  message's history and the dispatcher's push history.
* ``POST /v1/jobs/{id}/ack|nack|defer`` → push's ack-mode callbacks (``push_routes.settle_callback``);
  of the one push whose envelope's ``attempt`` the body names, if it does (an addition to SimpleQ's API:
  the lease of that push, which ``FindDelivery`` finds in the message's history, makes a retried
  callback exact).
* ``GET /v1/queues/{name}/dlq`` → ``BrowseDeadLetters`` of the queue's dead-letter queue (one command a
  page); ``POST /v1/queues/{name}/dlq/{jobId}/retry`` and ``POST /v1/queues/{name}/dlq/retry`` →
  ``FindDeadLetters`` (one command for every id asked) and ``redrive``.

Tokens stand in for SimpleQ's API keys (paths.py has each route's scope; the routes by job id check the
scope on the job's queue once they know it). Errors keep the broker's error body: SimpleQ documents none.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from quart import Response, request
from quart_trio import QuartTrio

from broker.clock import format_time
from broker.config import Limits
from broker.core import MessageView, QueueConfig, QueueStats, check_queue_name, parse_duration
from broker.core.commands import (
    Ack,
    BrowseDeadLetters,
    Command,
    Defer,
    FindDeadLetters,
    FindDelivery,
    GetMessage,
    Nack,
    UpdateConfig,
)
from broker.core.config import TEMPLATES, RetryBackoff, redacted_url
from broker.core.model import (
    DUPLICATE,
    DeadLetterLookup,
    DeadLetterPage,
    DeliveryLookup,
    PublishedRef,
    State,
)
from broker.core.queue import DEAD_LETTER_ATTEMPTS, DEAD_LETTER_FROM, DEAD_LETTER_REASON, ORIGINAL_ID
from broker.core.records import (
    Acked,
    Claimed,
    DeadLettered,
    Deferred,
    LeaseExpired,
    Nacked,
    Released,
)
from broker.errors import (
    BrokerError,
    Conflict,
    InvalidRequest,
    MessageNotFound,
    PayloadTooLarge,
    QueueNotFound,
    quoted_value,
)
from broker.http import parse
from broker.http.auth import grant_of
from broker.http.compat_io import json_response, no_content, object_body, object_body_with_cbor_flag
from broker.http.push_routes import may, require_scope_by_id, settle_callback
from broker.push import PushSupervisor
from broker.push.dispatcher import CONSUMER as PUSH_CONSUMER
from broker.push.request import Attempt
from broker.registry import Registry

PREFIX = "/compat/simpleq"
#: SimpleQ's limits: a publish's ``delay`` and a defer's ``retryAfter``, in seconds; a bulk retry.
MAX_DELAY = 86400.0
MAX_RETRY_AFTER = 3600.0
MAX_BULK_RETRY = 1000
#: The rate-limit window when ``rateLimitMax`` comes without ``rateLimitWindow`` (SimpleQ's examples
#: use 60: a requests-per-minute guard).
DEFAULT_RATE_WINDOW = 60.0

#: SimpleQ's queue fields that live in the native ``push`` object, by their native name.
_PUSH_FIELDS = {
    "webhookUrl": "url",
    "mode": "mode",
    "concurrency": "concurrency",
    "ackTimeout": "ack_timeout",
    "ackTimeoutAction": "ack_timeout_action",
}
_UPDATE_FIELDS = frozenset(
    {
        *_PUSH_FIELDS,
        "maxAttempts",
        "dlqEnabled",
        "rateLimitMax",
        "rateLimitWindow",
        "backoffType",
        "backoffDelay",
    }
)
_CREATE_FIELDS = _UPDATE_FIELDS | {"name", "template"}
#: Native field names in the config's error messages → SimpleQ's (longest first: one may prefix another).
_FIELD_NAMES = (
    ("push.ack_timeout_action", "ackTimeoutAction"),
    ("push.ack_timeout", "ackTimeout"),
    ("push.concurrency", "concurrency"),
    ("push.mode", "mode"),
    ("push.url", "webhookUrl"),
    ("max_attempts", "maxAttempts"),
    ("retry_backoff.type", "backoffType"),
    ("retry_backoff.base", "backoffDelay"),
    ("rate_limit.max", "rateLimitMax"),
    ("rate_limit.per", "rateLimitWindow"),
)

#: A job's state (``GET /v1/jobs/{id}``) by its message's state; ``in_flight`` and ``dead_lettered``
#: are told apart further by ``_job_state``. (A deleted or purged message is not kept: its job is a 404,
#: and those two states are here for a complete map only.)
_JOB_STATES = {
    State.READY: "queued",
    State.DELAYED: "queued",
    State.IN_FLIGHT: "processing",
    State.ACKED: "completed",
    State.DEAD_LETTERED: "dead",
    State.EXPIRED: "expired",
    State.DELETED: "deleted",
    State.PURGED: "deleted",
    State.REDRIVEN: "retried",
}
#: What an attempt's settlement means for it, by the record that ended its lease.
_ATTEMPT_ENDS: dict[type[Any], str] = {
    Acked: "completed",
    Nacked: "failed",
    Deferred: "deferred",
    LeaseExpired: "timed_out",
    Released: "released",
    DeadLettered: "dead",
}


#: The native publish's names in its refusals → SimpleQ's (the CBOR one first: a SimpleQ payload is an
#: object, never a byte string, so "or a CBOR byte string" would mislead).
_JOB_NAMES = (
    ("the message.payload must be a JSON value or a CBOR byte string", "payload must hold JSON values only"),
    ("the message.payload", "payload"),
    ("the message.key", "idempotencyKey"),
)


def _simpleq_job_names(error: InvalidRequest | PayloadTooLarge) -> BrokerError:
    """The native publish's refusal, of the same kind, with SimpleQ's field names in place of the native
    ones."""
    message = error.message
    for native, simpleq in _JOB_NAMES:
        message = message.replace(native, simpleq)
    return type(error)(message)


def _simpleq_names(error: InvalidRequest) -> InvalidRequest:
    """The config's refusal with SimpleQ's field names in place of the native ones."""
    message = error.message
    for native, simpleq in _FIELD_NAMES:
        message = message.replace(native, simpleq)
    return InvalidRequest(message)


# -- queues: SimpleQ's fields ↔ the native config ------------------------------------------------------


def native_changes(name: str, body: Mapping[str, Any], current: QueueConfig | None) -> dict[str, Any]:
    """The native config change for SimpleQ's queue fields in ``body``: on a new queue (``current``
    ``None``, where ``template`` may prefill them) or on the existing config ``current``."""
    changes: dict[str, Any] = {}
    template_name = body.get("template")
    template = TEMPLATES.get(template_name) if isinstance(template_name, str) else None
    if "template" in body:
        changes["template"] = template_name  # expanded (or refused) by QueueConfig.updated
    given_push = {native: body[field] for field, native in _PUSH_FIELDS.items() if field in body}
    if given_push or current is None:
        push: dict[str, Any] = {}
        if current is not None and current.push is not None:
            push = {field: value for field, value in current.push.to_dict().items() if field != "format"}
        if "url" not in given_push and "url" not in push:
            if current is None:
                raise InvalidRequest("webhookUrl is required: the URL SimpleQ jobs are pushed to")
            # A well-formed change the queue's state refuses (as rotating the secret of a queue that does
            # not push is): a native queue, which has no webhook to keep.
            raise Conflict(f"queue {name!r} does not push: a change of its push fields needs webhookUrl")
        changes["push"] = {**push, **given_push, "format": "simpleq"}
    if "maxAttempts" in body:
        changes["max_attempts"] = body["maxAttempts"]
    if "dlqEnabled" in body:
        enabled = body["dlqEnabled"]
        if not isinstance(enabled, bool):
            raise InvalidRequest("dlqEnabled must be true or false")
        changes["dead_letter"] = QueueConfig().dead_letter_queue(name) if enabled else None
    if "backoffType" in body or "backoffDelay" in body:
        backoff = current.retry_backoff if current is not None else RetryBackoff()
        start: Mapping[str, Any] = {"type": backoff.type, "base": backoff.base, "max": backoff.max}
        if template is not None and current is None:
            start = {**start, **template["retry_backoff"]}
        retry = changes["retry_backoff"] = {
            **start,
            **({"type": body["backoffType"]} if "backoffType" in body else {}),
        }
        if "backoffDelay" in body:  # SimpleQ has no cap: one below the delay is raised to it
            retry["base"] = parse_duration(body["backoffDelay"], "backoffDelay", high=604800)
            retry["max"] = max(retry["max"], retry["base"])
    if "rateLimitMax" in body or "rateLimitWindow" in body:
        changes["rate_limit"] = _rate_limit(body, current)
    return changes


def _rate_limit(body: Mapping[str, Any], current: QueueConfig | None) -> dict[str, Any] | None:
    rate = None if current is None else current.rate_limit
    if "rateLimitMax" in body:
        count = body["rateLimitMax"]
        if count is None:
            return None
    elif rate is not None:
        count = rate[0]
    else:
        raise InvalidRequest("rateLimitWindow needs rateLimitMax: the deliveries allowed per window")
    window = body.get("rateLimitWindow")
    if window is None:
        window = rate[1] if rate is not None else DEFAULT_RATE_WINDOW
    return {"max": count, "per": window}


def queue_document(name: str, config: QueueConfig, stats: QueueStats) -> dict[str, Any]:
    """A queue in SimpleQ's field names (never its signing secret)."""
    push = config.push
    rate = config.rate_limit
    return {
        "id": name,
        "name": name,
        "webhookUrl": None if push is None else redacted_url(push.url),
        "mode": None if push is None else push.mode,
        "concurrency": None if push is None else push.concurrency,
        "maxAttempts": config.max_attempts,
        "ackTimeout": None if push is None else push.ack_timeout,
        "ackTimeoutAction": None if push is None else push.ack_timeout_action,
        "backoffType": config.retry_backoff.type,
        "backoffDelay": config.retry_backoff.base,
        "rateLimitMax": None if rate is None else rate[0],
        "rateLimitWindow": None if rate is None else rate[1],
        "dlqEnabled": config.dead_letter is not None,
        "depth": stats.depth,
    }


def _is_simpleq(config: QueueConfig) -> bool:
    return config.push is not None and config.push.format == "simpleq"


# -- jobs: a message, its state and its attempts ----------------------------------------------------------


def attempts(view: MessageView, pushes: Sequence[Attempt]) -> list[dict[str, Any]]:
    """The job's attempts, oldest first: one per delivery in the message's history (a claim whose
    release gave its attempt back never reached a worker and is left out), with how it ended, and the
    receiver's HTTP status and error from the push history (``pushes``, the dispatcher's ``Attempt``
    list, which is in memory only and may have forgotten the oldest), matched to its delivery by lease:
    a push in progress has no entry yet, and a delivery by a native consumer none at all."""
    entries: list[dict[str, Any]] = []
    by_lease: dict[str, dict[str, Any]] = {}
    for at, record in view.history:
        if isinstance(record, Claimed):
            opened: dict[str, Any] = {
                "attempt": record.attempt,
                "status": "processing",
                "error": None,
                "webhookStatusCode": None,
                "timestamp": format_time(at),
            }
            entries.append(opened)
            by_lease[record.lease_id] = opened
            continue
        lease_id = getattr(record, "lease_id", None)
        if type(record) not in _ATTEMPT_ENDS or not isinstance(lease_id, str):
            continue  # e.g. an extend: the attempt goes on
        ended = by_lease.get(lease_id)  # a later record of the same lease has the last word
        if ended is None:
            continue
        if isinstance(record, Released) and record.refunded:  # never reached a worker
            entries = [entry for entry in entries if entry is not ended]
            continue
        ended["status"] = _ATTEMPT_ENDS[type(record)]
        reason = getattr(record, "reason", None)
        if isinstance(record, Nacked | Deferred | DeadLettered) and reason is not None:
            ended["error"] = ended["error"] if isinstance(record, DeadLettered) and ended["error"] else reason
    for push in pushes:
        entry = by_lease.get(push.lease_id)
        if entry is None or push.outcome == "ack_timeout":  # the timeout's entry: no answer of a receiver
            continue
        entry["webhookStatusCode"] = push.status
        if push.error is not None and entry["error"] is None:
            entry["error"] = push.error
        if push.outcome == "awaiting_ack" and entry["status"] == "processing":
            entry["status"] = "awaiting_ack"
    return entries


def job_state(view: MessageView, tried: Sequence[Mapping[str, Any]]) -> str:
    if view.state is State.IN_FLIGHT and tried and tried[-1]["status"] == "awaiting_ack":
        return "awaiting_ack"
    if view.state is State.DEAD_LETTERED:
        for _, record in reversed(view.history):
            if isinstance(record, DeadLettered):
                return "dead" if record.to is not None else "failed"
    return _JOB_STATES[view.state]


def job_document(
    queue: str, config: QueueConfig, view: MessageView, pushes: Sequence[Attempt]
) -> dict[str, Any]:
    tried = attempts(view, pushes)
    document: dict[str, Any] = {
        "id": view.id,
        "queue": queue,
        "state": job_state(view, tried),
        "payload": None,
        "idempotencyKey": view.key,
        "attempt": view.attempt,
        "maxAttempts": config.max_attempts,
        "createdAt": format_time(view.published_at),
        "runAt": None if view.available_at is None else format_time(view.available_at),
        "attempts": tried,
    }
    render_payload(document, view.payload, view.binary)
    return document


def render_payload(out: dict[str, Any], payload: bytes | None, binary: bool) -> None:
    if payload is None:  # a finished job's, let go: its payload stays null
        return
    if binary:
        out["payload"] = base64.b64encode(payload).decode()
        out["payloadEncoding"] = "base64"
    else:
        out["payload"] = orjson.Fragment(payload)


def dlq_entry(view: MessageView) -> dict[str, Any]:
    """One message of a dead-letter queue as a DLQ entry."""
    headers = view.headers or {}
    attempts_text = headers.get(DEAD_LETTER_ATTEMPTS, "")
    entry: dict[str, Any] = {
        "id": view.id,
        "jobId": headers.get(ORIGINAL_ID, view.id),
        "queue": headers.get(DEAD_LETTER_FROM),
        "payload": None,
        # Any publisher may set the header: "²" passes str.isdigit, and int() raises past 4300 digits.
        "attempts": int(attempts_text) if parse.QUERY_INTEGER.fullmatch(attempts_text) else None,
        "reason": headers.get(DEAD_LETTER_REASON),
        "idempotencyKey": view.key,
        "failedAt": format_time(view.published_at),
        "state": "retrying" if view.state is State.IN_FLIGHT else "dead",
    }
    render_payload(entry, view.payload, view.binary)
    return entry


def register(
    app: QuartTrio, registry: Registry, supervisor: PushSupervisor, limits: Limits | None = None
) -> None:
    limits = limits or Limits()

    async def describe(name: str) -> dict[str, Any]:
        actor = registry.get(name)
        return queue_document(name, actor.config, await actor.stats())

    async def ask_job_queue(job_id: str, command: Command) -> tuple[str, Any]:
        """The queue that has (or had) the job, and its answer to ``command``, a read of the job that
        raises ``MessageNotFound`` when the queue does not have it (``GetMessage``, ``FindDelivery``)."""
        for name in await registry.holding(job_id):
            try:
                answer = await registry.get(name).request(command)
            except (MessageNotFound, QueueNotFound):
                continue
            return name, answer
        raise MessageNotFound(f"job {quoted_value(job_id)} not found")

    async def find_job(job_id: str) -> tuple[str, MessageView]:
        """The queue that has (or had) the job, and its message."""
        queue, view = await ask_job_queue(job_id, GetMessage(job_id))
        return queue, view

    async def job_answer(queue: str, view: MessageView) -> dict[str, Any]:
        config = registry.get(queue).config
        return job_document(queue, config, view, supervisor.history(queue, view.id) or [])

    def dead_letter_queue(queue: str) -> str | None:
        """The queue's dead-letter queue, when it has one that exists (it is made on demand)."""
        name = registry.get(queue).config.dead_letter_queue(queue)
        return name if name is not None and name in registry else None

    async def dlq_views(queue: str, dlq: str, limit: int, after: int) -> tuple[list[MessageView], int]:
        """Of the first ``limit`` messages of ``dlq`` after ``after``, those that came from ``queue``,
        and the seq the next page starts after (0: none). Only those its dead-lettering marked as from
        ``queue`` (``QueueCore.browse_dead_letters``): the route needs ``read:<queue>``, not a scope on
        ``dlq``, which may be shared and hold messages published into it directly."""
        page: DeadLetterPage = await registry.get(dlq).request(BrowseDeadLetters(queue, limit, after))
        return page.views, page.after

    async def dlq_entries(queue: str, dlq: str, job_ids: Sequence[str]) -> DeadLetterLookup:
        """Each asked id → the id of its entry in ``dlq`` (an entry's own id, or the id of the job it
        was), among the entries from ``queue`` only, as ``dlq_views`` shows them; and which of the ids
        with none name an entry already retried (``QueueCore.find_dead_letters``)."""
        lookup: DeadLetterLookup = await registry.get(dlq).request(FindDeadLetters(queue, job_ids))
        return lookup

    # -- queues ------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/v1/queues")
    async def simpleq_create_queue() -> Response:
        body = await object_body()
        parse.known_fields(body, _CREATE_FIELDS, "the queue")
        name = body.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("name is required: the queue's name")
        check_queue_name(name, "name")
        if name in registry:
            raise Conflict(f"queue {name!r} exists; change it with PUT /v1/queues/{name}")
        try:
            reply = registry.create(name, native_changes(name, body, None))
        except InvalidRequest as error:
            raise _simpleq_names(error) from None
        await reply.wait()
        answer = await describe(name)
        push = registry.get(name).config.push
        answer["signingSecret"] = None if push is None else push.secret
        return json_response(answer, 201)

    @app.get(f"{PREFIX}/v1/queues")
    async def simpleq_list_queues() -> Response:
        grant = grant_of(request.scope)
        wanted = None if grant is None else lambda name: grant.may("read", name)
        queues = [
            queue_document(actor.name, actor.config, stats)
            async for actor, stats in registry.each_with_stats(wanted)
            if _is_simpleq(actor.config)
        ]
        return json_response(queues)

    @app.get(f"{PREFIX}/v1/queues/<queue>")
    async def simpleq_get_queue(queue: str) -> Response:
        return json_response(await describe(queue))

    @app.put(f"{PREFIX}/v1/queues/<queue>")
    async def simpleq_update_queue(queue: str) -> Response:
        actor = registry.get(queue)
        body = await object_body()
        if "name" in body and body["name"] != queue:
            raise InvalidRequest("name cannot be changed after creation")
        parse.known_fields(body, _UPDATE_FIELDS | {"name"}, "the queue update")
        try:
            changes = native_changes(queue, body, actor.config)
            if changes:
                await actor.request(UpdateConfig(changes))
        except InvalidRequest as error:
            raise _simpleq_names(error) from None
        answer = await describe(queue)
        push = actor.config.push
        answer["signingSecret"] = None if push is None else push.secret  # as SimpleQ's PUT answers
        return json_response(answer)

    @app.delete(f"{PREFIX}/v1/queues/<queue>")
    async def simpleq_delete_queue(queue: str) -> Response:
        await registry.delete(queue).wait()
        return no_content()

    # -- jobs ----------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/v1/queues/<queue>/jobs")
    async def simpleq_publish(queue: str) -> Response:
        actor = registry.get(queue)
        body, from_cbor = await object_body_with_cbor_flag()
        parse.known_fields(body, {"payload", "idempotencyKey", "delay"}, "the job")
        if not isinstance(body.get("payload"), Mapping):
            raise InvalidRequest("payload is required: a JSON object, delivered as it is")
        message: dict[str, Any] = {"payload": body["payload"]}
        if body.get("idempotencyKey") is not None:
            message["key"] = body["idempotencyKey"]
        if body.get("delay") is not None:
            message["delay"] = parse_duration(body["delay"], "delay", high=MAX_DELAY)
        try:
            command = parse.publish(message, limits, from_cbor)
        except (InvalidRequest, PayloadTooLarge) as error:
            raise _simpleq_job_names(error) from None
        refs: list[PublishedRef] = await actor.request(command)
        job_id, _, outcome = refs[0]
        status = 200 if outcome == DUPLICATE else 201
        if outcome != DUPLICATE or may("read", queue):
            try:
                view: MessageView = await actor.request(GetMessage(job_id))
            except MessageNotFound:
                pass  # finished and let go (``finished_history``), as the job a key matched may be
            else:
                return json_response(await job_answer(queue, view), status)
        # Its id, and the key the caller sent, as the native publish answers a duplicate: the job is
        # gone, or the one the key matched is not the caller's to read (payload, state, attempts).
        return json_response({"id": job_id, "queue": queue, "idempotencyKey": message.get("key")}, status)

    @app.get(f"{PREFIX}/v1/jobs/<message_id>")
    async def simpleq_get_job(message_id: str) -> Response:
        queue, view = await find_job(message_id)
        require_scope_by_id("read", queue, MessageNotFound(f"job {quoted_value(message_id)} not found"))
        return json_response(await job_answer(queue, view))

    async def delivery_of_attempt(job_id: str, attempt: int) -> str:
        """The lease of the job's latest push whose envelope said ``attempt``: the delivery a callback
        naming that attempt answers. Refused (400) when the job has no such push in its history, which
        then settles nothing."""
        lookup = FindDelivery(job_id, PUSH_CONSUMER, attempt)
        queue, found = await ask_job_queue(job_id, lookup)  # 404 when there is no such job at all
        require_scope_by_id("consume", queue, MessageNotFound(f"job {quoted_value(job_id)} not found"))
        delivery: DeliveryLookup = found
        if delivery.lease_id is not None:
            return delivery.lease_id
        raise InvalidRequest(
            f"job {quoted_value(job_id)} has no push of attempt {attempt} to answer "
            f"(its attempt is {delivery.attempt}); nothing was settled"
        )

    async def callback(
        job_id: str, verb: str, command: Callable[[Sequence[str]], Command], body: Mapping[str, Any]
    ) -> Response:
        """Carry out a callback. With ``attempt`` (the push envelope's, an extension: SimpleQ's callbacks
        name only the job), it answers that push only: once the job was pushed again, a retried callback
        is answered from what became of its own push and settles nothing (docs/compat.md)."""
        attempt = body.get("attempt")
        if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1):
            raise InvalidRequest("attempt must be the push envelope's attempt, an integer from 1")
        lease_id = None if attempt is None else await delivery_of_attempt(job_id, attempt)
        try:
            answer = await settle_callback(supervisor, job_id, verb, command, lease_id)
        except MessageNotFound:
            queue, view = await find_job(job_id)  # 404 when there is no such job at all
            require_scope_by_id("consume", queue, MessageNotFound(f"job {quoted_value(job_id)} not found"))
            push = registry.get(queue).config.push
            if push is None or push.mode != "ack":
                raise InvalidRequest(
                    f"job {quoted_value(job_id)} is in queue {queue!r}, which does not use ack mode"
                ) from None
            state = job_state(view, attempts(view, supervisor.history(queue, job_id) or []))
            raise InvalidRequest(
                f"job {quoted_value(job_id)} is not awaiting ack; its state is {state}"
            ) from None
        except Conflict as error:
            raise InvalidRequest(f"{error.message}; the job is not awaiting ack") from None
        queue = answer["queue"]
        view = await registry.get(queue).request(GetMessage(job_id))
        return json_response(await job_answer(queue, view))

    @app.post(f"{PREFIX}/v1/jobs/<message_id>/ack")
    async def simpleq_ack(message_id: str) -> Response:
        body = await object_body()
        parse.known_fields(body, {"attempt"}, "the ack")
        return await callback(message_id, "ack", Ack, body)

    @app.post(f"{PREFIX}/v1/jobs/<message_id>/nack")
    async def simpleq_nack(message_id: str) -> Response:
        body = await object_body()
        parse.known_fields(body, {"retryable", "reason", "attempt"}, "the nack")
        retryable = body.get("retryable", True)
        if not isinstance(retryable, bool):
            raise InvalidRequest("retryable must be true or false")
        why = parse.reason(body, limits)
        return await callback(
            message_id, "nack", lambda leases: Nack(leases, reason=why, retryable=retryable), body
        )

    @app.post(f"{PREFIX}/v1/jobs/<message_id>/defer")
    async def simpleq_defer(message_id: str) -> Response:
        body = await object_body()
        parse.known_fields(body, {"retryAfter", "reason", "attempt"}, "the defer")
        if "retryAfter" not in body:
            raise InvalidRequest(
                f"retryAfter is required: seconds (0 to {MAX_RETRY_AFTER:g}) to hold the job"
            )
        # A number, or the text a worker passes through from a provider (a Retry-After header's "30",
        # Gemini's retryDelay "30s"), as SimpleQ's backpressure guide tells it to.
        seconds = parse_duration(body["retryAfter"], "retryAfter", high=MAX_RETRY_AFTER)
        why = parse.reason(body, limits)
        return await callback(message_id, "defer", lambda leases: Defer(leases, seconds, why), body)

    # -- the dead-letter queue -----------------------------------------------------------------------

    @app.get(f"{PREFIX}/v1/queues/<queue>/dlq")
    async def simpleq_dlq(queue: str) -> Response:
        dlq = dead_letter_queue(queue)
        limit = parse.query_integer(request.args, "limit", 100, 1, 1000)
        cursor = parse.query_integer(request.args, "cursor", 0, 0, 2**63)
        if dlq is None:
            return json_response({"data": [], "nextCursor": None})
        views, after = await dlq_views(queue, dlq, limit, cursor)
        return json_response(
            {"data": [dlq_entry(view) for view in views], "nextCursor": str(after) if after else None}
        )

    @app.post(f"{PREFIX}/v1/queues/<queue>/dlq/<message_id>/retry")
    async def simpleq_dlq_retry(queue: str, message_id: str) -> Response:
        dlq = dead_letter_queue(queue)
        if dlq is None:
            raise MessageNotFound(f"queue {queue!r} has no dead-letter job {quoted_value(message_id)}")
        found = await dlq_entries(queue, dlq, [message_id])
        if message_id not in found.entries:
            if message_id in found.redriven:
                raise Conflict(f"dead-letter job {quoted_value(message_id)} was already retried")
            raise MessageNotFound(f"queue {queue!r} has no dead-letter job {quoted_value(message_id)}")
        entry_id = found.entries[message_id]
        outcome = await registry.redrive(dlq, [entry_id], queue)
        if not outcome.redriven:
            why = outcome.skipped[0][1] if outcome.skipped else "gone"
            raise Conflict(f"dead-letter job {quoted_value(message_id)} was not retried ({why})")
        return json_response({"id": entry_id, "queue": queue, "retried": 1}, 201)

    @app.post(f"{PREFIX}/v1/queues/<queue>/dlq/retry")
    async def simpleq_dlq_retry_bulk(queue: str) -> Response:
        body = await object_body()
        parse.known_fields(body, {"jobIds", "all"}, "the bulk retry")
        every = body.get("all", False)
        if not isinstance(every, bool):
            raise InvalidRequest("all must be true or false")
        job_ids = body.get("jobIds")
        if (job_ids is not None) == every:
            raise InvalidRequest('say which jobs to retry: either "jobIds": [...] or "all": true')
        if job_ids is not None and (
            not isinstance(job_ids, list)
            or not job_ids
            or not all(isinstance(item, str) for item in job_ids)
            or len(job_ids) > MAX_BULK_RETRY
        ):
            raise InvalidRequest(f"jobIds must be an array of 1 to {MAX_BULK_RETRY} job id strings")
        dlq = dead_letter_queue(queue)
        if dlq is None:
            return json_response({"retried": 0, "notFound": list(job_ids or []), "skipped": []})
        entries: Mapping[str, str]
        if job_ids is None:
            views, _ = await dlq_views(queue, dlq, MAX_BULK_RETRY, 0)
            entries = {view.id: view.id for view in views}
            job_ids = list(entries)
        else:
            entries = (await dlq_entries(queue, dlq, job_ids)).entries
        not_found = [job_id for job_id in dict.fromkeys(job_ids) if job_id not in entries]
        retried = 0
        skipped: list[dict[str, str]] = []
        if entries:
            outcome = await registry.redrive(dlq, list(dict.fromkeys(entries.values())), queue)
            retried = outcome.redriven
            skipped = [{"id": entry, "reason": why} for entry, why in outcome.skipped]
        return json_response({"retried": retried, "notFound": not_found, "skipped": skipped})


__all__ = ["PREFIX", "register"]
