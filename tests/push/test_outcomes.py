"""Each answer's outcome, with time moved by the autojump clock (the receiver is answered in memory,
``Receiver.transport()``, so no socket races the jumps): ack mode and its timeout, backpressure that
spends no attempt, timeouts, the pause on 401/403, concurrency and the rate limit."""

from __future__ import annotations

import email.utils
from typing import Any

import pytest
import structlog
import trio

from broker.actor import QueueActor
from broker.core.commands import Ack
from broker.errors import StorageUnavailable
from broker.push.dispatcher import CLAIM_WAIT
from tests.push.conftest import Received, Receiver, message, publish, pushing, put_queue, stats, wait_until

HOOK = "http://receiver.test/hook"
#: Wall time and Trio time differ by an offset, so a wall-time delay lands within float error of it.
EPSILON = 1e-6


def answers(*sequence: tuple[int, dict[str, str]]) -> Any:
    """An answer function giving ``sequence`` in turn, then 200."""
    queue = list(sequence)

    async def answer(_: Received) -> tuple[int, dict[str, str]]:
        return queue.pop(0) if queue else (200, {})

    return answer


async def shown_status(response: Any) -> dict[str, Any]:
    status: dict[str, Any] = (await response.get_json())["status"]
    return status


async def test_ack_mode_waits_for_the_callback(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "mode": "ack", "ack_timeout": 600})
        message_id = await publish(p.client, {"job": 1})
        await wait_until(lambda: len(receiver.requests) == 1)
        await trio.sleep(300)
        assert (await stats(p.client))["in_flight"] == 1, "a 2xx in ack mode does not ack"
        assert (await message(p.client, message_id))["state"] == "in_flight"

        response = await p.client.post(f"/v1/messages/{message_id}/ack")
        assert response.status_code == 200
        assert await response.get_json() == {"id": message_id, "queue": "jobs", "acked": 1}
        assert (await stats(p.client))["acked_total"] == 1
        shown = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        assert [(a["attempt"], a["status"], a["outcome"]) for a in shown["attempts"]] == [
            (1, 200, "settled by ack")  # no longer awaiting
        ]
        assert (await shown_status(await p.client.get("/v1/queues/jobs/push")))["acked_total"] == 1
        again = await p.client.post(f"/v1/messages/{message_id}/ack")
        assert (again.status_code, await again.get_json()) == (200, await response.get_json()), "idempotent"
        other = await p.client.post(f"/v1/messages/{message_id}/nack", json={})
        assert other.status_code == 409
        unknown = await p.client.post("/v1/messages/nope/ack")
        assert (unknown.status_code, (await unknown.get_json())["error"]["code"]) == (
            404,
            "message_not_found",
        )
        await trio.sleep(1000)
        assert len(receiver.requests) == 1


async def test_an_ack_mode_push_whose_lease_ended_leaves_the_next_push_of_its_message_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The receiver settles the first push through the lease API instead of the callback (here a nack),
    so the message is pushed again while the first push still waits: the first push's ack_timeout must
    not end the second, whose callback settles it."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "mode": "ack", "ack_timeout": 600})
        message_id = await publish(p.client, {"job": 1})
        await wait_until(lambda: len(receiver.requests) == 1)
        first_lease = receiver.requests[0].json["lease_id"]
        await trio.sleep(100)  # the second push's ack_timeout ends 100 s after the first's
        nacked = await p.client.post("/v1/queues/jobs/nack", json={"leases": [first_lease], "delay": 0})
        assert (await nacked.get_json())["nacked"] == 1
        await wait_until(lambda: len(receiver.requests) == 2)
        second_lease = receiver.requests[1].json["lease_id"]
        assert second_lease != first_lease

        await trio.sleep(600 - (trio.current_time() - receiver.requests[0].at) + 0.1)  # first's timeout
        assert (await message(p.client, message_id))["state"] == "in_flight"
        late = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": first_lease})
        assert late.status_code == 409
        assert "pushed again" in (await late.get_json())["error"]["message"]
        response = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": second_lease})
        assert (response.status_code, await response.get_json()) == (
            200,
            {"id": message_id, "queue": "jobs", "acked": 1},
        )
        assert (await stats(p.client))["acked_total"] == 1
        await trio.sleep(1000)
        assert len(receiver.requests) == 2, "settled: not pushed again"


