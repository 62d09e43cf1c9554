"""A queue's configuration (§3): defaults, validation of a partial update, and its plain-dict form."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from broker.core.durations import parse_duration
from broker.errors import Conflict, InvalidRequest, quoted, quoted_value

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_QUEUE_NAME = 128

#: The dead-letter queue name that means "<queue>.dlq" (resolved against the queue's own name).
DEFAULT_DEAD_LETTER = "<queue>.dlq"


def check_queue_name(name: str, field: str = "queue name") -> str:
    """Return ``name`` if it is a valid queue name (§2), else raise ``InvalidRequest`` naming ``field``."""
    if not QUEUE_NAME.fullmatch(name):
        raise InvalidRequest(f"{field} {quoted_value(name)} must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$")
    return name


@dataclass(frozen=True, slots=True)
class FinishedHistory:
    """How many of the messages that left a queue (acked, dead-lettered, expired, redriven; not deleted)
    it keeps, newest kept, so that get-one still shows them with their history (§6): at most ``count``;
    and how much of their payloads: past ``payload_bytes``, the oldest let theirs go and are shown
    without it (a queue of 1 MiB payloads would otherwise hold 10 GiB of messages already done with)."""

    count: int = 10_000
    payload_bytes: int = 64 << 20


DEFAULT_HISTORY = FinishedHistory()

#: ``retry_backoff.max`` when a config gives none and its ``base`` is not over it.
DEFAULT_BACKOFF_MAX = 3600.0


@dataclass(frozen=True, slots=True)
class RetryBackoff:
    """Delay for a nack that names none: ``fixed`` = base; ``exponential`` = base·2^(attempt-1); both
    capped at ``max`` (which a config never sets below ``base``)."""

    type: str = "fixed"
    base: float = 0.0
    max: float = DEFAULT_BACKOFF_MAX

    def delay(self, attempt: int) -> float:
        if self.type == "fixed":
            return min(self.base, self.max)
        # 2.0 ** 1024 overflows (OverflowError), and a message may be nacked that often with
        # max_attempts 0; past 2 ** 1023 every delay but a vanishing base's is capped anyway.
        return min(self.base * 2.0 ** min(max(attempt - 1, 0), 1023), self.max)


@dataclass(frozen=True, slots=True)
class PushConfig:
    """Webhook push (docs/push.md): the broker POSTs each message to ``url``.

    ``secret`` signs the requests. It is generated when push is first configured and kept across
    later updates; ``to_dict`` never shows it (the PUT that generated it shows it once, see
    ``broker.push.secrets``). It is part of the config, so the journal and snapshots hold it: that is
    what lets signatures survive a restart (docs/push.md, "Where the secret lives").
    """

    url: str
    mode: str = "standard"
    timeout: float = 15.0
    concurrency: int = 10
    ack_timeout: float = 300.0
    ack_timeout_action: str = "retry"
    allow_private: bool = False
    secret: str = dataclasses.field(default="", repr=False)
    #: The request's shape: ``broker`` (the envelope and ``x-broker-signature`` of docs/push.md) or
    #: ``simpleq`` (SimpleQ's delivery envelope and ``x-simpleq-signature``, docs/compat.md).
    format: str = "broker"

    def to_dict(self) -> dict[str, Any]:
        """The push config as the API shows it: everything but the secret, and ``format`` only when it
        is not the native ``broker`` (so native answers keep the shape docs/push.md documents)."""
        shown: dict[str, Any] = {
            "url": redacted_url(self.url),
            "mode": self.mode,
            "timeout": self.timeout,
            "concurrency": self.concurrency,
            "ack_timeout": self.ack_timeout,
            "ack_timeout_action": self.ack_timeout_action,
            "allow_private": self.allow_private,
        }
        if self.format != "broker":
            shown["format"] = self.format
        return shown


#: What a push URL's password reads as wherever the broker shows the URL (docs/push.md).
REDACTED_PASSWORD = "***"


def redacted_url(url: str) -> str:
    """``url`` with the password of its user-info, if it has one, shown as ``***``. Never raises, so it
    may name a URL that does not parse."""
    scheme, netloc, rest = _split_authority(url)
    return f"{scheme}{_masked(netloc)}{rest}"


def _masked(netloc: str) -> str:
    """``user:password@host`` as ``user:***@host``; unchanged without a password."""
    user_info, at, host = netloc.rpartition("@")
    user, _, password = user_info.partition(":")
    return f"{user}:{REDACTED_PASSWORD}@{host}" if at and password else netloc


def _split_authority(url: str) -> tuple[str, str, str]:
    """``("scheme://", "user:password@host:port", "/path?query#fragment")``; the middle one empty
    when ``url`` has no ``//``."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return "", "", url
    end = min([index for index in map(rest.find, "/?#") if index != -1], default=len(rest))
    return scheme + separator, rest[:end], rest[end:]


