"""``broker queues list | create | inspect | peek | dlq | redrive | purge | delete``."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from typing import Any, NoReturn

from broker.client import Client, QueueNotFound, durations
from broker.commands.exits import CommandError, Exit, bad_input
from broker.commands.output import Output, payload_text

#: What one browse or redrive call may carry (the broker's limit).
PAGE = 1000

STAT_COLUMNS = (
    ("ready", "ready"),
    ("delayed", "delayed"),
    ("in_flight", "in flight"),
    ("oldest_ready_age", "oldest ready (s)"),
    ("published_total", "published"),
    ("acked_total", "acked"),
    ("dead_lettered_total", "dead-lettered"),
)


def list_queues(client: Client, args: argparse.Namespace, out: Output) -> None:
    queues = client.list_queues()
    if out.as_json:
        out.json({"queues": queues})
        return
    if not queues:
        out.line("no queues")
        return
    names = [label for _, label in STAT_COLUMNS]
    rows = [[queue["name"], *(_age(queue["stats"], key) for key, _ in STAT_COLUMNS)] for queue in queues]
    out.table(["queue", *names], rows, right=names)


def _age(stats: dict[str, Any], key: str) -> Any:
    value = stats.get(key)
    return round(value, 1) if key == "oldest_ready_age" and value is not None else value


# -- create -------------------------------------------------------------------------------------------


def duration(text: str, flag: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    """A duration flag in seconds: a number, or a number with a unit (``250ms``, ``30s``, ``5m``,
    ``12h``, ``1d``). NaN, infinities and values outside ``low`` … ``high`` are bad input (exit 2) here,
    before anything is sent: the field's range is the broker's, for the flags that need it checked
    before a claim (``consume --delay``); the others it checks itself."""
    try:
        seconds = float(text)  # any number Python reads ("1e3"), sent as a number
    except ValueError:
        try:
            seconds = durations.seconds(text)  # the broker's grammar for a string
        except ValueError as error:
            raise bad_input(f"{flag} {error}") from None
    if not math.isfinite(seconds):
        raise bad_input(f"{flag} {text!r} is not a finite number of seconds")
    if not low <= seconds <= high:
        raise bad_input(f"{flag} {text!r} is out of range: {low:.15g} up to {high:.15g} seconds")
    return seconds + 0.0  # -0.0 is 0


class _NotFinite(Exception):
    """A JSON number Python would read as NaN or an infinity (``NaN``, ``Infinity``, ``1e400``)."""


def _constant(text: str) -> NoReturn:
    raise _NotFinite(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def read_json(text: str, where: str, hint: str = "") -> Any:
    """``text`` as JSON, or bad input naming ``where`` (``--payload``, ``stdin line 3``). NaN, Infinity
    and numbers beyond a float's range are refused: Python would read them, and send them as null."""
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except json.JSONDecodeError as error:
        raise bad_input(f"{where} is not valid JSON: {error}{hint}") from None
    except _NotFinite as error:
        raise bad_input(f"{where} is not valid JSON: {error} is not a finite number") from None


def queue_config(args: argparse.Namespace) -> dict[str, Any]:
    """The body of ``PUT /v1/queues/{queue}`` from ``--config JSON`` and the field flags (flags win)."""
    config: dict[str, Any] = {}
    if args.config is not None:
        parsed = read_json(args.config, "--config")
        if not isinstance(parsed, dict):
            raise bad_input("--config must be a JSON object, e.g. '{\"lease\": 30}'")
        config.update(parsed)
    for key in ("lease", "message_ttl", "claim_window", "dedup_window"):
        value = getattr(args, key)
        if value is not None:
            config[key] = duration(value, f"--{key.replace('_', '-')}")
    for key in ("max_attempts", "max_depth", "durable"):
        value = getattr(args, key)
        if value is not None:
            config[key] = value
    if args.dead_letter is not None:
        config["dead_letter"] = None if args.dead_letter.lower() == "none" else args.dead_letter
    if args.retry_backoff is not None:
        config["retry_backoff"] = _retry_backoff(args.retry_backoff)
    if args.rate_limit is not None:
        config["rate_limit"] = _rate_limit(args.rate_limit)
    return config


