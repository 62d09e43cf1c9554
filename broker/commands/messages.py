"""``broker publish`` and ``broker consume``."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any

import httpx

from broker.client import BrokerError, Client, Delivery, Message, Published, Settled
from broker.client.worker import LEASE_RANGE, MAX_NACK_DELAY, MAX_REASON
from broker.commands.exits import CommandError, bad_input, exit_for
from broker.commands.output import Output, StdoutFailed, payload_text
from broker.commands.queues import PAGE, duration, read_json

#: A publish request stays well under the broker's 16 MiB body limit.
BATCH_BYTES = 8 * 1024 * 1024
#: The fields a line of ``--file … --envelope`` may have (a message of §4).
ENVELOPE_FIELDS = frozenset(
    {"payload", "payload_encoding", "headers", "key", "on_duplicate", "delay", "priority"}
)
#: ``consume --print-only`` claims under this lease unless ``--lease`` says otherwise: if the command
#: dies before it gives the messages back, they are claimable again this soon.
PRINT_ONLY_LEASE = 60.0
CONSUMER = "broker-cli"


# -- publish ------------------------------------------------------------------------------------------


def _headers(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    headers = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise bad_input(f"--header {pair!r}: expected NAME=VALUE")
        headers[name] = value
    return headers


def _payload(text: str, where: str) -> Any:
    return read_json(text, where, hint=" (a string needs quotes: '\"hello\"')")


def _envelope(value: Any, where: str) -> Message:
    if not isinstance(value, dict) or "payload" not in value:
        raise bad_input(f"{where}: with --envelope every line is an object with a payload")
    unknown = set(value) - ENVELOPE_FIELDS
    if unknown:
        raise bad_input(f"{where}: unknown fields {', '.join(sorted(unknown))}")
    payload = value["payload"]
    if value.get("payload_encoding") == "base64":
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, TypeError):
            raise bad_input(f"{where}: the payload is not base64") from None
    return Message(
        payload,
        headers=value.get("headers"),
        key=value.get("key"),
        delay=value.get("delay"),
        priority=value.get("priority"),
        on_duplicate=value.get("on_duplicate"),
    )


def read_messages(stream: IO[str], name: str, args: argparse.Namespace) -> list[Message]:
    """Every line of a JSON Lines file as a message, all checked before anything is sent."""
    headers = _headers(args.header)
    delay = None if args.delay is None else duration(args.delay, "--delay")
    messages = []
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        value = _payload(line, f"{name} line {number}")
        if args.envelope:
            message = _envelope(value, f"{name} line {number}")
            messages.append(
                Message(
                    message.payload,
                    headers=message.headers if message.headers is not None else headers,
                    key=message.key,
                    delay=message.delay if message.delay is not None else delay,
                    priority=message.priority if message.priority is not None else args.priority,
                    on_duplicate=message.on_duplicate,
                )
            )
        else:
            messages.append(Message(value, headers=headers, delay=delay, priority=args.priority))
    return messages


def _batches(messages: list[Message]) -> Iterator[list[Message]]:
    batch: list[Message] = []
    size = 0
    for message in messages:
        estimate = len(json.dumps(message.to_json())) + 1
        if batch and (len(batch) == PAGE or size + estimate > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(message)
        size += estimate
    if batch:
        yield batch


def _published_json(refs: list[Published]) -> list[dict[str, Any]]:
    return [
        {
            "id": ref.id,
            "seq": ref.seq,
            "duplicate": ref.duplicate,
            **({"replaced": True} if ref.replaced else {}),
        }
        for ref in refs
    ]


def publish(client: Client, args: argparse.Namespace, out: Output) -> None:
    if args.file is None:
        payload = _payload(args.payload, "--payload")
        refs = [
            client.publish(
                args.name,
                payload,
                headers=_headers(args.header),
                key=args.key,
                delay=None if args.delay is None else duration(args.delay, "--delay"),
                priority=args.priority,
            )
        ]
    else:
        if args.key is not None:
            raise bad_input("--key names one message: with --file, put keys in the lines (--envelope)")
        messages = _read_file(args.file, args)
        refs = []
        with out.progress(f"publishing to {args.name}", len(messages)) as advance:
            for batch in _batches(messages):
                try:
                    refs.extend(client.publish_batch(args.name, batch))
                except BrokerError as error:
                    if not refs:
                        raise
                    done = f"the first {len(refs)} of {len(messages)} were published"
                    note = f"{error.message.rstrip('.')} ({done})"
                    raise CommandError(error.code, note, exit_for(error.code)) from None
                advance(len(batch))
    duplicates = sum(ref.duplicate for ref in refs)
    if out.as_json:
        out.json({"queue": args.name, "published": len(refs) - duplicates, "messages": _published_json(refs)})
        return
    if args.file is None:
        [ref] = refs
        what = "duplicate of" if ref.duplicate else "published"
        out.line(f"{what} {ref.id} (seq {ref.seq}) in {args.name}")
    else:
        extra = f" ({duplicates} duplicates)" if duplicates else ""
        out.line(f"published {len(refs) - duplicates} messages to {args.name}{extra}")


def _read_file(path: str, args: argparse.Namespace) -> list[Message]:
    if path == "-":
        return read_messages(sys.stdin, "stdin", args)
    try:
        with open(path, encoding="utf-8") as stream:
            return read_messages(stream, path, args)
    except OSError as error:
        raise bad_input(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise bad_input(f"{path} is not UTF-8 text") from None


# -- consume ------------------------------------------------------------------------------------------


def _settle(
    client: Client, args: argparse.Namespace, action: str, deliveries: Sequence[Delivery], delay: float | None
) -> Settled:
    if action == "ack":
        return client.ack(args.name, deliveries)
    if action == "nack":
        return client.nack(args.name, deliveries, delay=delay, reason=args.reason)
    return client.defer(args.name, deliveries, 0, reason=args.reason)


def _give_back(client: Client, queue: str, deliveries: Sequence[Delivery]) -> str:
    """Defer ``deliveries`` for 0 s with no reason (nothing the broker could refuse): claimable again
    at once, no attempt spent. Says how it went, for the error that made ``consume`` stop."""
    claimed = f"{len(deliveries)} message{'' if len(deliveries) == 1 else 's'} claimed"
    try:
        for start in range(0, len(deliveries), PAGE):
            client.defer(queue, deliveries[start : start + PAGE], 0)
    except (BrokerError, httpx.HTTPError, ValueError):
        return f"the {claimed} could not be given back: they return when their lease ends"
    return f"the {claimed} {'was' if len(deliveries) == 1 else 'were'} given back, no attempt spent"


def _show(out: Output, claimed: Sequence[Delivery]) -> None:
    rows = [
        [d.id, d.seq, d.attempt, d.priority, d.key, d.published_at, payload_text(delivery_json(d))]
        for d in claimed
    ]
    columns = ["id", "seq", "attempt", "priority", "key", "published", "payload"]
    out.table(columns, rows, right=["seq", "attempt", "priority"], shrink=["key", "payload"])


def delivery_json(delivery: Delivery) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": delivery.id,
        "seq": delivery.seq,
        "lease_id": delivery.lease_id,
        "lease_deadline": delivery.lease_deadline,
        "attempt": delivery.attempt,
        "payload": delivery.payload,
        "headers": dict(delivery.headers),
        "key": delivery.key,
        "priority": delivery.priority,
        "published_at": delivery.published_at,
    }
    if isinstance(delivery.payload, bytes):
        document["payload"] = base64.b64encode(delivery.payload).decode()
        document["payload_encoding"] = "base64"
    return document


def consume(client: Client, args: argparse.Namespace, out: Output) -> None:
    """Claim up to ``--max`` messages, show them, then settle them all at once: ``--ack``, ``--nack``,
    or (the default) ``--print-only``, which defers them for 0 s: back at once, attempt refunded.
    Settling only at the end keeps a message given back from being claimed again by this same run.

    The flags are checked before the first claim; if a claim or a settle still fails (a broker whose
    ``max_reason_length`` is below the default refuses ``--reason``), what was claimed and not settled
    is given back before the error is reported, so no message is left leased, to come back at lease
    expiry with an attempt spent."""
    action = "ack" if args.ack else "nack" if args.nack else "print-only"
    # The broker's ranges (as the worker knows them), checked before anything is claimed.
    lease = (
        None
        if args.lease is None
        else duration(args.lease, "--lease", low=LEASE_RANGE[0], high=LEASE_RANGE[1])
    )
    if action == "print-only" and lease is None:
        lease = PRINT_ONLY_LEASE
    delay = None if args.delay is None else duration(args.delay, "--delay", low=0, high=MAX_NACK_DELAY)
    if args.reason is not None and len(args.reason) > MAX_REASON:
        raise bad_input(f"--reason is {len(args.reason)} characters long: at most {MAX_REASON}")
    claimed: list[Delivery] = []
    unsettled = 0  # where the deliveries not settled yet start in ``claimed``
    settled = 0
    skipped: list[str] = []
    try:
        wait = args.wait
        with out.progress(f"claiming from {args.name}", args.max) as advance:
            while len(claimed) < args.max:
                result = client.claim(
                    args.name,
                    consumer=args.consumer,
                    max=min(PAGE, args.max - len(claimed)),
                    lease=lease,
                    wait=wait,
                )
                if not result.messages:
                    break
                claimed.extend(result.messages)
                advance(len(result.messages))
                wait = None  # only the first claim waits: then take what is ready and stop
        if claimed and not out.as_json:
            _show(out, claimed)  # before settling: an ack must not go to messages no one saw
        for start in range(0, len(claimed), PAGE):
            chunk = claimed[start : start + PAGE]
            answer = _settle(client, args, action, chunk, delay)
            unsettled = start + len(chunk)
            settled += answer.count
            skipped.extend(answer.skipped)
    except (StdoutFailed, KeyboardInterrupt):  # not shown, or stopped: not settled either
        _give_back(client, args.name, claimed[unsettled:])
        raise
    except (BrokerError, httpx.HTTPError, ValueError) as error:
        if unsettled == len(claimed):
            raise
        note = _give_back(client, args.name, claimed[unsettled:])
        if isinstance(error, BrokerError) and error.well_formed:
            message = f"{error.message.rstrip('.')} ({note})"
            raise CommandError(error.code, message, exit_for(error.code)) from None
        raise
    if out.as_json:
        out.json(
            {
                "queue": args.name,
                "action": action,
                "messages": [delivery_json(delivery) for delivery in claimed],
                "settled": settled,
                "skipped": skipped,
            }
        )
        return
    if not claimed:
        out.line(f"no messages ready in {args.name}")
        return
    done = {"ack": "acked", "nack": "nacked", "print-only": "given back (attempt refunded)"}[action]
    out.line(
        f"{done}: {settled} of {len(claimed)}"
        + (f"; skipped (lease lost): {len(skipped)}" if skipped else "")
    )
