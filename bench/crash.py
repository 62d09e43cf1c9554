"""Crash testing: ``kill -9`` a loaded ``broker serve`` again and again, and check the durability promise.

``python -m bench.crash [--cycles 100] [--seed S] [--timeout 900] [--keep]``

The promise (CONTRACT §8): for a durable queue, after ``kill -9`` at any moment and a restart, every
message whose publish got a 2xx is present unless a 2xx ack (dead-letter, delete, purge, expiry; this
load uses none of those) removed it, and nothing whose ack got a 2xx comes back. Leases need not survive.

How. One real ``broker serve`` subprocess on a data directory, one durable queue with a short lease.
Publisher threads send batches with unique keys; consumer threads claim batches (long polls), ack most
of what they get and now and then keep a delivery without settling it, so that its lease expires. Every
request is recorded on the client side with the server incarnation (the *epoch*) that answered it: each
publish that got a 2xx with its ids, each delivery, each ack with the lease ids it did not skip. A
request that fails in transport (the kill came while it was in flight) is *unknown*: neither acknowledged
nor refused, which is exactly what the promise allows. At seeded random moments the server is killed
with SIGKILL and started again on the same directory, on a port no earlier incarnation used, so a
response always tells which incarnation gave it; now and then one more incarnation, which no client
sees, is killed while it starts (often in the middle of recovery). Publishers retry an unknown batch
with the same keys, and consumers retry an unknown ack once, on the next incarnation (both are safe per
§4 and §5). At the end the load stops, the queue is drained, and ``check`` judges the whole history:

* ``lost``: every id a 2xx publish answered was acked by a 2xx ack, named by an ack without an answer,
  or delivered by the final drain;
* ``acked_came_back``: no id is delivered by a claim sent after a 2xx ack of it came back, nor acked
  again by a later 2xx ack;
* ``unexplained_duplicate``: each delivery of a message after the first is explained by a kill since
  the earlier one (it came from a later incarnation) or by the earlier lease's possible expiry;
* ``wrong_payload``, ``phantom``, ``key_twice``: an acknowledged id keeps its message; nothing is
  delivered that nobody published; one idempotency key never stands for two durable messages.

Two things the promise allows are counted as notes, not violations: an id (and its first lease id)
given again after a kill lost a message that a claim had already handed out before its publish was
committed (``reused_ids``), and a retried ack settling another consumer's delivery because its lease id
was given again (``foreign_acks``).

``check`` is pure (a ``History`` in, a ``Verdict`` out), so it is tested on synthetic histories too
(tests/e2e/test_crash.py), including ones it must reject.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

QUEUE = "crash"
#: The queue's lease: short, so that kept deliveries often come back (duplicates explained by expiry)
#: before the next kill.
LEASE = 1.0
HTTP_TIMEOUT = 10.0
START_TIMEOUT = 30.0
#: Slack when deciding that a lease may have expired: clock resolution and float rounding only.
EXPIRY_TOLERANCE = 0.05

OK = "ok"  # the answer was a 2xx
UNKNOWN = "unknown"  # no answer: the request failed in transport (a kill, or a timeout)
REFUSED = "refused"  # a non-2xx answer

# Kinds of violations.
LOST = "lost"  # a message whose publish got a 2xx vanished without a 2xx ack
ACKED_CAME_BACK = "acked_came_back"  # delivered (or acked) again after an ack of it got a 2xx
UNEXPLAINED_DUPLICATE = "unexplained_duplicate"  # redelivered while its earlier lease was live, no crash
#: An acknowledged id answered or delivered for another key: the acknowledged message was lost and its id
#: given again (a lost message whose id was reused looks acked or present by id alone; this catches it).
WRONG_PAYLOAD = "wrong_payload"
PHANTOM = "phantom"  # a delivery of a key nobody ever tried to publish
KEY_TWICE = "key_twice"  # one idempotency key behind two durable messages
DRAIN_INCOMPLETE = "drain_incomplete"  # the harness could not empty the queue at the end


# -- the history, as the clients saw it -------------------------------------------------------------


@dataclass(slots=True)
class Publish:
    """One publish request: its keys in request order and, when it got a 2xx, the ids in that order."""

    keys: tuple[str, ...]
    epoch: int
    sent: float
    received: float
    outcome: str
    ids: tuple[str, ...] = ()


@dataclass(slots=True)
class Delivery:
    """One message as a claim answer gave it (``drain``: during the final drain)."""

    id: str
    lease_id: str
    key: str
    consumer: str
    epoch: int
    sent: float
    received: float
    drain: bool = False


@dataclass(slots=True)
class Ack:
    """One ack request: the (message id, lease id) pairs it named and, on a 2xx, the leases not skipped."""

    leases: tuple[tuple[str, str], ...]
    epoch: int
    sent: float
    received: float
    outcome: str
    acked: frozenset[str] = frozenset()
    consumer: str = ""


@dataclass
class History:
    """Everything the clients saw. Times are ``time.monotonic()``, the clock the server's Trio uses.
    Epoch ``n`` is the ``n``-th server incarnation (0 the first); every epoch but the last ended in a
    kill. ``drained``: the final drain emptied the queue, so its deliveries are what was left."""

    lease: float
    publishes: list[Publish] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    drained: bool = True
    #: Non-2xx answers nobody expected, as "<call> <status> <body>" (reported, not judged).
    errors: list[str] = field(default_factory=list)
    #: When claims failed in transport (a list, so that threads can add to it safely).
    claims_unknown: list[float] = field(default_factory=list)


# -- the checker --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    message_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.message_id}: {self.detail}"


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    messages: int = 0  # distinct ids that a 2xx publish answered
    acked: int = 0  # distinct ids that a 2xx ack acked
    deliveries: int = 0
    drained: int = 0  # distinct ids delivered by the final drain
    duplicates: int = 0  # deliveries of a message after its first
    by_crash: int = 0  # ... whose earlier lease was given by an incarnation since killed
    by_expiry: int = 0  # ... given after the earlier lease may have expired
    publishes_unknown: int = 0
    acks_unknown: int = 0
    #: Ids given to a message that was never acknowledged and lost at a kill, then given again to
    #: another message (a note on ``id`` uniqueness, not a §8 violation).
    reused_ids: int = 0
    #: 2xx acks that settled a delivery made to another consumer: a lease id given again after a kill
    #: lost the record of its first delivery, and the first holder's ack came after the second claim.
    foreign_acks: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[str]:
        return {violation.kind for violation in self.violations}


def check(history: History) -> Verdict:
    """Judge a history against the durability promise; every violation is listed, none is fatal."""
    verdict = Verdict()
    violations = verdict.violations
    if not history.drained:
        violations.append(Violation(DRAIN_INCOMPLETE, "-", "the queue was not empty at the end"))

    # What was acknowledged: id -> (key, epoch of the first 2xx publish answering with it).
    published: dict[str, tuple[str, int]] = {}
    tried_keys: set[str] = set()
    for publish in history.publishes:
        tried_keys.update(publish.keys)
        if publish.outcome != OK:
            verdict.publishes_unknown += publish.outcome == UNKNOWN
            continue
        for key, message_id in zip(publish.keys, publish.ids, strict=True):
            known = published.setdefault(message_id, (key, publish.epoch))
            if known[0] != key:
                violations.append(
                    Violation(WRONG_PAYLOAD, message_id, f"acknowledged for key {known[0]} and for {key}")
                )
    verdict.messages = len(published)

    # Acks: id -> when the first 2xx ack of it came back; and the ids of acks with no answer.
    acked_at: dict[str, float] = {}
    ack_tried: set[str] = set()
    for ack in sorted(history.acks, key=lambda ack: ack.received):
        if ack.outcome != OK:
            verdict.acks_unknown += ack.outcome == UNKNOWN
            ack_tried.update(message_id for message_id, _ in ack.leases)
            continue
        for message_id, lease_id in ack.leases:
            if lease_id not in ack.acked:
                continue
            first = acked_at.get(message_id)
            if first is None:
                acked_at[message_id] = ack.received
            elif ack.sent > first:
                violations.append(
                    Violation(ACKED_CAME_BACK, message_id, f"acked again under lease {lease_id}")
                )
    verdict.acked = len(acked_at)

    deliveries = history.deliveries
    verdict.deliveries = len(deliveries)
    drained = {delivery.id for delivery in deliveries if delivery.drain}
    verdict.drained = len(drained)

    # 1. Nothing acknowledged is lost.
    if history.drained:
        for message_id, (key, epoch) in published.items():
            if message_id not in acked_at and message_id not in ack_tried and message_id not in drained:
                violations.append(
                    Violation(LOST, message_id, f"key {key}, publish acknowledged in epoch {epoch}")
                )

    # 2. Nothing acked comes back; acknowledged ids keep their message.
    by_message: dict[tuple[str, str], list[Delivery]] = defaultdict(list)
    keys_of_id: dict[str, set[str]] = defaultdict(set)
    for delivery in deliveries:
        by_message[delivery.id, delivery.key].append(delivery)
        keys_of_id[delivery.id].add(delivery.key)
        acked = acked_at.get(delivery.id)
        if acked is not None and delivery.sent > acked:
            violations.append(
                Violation(
                    ACKED_CAME_BACK,
                    delivery.id,
                    f"delivered as {delivery.lease_id} in epoch {delivery.epoch}"
                    f"{' (drain)' if delivery.drain else ''}, {delivery.sent - acked:.3f} s after its ack",
                )
            )
        acknowledged = published.get(delivery.id)
        if acknowledged is not None and acknowledged[0] != delivery.key and delivery.epoch >= acknowledged[1]:
            violations.append(
                Violation(
                    WRONG_PAYLOAD,
                    delivery.id,
                    f"acknowledged as key {acknowledged[0]} in epoch {acknowledged[1]}, "
                    f"delivered as {delivery.key} "
                    f"in epoch {delivery.epoch}",
                )
            )
        if delivery.key not in tried_keys:
            violations.append(Violation(PHANTOM, delivery.id, f"key {delivery.key} was never published"))
    verdict.reused_ids = sum(len(keys) > 1 for keys in keys_of_id.values())

    # 3. Every duplicate delivery is explained by a crash since the earlier lease, or by its expiry.
    for (message_id, _), seen in by_message.items():
        seen.sort(key=lambda delivery: delivery.received)
        for earlier, later in itertools.pairwise(seen):
            verdict.duplicates += 1
            if later.epoch > earlier.epoch:
                verdict.by_crash += 1
            elif later.received + EXPIRY_TOLERANCE >= earlier.sent + history.lease:
                verdict.by_expiry += 1
            else:
                violations.append(
                    Violation(
                        UNEXPLAINED_DUPLICATE,
                        message_id,
                        f"{later.lease_id} given {later.received - earlier.sent:.3f} s after "
                        f"{earlier.lease_id} was claimed, both in epoch {later.epoch}",
                    )
                )

    # A note: acks that settled another consumer's delivery under the same lease id.
    holders: dict[str, list[Delivery]] = defaultdict(list)
    for delivery in sorted(deliveries, key=lambda delivery: delivery.received):
        holders[delivery.lease_id].append(delivery)
    for ack in history.acks:
        for lease_id in ack.acked:
            before = [d for d in holders.get(lease_id, []) if d.received <= ack.received]
            if ack.consumer and before and before[-1].consumer != ack.consumer:
                verdict.foreign_acks += 1

    # 4. An idempotency key stands for one durable message. Durable: a 2xx publish answered with it,
    # or it survived a kill (seen in two epochs, or left for the drain).
    durable: dict[str, set[str]] = defaultdict(set)
    for message_id, (key, _) in published.items():
        durable[key].add(message_id)
    for (message_id, key), seen in by_message.items():
        if any(delivery.drain for delivery in seen) or len({delivery.epoch for delivery in seen}) > 1:
            durable[key].add(message_id)
    for key, ids in durable.items():
        if len(ids) > 1:
            violations.append(
                Violation(KEY_TWICE, ",".join(sorted(ids)), f"key {key} has {len(ids)} messages")
            )
    return verdict


def journal_notes(data_dir: Path, message_ids: set[str]) -> dict[str, list[str]]:
    """What the journal in ``data_dir`` holds about these messages: "lsn Type lease" lines."""
    from broker.storage.segments import read_entries  # the broker's own reader, imported only when needed

    notes: dict[str, list[str]] = defaultdict(list)
    for entry in read_entries(data_dir / "journal"):
        message_id = getattr(entry.record, "id", None)
        if message_id in message_ids:
            lease = getattr(entry.record, "lease_id", "")
            notes[message_id].append(f"{entry.lsn} {type(entry.record).__name__} {lease}".rstrip())
    return dict(notes)


# -- the server --------------------------------------------------------------------------------------


#: How the server is started, after ``sys.executable``; experiments replace it (e.g. with ``-c`` code that
#: breaks the broker on purpose, to see the checker catch it).
SERVER_COMMAND = ["-m", "broker"]
#: Incarnations started and not yet killed, for the watchdog of ``main``.
LIVE: set[ServerProcess] = set()


class ServerProcess:
    """One ``broker serve`` incarnation; its stderr (JSON log lines) is read by a thread."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.port = port
        self.process = subprocess.Popen(
            [sys.executable, *SERVER_COMMAND, "serve", "--port", str(port), "--data-dir", str(data_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=data_dir.parent,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.raw: list[str] = []
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True)
        self._reader.start()
        LIVE.add(self)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_listening(self, timeout: float) -> str | None:
        """The URL from the "listening" line; None if the process ended first (e.g. the port was taken)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                return None
            self.raw.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                self.seen.append(record)
                if record.get("event") == "listening":
                    return str(record["url"])
        raise RuntimeError(f"no 'listening' line within {timeout} s; stderr: {''.join(self.raw)}")

    def events(self, name: str) -> list[dict[str, Any]]:
        return [record for record in self.seen if record.get("event") == name]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=START_TIMEOUT)
        LIVE.discard(self)
        self._reader.join(timeout=START_TIMEOUT)
        while True:  # the lines logged after "listening", for the report
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                continue
            self.raw.append(line)
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    self.seen.append(record)
        assert self.process.stderr is not None
        self.process.stderr.close()


def _free_port(used: set[int]) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port not in used:
            return port


def kill_early(data_dir: Path, used_ports: set[int], after: float) -> ServerProcess:
    """Start an incarnation that no client ever sees and kill it ``after`` seconds, listening or not
    (often in the middle of recovery): a kill at any moment includes the start."""
    port = _free_port(used_ports)
    used_ports.add(port)
    server = ServerProcess(data_dir, port)
    time.sleep(after)
    server.kill()
    return server


def start_server(data_dir: Path, used_ports: set[int]) -> tuple[ServerProcess, str]:
    """Start an incarnation on a port no earlier one used, so that no answer can come from the wrong one."""
    for _ in range(5):
        port = _free_port(used_ports)
        used_ports.add(port)
        server = ServerProcess(data_dir, port)
        try:
            url = server.wait_listening(START_TIMEOUT)
        except BaseException:
            server.kill()
            raise
        if url is not None:
            return server, url
        server.kill()  # most likely the port was taken in between: try another
    raise RuntimeError(f"the server did not start; stderr: {''.join(server.raw)}")


# -- the load ----------------------------------------------------------------------------------------


class Gate:
    """Which incarnation clients talk to: ``(epoch, url)``, or nothing while one is being restarted."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._epoch = -1
        self._url: str | None = None
        self.stopping = False

    def open(self, epoch: int, url: str) -> None:
        with self._condition:
            self._epoch, self._url = epoch, url
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._url = None

    def stop(self) -> None:
        with self._condition:
            self.stopping = True
            self._condition.notify_all()

    def current(self) -> tuple[int, str] | None:
        """The incarnation to talk to (waiting while there is none); None once the load stops."""
        with self._condition:
            while not self.stopping and self._url is None:
                self._condition.wait()
            return None if self.stopping else (self._epoch, self._url or "")

    def wait_past(self, epoch: int, timeout: float) -> None:
        """Wait until an incarnation after ``epoch`` is up, the load stops, or ``timeout`` passes."""
        with self._condition:
            self._condition.wait_for(
                lambda: self.stopping or (self._epoch > epoch and self._url is not None), timeout
            )


@dataclass(slots=True)
class Answer:
    epoch: int
    sent: float
    received: float
    response: httpx.Response | None  # None: failed in transport


class Session:
    """One client thread's HTTP connection, re-made for every incarnation."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._client: httpx.Client | None = None
        self._epoch = -1

    def post(self, path: str, body: dict[str, Any]) -> Answer | None:
        """POST to the current incarnation; None once the load stops."""
        current = self.gate.current()
        if current is None:
            return None
        epoch, url = current
        if self._client is None or self._epoch != epoch:
            self.close()
            self._client = httpx.Client(base_url=url, timeout=HTTP_TIMEOUT)
            self._epoch = epoch
        sent = time.monotonic()
        try:
            response = self._client.post(path, json=body)
        except httpx.TransportError:
            return Answer(epoch, sent, time.monotonic(), None)
        return Answer(epoch, sent, time.monotonic(), response)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _publisher(name: str, gate: Gate, history: History, rng: random.Random) -> None:
    session = Session(gate)
    count = 0
    try:
        while not gate.stopping:
            size = rng.randint(1, 5)
            keys = tuple(f"{name}-{count + i}" for i in range(size))
            count += size
            body = {"messages": [{"payload": {"key": key, "n": i}, "key": key} for i, key in enumerate(keys)]}
            while True:  # the same batch, same keys, until it is answered: safe thanks to the keys
                answer = session.post(f"/v1/queues/{QUEUE}/messages", body)
                if answer is None:
                    break
                response = answer.response
                if response is not None and response.is_success:
                    ids = tuple(message["id"] for message in response.json()["messages"])
                    history.publishes.append(
                        Publish(keys, answer.epoch, answer.sent, answer.received, OK, ids)
                    )
                    break
                outcome = UNKNOWN if response is None else REFUSED
                history.publishes.append(Publish(keys, answer.epoch, answer.sent, answer.received, outcome))
                if response is not None:
                    history.errors.append(f"publish {response.status_code} {response.text[:200]}")
                gate.wait_past(answer.epoch, 1.0)
            time.sleep(rng.uniform(0, 0.02))
    finally:
        session.close()


def _consumer(name: str, gate: Gate, history: History, rng: random.Random, keep: float) -> None:
    session = Session(gate)
    try:
        while not gate.stopping:
            answer = session.post(
                f"/v1/queues/{QUEUE}/claim", {"consumer": name, "max": rng.randint(1, 8), "wait": 0.5}
            )
            if answer is None:
                break
            response = answer.response
            if response is None or not response.is_success:
                if response is None:
                    history.claims_unknown.append(answer.sent)
                else:
                    history.errors.append(f"claim {response.status_code} {response.text[:200]}")
                gate.wait_past(answer.epoch, 1.0)
                continue
            settle = []
            for message in response.json()["messages"]:
                delivery = Delivery(
                    message["id"],
                    message["lease_id"],
                    message["payload"]["key"],
                    name,
                    answer.epoch,
                    answer.sent,
                    answer.received,
                )
                history.deliveries.append(delivery)
                if rng.random() >= keep:  # else kept unsettled: its lease expires and it comes back
                    settle.append((delivery.id, delivery.lease_id))
            if not settle:
                continue
            time.sleep(rng.uniform(0, 0.03))  # the work
            _ack(name, session, gate, history, tuple(settle), retries=1)
    finally:
        session.close()


def _ack(
    name: str,
    session: Session,
    gate: Gate,
    history: History,
    leases: tuple[tuple[str, str], ...],
    retries: int,
) -> None:
    body = {"leases": [lease_id for _, lease_id in leases]}
    for _ in range(retries + 1):
        answer = session.post(f"/v1/queues/{QUEUE}/ack", body)
        if answer is None:
            return
        response = answer.response
        if response is not None and response.is_success:
            skipped = set(response.json()["skipped"])
            acked = frozenset(lease_id for _, lease_id in leases if lease_id not in skipped)
            history.acks.append(Ack(leases, answer.epoch, answer.sent, answer.received, OK, acked, name))
            return
        outcome = UNKNOWN if response is None else REFUSED
        history.acks.append(Ack(leases, answer.epoch, answer.sent, answer.received, outcome, consumer=name))
        if response is not None:
            history.errors.append(f"ack {response.status_code} {response.text[:200]}")
        gate.wait_past(answer.epoch, 1.0)  # then retry: settling is idempotent and safe to retry (§5)


def _drain(url: str, epoch: int, history: History, timeout: float) -> bool:
    """Claim and ack until the queue is empty (leases restored by recovery expire first)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
        while time.monotonic() < deadline:
            sent = time.monotonic()
            response = http.post(
                f"/v1/queues/{QUEUE}/claim", json={"consumer": "drain", "max": 1000, "wait": 0.5}
            )
            received = time.monotonic()
            response.raise_for_status()
            messages = response.json()["messages"]
            if messages:
                leases = []
                for message in messages:
                    key = message["payload"]["key"]
                    delivery = Delivery(
                        message["id"], message["lease_id"], key, "drain", epoch, sent, received, True
                    )
                    history.deliveries.append(delivery)
                    leases.append((delivery.id, delivery.lease_id))
                sent = time.monotonic()
                acked = http.post(f"/v1/queues/{QUEUE}/ack", json={"leases": [lease for _, lease in leases]})
                acked.raise_for_status()
                skipped = set(acked.json()["skipped"])
                history.acks.append(
                    Ack(
                        tuple(leases),
                        epoch,
                        sent,
                        time.monotonic(),
                        OK,
                        frozenset(lease for _, lease in leases if lease not in skipped),
                        "drain",
                    )
                )
                continue
            stats = http.get(f"/v1/queues/{QUEUE}").json()["stats"]
            if stats["ready"] == stats["delayed"] == stats["in_flight"] == 0:
                return True
    return False


@dataclass
class Run:
    history: History
    verdict: Verdict
    cycles: int
    early_kills: int
    seconds: float
    tails_cut: int
    recovery_seconds: list[float]
    data_dir: Path
    notes: dict[str, list[str]] = field(default_factory=dict)

    def summary(self) -> str:
        verdict, history = self.verdict, self.history
        acked_calls = sum(ack.outcome == OK for ack in history.acks)
        lines = [
            f"cycles        {self.cycles} kills under load and restarts, {self.early_kills} more kills while "
            f"starting, in {self.seconds:.1f} s (journal tails cut: {self.tails_cut}; slowest recovery "
            f"{max(self.recovery_seconds, default=0):.3f} s)",
            f"messages      {verdict.messages} acknowledged publishes "
            f"({sum(p.outcome == OK for p in history.publishes)} calls, {verdict.publishes_unknown} unknown)",
            f"acks          {verdict.acked} messages acked "
            f"({acked_calls} calls, {verdict.acks_unknown} unknown)",
            f"deliveries    {verdict.deliveries} ({verdict.drained} left for the final drain; "
            f"{len(history.claims_unknown)} claims unknown)",
            f"duplicates    {verdict.duplicates}: {verdict.by_crash} explained by a crash, "
            f"{verdict.by_expiry} by lease expiry",
            f"reused ids    {verdict.reused_ids} (an id first given to a message lost at a kill before its "
            "publish was acknowledged)",
            f"foreign acks  {verdict.foreign_acks} (a retried ack that settled another consumer's delivery: "
            "the lease id was given again after a kill)",
            f"errors        {len(history.errors)} unexpected non-2xx answers",
            f"violations    {len(verdict.violations)}"
            + "".join(
                f", {kind} {count}"
                for kind, count in sorted(Counter(v.kind for v in verdict.violations).items())
            ),
        ]
        lines += [f"  {error}" for error in history.errors[:10]]
        for violation in verdict.violations[:50]:
            lines.append(f"  {violation}")
            lines += [f"      journal: {note}" for note in self.notes.get(violation.message_id, [])]
        return "\n".join(lines)


def run(
    data_dir: Path,
    *,
    cycles: int,
    seed: int,
    publishers: int = 2,
    consumers: int = 3,
    between: tuple[float, float] = (0.05, 2.0),
    early: float = 0.2,
    keep: float = 0.05,
    lease: float = LEASE,
    progress: Callable[[str], None] | None = None,
) -> Run:
    """``cycles`` kills at seeded random moments, each ``between`` seconds of load after the restart; after
    a kill, with probability ``early``, one more incarnation is killed while it starts."""
    rng = random.Random(seed)
    history = History(lease=lease)
    gate = Gate()
    used_ports: set[int] = set()
    started = time.monotonic()
    tails_cut = early_kills = 0
    recovery: list[float] = []
    server, url = start_server(data_dir, used_ports)
    threads: list[threading.Thread] = []
    try:
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT) as http:
            created = http.put(f"/v1/queues/{QUEUE}", json={"lease": lease})
            created.raise_for_status()
            assert created.json()["config"]["durable"] is True
        gate.open(0, url)
        failures: list[BaseException] = []

        def guarded(target: Callable[..., None], *args: Any) -> threading.Thread:
            def body() -> None:
                try:
                    target(*args)
                except BaseException as error:  # a client bug must fail the run, not thin the load
                    failures.append(error)
                    gate.stop()

            return threading.Thread(target=body, name=str(args[0]))

        for i in range(publishers):
            threads.append(guarded(_publisher, f"p{i}", gate, history, random.Random(f"{seed}-p{i}")))
        for i in range(consumers):
            threads.append(guarded(_consumer, f"c{i}", gate, history, random.Random(f"{seed}-c{i}"), keep))
        for thread in threads:
            thread.start()
        for cycle in range(1, cycles + 1):
            time.sleep(rng.uniform(*between))
            if failures:
                break
            history.kills.append(time.monotonic())
            server.kill()  # SIGKILL, whatever is in flight
            gate.close()
            if cycle == cycles:
                gate.stop()
            if rng.random() < early:
                early_kills += 1
                starting = kill_early(data_dir, used_ports, after=rng.uniform(0.05, 1.0))
                tails_cut += len(starting.events("journal_tail_cut"))
            server, url = start_server(data_dir, used_ports)
            tails_cut += len(server.events("journal_tail_cut"))
            recovery += [float(record["seconds"]) for record in server.events("recovered")]
            if cycle < cycles:
                gate.open(cycle, url)
            if progress is not None and (cycle % 10 == 0 or cycle == cycles):
                progress(
                    f"cycle {cycle}/{cycles}: {len(history.publishes)} publishes, "
                    f"{len(history.deliveries)} deliveries, {time.monotonic() - started:.0f} s"
                )
        gate.stop()
        for thread in threads:
            thread.join(timeout=HTTP_TIMEOUT + 5)
            if thread.is_alive():
                raise RuntimeError(f"the client thread {thread.name} did not stop")
        if failures:
            raise RuntimeError(f"a client thread failed: {failures[0]!r}") from failures[0]
        history.drained = _drain(url, cycles, history, timeout=lease + 20)
    finally:
        gate.stop()
        server.kill()
    verdict = check(history)
    result = Run(
        history, verdict, cycles, early_kills, time.monotonic() - started, tails_cut, recovery, data_dir
    )
    if verdict.violations:
        ids = {part for violation in verdict.violations for part in violation.message_id.split(",")}
        result.notes = journal_notes(data_dir, ids)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=100, help="kills and restarts (default 100)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill moments and the load")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"crash test: {args.cycles} cycles, seed {seed}", file=sys.stderr, flush=True)

    def give_up() -> None:
        print(f"crash test: gave up after {args.timeout} s (seed {seed})", file=sys.stderr, flush=True)
        for server in list(LIVE):
            with contextlib.suppress(OSError):
                server.process.kill()
        os._exit(2)

    watchdog = threading.Timer(args.timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    root = Path(tempfile.mkdtemp(prefix="broker-crash-"))
    data_dir = root / "data"
    ok = False
    try:
        result = run(
            data_dir,
            cycles=args.cycles,
            seed=seed,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        print(f"seed          {seed}")
        print(result.summary())
        ok = result.verdict.ok
    finally:
        watchdog.cancel()
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"data directory kept: {data_dir}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