def _retry_backoff(text: str) -> dict[str, Any]:
    """``fixed:BASE`` or ``exponential:BASE[:MAX]`` (``exponential:1s:5m``)."""
    kind, *rest = text.split(":")
    if kind not in ("fixed", "exponential") or len(rest) > 2:
        raise bad_input(f"--retry-backoff {text!r}: expected fixed:BASE or exponential:BASE[:MAX]")
    backoff: dict[str, Any] = {"type": kind}
    for name, value in zip(("base", "max"), rest, strict=False):
        backoff[name] = duration(value, f"--retry-backoff {name}")
    return backoff


def _rate_limit(text: str) -> dict[str, Any] | None:
    """``N/PER`` (``100/1s``: at most 100 deliveries a second), or ``none``."""
    if text.lower() == "none":
        return None
    count, _, per = text.partition("/")
    try:
        most = int(count)
    except ValueError:
        raise bad_input(f"--rate-limit {text!r}: expected N/PER, e.g. 100/1s, or none") from None
    return {"max": most, "per": duration(per or "1", "--rate-limit PER")}


def create(client: Client, args: argparse.Namespace, out: Output) -> None:
    created, queue = client.put_queue(args.name, **queue_config(args))
    if out.as_json:
        out.json({"created": created, **queue})
        return
    out.line(f"{'created' if created else 'updated'} queue {queue['name']}")
    out.fields(queue["config"].items())


# -- reading ------------------------------------------------------------------------------------------