def _password_kept(url: str, old_url: str | None) -> str:
    """A push URL sent back with its password masked as answers show it keeps the password of the URL
    it replaces, when it names the same user and host (its path or query may change). With another
    user or host, or nothing to keep, the mask is refused rather than saved as the password."""
    if urlsplit(url).password != REDACTED_PASSWORD:
        return url
    scheme, netloc, rest = _split_authority(url)
    if old_url is not None:
        _, old_netloc, _ = _split_authority(old_url)
        if _masked(old_netloc) == netloc != old_netloc:
            return f"{scheme}{old_netloc}{rest}"
    raise InvalidRequest(
        f"push.url's password {REDACTED_PASSWORD} is the mask answers show, not a password: send the "
        "password itself for another user or host"
    )


def url_origin(url: str) -> str:
    """``host`` or ``host:port`` of ``url``: what logs and messages name, never its user-info, path or
    query (any may hold a credential)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port}" if parts.port else host


def new_push_secret() -> str:
    """A fresh signing secret: 32 random bytes as 64 hex digits. (The one step of config parsing that
    is not a pure function of its input; replay never repeats it, since records hold the result.)"""
    return secrets.token_hex(32)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Everything `PUT /v1/queues/{queue}` can set. Durations are seconds."""

    lease: float = 30.0
    max_attempts: int = 0
    dead_letter: str | None = DEFAULT_DEAD_LETTER
    retry_backoff: RetryBackoff = RetryBackoff()
    max_depth: int = 0
    rate_limit: tuple[int, float] | None = None
    message_ttl: float = 0.0
    claim_window: float = 0.0
    durable: bool = True
    dedup_window: float = 86400.0
    push: PushConfig | None = None

    def with_new_push_secret(self, queue: str) -> QueueConfig:
        """A copy whose push config has a fresh secret; ``Conflict`` when there is no push config."""
        if self.push is None:
            raise Conflict(f"queue {queue!r} has no push config; PUT one first")
        return dataclasses.replace(self, push=dataclasses.replace(self.push, secret=new_push_secret()))

    def updated(self, changes: Mapping[str, Any]) -> QueueConfig:
        """A copy with ``changes`` (any subset of the fields, as a client sends them) applied.

        Raises ``InvalidRequest`` naming the first bad field; nothing is half-applied.
        """
        if not isinstance(changes, Mapping):
            raise InvalidRequest("the queue config must be a JSON object")
        parsed: dict[str, Any] = {}
        if "template" in changes:
            changes, parsed = expand_template(changes, self.push)
        for field, value in changes.items():
            parser = _FIELD_PARSERS.get(field)
            if parser is None:
                known = ", ".join([*_FIELD_PARSERS, "template"])
                raise InvalidRequest(
                    f"unknown queue config field {quoted_value(field)}; known fields: {known}"
                )
            parsed[field] = parser(value)
        push = parsed.get("push")
        if push is not None:  # the URL as answers show it, sent back, keeps its password
            old_url = self.push.url if self.push is not None else None
            push = parsed["push"] = dataclasses.replace(push, url=_password_kept(push.url, old_url))
        if push is not None and not push.secret:  # keep the secret across updates, else make one
            kept = self.push.secret if self.push is not None else ""
            parsed["push"] = dataclasses.replace(push, secret=kept or new_push_secret())
        return dataclasses.replace(self, **parsed)

    def to_dict(self, queue: str) -> dict[str, Any]:
        """The config as the API shows it, with the default dead-letter name resolved for ``queue``."""
        return {
            "lease": self.lease,
            "max_attempts": self.max_attempts,
            "dead_letter": self.dead_letter_queue(queue),
            "retry_backoff": {
                "type": self.retry_backoff.type,
                "base": self.retry_backoff.base,
                "max": self.retry_backoff.max,
            },
            "max_depth": self.max_depth,
            "rate_limit": (
                None if self.rate_limit is None else {"max": self.rate_limit[0], "per": self.rate_limit[1]}
            ),
            "message_ttl": self.message_ttl,
            "claim_window": self.claim_window,
            "durable": self.durable,
            "dedup_window": self.dedup_window,
            "push": None if self.push is None else self.push.to_dict(),
        }

    def dead_letter_queue(self, queue: str) -> str | None:
        """Where ``queue`` dead-letters to. The default is ``<queue>.dlq``, with ``queue`` cut short
        when needed to keep the name within 128 characters, and never the queue itself."""
        if self.dead_letter != DEFAULT_DEAD_LETTER:
            return self.dead_letter
        name = f"{queue[: MAX_QUEUE_NAME - 4]}.dlq"
        if name == queue:  # a 128-character name ending in ".dlq" would be its own dead-letter queue
            mark = "_" if queue[MAX_QUEUE_NAME - 5] != "_" else "-"
            name = f"{queue[: MAX_QUEUE_NAME - 5]}{mark}.dlq"
        return name

    def check_for(self, queue: str) -> None:
        """Raise ``InvalidRequest`` unless this config can serve ``queue``: what only the queue's name
        decides (it may not dead-letter into itself)."""
        if self.dead_letter_queue(queue) == queue:
            raise InvalidRequest(f"dead_letter must name another queue than {queue!r} itself")


