"""Process-wide settings the server makes at start (broker/runtime.py): the open files limit."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys
import weakref

import pytest
import structlog
import trio
import trio.testing

from broker.cli import OPEN_FILES_ADVISED, _log_open_files_limit
from broker.clock import Clock
from broker.registry import FREEZE_EVERY, Registry
from broker.storage import InMemoryJournal

_SHOW = (
    "import resource; from broker.runtime import raise_open_files_limit; "
    "print(*raise_open_files_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
)


def _limits_in_a_process_started_with(soft: int, hard: int) -> list[int]:
    """What ``raise_open_files_limit`` answers, then the soft and hard limits after it, in a process
    whose limits were ``soft`` and ``hard`` (as a shell's ``ulimit -Sn``/``-Hn`` would leave them)."""
    done = subprocess.run(
        [sys.executable, "-c", _SHOW],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [int(word) for word in done.stdout.split()]


HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
LOW = 256


@pytest.mark.skipif(
    HARD != resource.RLIM_INFINITY and HARD <= LOW,
    reason=f"this machine's hard limit of open files ({HARD}) leaves no room to raise a soft one",
)
def test_a_low_soft_limit_of_open_files_is_raised_to_the_hard_one() -> None:
    """A shell's 1,024 ran out under a few push queues of high concurrency: the listener could not
    accept, and pushes failed on the broker's side."""
    hard = HARD if HARD != resource.RLIM_INFINITY else 1 << 20
    assert _limits_in_a_process_started_with(LOW, hard) == [LOW, hard, hard, hard]


def test_a_limit_that_cannot_be_raised_is_left_and_said() -> None:
    assert _limits_in_a_process_started_with(LOW, LOW) == [LOW, LOW, LOW, LOW]
    with structlog.testing.capture_logs() as logs:
        _log_open_files_limit(LOW, LOW)
        _log_open_files_limit(LOW, OPEN_FILES_ADVISED)
    low, raised = logs
    assert (low["event"], low["log_level"], low["limit"], low["raised_from"]) == (
        "open_files_limit",
        "warning",
        LOW,
        None,
    )
    assert "LimitNOFILE" in low["hint"]
    assert (raised["log_level"], raised["limit"], raised["raised_from"]) == ("info", OPEN_FILES_ADVISED, LOW)


async def test_queues_made_at_run_time_are_frozen_out_of_the_collectors_walks_after_growth() -> None:
    """50,000 queues made at run time were walked by every collection of the old generation: ~3 s with
    every request held up. Frozen, a queue is still freed by reference counts when it is deleted."""
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, InMemoryJournal(), Clock())
        frozen = gc.get_freeze_count()
        for number in range(FREEZE_EVERY - 1):
            registry.create(f"q{number:04d}", {})
        # Not yet grown by FREEZE_EVERY: nothing frozen (frozen objects of earlier tests may die meanwhile).
        assert gc.get_freeze_count() <= frozen
        registry.create("last", {})
        assert gc.get_freeze_count() - frozen >= 20 * FREEZE_EVERY  # each queue's objects
        await trio.testing.wait_all_tasks_blocked()

        core = weakref.ref(registry.get("q0001").core)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            await registry.delete("q0001").wait()
            await trio.testing.wait_all_tasks_blocked()
            assert core() is None, "a deleted queue is freed without the collector"
        finally:
            if was_enabled:
                gc.enable()

        frozen = gc.get_freeze_count()
        for number in range(2, 2 + 2 * FREEZE_EVERY):  # made and deleted: no growth past the most
            name = f"q{number % FREEZE_EVERY:04d}"
            if name in registry:
                await registry.delete(name).wait()
            else:
                registry.create(name, {})
        assert gc.get_freeze_count() <= frozen  # deleted ones left it; a freeze would add every queue
        registry.stop_all()
