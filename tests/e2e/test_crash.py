"""Crash testing (CONTRACT §8): a loaded ``broker serve`` killed with SIGKILL and restarted, many times.

The machinery (the load, the kills, the history and its checker) lives in ``bench/crash.py``, whose
``python -m bench.crash`` is the long version (100 cycles). Here: the checker on synthetic histories,
including ones it must reject, so that it is known to be able to fail; then a short real run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.crash import (
    ACKED_CAME_BACK,
    DRAIN_INCOMPLETE,
    KEY_TWICE,
    LOST,
    OK,
    PHANTOM,
    REFUSED,
    UNEXPLAINED_DUPLICATE,
    UNKNOWN,
    WRONG_PAYLOAD,
    Ack,
    Delivery,
    History,
    Publish,
    check,
    run,
)

LEASE = 2.0  # of the synthetic histories
#: The seed of the kill moments and of the load; the verdict must not depend on it.
SEED = 20261122
CYCLES = 10
#: Seconds of load between a restart and the next kill: shorter than bench.crash's, for time.
BETWEEN = (0.05, 1.0)


# -- the checker, on synthetic histories ---------------------------------------------------------------


def delivery(message_id: str, n: int, key: str, epoch: int, at: float, *, drain: bool = False) -> Delivery:
    """Delivery number ``n`` of a message, claimed at ``at`` and answered 10 ms later."""
    return Delivery(message_id, f"{message_id}.{n}", key, "c0", epoch, at, at + 0.01, drain)


def ack(lease_ids: list[str], epoch: int, at: float, outcome: str = OK, skipped: tuple[str, ...] = ()) -> Ack:
    leases = tuple((lease_id.rsplit(".", 1)[0], lease_id) for lease_id in lease_ids)
    acked = frozenset(lease_ids) - set(skipped) if outcome == OK else frozenset()
    return Ack(leases, epoch, at, at + 0.01, outcome, acked)


def good_history() -> History:
    """Everything the promise allows, at least once: three kills (epochs 0-3), then a drain in epoch 3."""
    history = History(lease=LEASE, kills=[10.0, 20.0, 30.0])
    history.publishes += [
        Publish(("a", "b", "c"), 0, 1.0, 1.01, OK, ("m1", "m2", "m3")),
        Publish(("d",), 0, 9.9, 10.0, UNKNOWN),  # in flight at the kill, and lost: allowed
        Publish(("e",), 0, 9.9, 10.0, UNKNOWN),  # in flight at the kill, yet committed: allowed
        Publish(("e",), 1, 11.0, 11.01, OK, ("m5",)),  # the retry finds it by its key
        Publish(("f",), 1, 12.0, 12.01, REFUSED),  # a 503 acknowledges nothing
        Publish(("g",), 2, 21.0, 21.01, OK, ("m7",)),
        Publish(("h",), 2, 29.9, 30.0, UNKNOWN),  # in flight at the kill, and lost
    ]
    history.deliveries += [
        delivery("m1", 1, "a", 0, 2.0),
        delivery("m2", 1, "b", 0, 2.0),
        delivery("m4", 1, "d", 0, 9.95),  # delivered before its publish was committed, then lost
        delivery("m2", 2, "b", 0, 4.5),  # m2.1 was claimed at 2.0 with a lease of 2 s: expired
        delivery("m3", 1, "c", 0, 9.0),  # leased at the kill of epoch 0 ...
        delivery("m3", 1, "c", 1, 11.5),  # ... so claimable again, even under the same lease id
        delivery("m5", 1, "e", 1, 11.5),
        delivery("m4", 1, "h", 2, 29.95),  # "m4" given again, to another message lost at a kill
        delivery("m7", 1, "g", 2, 21.5),
        delivery("m5", 2, "e", 3, 31.0, drain=True),  # its ack was in flight at the kill: unacked
        delivery("f1", 1, "f", 3, 31.0, drain=True),  # the refused publish was kept after all
    ]
    history.acks += [
        ack(["m1.1", "m2.1"], 0, 3.0, skipped=("m2.1",)),  # m2.1 expired and was redelivered: stale
        ack(["m2.2"], 0, 5.0),
        ack(["m3.1"], 1, 11.6),
        ack(["m5.1"], 2, 29.9, outcome=UNKNOWN),
        ack(["m7.1"], 2, 29.9, outcome=UNKNOWN),  # in flight at the kill, and committed: m7 is gone
        ack(["m5.2", "f1.1"], 3, 31.1),
    ]
    return history


def test_a_history_that_keeps_the_promise_passes() -> None:
    verdict = check(good_history())
    assert verdict.violations == []
    assert verdict.ok
    assert (verdict.messages, verdict.acked, verdict.drained) == (5, 5, 2)
    assert (verdict.duplicates, verdict.by_crash, verdict.by_expiry) == (3, 2, 1)
    assert (verdict.publishes_unknown, verdict.acks_unknown, verdict.reused_ids) == (3, 2, 1)


def lose_a_message(history: History) -> None:
    history.acks = [a for a in history.acks if ("m7", "m7.1") not in a.leases]  # nothing excuses it


def ack_skipped_then_gone(history: History) -> None:
    history.acks[1] = ack(["m2.2"], 0, 5.0, skipped=("m2.2",))  # a 2xx, but m2 was not acked by it


def redeliver_after_ack(history: History) -> None:
    history.deliveries.append(delivery("m1", 2, "a", 3, 31.0, drain=True))


def ack_twice(history: History) -> None:
    history.acks.append(ack(["m1.1"], 1, 11.2))  # m1 was back after the restart: its old lease acks it


def duplicate_within_lease(history: History) -> None:
    history.deliveries.append(delivery("m7", 2, "g", 2, 22.0))  # m7.1 was claimed 0.5 s before


def deliver_another_payload(history: History) -> None:
    history.deliveries.append(delivery("m7", 2, "x", 3, 31.0, drain=True))
    history.publishes.append(Publish(("x",), 2, 21.0, 21.01, UNKNOWN))


def deliver_a_phantom(history: History) -> None:
    history.deliveries.append(delivery("m9", 1, "never-sent", 1, 12.0))


def forget_a_key(history: History) -> None:
    history.deliveries.append(delivery("m8", 1, "e", 3, 31.0, drain=True))  # "e" is m5's key
    history.acks.append(ack(["m8.1"], 3, 31.2))


def stop_draining(history: History) -> None:
    history.drained = False


@pytest.mark.parametrize(
    ("spoil", "kind"),
    [
        (lose_a_message, LOST),
        (ack_skipped_then_gone, LOST),
        (redeliver_after_ack, ACKED_CAME_BACK),
        (ack_twice, ACKED_CAME_BACK),
        (duplicate_within_lease, UNEXPLAINED_DUPLICATE),
        (deliver_another_payload, WRONG_PAYLOAD),
        (deliver_a_phantom, PHANTOM),
        (forget_a_key, KEY_TWICE),
        (stop_draining, DRAIN_INCOMPLETE),
    ],
)
def test_a_history_that_breaks_the_promise_fails(spoil: Callable[[History], None], kind: str) -> None:
    history = good_history()
    spoil(history)
    verdict = check(history)
    assert not verdict.ok
    assert verdict.kinds() == {kind}, [str(violation) for violation in verdict.violations]


def test_a_duplicate_is_explained_by_expiry_only_once_the_lease_may_have_run_out() -> None:
    history = History(lease=LEASE)
    history.publishes.append(Publish(("a",), 0, 0.0, 0.01, OK, ("m1",)))
    claimed = Delivery("m1", "m1.1", "a", "c0", 0, 1.0, 1.5, False)
    early = Delivery("m1", "m1.2", "a", "c1", 0, 2.5, 2.9, False)  # answered before 1.0 + 2 s
    late = Delivery("m1", "m1.2", "a", "c1", 0, 2.5, 3.0, False)  # may have been served at 3.0
    drained = Delivery("m1", "m1.3", "a", "drain", 0, 10.0, 10.01, True)
    history.deliveries = [claimed, early, drained]
    assert check(history).kinds() == {UNEXPLAINED_DUPLICATE}
    history.deliveries = [claimed, late, drained]
    assert check(history).ok


def test_an_id_and_lease_given_again_after_a_kill_are_noted_not_judged() -> None:
    """What the broker does today: a claim may hand out a message before its publish is committed; if a
    kill loses the publish, the restarted broker gives the same id, and the same first lease id, to the
    next message. A retried ack of the old lease then settles the new message, whose consumer's own ack
    is skipped. The 2xx ack did remove it, so §8 holds to the letter; the history counts it as a note."""
    history = History(lease=LEASE, kills=[10.0])
    history.publishes += [
        Publish(("a",), 0, 9.9, 10.0, UNKNOWN),  # committed never: lost at the kill
        Publish(("b",), 1, 11.0, 11.01, OK, ("m1",)),  # the next message after the restart gets "m1" too
    ]
    history.deliveries += [
        Delivery("m1", "m1.1", "a", "c0", 0, 9.95, 9.96),
        Delivery("m1", "m1.1", "b", "c1", 1, 11.1, 11.11),
    ]
    history.acks += [
        Ack((("m1", "m1.1"),), 0, 9.97, 10.0, UNKNOWN, consumer="c0"),
        Ack((("m1", "m1.1"),), 1, 11.2, 11.21, OK, frozenset({"m1.1"}), "c0"),  # c0's retry acks "b"
        Ack((("m1", "m1.1"),), 1, 11.3, 11.31, OK, frozenset(), "c1"),  # skipped
    ]
    verdict = check(history)
    assert verdict.ok, [str(violation) for violation in verdict.violations]
    assert (verdict.reused_ids, verdict.foreign_acks, verdict.duplicates) == (1, 1, 0)


# -- the real thing ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_kill_9_at_random_moments_loses_nothing_acknowledged(tmp_path: Path) -> None:
    result = run(tmp_path / "data", cycles=CYCLES, seed=SEED, between=BETWEEN)
    verdict = result.verdict
    assert verdict.violations == [], f"seed {SEED}, data in {result.data_dir}\n{result.summary()}"
    assert len(result.history.kills) == CYCLES
    assert verdict.messages > 0 and verdict.acked > 0, result.summary()
    assert result.history.errors == [], result.summary()
