"""Messages that leave a queue without being claimed are let go of, not held by stale entries.

A message that leaves while ready or delayed (its ``message_ttl`` ran out, a delete) leaves its entry
in the ready lanes, the reclaim heap or the delay heap; only a claim that reaches it, or a delay
ending, would drop it. ``_advance`` compacts those structures once stale entries outnumber live ones,
so a queue that nobody claims from does not keep every message it expired. The tests count the
``Message`` objects still in memory (through the garbage collector, which tracks them), so they fail
on any reference left behind, wherever it sits.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

from broker.core import FinishedHistory, NewMessage, QueueConfig, QueueCore
from broker.core.model import Message

#: Get-one keeps this many finished messages (they are meant to stay in memory).
KEPT = 10
_prefixes = (f"stale{n}-" for n in itertools.count())


def a_queue(**config: Any) -> QueueCore:
    """A queue with a TTL of 1 s, dropping what expires, whose ids start with a prefix of its own."""
    settings: dict[str, Any] = {"message_ttl": 1.0, "dead_letter": None, **config}
    return QueueCore("t3", QueueConfig(**settings), next(_prefixes), history=FinishedHistory(count=KEPT))


def messages_in_memory(queue: QueueCore) -> int:
    """How many of ``queue``'s messages, live or gone, are still objects in memory."""
    gc.collect()
    prefix = queue.id_prefix
    return sum(1 for obj in gc.get_objects() if type(obj) is Message and obj.id.startswith(prefix))


def publish_rounds(queue: QueueCore, now: float, *, delay: float, rounds: int = 3, batch: int = 1000) -> None:
    """Each round: ``batch`` messages, every other one delayed by ``delay``."""
    messages = [NewMessage(b"{}", delay=delay if n % 2 else 0.0) for n in range(batch)]
    for _ in range(rounds):
        queue.publish(messages, now)


def test_expired_messages_are_let_go_when_delayed_ones_came_due_out_of_order() -> None:
    # The reviewer's case: the delayed half comes due behind later publishes, into the out-of-order
    # part of its lane, which stats reads never trimmed; there they stayed until a claim.
    queue = a_queue()
    for round_start in (1000.0, 1010.0, 1020.0, 1030.0):
        publish_rounds(queue, round_start, delay=0.2)
        queue.stats(round_start + 0.5)  # the delays end
        stats, _ = queue.stats(round_start + 2.0)  # every TTL ran out
        assert (stats.ready, stats.delayed) == (0, 0)
        assert messages_in_memory(queue) <= KEPT
    assert queue.stats(1040.0)[0].expired_total == 4 * 3000


def test_expired_messages_are_let_go_by_a_wake_up_without_a_stats_read() -> None:
    # Without delays every entry sits in the in-order part; notice_due (the actor's wake-up at the
    # next TTL) never looked at the heads, so they stayed until the next stats read or claim.
    queue = a_queue()
    publish_rounds(queue, 1000.0, delay=0.0)
    assert len(queue.notice_due(1002.0)) == 3000
    assert messages_in_memory(queue) <= KEPT


def test_expired_messages_whose_lease_had_expired_are_let_go() -> None:
    queue = a_queue(lease=0.1)
    publish_rounds(queue, 1000.0, delay=0.0)
    outcome, _ = queue.claim("worker", 3000, None, 1000.0)
    assert len(outcome.deliveries) == 3000
    del outcome
    assert queue.stats(1000.5)[0].ready == 3000  # noticed: all on the reclaim heap
    queue.notice_due(1002.0)
    assert messages_in_memory(queue) <= KEPT


def test_expired_messages_still_delayed_are_let_go_before_their_delay_ends() -> None:
    queue = a_queue()
    publish_rounds(queue, 1000.0, delay=3600.0)
    queue.notice_due(1002.0)
    assert messages_in_memory(queue) <= KEPT


def test_deleted_messages_are_let_go_without_a_claim() -> None:
    queue = a_queue(message_ttl=0.0)
    messages = [NewMessage(b"{}", delay=100.0 if n % 2 else 0.0) for n in range(3000)]
    ids = [message_id for message_id, _, _ in queue.publish(messages, 1000.0)[0]]
    for message_id in ids:
        queue.delete(message_id, 1000.0)
    queue.notice_due(1000.0)
    # Deleted messages are not kept for get-one; at most the compaction's slack of stale entries (1,024
    # per structure) may still hold some, whatever the number deleted.
    assert messages_in_memory(queue) <= 1024


def test_compaction_keeps_the_live_messages_in_claim_order() -> None:
    # Stale entries between live ones, in every structure: what is left comes out as it would have.
    queue = a_queue(message_ttl=0.0)
    priorities = [0, 5, 0, -1]
    messages = [
        NewMessage(b"{}", priority=priorities[n % 4], delay=2.0 if n % 3 == 0 else 0.0) for n in range(6000)
    ]
    ids = [message_id for message_id, _, _ in queue.publish(messages, 1000.0)[0]]
    kept = set(ids[::7])
    for message_id in ids:
        if message_id not in kept:
            queue.delete(message_id, 1000.0)
    queue.notice_due(1001.0)
    queue.notice_due(1003.0)  # the delays end: out-of-order entries of their lanes
    outcome, _ = queue.claim("worker", 6000, None, 1003.0)
    claimed = [(message.priority, message.seq) for _, message in outcome.deliveries]
    assert len(claimed) == len(kept)
    assert claimed == sorted(claimed, key=lambda item: (-item[0], item[1]))


def test_publish_and_delete_alone_let_the_deleted_messages_go() -> None:
    """Nothing else advances such a queue (no claim, no stats read): the deletes compact the lanes."""
    queue = QueueCore("jobs", QueueConfig(), "m-")
    now = 1000.0
    for _ in range(5_000):
        now += 0.001
        [(message_id, _, _)], _ = queue.publish([NewMessage(b'"x"')], now)
        queue.delete(message_id, now)
    assert len(queue._fresh) <= 1024 + 1  # nothing ready: at most the slack, and the last one