async def test_a_push_that_fails_while_its_callback_is_carried_out_waits_for_what_the_callback_does(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver calls back (an ack), then answers 500; the ack reaches the actor only after that,
    and fails (a storage fault's 503). The push used to be taken as settled by the ack and leave the book
    at once: the message sat in flight, a retried callback was answered 404, until its lease expired.
    The push waits for its callback, and when that fails settles as a failed push: nacked, retried."""
    gate = trio.Event()
    request = QueueActor.request

    async def ack_failing_at_the_gate(actor: QueueActor, command: Any) -> Any:
        if isinstance(command, Ack):
            await gate.wait()
            raise StorageUnavailable("the journal cannot be written; nothing was acknowledged")
        return await request(actor, command)

    monkeypatch.setattr(QueueActor, "request", ack_failing_at_the_gate)
    callbacks: list[int] = []
    receiver = Receiver()
    async with pushing(receiver.transport()) as p, trio.open_nursery() as nursery:

        async def call_back(message_id: str) -> None:
            callbacks.append((await p.client.post(f"/v1/messages/{message_id}/ack")).status_code)

        async def call_back_then_fail(received: Received) -> tuple[int, dict[str, str]]:
            if len(receiver.requests) > 1:
                return 200, {}
            nursery.start_soon(call_back, received.json["id"])
            await wait_until(lambda: p.supervisor.acks._waiting[received.json["id"]].verb == "ack")
            return 500, {}

        receiver.answer = call_back_then_fail
        await put_queue(
            p.client, retry_backoff={"type": "fixed", "base": 5}, push={"url": HOOK, "mode": "ack"}
        )
        message_id = await publish(p.client, {"job": 1})
        await wait_until(lambda: len(receiver.requests) == 1)
        await trio.sleep(1)
        assert (await message(p.client, message_id))["state"] == "in_flight", "the callback decides"
        gate.set()
        await wait_until(lambda: callbacks == [503])
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("failed_total") == 1, within=1)
        assert (await message(p.client, message_id))["state"] == "delayed", "nacked, back after retry_backoff"
        await wait_until(lambda: len(receiver.requests) == 2, within=6)
        shown = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        first = shown["attempts"][0]
        assert (first["attempt"], first["status"], first["outcome"]) == (1, 500, "failed")


async def test_ack_mode_nack_and_defer_callbacks(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, max_attempts=5, push={"url": HOOK, "mode": "ack"})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        deferred = await p.client.post(f"/v1/messages/{message_id}/defer", json={"retry_after": 30})
        assert (await deferred.get_json())["deferred"] == 1
        await wait_until(lambda: len(receiver.requests) == 2, within=100)
        assert receiver.requests[1].at - receiver.requests[0].at >= 30 - EPSILON
        assert receiver.requests[1].json["attempt"] == 1, "a defer spends no attempt"
        nacked = await p.client.post(
            f"/v1/messages/{message_id}/nack", json={"retryable": False, "reason": "bad"}
        )
        assert await nacked.get_json() == {"id": message_id, "queue": "jobs", "nacked": 1, "dead_lettered": 1}
        assert (await stats(p.client))["dead_lettered_total"] == 1


async def test_null_in_a_callback_s_optional_field_is_its_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(
            p.client, retry_backoff={"type": "fixed", "base": 5}, push={"url": HOOK, "mode": "ack"}
        )
        message_id = await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        deferred = await p.client.post(
            f"/v1/messages/{message_id}/defer", json={"retry_after": None, "reason": None, "lease_id": None}
        )
        assert (await deferred.get_json())["deferred"] == 1  # back at once: retry_after 0
        await wait_until(lambda: len(receiver.requests) == 2, within=1)
        nacked = await p.client.post(
            f"/v1/messages/{message_id}/nack", json={"retryable": None, "delay": None}
        )
        assert (await nacked.get_json())["dead_lettered"] == 0, "retryable: true"
        await wait_until(lambda: len(receiver.requests) == 3, within=6)  # after retry_backoff


async def test_a_callback_naming_its_delivery_never_settles_a_later_push(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A nack's answer is lost and the worker retries it; meanwhile the message was pushed again (no
    backoff). Named by the envelope's lease_id, the retry gets the first answer again, and the new
    delivery still waits for its own callback."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, max_attempts=2, push={"url": HOOK, "mode": "ack"})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        first = receiver.requests[0].json["lease_id"]
        nack = {"retryable": True, "lease_id": first}
        answer = await p.client.post(f"/v1/messages/{message_id}/nack", json=nack)
        assert await answer.get_json() == {"id": message_id, "queue": "jobs", "nacked": 1, "dead_lettered": 0}
        await wait_until(lambda: len(receiver.requests) == 2)
        second = receiver.requests[1].json["lease_id"]
        assert second != first
        again = await p.client.post(f"/v1/messages/{message_id}/nack", json=nack)
        assert (again.status_code, await again.get_json()) == (200, await answer.get_json())
        assert (await stats(p.client))["dead_lettered_total"] == 0, "the second push is not nacked"
        other = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": first})
        assert other.status_code == 409  # the first delivery was nacked, not acked
        acked = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": second})
        assert (acked.status_code, (await acked.get_json())["acked"]) == (200, 1)
        unknown = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": "nope"})
        assert unknown.status_code == 404
        bad = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": 7})
        assert bad.status_code == 400


async def test_a_made_up_lease_id_is_refused_without_a_false_story(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lease_id that is not the waiting delivery's, and of no delivery the broker remembers settling:
    a 409 that says only that (not that the message was pushed again, which it was not), and the
    waiting delivery is untouched."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "mode": "ack"})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        waiting = receiver.requests[0].json["lease_id"]
        made_up = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": waiting + "x"})
        error = (await made_up.get_json())["error"]
        assert (made_up.status_code, error["code"]) == (409, "conflict")
        assert error["message"] == (
            f"lease {waiting + 'x'!r} is not the delivery of message {message_id!r} that waits for a "
            f"callback (that is {waiting!r}); nothing was settled"
        )
        acked = await p.client.post(f"/v1/messages/{message_id}/ack", json={"lease_id": waiting})
        assert (acked.status_code, (await acked.get_json())["acked"]) == (200, 1)
        assert len(receiver.requests) == 1


async def test_a_callback_may_come_before_the_2xx(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:

        async def ack_first(request: Received) -> tuple[int, dict[str, str]]:
            response = await p.client.post(f"/v1/messages/{request.json['id']}/ack")
            assert response.status_code == 200
            return 200, {}

        receiver.answer = ack_first
        await put_queue(p.client, push={"url": HOOK, "mode": "ack"})
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        await trio.sleep(1000)
        assert (await stats(p.client))["acked_total"] == 1
        assert len(receiver.requests) == 1
        # …and counted among the callbacks, though it came before the 2xx
        assert (await shown_status(await p.client.get("/v1/queues/jobs/push")))["acked_total"] == 1


@pytest.mark.parametrize("action", ["retry", "dead"])
async def test_the_ack_timeout_retries_or_dead_letters(
    action: str, autojump_clock: trio.testing.MockClock
) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        push = {"url": HOOK, "mode": "ack", "ack_timeout": 60, "ack_timeout_action": action}
        await put_queue(p.client, max_attempts=3, push=push)
        message_id = await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        if action == "retry":
            await wait_until(lambda: len(receiver.requests) == 2, within=100)
            assert 60 <= receiver.requests[1].at - receiver.requests[0].at < 70
            assert receiver.requests[1].json["attempt"] == 2
        else:
            await wait_until(lambda: "jobs.dlq" in p.broker.registry, within=100)
            assert len(receiver.requests) == 1
        late = await p.client.post(f"/v1/messages/{message_id}/ack")
        if action == "dead":
            assert late.status_code == 409
            assert "ack_timeout" in (await late.get_json())["error"]["message"]
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        outcomes = [(a["attempt"], a["outcome"]) for a in history["attempts"]][:2]
        assert outcomes == [(1, "awaiting_ack"), (1, "ack_timeout")]


@pytest.mark.parametrize("status", [429, 503, 529])
async def test_backpressure_defers_for_retry_after_seconds(
    status: int, autojump_clock: trio.testing.MockClock
) -> None:
    receiver = Receiver(answers((status, {"retry-after": "30"})))
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, max_attempts=1, push={"url": HOOK})
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 2, within=100)
        assert 30 - EPSILON <= receiver.requests[1].at - receiver.requests[0].at < 31
        assert [r.json["attempt"] for r in receiver.requests] == [1, 1], "no attempt spent"
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        assert (await stats(p.client))["deferred_total"] == 1


async def test_retry_after_as_an_http_date(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        when = email.utils.formatdate(p.broker.clock.now() + 120, usegmt=True)
        receiver.answer = answers((429, {"retry-after": when}))
        await put_queue(p.client, push={"url": HOOK})
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 2, within=200)
        assert 118 <= receiver.requests[1].at - receiver.requests[0].at < 122


async def test_no_retry_after_holds_for_60_seconds(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver(answers((503, {})))
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK})
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 2, within=200)
        assert 60 - EPSILON <= receiver.requests[1].at - receiver.requests[0].at < 61


async def test_failures_back_off_then_dead_letter(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver(answers((500, {}), (404, {}), (502, {})))
    async with pushing(receiver.transport()) as p:
        backoff = {"type": "exponential", "base": 10, "max": 600}
        await put_queue(p.client, max_attempts=3, retry_backoff=backoff, push={"url": HOOK})
        await publish(p.client, "x")
        await wait_until(lambda: "jobs.dlq" in p.broker.registry, within=200)
        times = [r.at for r in receiver.requests]
        assert len(times) == 3
        assert 10 - EPSILON <= times[1] - times[0] < 11 and 20 - EPSILON <= times[2] - times[1] < 21
        [dead] = (
            await (await p.client.get("/v1/queues/jobs.dlq/messages")).get_json()
            and (await (await p.client.get("/v1/queues/jobs.dlq/messages")).get_json())["messages"]
        )
        assert dead["headers"]["x-dead-letter-reason"] == "max_attempts"


async def test_a_timeout_is_a_failed_attempt(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(_: Received) -> tuple[int, dict[str, str]]:
        await trio.sleep(100)
        return 200, {}

    receiver = Receiver(slow)
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, max_attempts=1, push={"url": HOOK, "timeout": 2})
        message_id = await publish(p.client, "x")
        await wait_until(lambda: "jobs.dlq" in p.broker.registry, within=50)
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        [attempt] = history["attempts"]
        assert (attempt["status"], attempt["error"], attempt["outcome"]) == (
            None,
            "timeout after 2s",
            "failed",
        )
        assert 2 <= attempt["duration"] < 2.1


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refusal_pauses_the_queues_push(status: int, autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver(answers((status, {}), (status, {})))
    async with pushing(receiver.transport()) as p:
        url = HOOK.replace("//", "//alice:hidden@") + "?token=hidden"  # user-info, path and query: secret
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, max_attempts=1, push={"url": url})
            await publish(p.client, "a")
            await wait_until(lambda: len(receiver.requests) == 1)
            await trio.sleep(1)
        [paused] = [entry for entry in logs if entry["event"] == "push_paused"]
        assert paused["host"] == "receiver.test" and "hidden" not in str(paused)
        shown = await (await p.client.get("/v1/queues/jobs/push")).get_json()
        assert shown["status"]["state"] == "paused"
        assert (
            str(status) in shown["status"]["pause_reason"] and "hidden" not in shown["status"]["pause_reason"]
        )
        queue = await (await p.client.get("/v1/queues/jobs")).get_json()  # the queue's own answer too
        assert queue["push"]["state"] == "paused" and queue["push"]["refused_total"] == 1
        assert queue["config"]["push"]["url"] == "http://alice:***@receiver.test/hook?token=hidden"
        await publish(p.client, "b")
        await trio.sleep(50)
        assert len(receiver.requests) == 1, "nothing is pushed while paused"
        await wait_until(lambda: len(receiver.requests) == 2, within=20)  # the probe after 60 s
        assert 60 - EPSILON <= receiver.requests[1].at - receiver.requests[0].at < 61
        await wait_until(lambda: len(receiver.requests) >= 3, within=200)  # refused again: 120 s
        assert 120 - EPSILON <= receiver.requests[2].at - receiver.requests[1].at < 121
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 2, within=10)
        assert (await stats(p.client))["dead_lettered_total"] == 0, "a refusal spends no attempt"
        assert (await (await p.client.get("/v1/queues/jobs/push")).get_json())["status"]["state"] == "running"
        assert (await (await p.client.get("/v1/queues/jobs")).get_json())["push"]["state"] == "running"


async def test_a_new_push_config_ends_a_pause_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """A refusal pauses push 60 s, doubling to 15 minutes; the operator's fix, a new secret or URL, used
    to wait for the pause to end. It ends the pause: its first push is the probe. A PUT that leaves the
    push config as it was does not. (The refused message itself was deferred for the pause.)"""
    receiver = Receiver(answers((401, {})))
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "secret": "old-secret-0123456789"})
        await publish(p.client, "a")
        await wait_until(lambda: len(receiver.requests) == 1)
        await trio.sleep(1)
        assert (await (await p.client.get("/v1/queues/jobs/push")).get_json())["status"]["state"] == "paused"
        await publish(p.client, "b")
        await put_queue(p.client, push={"url": HOOK, "secret": "old-secret-0123456789"}, max_attempts=9)
        await trio.sleep(10)
        assert len(receiver.requests) == 1, "the same push config: still paused"
        refused_at = receiver.requests[0].at
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, push={"url": HOOK, "secret": "new-secret-0123456789"})
            await wait_until(lambda: len(receiver.requests) == 2, within=1)
        assert receiver.requests[1].at - refused_at < 12, "pushed within a second of the PUT, not at 60 s"
        assert receiver.requests[1].json["payload"] == "b"
        assert [entry["event"] for entry in logs if entry["event"] == "push_resumed"] == ["push_resumed"]
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        assert (await (await p.client.get("/v1/queues/jobs/push")).get_json())["status"]["state"] == "running"


async def test_a_new_push_config_ends_a_pause_while_the_claim_loop_long_polls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With fewer messages than ``concurrency``, the claim loop is in a long poll (up to ``CLAIM_WAIT``)
    when the pause begins: the pause went on until that claim returned, seconds after the PUT."""
    receiver = Receiver(answers((401, {})))
    async with pushing(receiver.transport()) as p:

        def state() -> Any:
            return (p.supervisor.status("jobs") or {}).get("state")

        await put_queue(p.client, push={"url": HOOK, "secret": "old-secret-0123456789"})
        await publish(p.client, "a")
        await wait_until(lambda: state() == "paused")
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, push={"url": HOOK, "secret": "new-secret-0123456789"})
            await wait_until(lambda: state() == "running", within=0.6)
        assert CLAIM_WAIT > 1 and [entry["event"] for entry in logs if entry["event"] == "push_resumed"]
        await publish(p.client, "b")
        await wait_until(lambda: len(receiver.requests) == 2, within=0.1)  # the probe, pushed at once
        assert receiver.requests[1].json["payload"] == "b"


async def test_concurrency_is_never_exceeded(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(_: Received) -> tuple[int, dict[str, str]]:
        await trio.sleep(1)
        return 200, {}

    receiver = Receiver(slow)
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK, "concurrency": 3})
        for n in range(10):
            await publish(p.client, n)
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 10, within=100)
        assert receiver.most_in_progress == 3


