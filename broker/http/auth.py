"""Bearer tokens and scopes (§10): who may do what, checked in front of every route.

``Gate`` is the outermost ASGI layer, so every request meets it, the fast path's and the push stream's
included, before anything else reads it. With no tokens configured it is not installed at all (the
broker then serves on loopback only, see ``config.check_exposure``).

A request names its token as ``Authorization: Bearer <secret>``. The secret is hashed and the hash
compared with every token's in constant time (``hmac.compare_digest``), all of them every time, so the
answer's timing tells nothing about how close a guess came or which token it nearly was. Missing or
wrong: 401 with ``WWW-Authenticate: Bearer``. Right token, wrong scope: 403 naming the scope needed.
Secrets never reach a log line or an error message.

What each route needs is in ``paths.py`` (and docs/operations.md). ``admin`` may do everything.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from broker.config import Token
from broker.errors import BrokerError, Forbidden, Unauthorized
from broker.http.asgi import ASGIApp
from broker.http.paths import origin_scope, target_of
from broker.http.render import send_error

#: The key under which the request's ``Grant`` is left in the ASGI scope for views that filter by it.
SCOPE_KEY = "broker.grant"
#: What a 401 adds to its headers (RFC 6750 §3).
_CHALLENGE = (b"www-authenticate", b'Bearer realm="broker"')


@dataclass(frozen=True, slots=True)
class Need:
    """What a request needs: ``kind`` is ``open``, ``any`` (a valid token), ``admin``, ``read_all``, or
    a queue scope (``publish``, ``consume``, ``read``) on ``queue``."""

    kind: str
    queue: str | None = None

    def describe(self) -> str:
        if self.kind == "read_all":
            return "read:* or admin"
        return self.kind if self.queue is None else f"{self.kind}:{self.queue}"


OPEN = Need("open")
ANY = Need("any")
ADMIN = Need("admin")


def need_of(method: str, path: str) -> Need:
    """What a request for ``method path`` needs (see ``paths.py``)."""
    target = target_of(method, path)
    kind = target.scope
    if kind in ("publish", "consume", "read"):
        return Need(kind, target.queue)
    return _NEEDS[kind]


_NEEDS = {"open": OPEN, "any": ANY, "admin": ADMIN, "read_all": Need("read_all")}


class Grant:
    """What one token may do, with its globs matched once per queue name."""

    __slots__ = ("_globs", "_seen", "admin", "name")

    #: Decisions remembered per grant before the memory is cleared (queue names are unbounded).
    MEMORY = 10_000

    def __init__(self, token: Token) -> None:
        self.name = token.name
        self.admin = "admin" in token.scopes
        self._globs: dict[str, list[str]] = {"publish": [], "consume": [], "read": []}
        for scope in token.scopes:
            kind, _, glob = scope.partition(":")
            if kind in self._globs:
                self._globs[kind].append(glob)
        self._seen: dict[tuple[str, str], bool] = {}

    def allows(self, need: Need) -> bool:
        if self.admin or need.kind in ("open", "any"):
            return True
        if need.kind == "read_all":
            return "*" in self._globs["read"]
        if need.queue is None:
            return False
        return self.may(need.kind, need.queue)

    def may(self, kind: str, queue: str) -> bool:
        """Whether a ``kind`` scope of this token matches ``queue`` (admin may everything)."""
        if self.admin:
            return True
        decided = self._seen.get((kind, queue))
        if decided is None:
            decided = any(fnmatchcase(queue, glob) for glob in self._globs.get(kind, ()))
            if len(self._seen) >= self.MEMORY:
                self._seen.clear()
            self._seen[(kind, queue)] = decided
        return decided


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class Gate:
    """ASGI middleware: answers 401 or 403 for a request its token does not allow, else passes it on
    with the token's ``Grant`` in ``scope[SCOPE_KEY]``."""

    def __init__(self, app: ASGIApp, tokens: Sequence[Token]) -> None:
        self._app = app
        self._tokens = [(_digest(token.secret.encode()), Grant(token)) for token in tokens]

    def identify(self, authorization: bytes | None) -> Grant:
        """The grant of the token ``authorization`` carries; ``Unauthorized`` when none does."""
        if authorization is None:
            raise Unauthorized("this broker needs a token: send Authorization: Bearer <token>")
        scheme, _, secret = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not secret.strip():
            raise Unauthorized("the Authorization header must be: Bearer <token>")
        presented = _digest(secret.strip())
        found = None
        for digest, grant in self._tokens:  # every one, whatever matched: constant time
            if hmac.compare_digest(digest, presented):
                found = grant
        if found is None:
            raise Unauthorized("the token is not valid")
        return found

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "websocket":
            # The broker serves none; refused here, so that a websocket route added one day is not open
            # to anyone until the gate learns what it needs. Closing before accepting answers 403.
            await send({"type": "websocket.close", "code": 1008, "reason": ""})
            return
        if scope["type"] != "http":  # lifespan
            await self._app(scope, receive, send)
            return
        scope = origin_scope(scope)  # the path judged is the path routed, whatever form the target had
        need = need_of(scope["method"], scope["path"])
        if need is not OPEN:
            authorization = None
            for name, value in scope["headers"]:
                if name.lower() == b"authorization":
                    authorization = value
                    break
            try:
                grant = self.identify(authorization)
                if not grant.allows(need):
                    raise Forbidden(f"the token {grant.name!r} lacks the scope {need.describe()}")
            except BrokerError as error:
                challenge = [_CHALLENGE] if isinstance(error, Unauthorized) else []
                await send_error(send, scope, error, *challenge)
                return
            scope[SCOPE_KEY] = grant  # type: ignore[literal-required]
        await self._app(scope, receive, send)


def grant_of(scope: Any) -> Grant | None:
    """The request's grant, or None when the broker has no tokens."""
    grant: Grant | None = scope.get(SCOPE_KEY)
    return grant
