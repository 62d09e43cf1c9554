"""Cloudflare Queues' HTTP pull consumer API, under ``/compat/cloudflare`` (docs/compat.md): a pull
consumer written for Cloudflare works against this broker once its API base URL is
``http://<broker>/compat/cloudflare/client/v4``. The account id in the path is accepted and ignored;
the queue id is the broker's queue name.

* ``POST …/queues/{queue}/messages/pull`` ``{"batch_size", "visibility_timeout_ms"}`` → ``Claim``
  (no wait: Cloudflare short-polls).
* ``POST …/queues/{queue}/messages/ack`` ``{"acks": [{lease_id}], "retries": [{lease_id,
  delay_seconds}]}`` → ``Ack``; for the acks it skipped, ``FindLeases`` and one more ``Ack`` (late
  acks, below); and ``Nack`` per distinct delay. Each lease once, and one warning per lease that
  settled nothing.

Every answer is Cloudflare's envelope ``{"success", "errors", "messages", "result"}``, errors included
(those the token gate answers before a route runs keep the broker's error body).

A ``lease_id`` handed out here is opaque: the message id and the broker's lease id, base64url-encoded.
Cloudflare accepts an ack after the visibility timeout, even when the message went to another consumer
meanwhile; so an ack whose lease is no longer current settles the lease of the message's latest
delivery instead, which its queue's core names (``QueueCore.find_leases``: all the late acks of a call
in one command, settled together with one ``Ack``). A retry of a lease that is no longer current is
skipped with a warning: the message is already back in circulation.

Bodies follow Cloudflare's content types: a JSON string is ``text`` (sent as is), bytes are ``bytes``
and any other JSON value is ``json`` (both base64); a ``cf-content-type`` message header of ``json`` or
``bytes`` overrides the guess. ``metadata["CF-Content-Type"]`` says which, as Cloudflare's does.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from broker.actor import QueueActor
from broker.config import Limits
from broker.core import ClaimOutcome, SettleOutcome
from broker.core.commands import Ack, Claim, FindLeases, Nack
from broker.core.durations import parse_duration
from broker.core.model import Delivery
from broker.errors import BrokerError, InvalidRequest, quoted
from broker.http import parse
from broker.http.auth import grant_of
from broker.http.compat_io import object_body
from broker.http.observe import bind_request
from broker.http.render import error_answer
from broker.registry import Registry
from broker.storage.codec import check_plain_json

PREFIX = "/compat/cloudflare"
_QUEUE = f"{PREFIX}/client/v4/accounts/<account>/queues/<queue>/messages"
DEFAULT_BATCH = 5
MAX_BATCH = 100
#: Cloudflare's visibility timeout is at most 12 hours; the broker's lease is at least 0.1 s.
MAX_VISIBILITY_MS = 43_200_000
MIN_VISIBILITY_MS = 100
#: Cloudflare's longest retry delay (12 hours).
MAX_RETRY_DELAY = 43_200.0
CONTENT_TYPE_HEADER = "cf-content-type"


def envelope(result: Any, status: int = 200, errors: list[dict[str, Any]] | None = None) -> Response:
    body = {"success": not errors, "errors": errors or [], "messages": [], "result": result}
    return Response(orjson.dumps(body), status, content_type=parse.JSON)


def error_envelope(error: BrokerError | HTTPException) -> Response:
    """A refusal in Cloudflare's shape; ``code`` is the HTTP status (Cloudflare's own numbers are its
    API's), the message starts with the broker's snake_case code (the one its error body would have:
    ``payload_too_large`` for a 413, not werkzeug's name for it)."""
    status, body, _ = error_answer(error, request.method, request.path)
    text = f"{body['error']['code']}: {body['error']['message']}"
    return envelope(None, status, [{"code": status, "message": text}])


def lease_token(message_id: str, lease_id: str) -> str:
    """The opaque ``lease_id`` this surface hands out: both ids, so a late ack can find the message."""
    raw = orjson.dumps([message_id, lease_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def parse_lease_token(token: Any) -> tuple[str, str] | None:
    """``(message id, lease id)`` from a ``lease_token``; ``None`` for anything else."""
    if not isinstance(token, str) or not token:
        return None
    try:
        decoded = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError):
        return None
    if (
        isinstance(decoded, list)
        and len(decoded) == 2
        and all(isinstance(part, str) and part for part in decoded)
    ):
        return decoded[0], decoded[1]
    return None


def content_type(item: Delivery) -> str:
    _, stored = item
    override = (stored.headers or {}).get(CONTENT_TYPE_HEADER)
    if override in ("json", "bytes"):
        return override
    if stored.binary:
        return "bytes"
    return "text" if stored.payload.startswith(b'"') else "json"


def message(item: Delivery) -> dict[str, Any]:
    claimed, stored = item
    kind = content_type(item)
    # text goes as the string itself; json and bytes as base64 of what was stored
    body = orjson.loads(stored.payload) if kind == "text" else base64.b64encode(stored.payload).decode()
    return {
        "id": stored.id,
        "body": body,
        "timestamp_ms": round(stored.published_at * 1000),
        "attempts": claimed.attempt,
        "lease_id": lease_token(stored.id, claimed.lease_id),
        "metadata": {"CF-Content-Type": kind},
    }


def _batch_size(body: Mapping[str, Any]) -> int:
    value = body.get("batch_size", DEFAULT_BATCH)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH:
        raise InvalidRequest(f"batch_size must be an integer from 1 to {MAX_BATCH}")
    return value


def _visibility(body: Mapping[str, Any]) -> float | None:
    """The lease in seconds, from milliseconds (``visibility_timeout_ms``, or the older
    ``visibility_timeout``, also milliseconds); ``None``: the queue's own lease."""
    for field in ("visibility_timeout_ms", "visibility_timeout"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{field} must be a number of milliseconds")
        if not MIN_VISIBILITY_MS <= value <= MAX_VISIBILITY_MS:
            raise InvalidRequest(
                f"{field} must be between {MIN_VISIBILITY_MS} and {MAX_VISIBILITY_MS} milliseconds"
            )
        return value / 1000
    return None


def _entries(body: Mapping[str, Any], field: str, limits: Limits) -> list[Mapping[str, Any]]:
    entries = body.get(field, [])
    if not isinstance(entries, list) or not all(
        isinstance(entry, Mapping) and "lease_id" in entry for entry in entries
    ):
        raise InvalidRequest(f'{field} must be an array of {{"lease_id": …}} objects')
    if len(entries) > limits.max_batch:
        raise InvalidRequest(f"{field} holds at most {limits.max_batch} entries, not {len(entries)}")
    return entries


def _delay(entry: Mapping[str, Any]) -> float | None:
    value = entry.get("delay_seconds")
    return None if value is None else parse_duration(value, "delay_seconds", high=MAX_RETRY_DELAY)


def shown(value: Any) -> str:
    """A value a client sent, for a warning: as JSON (``null``, ``["a"]``), else its kind in angle
    brackets (``<bytes>``: CBOR holds values JSON has no text for, which orjson would refuse or, for
    NaN, dates and UUIDs, write as another value; and it writes no integer past 64 bits nor arrays
    nested past 254 levels). Cut short past ``QUOTED_CHARS``."""
    try:
        check_plain_json(value)
        return quoted(orjson.dumps(value).decode())
    except (TypeError, ValueError):  # orjson.JSONEncodeError is a TypeError
        return f"<{type(value).__name__}>"


def _identity(sent: Any) -> object:
    """What tells two sent lease ids apart, where ``shown`` may give two the same text (``<bytes>``, cut
    short): the value, or its JSON; anything else counts as distinct from every other id (a ``repr``
    of a list nested 1,000 deep raised ``RecursionError``)."""
    if isinstance(sent, str | bytes):
        return (type(sent), sent)
    try:
        check_plain_json(sent)
        return orjson.dumps(sent)
    except (TypeError, ValueError):  # orjson.JSONEncodeError is a TypeError
        return object()


def _distinct_leases(
    entries: list[Mapping[str, Any]],
    warnings: list[str],
    foreign: set[object],
    delays: list[float | None] | None = None,
) -> dict[tuple[str, str], float | None]:
    """The leases ``entries`` name, each once and in order, mapped to its (first) delay; a ``lease_id``
    this broker did not hand out is warned about once per call, in ``warnings`` (``foreign``: those
    warned about so far, acks and retries alike)."""
    leases: dict[tuple[str, str], float | None] = {}
    for index, entry in enumerate(entries):
        ids = parse_lease_token(entry["lease_id"])
        if ids is None:
            sent = entry["lease_id"]
            identity = _identity(sent)
            if identity not in foreign:
                foreign.add(identity)
                warnings.append(f"lease_id {shown(sent)} is not one this broker handed out")
        elif ids not in leases:
            leases[ids] = None if delays is None else delays[index]
    return leases


async def _settle_late(actor: QueueActor, late: list[tuple[str, str]], warnings: list[str]) -> int:
    """Late acks, of leases ``Ack`` skipped: each settles the lease of its message's latest delivery
    instead, as Cloudflare accepts an ack whichever delivery is current; how many did. The leases are
    found with one ``FindLeases`` and settled with one ``Ack``; a message's is counted for the first of
    its late acks only, and each late ack that settled nothing gets a warning, in order."""
    if not late:
        return 0
    latest: dict[str, str] = await actor.request(FindLeases([message_id for message_id, _ in late]))
    instead: list[str | None] = []  # what each late ack settles: None if its message has no other lease
    for message_id, lease in late:
        current = latest.get(message_id)
        instead.append(None if current == lease else current)
    chosen = list(dict.fromkeys(current for current in instead if current is not None))
    settled: set[str] = set()
    if chosen:
        outcome: SettleOutcome = await actor.request(Ack(chosen))
        settled = set(chosen).difference(outcome.skipped)
    acked = 0
    for current, (message_id, lease) in zip(instead, late, strict=True):
        if current is not None and current in settled:
            settled.discard(current)  # one delivery acked once: for the first late ack of its message
            acked += 1
        else:
            # Whoever settled it: this consumer, another one (a retry, a nack: it may be queued again),
            # the dead-lettering of an expired lease, a delete or purge.
            warnings.append(
                f"lease_id {lease_token(message_id, lease)} settled nothing: message {message_id} "
                "was already acknowledged, put back in the queue, or removed"
            )
    return acked


View = Callable[[str, str], Awaitable[Response]]


def _in_envelope(view: View) -> View:
    """Answer the view's refusals in Cloudflare's envelope rather than the broker's error body."""

    async def wrapped(account: str, queue: str) -> Response:
        try:
            return await view(account, queue)
        except (BrokerError, HTTPException) as error:
            return error_envelope(error)

    wrapped.__name__ = view.__name__
    return wrapped


def register(app: QuartTrio, registry: Registry, limits: Limits | None = None) -> None:
    limits = limits or Limits()

    @_in_envelope
    async def cloudflare_pull(account: str, queue: str) -> Response:
        actor = registry.get(queue)
        body = await object_body()
        grant = grant_of(request.scope)
        consumer = "cloudflare" if grant is None else f"cloudflare:{grant.name}"
        bind_request(consumer=consumer)  # on the request's log lines (§10)
        claim = Claim(consumer, max_count=_batch_size(body), lease=_visibility(body))
        outcome: ClaimOutcome = await actor.request(claim)
        messages = [message(item) for item in outcome.deliveries]
        return envelope({"message_backlog_count": outcome.ready, "messages": messages})

    @_in_envelope
    async def cloudflare_ack(account: str, queue: str) -> Response:
        actor = registry.get(queue)
        body = await object_body()
        acks, retries = _entries(body, "acks", limits), _entries(body, "retries", limits)
        delays = [_delay(entry) for entry in retries]  # every one checked before anything settles
        warnings: list[str] = []
        # Each lease once (the first retry of it gives the delay), so each is settled, counted and warned
        # about once; one both acked and retried is acked, and its retry then warned about.
        foreign: set[object] = set()
        to_ack = _distinct_leases(acks, warnings, foreign)
        to_retry = _distinct_leases(retries, warnings, foreign, delays)

        acked = 0
        if to_ack:
            outcome: SettleOutcome = await actor.request(Ack([lease for _, lease in to_ack]))
            acked = outcome.settled
            late = [(message_id, lease) for message_id, lease in to_ack if lease in outcome.skipped]
            acked += await _settle_late(actor, late, warnings)

        retried = 0
        by_delay: dict[float | None, list[tuple[str, str]]] = {}
        for (message_id, lease), delay in to_retry.items():
            by_delay.setdefault(delay, []).append((message_id, lease))
        for delay, batch in by_delay.items():
            outcome = await actor.request(Nack([lease for _, lease in batch], delay=delay))
            retried += outcome.settled
            warnings += [
                f"lease_id {lease_token(message_id, lease)} is no longer current; not retried"
                for message_id, lease in batch
                if lease in outcome.skipped
            ]
        return envelope({"ackCount": acked, "retryCount": retried, "warnings": warnings})

    app.add_url_rule(f"{_QUEUE}/pull", "cloudflare_pull", cloudflare_pull, methods=["POST"])
    app.add_url_rule(f"{_QUEUE}/ack", "cloudflare_ack", cloudflare_ack, methods=["POST"])


__all__ = ["PREFIX", "register"]
