"""Every route of the API by its template, so that the layers around the routes (the token gate,
request logs, metrics) name a request the same way without routing it: ``target_of("POST",
"/v1/queues/jobs/claim")`` is the route ``POST /v1/queues/{queue}/claim`` on queue ``jobs``, which needs
the scope ``consume``. Paths that are no route are ``other`` (one metrics label for all of them).

Scopes (docs/api.md, Tokens): ``open`` needs no token, ``any`` any valid one, ``read_all`` ``read:*``,
``admin`` admin, and ``publish``, ``consume``, ``read`` a scope of that kind whose glob matches the queue.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from hypercorn.typing import HTTPScope

FIXED_ROUTES = {
    ("GET", "/healthz"): "open",
    ("GET", "/readyz"): "open",
    ("GET", "/openapi.json"): "open",
    ("GET", "/metrics"): "read_all",
    ("GET", "/v1/queues"): "any",
    ("GET", "/v1/admin/snapshots"): "admin",
    ("POST", "/v1/admin/snapshots"): "admin",
}
#: ``/v1/queues/{queue}`` and ``/v1/queues/{queue}/<action>``: (method, action) → scope.
QUEUE_ROUTES = {
    ("GET", ""): "read",
    ("PUT", ""): "admin",
    ("DELETE", ""): "admin",
    ("POST", "messages"): "publish",
    ("GET", "messages"): "read",
    ("POST", "claim"): "consume",
    ("POST", "ack"): "consume",
    ("POST", "nack"): "consume",
    ("POST", "defer"): "consume",
    ("POST", "extend"): "consume",
    ("GET", "work"): "consume",
    ("POST", "purge"): "admin",
    ("POST", "redrive"): "admin",
    ("GET", "push"): "read",
}
#: ``/v1/queues/{queue}/work/{stream_id}/<action>``, calls on one open push stream: (method, action) →
#: scope, the stream's own (docs/workers.md).
WORK_ROUTES = {
    ("POST", "stop"): "consume",
}
#: ``/v1/queues/{queue}/push/<action>``: (method, action) → scope (docs/push.md).
PUSH_ROUTES = {
    ("POST", "rotate-secret"): "admin",
}
#: ``/v1/messages/{id}/<action>``, the callbacks of push's ack mode: any valid token here; the route
#: checks ``consume`` on the message's queue once it knows the queue.
CALLBACK_ROUTES = {("POST", "ack"): "any", ("POST", "nack"): "any", ("POST", "defer"): "any"}
#: ``/v1/queues/{queue}/messages/{id}``: method → scope.
MESSAGE_ROUTES = {"GET": "read", "DELETE": "admin"}
#: The compatibility surfaces (docs/compat.md): (method, path template) → scope. A ``{…}`` segment
#: matches any one segment; ``{queue}`` names the queue the scope applies to.
COMPAT_ROUTES = {
    ("GET", "/compat/qhook/api/queues"): "any",
    ("GET", "/compat/qhook/api/queues/{queue}/messages"): "consume",
    ("POST", "/compat/qhook/api/queues/{queue}/ack"): "consume",
    ("POST", "/compat/qhook/api/queues/{queue}/nack"): "consume",
    ("POST", "/compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/pull"): "consume",
    ("POST", "/compat/cloudflare/client/v4/accounts/{account}/queues/{queue}/messages/ack"): "consume",
    # SimpleQ: the routes by job id (no queue in the path) check the scope on the job's queue.
    ("POST", "/compat/simpleq/v1/queues"): "admin",
    ("GET", "/compat/simpleq/v1/queues"): "any",
    ("GET", "/compat/simpleq/v1/queues/{queue}"): "read",
    ("PUT", "/compat/simpleq/v1/queues/{queue}"): "admin",
    ("DELETE", "/compat/simpleq/v1/queues/{queue}"): "admin",
    ("POST", "/compat/simpleq/v1/queues/{queue}/jobs"): "publish",
    ("GET", "/compat/simpleq/v1/queues/{queue}/dlq"): "read",
    ("POST", "/compat/simpleq/v1/queues/{queue}/dlq/retry"): "admin",
    ("POST", "/compat/simpleq/v1/queues/{queue}/dlq/{id}/retry"): "admin",
    ("GET", "/compat/simpleq/v1/jobs/{id}"): "any",
    ("POST", "/compat/simpleq/v1/jobs/{id}/ack"): "any",
    ("POST", "/compat/simpleq/v1/jobs/{id}/nack"): "any",
    ("POST", "/compat/simpleq/v1/jobs/{id}/defer"): "any",
}

#: The native routes that read a query, each checking the names in it (``parse.browse``, ``parse.work``).
#: Every other route under ``/v1/`` refuses a query rather than ignore it: ``POST …/claim?wait=5`` was a
#: claim with no long poll, silently. (The open routes and the compatibility surfaces let one pass: probes,
#: scrapers and other systems' clients add their own.)
QUERY_ROUTES = frozenset({"GET /v1/queues/{queue}/messages", "GET /v1/queues/{queue}/work"})

_ENCODED_SLASH = re.compile("%2[fF]")
#: The scope key that marks a scope ``origin_scope`` made.
_ORIGIN = "broker.origin_path"
_QUEUES = "/v1/queues/"
_MESSAGES = "/v1/messages/"
COMPAT_PREFIX = "/compat/"  # every compatibility surface is under it (docs/compat.md)
_COMPAT_SEGMENTS = {
    (method, tuple(template.split("/"))): (template, scope)
    for (method, template), scope in COMPAT_ROUTES.items()
}


@dataclass(frozen=True, slots=True)
class Target:
    route: str
    queue: str | None
    scope: str


def origin_scope(scope: HTTPScope) -> HTTPScope:
    """``scope`` with the path its router will see. A request's target may be in absolute form
    (``GET http://host/v1/queues``, which RFC 9112 §3.2.2 has servers accept): Hypercorn hands it on
    as it came, and Quart routes only its path. Werkzeug's router drops the leading slashes of a path
    (``//v1/queues/x`` is routed as ``/v1/queues/x``). And an encoded slash (``%2F``) is part of its
    segment, not a separator: Hypercorn decodes it with the rest, so ``/v1/queues/age%2Fclaim`` was a
    claim on ``age``; it stays ``%2F`` here, in a name no queue has (400), or a path no route has.
    Every layer must judge the path that will be routed (the token gate above all), so the layers
    outside the router are given that path too, and pass it on. Any other scope is returned as it is,
    uncopied. An absolute-form target is split as it was sent, then its path decoded: decoded first, a
    ``%3F`` or ``%23`` in it became a query or a fragment, cut off (``/v1/queues/age%3Fx`` served
    ``age``)."""
    if _ORIGIN in scope:  # made here already (the observer's, then the gate's): decoding twice turned
        return scope  # %2573 into s
    path = scope["path"]
    raw = scope.get("raw_path")
    encoded_slash = raw is not None and (b"%2f" in raw or b"%2F" in raw)
    if path.startswith("/") and not path.startswith("//") and not encoded_slash:
        return scope
    if raw is not None:
        # Not a URL (``http://[/v1``), or bytes Hypercorn would not have decoded: the decoded path
        # stays, and no route has it: a 404.
        with contextlib.suppress(UnicodeDecodeError, ValueError):
            target = raw.decode("ascii")
            if not target.startswith("/"):
                target = urlsplit(target).path
            path = unquote(_ENCODED_SLASH.sub("%252F", target))
    elif not path.startswith("/"):
        with contextlib.suppress(ValueError):
            path = urlsplit(path).path
    path = "/" + path.lstrip("/")
    return cast("HTTPScope", {**scope, "path": path, "raw_path": path.encode(), _ORIGIN: True})


def takes_no_query(route: str) -> bool:
    """Whether ``route`` (a ``Target.route``) is a native route that reads no query."""
    return route not in QUERY_ROUTES and route.partition(" ")[2].startswith("/v1/")


def target_of(method: str, path: str) -> Target:
    if method == "HEAD":
        method = "GET"
    scope = FIXED_ROUTES.get((method, path))
    if scope is not None:
        return Target(f"{method} {path}", None, scope)
    if path.startswith(_QUEUES):
        queue, slash, rest = path[len(_QUEUES) :].partition("/")
        if queue and not (slash and not rest):  # a trailing slash (``/v1/queues/jobs/``) is no route
            action, slash, message = rest.partition("/")
            if not slash:
                scope = QUEUE_ROUTES.get((method, action))
                if scope is not None:
                    suffix = f"/{action}" if action else ""
                    return Target(f"{method} /v1/queues/{{queue}}{suffix}", queue, scope)
            elif action == "messages" and message and "/" not in message:
                scope = MESSAGE_ROUTES.get(method)
                if scope is not None:
                    return Target(f"{method} /v1/queues/{{queue}}/messages/{{id}}", queue, scope)
            elif action == "work":
                stream, _, work_action = message.partition("/")
                scope = WORK_ROUTES.get((method, work_action))
                if stream and scope is not None:
                    return Target(
                        f"{method} /v1/queues/{{queue}}/work/{{stream_id}}/{work_action}", queue, scope
                    )
            elif action == "push":
                if "/" not in message:
                    scope = PUSH_ROUTES.get((method, message))
                    if scope is not None:
                        return Target(f"{method} /v1/queues/{{queue}}/push/{message}", queue, scope)
                elif (
                    method == "GET"
                    and message.startswith("messages/")
                    and message.count("/") == 1
                    and not message.endswith("/")
                ):
                    return Target("GET /v1/queues/{queue}/push/messages/{id}", queue, "read")
    if path.startswith(_MESSAGES):
        message, _, action = path[len(_MESSAGES) :].partition("/")
        scope = CALLBACK_ROUTES.get((method, action))
        if message and scope is not None:
            return Target(f"{method} /v1/messages/{{id}}/{action}", None, scope)
    if path.startswith(COMPAT_PREFIX):
        compat = _compat_target(method, path)
        if compat is not None:
            return compat
    if path.startswith("/v1/admin/"):
        return Target("other", None, "admin")
    return Target("other", None, "any")


def _compat_target(method: str, path: str) -> Target | None:
    segments = path.split("/")
    for (route_method, pattern), (template, scope) in _COMPAT_SEGMENTS.items():
        if route_method != method or len(pattern) != len(segments):
            continue
        queue = None
        for expected, actual in zip(pattern, segments, strict=True):
            if expected.startswith("{"):
                if not actual:
                    break
                if expected == "{queue}":
                    queue = actual
            elif expected != actual:
                break
        else:
            return Target(f"{method} {template}", queue, scope)
    return None
