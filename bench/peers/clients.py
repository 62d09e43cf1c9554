"""The same work on every system, through the best-known Python client of each.

One small adapter per system (``publish``, ``claim``, ``ack``) and one loop for each role that every
system shares: the publisher, the consumers of the drain, and the single-message claim latency. The lease
each adapter implements:

* broker: ``POST …/claim`` (max 100, a 30 s lease, long poll ``wait``), ``POST …/ack`` with the lease ids.
* beanstalkd (greenstalk): ``reserve`` one job (its TTR, 60 s, is the lease), ``delete`` it to ack. The
  protocol has no batch reserve and greenstalk no pipelining: one round trip per put, reserve and delete.
* Redis (redis-py): ``RPUSH`` a batch of 100 in one command; claim = ``MOVE_SCRIPT``, a Lua script that
  runs up to 100 ``LMOVE queue processing:<consumer> LEFT RIGHT`` in the server and stops at the first
  that finds the list empty (one round trip, one command; a pipeline of 100 ``LMOVE`` sent 100 commands
  whatever the list held, and redis-py parsed every empty answer); when the queue is empty, one
  ``BLMOVE`` with the wait, and once it returns a message, the script again for up to 99 more in the
  same claim. Ack = a pipeline of ``LREM processing:<consumer> 1 <payload>``. A processing list is a
  lease without a deadline: a message stays there until acked, and only a reaper (not part of this
  benchmark) could give a dead consumer's messages back. Payloads are unique, so LREM removes the right
  one.
* PostgreSQL (psycopg 3, autocommit): ``INSERT … SELECT unnest(%s::text[])`` of 100 rows; the claim and
  the ack of ``CLAIM_SQL`` and ``ACK_SQL`` below, each its own transaction. An expired lease
  (``leased_until < now()``) is claimable again, as in the broker. An empty claim polls again after
  ``POLL_INTERVAL``. (LISTEN/NOTIFY drained slower: every listening consumer wakes on each commit and
  claims, all but one for nothing; in interleaved probes of 30,000 messages, 10,617 to 13,436 msg/s and
  2,090 to 2,124 empty claims against 15,384 to 15,632 msg/s and 1,747 to 1,842 polling every 10 ms.)

Every adapter counts ``empty_claim_queries``: the claim requests its server answered with nothing (an
empty PostgreSQL ``UPDATE``, a Redis move script that moved nothing or a ``BLMOVE`` that timed out, a
beanstalkd ``reserve`` or a broker long poll that timed out), the cost of waiting for work that the
drain records.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.synchronize
import time
from collections.abc import Callable
from typing import Any, Protocol

from bench.server import BenchError, Connection

#: Which client the broker's adapter uses: ``"client"`` (``broker.client.Client``: http.client
#: keep-alive connections since ``broker/client/wire.py``, httpx before) or ``"connection"``
#: (``bench.server.Connection``: bare http.client and orjson, the lightest, as ``bench.http_api``).
BROKER_CLIENT = "client"

BATCH = 100
PAYLOAD_SIZE = 200
LEASE_SECONDS = 30
#: A consumer's wait when the queue is empty: long poll (broker), reserve timeout (beanstalkd), BLMOVE
#: timeout (Redis), or for how long to poll (PostgreSQL).
CONSUMER_WAIT = 1.0
POLL_INTERVAL = 0.01
SETUP_TIMEOUT = 60.0

_fork = multiprocessing.get_context("fork")

TABLE_SQL = """
CREATE TABLE {table} (
    id           bigserial PRIMARY KEY,
    payload      text NOT NULL,
    attempts     integer NOT NULL DEFAULT 0,
    lease_owner  text,
    leased_until timestamptz,            -- NULL: ready; in the past: the lease expired, claimable again
    published_at timestamptz NOT NULL DEFAULT now()
)
"""
PUBLISH_SQL = "INSERT INTO {table} (payload) SELECT unnest(%s::text[])"
#: Up to ARGV[1] messages from KEYS[1] to KEYS[2], in the server, stopping when the list is empty.
MOVE_SCRIPT = """
local moved = {}
for _ = 1, tonumber(ARGV[1]) do
  local value = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not value then break end
  moved[#moved + 1] = value
end
return moved
"""
CLAIM_SQL = """
UPDATE {table} SET leased_until = now() + make_interval(secs => %(lease)s),
                   lease_owner = %(consumer)s, attempts = attempts + 1
WHERE id IN (
    SELECT id FROM {table}
    WHERE leased_until IS NULL OR leased_until < now()
    ORDER BY id
    LIMIT %(max)s
    FOR UPDATE SKIP LOCKED
)
RETURNING id, payload
"""
ACK_SQL = "DELETE FROM {table} WHERE id = ANY(%(ids)s) AND lease_owner = %(consumer)s"


def payloads(start: int, count: int) -> list[str]:
    """``count`` distinct ``PAYLOAD_SIZE``-character payloads, numbered from ``start``."""
    pad = "x" * (PAYLOAD_SIZE - 12)
    return [f"{number:012d}{pad}" for number in range(start, start + count)]


class Peer(Protocol):
    #: The most messages one claim returns.
    batch: int
    #: Claim requests the server answered with nothing so far.
    empty_claim_queries: int

    def publish(self, payloads: list[str]) -> None: ...
    def claim(self, max_count: int, wait: float) -> list[Any]: ...
    def ack(self, handles: list[Any]) -> None: ...
    def close(self) -> None: ...


#: How a peer is made: its class, called with the server's address, the queue and the consumer's name.
PeerClass = Callable[[dict[str, Any], str, str], Peer]


class BrokerClientPeer:
    """``broker.client.Client``."""

    batch = BATCH

    def __init__(self, address: dict[str, Any], queue: str, consumer: str) -> None:
        from broker.client import Client

        self._client = Client(f"http://{address['host']}:{address['port']}", timeout=60.0)
        self._queue, self._consumer = queue, consumer
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        self._client.publish_batch(self._queue, [{"payload": payload} for payload in payloads])

    def claim(self, max_count: int, wait: float) -> list[Any]:
        messages = self._client.claim(
            self._queue, consumer=self._consumer, max=max_count, lease=LEASE_SECONDS, wait=wait or None
        ).messages
        if not messages:
            self.empty_claim_queries += 1
        return messages

    def ack(self, handles: list[Any]) -> None:
        settled = self._client.ack(self._queue, handles)
        if settled.count != len(handles):
            raise BenchError(f"acked {settled.count} of {len(handles)}")

    def close(self) -> None:
        self._client.close()


class BrokerConnectionPeer:
    """``bench.server.Connection``: one keep-alive http.client connection, orjson bodies."""

    batch = BATCH

    def __init__(self, address: dict[str, Any], queue: str, consumer: str) -> None:
        self._connection = Connection(address["host"], address["port"])
        path = f"/v1/queues/{queue}"
        self._messages, self._claim, self._ack = f"{path}/messages", f"{path}/claim", f"{path}/ack"
        self._consumer = consumer
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        self._connection.call("POST", self._messages, {"messages": [{"payload": p} for p in payloads]})

    def claim(self, max_count: int, wait: float) -> list[Any]:
        body = {"consumer": self._consumer, "max": max_count, "lease": LEASE_SECONDS}
        if wait:
            body["wait"] = wait
        leases = [m["lease_id"] for m in self._connection.call("POST", self._claim, body)["messages"]]
        if not leases:
            self.empty_claim_queries += 1
        return leases

    def ack(self, handles: list[Any]) -> None:
        answer = self._connection.call("POST", self._ack, {"leases": handles})
        if answer["acked"] != len(handles):
            raise BenchError(f"acked {answer['acked']} of {len(handles)}")

    def close(self) -> None:
        self._connection.close()


class BeanstalkPeer:
    batch = 1

    def __init__(self, address: dict[str, Any], queue: str, consumer: str) -> None:
        import greenstalk

        self._timed_out = greenstalk.TimedOutError
        self._client = greenstalk.Client((address["host"], address["port"]), use=queue, watch=queue)
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        put = self._client.put
        for payload in payloads:
            put(payload, ttr=60)

    def claim(self, max_count: int, wait: float) -> list[Any]:
        try:
            return [self._client.reserve(timeout=int(wait))]
        except self._timed_out:
            self.empty_claim_queries += 1
            return []

    def ack(self, handles: list[Any]) -> None:
        for job in handles:
            self._client.delete(job)

    def close(self) -> None:
        self._client.close()


class RedisPeer:
    batch = BATCH

    def __init__(self, address: dict[str, Any], queue: str, consumer: str) -> None:
        import redis

        self._redis = redis.Redis(host=address["host"], port=address["port"], socket_timeout=60)
        self._queue, self._processing = queue, f"{queue}:processing:{consumer}"
        self._move_script = self._redis.register_script(MOVE_SCRIPT)
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        self._redis.rpush(self._queue, *payloads)

    def claim(self, max_count: int, wait: float) -> list[Any]:
        claimed = self._move(max_count)
        if claimed or not wait:
            return claimed
        self.empty_claim_queries += 1
        # redis-py annotates the timeout as an int, but BLMOVE takes seconds as a double and redis-py
        # sends it as given: int() would turn a wait under a second into 0, which blocks for ever.
        value = self._redis.blmove(
            self._queue,
            self._processing,
            wait,  # type: ignore[arg-type]
            "LEFT",
            "RIGHT",
        )
        if value is None:
            self.empty_claim_queries += 1
            return []
        # One RPUSH wakes every blocked consumer with one message each; the first to top up takes the
        # rest of the batch here rather than returning one message to ack in a round trip of its own.
        return [value, *self._move(max_count - 1)]

    def _move(self, count: int) -> list[Any]:
        """Up to ``count`` messages from the queue to this consumer's processing list, one command."""
        if count <= 0:
            return []
        return list(self._move_script(keys=[self._queue, self._processing], args=[count]))

    def ack(self, handles: list[Any]) -> None:
        pipeline = self._redis.pipeline(transaction=False)
        for value in handles:
            pipeline.lrem(self._processing, 1, value)
        if sum(pipeline.execute()) != len(handles):
            raise BenchError("LREM removed fewer messages than were claimed")

    def close(self) -> None:
        self._redis.close()


class PostgresPeer:
    batch = BATCH

    def __init__(self, address: dict[str, Any], queue: str, consumer: str) -> None:
        import psycopg

        self._connection = psycopg.connect(address["dsn"], autocommit=True)
        self._consumer = consumer
        self._publish, self._claim, self._ack = (
            sql.format(table=queue) for sql in (PUBLISH_SQL, CLAIM_SQL, ACK_SQL)
        )
        self.empty_claim_queries = 0

    def publish(self, payloads: list[str]) -> None:
        self._connection.execute(self._publish, (payloads,))

    def claim(self, max_count: int, wait: float) -> list[Any]:
        give_up_at = time.monotonic() + wait
        arguments = {"lease": LEASE_SECONDS, "consumer": self._consumer, "max": max_count}
        while True:
            rows = self._connection.execute(self._claim, arguments).fetchall()
            if rows:
                return [row[0] for row in rows]
            self.empty_claim_queries += 1
            if time.monotonic() >= give_up_at:
                return []
            time.sleep(POLL_INTERVAL)

    def ack(self, handles: list[Any]) -> None:
        cursor = self._connection.execute(self._ack, {"ids": handles, "consumer": self._consumer})
        if cursor.rowcount != len(handles):
            raise BenchError(f"deleted {cursor.rowcount} of {len(handles)} rows")

    def close(self) -> None:
        self._connection.close()


CLIENT_MODULES = {
    "broker": ["broker.client"],
    "beanstalkd": ["greenstalk"],
    "redis": ["redis"],
    "postgres": ["psycopg"],
}
PEERS: dict[str, PeerClass] = {
    "beanstalkd": BeanstalkPeer,
    "redis": RedisPeer,
    "postgres": PostgresPeer,
}
BROKER_PEERS: dict[str, PeerClass] = {"client": BrokerClientPeer, "connection": BrokerConnectionPeer}


def connect(system: str, address: dict[str, Any], queue: str, consumer: str = "bench") -> Peer:
    # BROKER_CLIENT is read here, not at import, so that a command-line choice reaches forked clients; an
    # address may name its own (the http.client row of the table).
    if system == "broker":
        peer_class = BROKER_PEERS[address.get("broker_client") or BROKER_CLIENT]
    else:
        peer_class = PEERS[system]
    return peer_class(address, queue, consumer)


def prepare(system: str, address: dict[str, Any], queue: str) -> None:
    """What a queue needs before the clients start: the broker's queue (``address["queue_config"]``), the
    PostgreSQL table. Redis lists and beanstalkd tubes exist once used. The client library is imported
    here, before the client processes are forked, so that none of them spends its CPU importing it."""
    for module in CLIENT_MODULES[system]:
        importlib.import_module(module)
    if system == "broker":
        broker = Connection(address["host"], address["port"])
        try:
            broker.call("PUT", f"/v1/queues/{queue}", address.get("queue_config", {}))
        finally:
            broker.close()
    elif system == "postgres":
        import psycopg

        with psycopg.connect(address["dsn"], autocommit=True) as postgres:
            postgres.execute(TABLE_SQL.format(table=queue))


# -- the loops, run in forked processes ------------------------------------------------------------------


class DrainProgress:
    """Shared by a drain's processes: ``drained`` is set the moment every message the publisher published
    has been acked, so that the runner can read the server's CPU at the last ack rather than after the
    consumers' final empty claims (a second each) and their exit.

    The publisher reports its count once, at its end; each consumer adds what it acked after each ack
    (one lock per claimed batch, no work per message)."""

    def __init__(self) -> None:
        self._published = _fork.Value("q", -1)  # -1 until the publisher is done
        self._acked = _fork.Value("q", 0, lock=False)  # guarded by the lock of _published
        self.drained = _fork.Event()

    def add_published(self, count: int) -> None:
        with self._published.get_lock():
            self._published.value = count
            self._check()

    def add_acked(self, count: int) -> None:
        with self._published.get_lock():
            self._acked.value += count
            self._check()

    def _check(self) -> None:
        if 0 <= self._published.value <= self._acked.value:
            self.drained.set()


def publisher(
    system: str,
    address: dict[str, Any],
    queue: str,
    messages: int,
    budget: float,
    progress: DrainProgress,
    start: multiprocessing.synchronize.Barrier,
    published_all: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Publish ``messages`` in batches of ``BATCH``, one call at a time, or fewer if ``budget`` seconds
    run out first (a fsync per message makes some peers take minutes for 100,000)."""
    try:
        peer = connect(system, address, queue, "publisher")
        batches = [payloads(offset, min(BATCH, messages - offset)) for offset in range(0, messages, BATCH)]
        start.wait(SETUP_TIMEOUT)
        started = time.perf_counter()
        give_up_at = started + budget
        published = 0
        for batch in batches:
            if time.perf_counter() > give_up_at:
                break
            peer.publish(batch)
            published += len(batch)
        finished = time.perf_counter()
        progress.add_published(published)
        published_all.set()
        peer.close()
        results.put({"role": "publisher", "started": started, "finished": finished, "published": published})
    except BaseException as exc:
        published_all.set()
        results.put({"role": "publisher", "error": f"{type(exc).__name__}: {exc}"})


def consumer(
    system: str,
    address: dict[str, Any],
    queue: str,
    index: int,
    timeout: float,
    progress: DrainProgress,
    start: multiprocessing.synchronize.Barrier,
    published_all: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[dict[str, Any]],
) -> None:
    """Claim up to ``BATCH``, ack them all, until the publisher is done and a claim finds nothing."""
    try:
        peer = connect(system, address, queue, f"consumer-{index}")
        acked = claims = empty_claims = 0
        last_ack = None
        start.wait(SETUP_TIMEOUT)
        give_up_at = time.perf_counter() + timeout
        while True:
            if time.perf_counter() > give_up_at:
                raise BenchError(f"consumer {index} gave up after {timeout:g} s with {acked} acked")
            publisher_done = published_all.is_set()  # read before claiming: then empty means done
            handles = peer.claim(BATCH, CONSUMER_WAIT)
            claims += 1
            if not handles:
                empty_claims += 1
                if publisher_done:
                    break
                continue
            peer.ack(handles)
            last_ack = time.perf_counter()
            acked += len(handles)
            progress.add_acked(len(handles))
        peer.close()
        results.put(
            {
                "role": "consumer",
                "acked": acked,
                "last_ack": last_ack,
                "claims": claims,
                "empty_claims": empty_claims,
                "empty_claim_queries": peer.empty_claim_queries,
            }
        )
    except BaseException as exc:
        results.put({"role": "consumer", "error": f"{type(exc).__name__}: {exc}"})


def claim_latency(
    system: str, address: dict[str, Any], queue: str, claims: int, warmup: int, timeout: float
) -> list[float]:
    """Milliseconds per single-message claim (max 1, no wait) on a queue already holding them all. Each
    claimed message is acked, untimed, before the next timed claim, as a consumer does: no claim is timed
    with thousands of leases piling up (PostgreSQL's claim scans past every leased row) nor, for the
    broker, only ever after another claim."""
    peer = connect(system, address, queue, "latency")
    try:
        total = claims + warmup
        for offset in range(0, total, BATCH):
            peer.publish(payloads(offset, min(BATCH, total - offset)))
        perf_counter = time.perf_counter
        milliseconds: list[float] = []
        give_up_at = perf_counter() + timeout
        for index in range(total):
            if perf_counter() > give_up_at:
                raise BenchError(f"{index} claims took more than {timeout:g} s")
            started = perf_counter()
            claimed = peer.claim(1, 0)
            elapsed = perf_counter() - started
            if len(claimed) != 1:
                raise BenchError(f"a claim of one message returned {len(claimed)}")
            peer.ack(claimed)
            if index >= warmup:
                milliseconds.append(elapsed * 1000)
        return milliseconds
    finally:
        peer.close()