async def test_the_rate_limit_is_honoured(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, rate_limit={"max": 2, "per": 10}, push={"url": HOOK})
        for n in range(6):
            await publish(p.client, n)
        await wait_until(lambda: len(receiver.requests) == 6, within=100)
        times = [r.at - receiver.requests[0].at for r in receiver.requests]
        for start in times:
            assert sum(1 for t in times if start <= t < start + 10 - 1e-6) <= 2


async def test_removing_the_rate_limit_applies_to_push_within_a_claim_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An empty long poll under a full rate window answers when the window frees (``retry_after``):
    the dispatcher must not sleep that long, or a PUT lifting the limit waits out the old window."""
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, rate_limit={"max": 2, "per": 120}, push={"url": HOOK})
        for n in range(6):
            await publish(p.client, n)
        await wait_until(lambda: len(receiver.requests) == 2)
        await trio.sleep(2 * CLAIM_WAIT)  # the dispatcher's long poll ended empty, with a retry_after
        await put_queue(p.client, rate_limit=None, push={"url": HOOK})
        lifted = trio.current_time()
        await wait_until(lambda: len(receiver.requests) == 6, within=100)
        assert receiver.requests[2].at - lifted <= CLAIM_WAIT + 1


async def test_push_stops_when_removed_and_when_the_queue_is_deleted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK})
        await wait_until(lambda: p.supervisor.status("jobs") is not None)
        await put_queue(p.client, push=None)
        await wait_until(lambda: p.supervisor.status("jobs") is None)
        await publish(p.client, "x")
        await trio.sleep(10)
        assert receiver.requests == []
        await put_queue(p.client, push={"url": HOOK})
        await wait_until(lambda: len(receiver.requests) == 1)
        assert (await p.client.delete("/v1/queues/jobs")).status_code == 204
        await wait_until(lambda: p.supervisor.status("jobs") is None)


async def test_a_config_changed_while_the_claim_waits_applies_to_what_it_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK})
        await wait_until(lambda: p.supervisor.status("jobs") is not None)
        await trio.sleep(1)  # the dispatcher's claim is waiting on the empty queue
        await put_queue(p.client, push={"url": "http://elsewhere.test/new-hook"})
        await publish(p.client, "after the change")
        await wait_until(lambda: len(receiver.requests) == 1)
        assert receiver.requests[0].path == "/new-hook"  # not the URL the waiting claim started with


async def test_acks_of_pushes_that_finish_together_go_as_one_command(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    acks: list[int] = []
    request = QueueActor.request

    async def counting(actor: QueueActor, command: Any) -> Any:
        if isinstance(command, Ack):
            acks.append(len(command.lease_ids))
        return await request(actor, command)

    monkeypatch.setattr(QueueActor, "request", counting)
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client)
        for n in range(10):
            await publish(p.client, n)
        await put_queue(p.client, push={"url": HOOK, "concurrency": 10})
        await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 10)
        assert (await stats(p.client))["acked_total"] == 10
        assert acks == [10], "the ten pushes end in one scheduling round: one Ack for them all"


async def test_a_settle_the_journal_could_not_write_is_kept_not_reported_as_failed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage fault answers the dispatcher's ack with a 503 after the queue applied it: the queue
    keeps it and journals it once the disk recovers. It was logged push_settle_failed ("its lease
    expires and the message is pushed again"), which did not happen, and not counted as acked."""
    request = QueueActor.request

    async def applied_then_unwritable(actor: QueueActor, command: Any) -> Any:
        answer = await request(actor, command)
        if isinstance(command, Ack):
            raise StorageUnavailable("the journal cannot be written; nothing was acknowledged")
        return answer

    monkeypatch.setattr(QueueActor, "request", applied_then_unwritable)
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": HOOK})
        with structlog.testing.capture_logs() as logs:
            message_id = await publish(p.client, {"job": 1})
            await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        assert [entry for entry in logs if entry["event"] == "push_settle_failed"] == []
        assert (await message(p.client, message_id))["state"] == "acked"
        await trio.sleep(1000)
        assert len(receiver.requests) == 1, "settled: not pushed again"
