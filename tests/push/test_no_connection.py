"""Pushes that found no connection, with time moved by the autojump clock: a receiver that cannot be
reached pauses the queue's push, 1 s doubling to 30 s, rather than taking every message through its
attempts as fast as the backoff allows; a connection this host could not open (out of file descriptors)
spends no attempt (docs/push.md, "When the receiver cannot be reached")."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import trio

from broker.push.dispatcher import UNREACHABLE_MAX
from broker.push.transport import Answer, ConnectError, LocalError
from tests.push.conftest import Receiver, message, publish, pushing, put_queue, stats, wait_until

HOOK = "http://receiver.test/hook"


@dataclass
class Flaky:
    """The dispatcher's transport: raises ``failure`` while it is set, else the receiver answers."""

    receiver: Receiver
    failure: Exception | None = None
    tried_at: list[float] = field(default_factory=list)

    async def post(self, url: str, body: bytes, headers: dict[str, str], *, allow_private: bool) -> Answer:
        await trio.lowlevel.checkpoint()
        self.tried_at.append(trio.current_time())
        if self.failure is not None:
            raise self.failure
        return await self.receiver.transport().post(url, body, headers, allow_private=allow_private)

    def close(self) -> None:
        pass


async def test_a_receiver_that_cannot_be_reached_pauses_the_push_doubling_then_it_resumes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With the default config (a nack's backoff 0, unlimited attempts) a refused connection took each
    message round again at once: ~3,000 failed pushes a second, each a nack in the journal."""
    receiver = Receiver()
    transport = Flaky(receiver, ConnectError("cannot connect to receiver.test:80: Connection refused"))
    async with pushing(transport) as p:
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, push={"url": HOOK, "concurrency": 10})
            for number in range(20):
                await publish(p.client, number)
            await wait_until(lambda: len(transport.tried_at) >= 10 + 7, within=200)
            first, probes = transport.tried_at[:10], transport.tried_at[10:17]
            assert max(first) - min(first) < 0.1, "the first claim's ten go out at once, then the pause"
            gaps = [later - earlier for earlier, later in zip([first[-1], *probes], probes, strict=False)]
            assert [round(gap) for gap in gaps] == [1, 2, 4, 8, 16, UNREACHABLE_MAX, UNREACHABLE_MAX]
            shown = (await (await p.client.get("/v1/queues/jobs/push")).get_json())["status"]
            assert shown["state"] == "paused"
            assert shown["pause_reason"].startswith("the receiver at receiver.test cannot be reached")
            pauses = [entry for entry in logs if entry["event"] == "push_unreachable"]
            assert [entry["paused_for"] for entry in pauses][:7] == [1, 2, 4, 8, 16, 30, 30]
            assert (await stats(p.client))["nacked_total"] == 10 + 7, "one attempt per probe, not thousands"

            transport.failure = None  # the receiver is back: the next probe gets through, then all the rest
            await wait_until(lambda: len(receiver.requests) == 20, within=UNREACHABLE_MAX + 5)
            assert receiver.requests[-1].at - receiver.requests[0].at < 0.5, "at full speed once resumed"
            assert (await stats(p.client))["acked_total"] == 20


async def test_a_connection_this_host_could_not_open_spends_no_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Out of file descriptors, a push was a failed attempt: on its last one the message was
    dead-lettered (here: dropped) although the receiver never saw it."""
    receiver = Receiver()
    transport = Flaky(receiver, LocalError("cannot open a socket: Too many open files"))
    async with pushing(transport) as p:
        with structlog.testing.capture_logs() as logs:
            await put_queue(p.client, max_attempts=1, dead_letter=None, push={"url": HOOK})
            message_id = await publish(p.client, "x")
            await wait_until(lambda: len(transport.tried_at) == 1)
            transport.failure = None
            await wait_until(lambda: len(receiver.requests) == 1, within=5)
            assert 1 <= transport.tried_at[1] - transport.tried_at[0] < 1.1, "the queue's push waits 1 s"
            await wait_until(lambda: (p.supervisor.status("jobs") or {}).get("acked_total") == 1)
        counts = await stats(p.client)
        assert (counts["acked_total"], counts["dead_lettered_total"], counts["nacked_total"]) == (1, 0, 0)
        history = await (await p.client.get(f"/v1/queues/jobs/push/messages/{message_id}")).get_json()
        assert [(a["attempt"], a["outcome"]) for a in history["attempts"]] == [(1, "not_sent"), (1, "acked")]
        assert (p.supervisor.status("jobs") or {})["pushed_total"] == 1, "the one not sent is not counted"
        shown = (await message(p.client, message_id))["history"]
        assert [entry["event"] for entry in shown][:3] == ["published", "claimed", "released"]
        [error] = [entry for entry in logs if entry["log_level"] == "error"]
        assert error["event"] == "push_not_sent" and "LimitNOFILE" in error["hint"]