#: Queue templates (docs/push.md, Templates): config presets for pushing jobs that call a model
#: provider's API. The push fields go into ``push``; the rest are queue fields.
TEMPLATES: dict[str, dict[str, Any]] = {
    name: {
        "push": {"mode": "ack", "ack_timeout": ack_timeout, "ack_timeout_action": "retry", "concurrency": 20},
        "max_attempts": 4,
        "retry_backoff": {"type": "exponential", "base": 2},
    }
    for name, ack_timeout in (("anthropic", 600), ("openai", 300))
}


def expand_template(
    changes: Mapping[str, Any], push: PushConfig | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config change naming a ``template``, as the changes it stands for: the template's fields, with
    the fields the change gives explicitly winning (within ``push`` field by field). Returns the changes
    to parse and the values that need no parsing (the default dead-letter queue, ``<queue>.dlq``).

    A template is about push, so it needs a push URL: ``push.url`` in the change, else the queue's
    current one (``push``); with neither it is refused, as is ``"push": null`` beside a template."""
    name = changes["template"]
    template = TEMPLATES.get(name) if isinstance(name, str) else None
    if template is None:
        allowed = " or ".join(repr(known) for known in TEMPLATES)
        raise InvalidRequest(f"template must be {allowed}, not {quoted_value(name)}")
    explicit = {field: value for field, value in changes.items() if field != "template"}
    own_push = explicit.get("push", {})
    if not isinstance(own_push, Mapping):
        if own_push is None:
            raise InvalidRequest(f'template {name!r} configures push; it cannot go with "push": null')
        return explicit, {}  # the push parser names what is wrong with it
    merged_push = {**template["push"], **own_push}
    if "url" not in merged_push:
        if push is None:
            raise InvalidRequest(
                f"template {name!r} needs push.url, the URL to push the queue's messages to: "
                f'{{"template": "{name}", "push": {{"url": "https://…"}}}}'
            )
        kept = {"url": push.url, "allow_private": push.allow_private, "format": push.format}
        merged_push = {**kept, **merged_push}
    expanded = {**{field: value for field, value in template.items() if field != "push"}, **explicit}
    expanded["push"] = merged_push
    preset = {} if "dead_letter" in explicit else {"dead_letter": DEFAULT_DEAD_LETTER}
    return expanded, preset


def _int(field: str, low: int, high: int) -> Any:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidRequest(f"{field} must be an integer between {low} and {high}")
        return value

    return parse


def _duration(field: str, low: float, high: float) -> Any:
    return lambda value: parse_duration(value, field, low=low, high=high)


def _bool(field: str) -> Any:
    def parse(value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{field} must be true or false")
        return value

    return parse


def _dead_letter(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("dead_letter must be a queue name or null")
    return check_queue_name(value, "dead_letter")


def _field_names(unknown: set[Any]) -> str:
    """Unknown field names a client sent, for a refusal: the first few, each cut short (a name may be
    megabytes, and there may be thousands)."""
    names = sorted(quoted(str(name)) for name in unknown)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refused_url(url: str) -> str:
    """A push URL a refusal quotes: cut short, its password as ``***``; with an ``@`` past where the
    authority ends for ``redacted_url`` (a password holding "/", "?" or "#"), only its scheme (the URL
    is refused: nothing needs to be sent back)."""
    scheme, slashes, rest = url.partition("//")
    authority_end = min((i for i in map(rest.find, "/?#") if i != -1), default=len(rest))
    if slashes and "@" in rest[authority_end:]:
        return repr(f"{scheme}//…")
    return quoted_value(redacted_url(url))


def _retry_backoff(value: Any) -> RetryBackoff:
    if not isinstance(value, Mapping):
        raise InvalidRequest('retry_backoff must be an object like {"type": "fixed", "base": 0}')
    unknown = set(value) - {"type", "base", "max"}
    if unknown:
        raise InvalidRequest(f"unknown retry_backoff field(s): {_field_names(unknown)}")
    kind = value.get("type", "fixed")
    if kind not in ("fixed", "exponential"):
        raise InvalidRequest("retry_backoff.type must be 'fixed' or 'exponential'")
    base = parse_duration(value.get("base", 0), "retry_backoff.base", high=604800)
    if "max" not in value:  # a base over the default cap raises it: "fixed" 2 h means 2 h
        return RetryBackoff(kind, base, max(base, DEFAULT_BACKOFF_MAX))
    cap = parse_duration(value["max"], "retry_backoff.max", high=604800)
    if base > cap:  # every delay would be the cap, silently
        raise InvalidRequest(
            f"retry_backoff.base ({base:.15g} s) must not be over retry_backoff.max ({cap:.15g} s)"
        )
    return RetryBackoff(kind, base, cap)


def _rate_limit(value: Any) -> tuple[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"max", "per"}:
        raise InvalidRequest('rate_limit must be null or {"max": N, "per": seconds}')
    count = _int("rate_limit.max", 1, 1_000_000_000)(value["max"])
    per = parse_duration(value["per"], "rate_limit.per", low=0.001, high=86400)
    return (count, per)


_PUSH_FIELDS = frozenset(
    {
        "url",
        "mode",
        "timeout",
        "concurrency",
        "ack_timeout",
        "ack_timeout_action",
        "allow_private",
        "secret",
        "format",
    }
)
#: The shapes a push request can take (``PushConfig.format``).
PUSH_FORMATS = ("broker", "simpleq")
#: Host names that reach a cloud provider's instance metadata service.
_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})
_AWS_METADATA_V6 = ipaddress.ip_address("fd00:ec2::254")


def _push(value: Any) -> PushConfig | None:
    """``null`` removes push; an object replaces the push config, its missing fields at their defaults."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequest('push must be null or an object like {"url": "https://…", "mode": "standard"}')
    unknown = set(value) - _PUSH_FIELDS
    if unknown:
        raise InvalidRequest(f"unknown push field(s): {_field_names(unknown)}")
    if "url" not in value:
        raise InvalidRequest("push.url is required")
    allow_private = _bool("push.allow_private")(value.get("allow_private", False))
    mode = value.get("mode", "standard")
    if mode not in ("standard", "ack"):
        raise InvalidRequest("push.mode must be 'standard' or 'ack'")
    action = value.get("ack_timeout_action", "retry")
    if action not in ("retry", "dead"):
        raise InvalidRequest("push.ack_timeout_action must be 'retry' or 'dead'")
    push_format = value.get("format", "broker")
    if push_format not in PUSH_FORMATS:
        raise InvalidRequest("push.format must be 'broker' or 'simpleq'")
    secret = value.get("secret", "")
    if "secret" in value and (not isinstance(secret, str) or not 16 <= len(secret) <= 256):
        raise InvalidRequest("push.secret must be a string of 16 to 256 characters")
    return PushConfig(
        url=_push_url(value["url"], allow_private),
        mode=mode,
        timeout=parse_duration(value.get("timeout", 15), "push.timeout", low=0.1, high=3600),
        concurrency=_int("push.concurrency", 1, 1000)(value.get("concurrency", 10)),
        ack_timeout=parse_duration(value.get("ack_timeout", 300), "push.ack_timeout", low=1, high=43000),
        ack_timeout_action=action,
        allow_private=allow_private,
        secret=secret,
        format=push_format,
    )


def _push_url(value: Any, allow_private: bool) -> str:
    """An http or https URL with a host; link-local and metadata addresses only with ``allow_private``."""
    if not isinstance(value, str) or len(value) > 2048:
        raise InvalidRequest("push.url must be an http or https URL of at most 2048 characters")
    try:
        parts = urlsplit(value)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise InvalidRequest(f"push.url is not a valid URL: {_refused_url(value)}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidRequest(f"push.url must be an http or https URL with a host, not {_refused_url(value)}")
    if _SPACE_OR_CONTROL.search(value):
        raise InvalidRequest("push.url must not hold spaces or control characters: percent-encode them")
    if not allow_private and is_metadata_or_link_local(host):
        raise InvalidRequest(
            f"push.url names a link-local or metadata address ({host}); set push.allow_private to allow it"
        )
    return value


#: What a push URL must percent-encode: spaces and control characters (as the OpenAPI pattern says).
_SPACE_OR_CONTROL = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")


def is_metadata_or_link_local(host: str) -> bool:
    if host.lower().rstrip(".") in _METADATA_HOSTS:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # the other IPv4 forms a resolver takes as they are: 2852039166, 0xa9fea9fe, 169.254.43518
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except (OSError, ValueError):
            return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:169.254.169.254 reaches 169.254.169.254
    return address.is_link_local or address == _AWS_METADATA_V6


_FIELD_PARSERS: dict[str, Any] = {
    "lease": _duration("lease", 0.1, 43200),
    "max_attempts": _int("max_attempts", 0, 1_000_000),
    "dead_letter": _dead_letter,
    "retry_backoff": _retry_backoff,
    "max_depth": _int("max_depth", 0, 1_000_000_000),
    "rate_limit": _rate_limit,
    "message_ttl": _duration("message_ttl", 0, 31_536_000),
    "claim_window": _duration("claim_window", 0, 5),
    "durable": _bool("durable"),
    "dedup_window": _duration("dedup_window", 0, 31_536_000),
    "push": _push,
}
