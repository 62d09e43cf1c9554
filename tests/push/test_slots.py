"""A message pushed again while its previous push still runs: each push holds a slot of ``concurrency``
until it ends, and a stopping dispatcher gives back the lease of the newest delivery.

Both happen when a message is settled before its push task is done with it: in ack mode by a callback
that comes before the 2xx (which push.md allows), in standard mode by the push's own nack when the
queue's backoff is zero. The receiver is answered in memory under the autojump clock (conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from broker.actor import QueueActor
from broker.core.commands import Nack
from tests.push.conftest import Received, Receiver, publish, pushing, put_queue, stats, wait_until

HOOK = "http://receiver.test/hook"


async def test_a_message_repushed_while_its_first_push_runs_holds_a_slot_per_push(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ack mode, concurrency 3: the receiver nacks (no delay) the first push, of message A (either of
    two), by callback and answers its 2xx 3 s later. A is pushed again at once, so A's first request,
    A's second delivery and the other message fill the three slots: nothing else goes out until A's
    first request ends. Removing push then gives every message back at once and leaves nothing waiting
    for a callback."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        first_pushes: list[str] = []

        async def nack_first_then_answer_late(request: Received) -> tuple[int, dict[str, str]]:
            envelope = request.json
            if not first_pushes:
                first_pushes.append(envelope["id"])
                nack = {"lease_id": envelope["lease_id"], "delay": 0}
                response = await p.client.post(f"/v1/messages/{envelope['id']}/nack", json=nack)
                assert (await response.get_json())["nacked"] == 1
                await trio.sleep(3)
            return 200, {}  # the others then wait for a callback that never comes (within the test)

        receiver.answer = nack_first_then_answer_late
        await put_queue(p.client, push={"url": HOOK, "mode": "ack", "ack_timeout": 120, "concurrency": 3})
        await publish(p.client, "first")
        await publish(p.client, "second")
        await wait_until(lambda: len(receiver.requests) == 3)
        [nacked] = first_pushes  # A or B, whichever went out first
        pushed = sorted((r.json["id"] == nacked, r.json["attempt"]) for r in receiver.requests)
        assert pushed == [(False, 1), (True, 1), (True, 2)]
        for n in range(10):
            await publish(p.client, n)
        await trio.sleep(10)  # A's first request ends at 3 s: one slot frees, the other two wait

        assert len(receiver.requests) == 4, "one push per slot freed, never more than concurrency"
        status = p.supervisor.status("jobs")
        assert status is not None and status["in_flight"] == 3
        assert (await stats(p.client))["in_flight"] == 3, "the dispatcher's books match the queue's"

        await put_queue(p.client, push=None)
        await wait_until(lambda: p.supervisor.status("jobs") is None)
        after = await stats(p.client)
        assert (after["in_flight"], after["ready"]) == (0, 12), "every lease given back at once"
        assert len(p.supervisor.acks) == 0, "no delivery left waiting for a callback"


async def test_a_failed_push_repushed_before_its_task_ends_keeps_its_slot_and_lease(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Standard mode, zero backoff: the push's nack makes the message claimable at once, and the claim
    loop may push it again before the failed push's task has run its end. That order is forced here
    (the nack's reply is held until the second push has arrived): the task's end must free its own slot
    only, so the second push still counts, and its lease is given back when push stops."""
    second_push = trio.Event()
    request = QueueActor.request

    async def nack_returns_after_the_second_push(actor: QueueActor, command: Any) -> Any:
        result = await request(actor, command)
        if isinstance(command, Nack):
            await second_push.wait()
        return result

    monkeypatch.setattr(QueueActor, "request", nack_returns_after_the_second_push)

    async def fail_then_hold(request: Received) -> tuple[int, dict[str, str]]:
        if request.json["attempt"] == 1:
            return 500, {}
        second_push.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    receiver = Receiver(fail_then_hold)
    async with pushing(receiver.transport()) as p:
        backoff = {"type": "fixed", "base": 0}
        await put_queue(p.client, retry_backoff=backoff, push={"url": HOOK, "concurrency": 2, "timeout": 120})
        await publish(p.client, "x")
        await wait_until(lambda: receiver.in_progress == 1 and len(receiver.requests) == 2)
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("failed_total") == 1)
        status = p.supervisor.status("jobs")
        assert status is not None and status["in_flight"] == 1, "the second push holds its slot"

        await put_queue(p.client, push=None)
        await wait_until(lambda: p.supervisor.status("jobs") is None)
        after = await stats(p.client)
        assert (after["in_flight"], after["ready"]) == (0, 1), "its lease given back at once"