def browse(client: Client, queue: str, state: str, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` live messages in seq order, a page of at most 1000 per call."""
    found: list[dict[str, Any]] = []
    after = 0
    while len(found) < limit:
        page = client.browse(queue, state=state, limit=min(PAGE, limit - len(found)), after=after)
        found.extend(page)
        if len(page) < min(PAGE, limit - len(found) + len(page)):
            break
        after = page[-1]["seq"]
    return found


def all_messages(client: Client, queue: str) -> Iterator[dict[str, Any]]:
    after = 0
    while True:
        page = client.browse(queue, state="all", limit=PAGE, after=after)
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1]["seq"]


def message_rows(messages: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            m["id"],
            m["seq"],
            m["state"],
            m["attempt"],
            m["priority"],
            m["key"],
            m["published_at"],
            payload_text(m),
        ]
        for m in messages
    ]


MESSAGE_COLUMNS = ["id", "seq", "state", "attempt", "priority", "key", "published", "payload"]


def _messages_table(out: Output, messages: list[dict[str, Any]], empty: str) -> None:
    if messages:
        out.table(
            MESSAGE_COLUMNS,
            message_rows(messages),
            right=["seq", "attempt", "priority"],
            shrink=["key", "payload"],
        )
    else:
        out.line(empty)


def inspect(client: Client, args: argparse.Namespace, out: Output) -> None:
    queue = client.get_queue(args.name)
    messages = browse(client, args.name, "all", args.limit) if args.limit > 0 else []
    if out.as_json:
        out.json({**queue, "messages": messages})
        return
    out.line(f"queue {queue['name']}")
    out.line("")
    out.line("config")
    out.fields(queue["config"].items())
    out.line("")
    out.line("stats")
    out.fields((key, _age(queue["stats"], key)) for key in queue["stats"])
    if queue.get("push"):  # a queue with webhook push, its dispatcher running (or paused)
        out.line("")
        out.line("push")
        out.fields(queue["push"].items())
    if args.limit > 0:
        out.line("")
        shown = len(messages)
        total = sum(queue["stats"][key] for key in ("ready", "delayed", "in_flight"))
        out.line(f"messages (first {shown} of {total})" if shown < total else f"messages ({shown})")
        _messages_table(out, messages, "no messages")


def peek(client: Client, args: argparse.Namespace, out: Output) -> None:
    messages = browse(client, args.name, args.state, args.limit)
    if out.as_json:
        out.json({"queue": args.name, "state": args.state, "messages": messages})
        return
    what = "messages" if args.state == "all" else f"{args.state.replace('_', ' ')} messages"
    _messages_table(out, messages, f"no {what} in {args.name}")


def dead_letter_queue(client: Client, name: str) -> str:
    """The queue ``name`` dead-letters into, from its config."""
    target: str | None = client.get_queue(name)["config"]["dead_letter"]
    if target is None:
        raise CommandError(
            "no_dead_letter_queue",
            f"{name} has no dead-letter queue (dead_letter is null: dead letters are dropped)",
            Exit.NOT_FOUND,
        )
    return target


def dead_letters(client: Client, args: argparse.Namespace, out: Output) -> None:
    target = dead_letter_queue(client, args.name)
    try:
        messages = browse(client, target, "all", args.limit)
    except QueueNotFound:  # created on demand: nothing was dead-lettered yet
        messages = []
    if out.as_json:
        out.json({"queue": args.name, "dead_letter": target, "messages": messages})
        return
    if not messages:
        out.line(f"no dead letters in {target}")
        return
    rows = []
    for m in messages:
        headers = m.get("headers") or {}
        rows.append(
            [
                m["id"],
                headers.get("x-dead-letter-from"),
                headers.get("x-dead-letter-reason"),
                headers.get("x-dead-letter-attempts"),
                m["state"],
                m["published_at"],
                payload_text(m),
            ]
        )
    columns = ["id", "from", "reason", "attempts", "state", "dead-lettered", "payload"]
    out.table(columns, rows, right=["attempts"], shrink=["reason", "payload"])


# -- changing -----------------------------------------------------------------------------------------


def redrive(client: Client, args: argparse.Namespace, out: Output) -> None:
    """Move ``NAME``'s dead letters back: the ids given, or with ``--all`` every one that came from
    ``NAME`` (a dead-letter queue shared by several queues keeps the others' messages)."""
    target = dead_letter_queue(client, args.name)
    if args.to is not None:
        client.get_queue(args.to)  # it must exist (the broker says so too, but only when asked to move one)
    unknown: list[str] = []
    try:
        if args.all:
            ids = [
                m["id"]
                for m in all_messages(client, target)
                if (m.get("headers") or {}).get("x-dead-letter-from") == args.name
            ]
        else:
            ids = list(dict.fromkeys(args.ids))
            client.get_queue(target)
    except QueueNotFound:  # the dead-letter queue is created on demand: nothing was dead-lettered yet
        unknown = [] if args.all else list(dict.fromkeys(args.ids))
        ids = []
    redriven = 0
    skipped: list[dict[str, str]] = []
    # Without --to, the broker sends each message back to its x-dead-letter-from queue.
    destination = args.to or (args.name if args.all else "where they came from")
    with out.progress(f"redriving {target}", len(ids)) as advance:
        for start in range(0, len(ids), PAGE):
            answer = client.redrive(target, ids[start : start + PAGE], to=args.to)
            redriven += answer["redriven"]
            unknown.extend(answer.get("unknown", []))
            skipped.extend(answer.get("skipped", []))
            advance(len(ids[start : start + PAGE]))
    if out.as_json:
        out.json(
            {
                "queue": args.name,
                "dead_letter": target,
                "to": args.to,
                "redriven": redriven,
                "unknown": unknown,
                "skipped": skipped,
            }
        )
        return
    out.line(f"redriven {redriven} from {target} to {destination}")
    if unknown:
        out.line(f"not in {target}: {', '.join(unknown)}")
    for entry in skipped:
        out.line(f"skipped {entry['id']}: {entry['reason']}")


def _require_force(args: argparse.Namespace, verb: str, what: str) -> None:
    if not args.force:
        raise CommandError(
            "force_required", f"refusing to {verb} {args.name} without --force ({what})", Exit.USAGE
        )


def purge(client: Client, args: argparse.Namespace, out: Output) -> None:
    _require_force(args, "purge", "it removes every ready and delayed message")
    purged = client.purge(args.name)
    if out.as_json:
        out.json({"queue": args.name, "purged": purged})
    else:
        out.line(f"purged {purged} messages from {args.name}")


def delete(client: Client, args: argparse.Namespace, out: Output) -> None:
    _require_force(args, "delete", "it removes the queue and every message in it")
    client.delete_queue(args.name)
    if out.as_json:
        out.json({"queue": args.name, "deleted": True})
    else:
        out.line(f"deleted queue {args.name}")
