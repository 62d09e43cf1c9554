"""Benchmarks of the queue policies (§3), in process: the registry and the queue actors under
``trio.run`` with the real clock, without HTTP.

In process rather than over HTTP because on this two-core shared VM the HTTP stack costs about three
quarters of the server's CPU per request (see ``bench.http_api``) and moves by ±30% between runs: over
HTTP these figures would mostly measure Hypercorn and Quart. In process, what is measured is the policy
itself (the claim window's cohorts, the dead-letter path through the outbox and the registry's
``forward``) and the actors' command round trips, and nothing else.

* ``child_cohort``: 16 claimers (Trio tasks) on one queue with a ``claim_window``, each looping "claim
  up to 100, ack them all" until a claim comes back empty; the queue is pre-filled, so the run is
  bounded by its message count. Rate, and how evenly the messages were shared among the claimers.
* ``child_dead_letter``: every message is nacked until its ``max_attempts`` are used up, so all of them
  move to ``<queue>.dlq``; rate into the dead-letter queue, and a check that it holds every message
  exactly once, with the provenance headers of §6.

Each repetition runs in a fresh interpreter (``bench.child``), like the core benchmarks, and calls
``broker.runtime.tune_gc`` first, as the server does at start.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import trio

from bench.child import run_child
from bench.core import BATCH, GcWatch, new_batch
from bench.report import Result, failed, median, repetitions
from broker.actor import QueueActor
from broker.clock import Clock
from broker.core import QueueCore
from broker.core.commands import Ack, Browse, Claim, GetStats, Nack, Publish
from broker.registry import Registry
from broker.runtime import tune_gc
from broker.storage import InMemoryJournal

COHORT = {
    "full": {"messages": 100_000, "claimers": 16, "repeats": 3},
    "quick": {"messages": 20_000, "claimers": 16, "repeats": 1},
}
DEAD_LETTER = {
    "full": {"messages": 100_000, "max_attempts": 3, "repeats": 3},
    "quick": {"messages": 10_000, "max_attempts": 3, "repeats": 1},
}
#: The claim windows measured: the issue's 50 ms, and none (claims served one at a time) to compare.
CLAIM_WINDOWS = (0.05, 0.0)

#: Bounds: one run inside the child (then it fails), and the child process as a whole (then it is killed).
RUN_TIMEOUT = 120.0
CHILD_TIMEOUT = 300.0


# -- helpers --------------------------------------------------------------------------------------


async def _open_queue(registry: Registry, name: str, config: dict[str, Any], messages: int) -> QueueActor:
    """Create queue ``name`` with ``config`` and publish ``messages`` into it in batches of ``BATCH``."""
    await registry.create(name, config).wait()
    actor = registry.get(name)
    for _ in range(messages // BATCH):
        await actor.request(Publish(new_batch()))
    stats = await actor.request(GetStats())
    if stats.ready != messages:
        raise AssertionError(f"pre-filled {stats.ready} of {messages}")
    return actor


def jain_index(values: list[int]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all are equal, 1/n when one has everything."""
    squares = sum(value * value for value in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else math.nan


def share_summary(counts: list[int]) -> dict[str, Any]:
    """How evenly ``counts`` (one per claimer, so never empty) split their total: shares in percent of it,
    and relative to the fair share."""
    total = sum(counts)
    shares = [100.0 * count / total for count in counts] if total else []
    fair = 100.0 / len(counts)
    fewest = min(counts)
    return {
        "counts": counts,
        "share_percent_min": min(shares, default=math.nan),
        "share_percent_max": max(shares, default=math.nan),
        "share_percent_stdev": statistics.pstdev(shares) if shares else math.nan,
        "fair_share_percent": fair,
        "max_over_min": max(counts) / fewest if fewest else math.inf,
        "jain_index": jain_index(counts),
    }


# -- children: these run in a fresh interpreter and return plain data ---------------------------------


def child_cohort(messages: int, claimers: int, claim_window: float) -> dict[str, Any]:
    """``claimers`` tasks claim (max ``BATCH``) and ack until the pre-filled queue is empty."""
    tune_gc()
    return trio.run(_cohort, messages, claimers, claim_window)


async def _cohort(messages: int, claimers: int, claim_window: float) -> dict[str, Any]:
    clock = Clock()
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, InMemoryJournal(), clock)
        actor = await _open_queue(registry, "cohort", {"claim_window": claim_window}, messages)
        cohorts: list[tuple[int, int]] = []  # (claims, messages delivered) per cohort served
        _count_cohorts(actor.core, cohorts)
        start = trio.Event()
        results: list[dict[str, Any]] = []
        perf_counter = time.perf_counter

        async def claimer(index: int) -> None:
            claim = Claim(f"claimer-{index}", BATCH)
            acked = claims = repeated = 0
            last_ack = None
            await start.wait()
            while True:
                outcome = await actor.request(claim)
                claims += 1
                if not outcome.deliveries:
                    break
                repeated += sum(1 for record, _ in outcome.deliveries if record.attempt != 1)
                settled = await actor.request(Ack([record.lease_id for record, _ in outcome.deliveries]))
                if settled.settled != len(outcome.deliveries):
                    raise AssertionError(f"acked {settled.settled} of {len(outcome.deliveries)}")
                acked += settled.settled
                last_ack = perf_counter()
            results.append({"acked": acked, "claims": claims, "redelivered": repeated, "last_ack": last_ack})

        with trio.fail_after(RUN_TIMEOUT), GcWatch() as gc_watch:
            async with trio.open_nursery() as claiming:
                for index in range(claimers):
                    claiming.start_soon(claimer, index)
                await trio.lowlevel.checkpoint()  # lets the claimers reach the start event
                started, cpu = perf_counter(), time.process_time()
                start.set()
            cpu = time.process_time() - cpu
        stats = await actor.request(GetStats())
        registry.stop_all()
    counts = [result["acked"] for result in results]
    if sum(counts) != messages or stats.acked_total != messages or stats.in_flight or stats.ready:
        raise AssertionError(f"acked {sum(counts)} of {messages}; stats at the end: {stats}")
    if any(result["redelivered"] for result in results):
        raise AssertionError("a message was delivered twice")
    elapsed = max(result["last_ack"] for result in results if result["last_ack"] is not None) - started
    per_cohort = [claims for claims, _ in cohorts]
    return {
        "messages": messages,
        "claimers": claimers,
        "claim_window": claim_window,
        "seconds": round(elapsed, 4),
        "per_second": messages / elapsed,
        "cpu_seconds": round(cpu, 4),
        "gc": gc_watch.snapshot(),
        "claims": sum(result["claims"] for result in results),
        "cohorts": len(cohorts),
        "claims_per_cohort_min": min(per_cohort, default=0),
        "claims_per_cohort_median": median(per_cohort) if per_cohort else 0,
        "claims_per_cohort_max": max(per_cohort, default=0),
        "seconds_per_cohort": elapsed / len(cohorts) if cohorts else None,
        **share_summary(counts),
    }


def _count_cohorts(core: QueueCore, cohorts: list[tuple[int, int]]) -> None:
    """Record each cohort the actor hands to the core: how many claims, how many messages they got."""
    claim_cohort = core.claim_cohort

    def counted(claims: Any, now: float) -> Any:
        outcomes, records = claim_cohort(claims, now)
        cohorts.append((len(claims), sum(len(outcome.deliveries) for outcome in outcomes)))
        return outcomes, records

    core.claim_cohort = counted  # type: ignore[method-assign]


def child_dead_letter(messages: int, max_attempts: int) -> dict[str, Any]:
    """Claim batches of ``BATCH`` and nack them all (no delay) until every message is dead-lettered."""
    tune_gc()
    return trio.run(_dead_letter, messages, max_attempts)


async def _dead_letter(messages: int, max_attempts: int) -> dict[str, Any]:
    clock = Clock()
    async with trio.open_nursery() as nursery:
        registry = Registry(nursery, InMemoryJournal(), clock)
        # The default retry_backoff is a fixed 0 s: a nacked message is ready again at once.
        source = await _open_queue(registry, "work", {"max_attempts": max_attempts}, messages)
        published = await source.request(Browse(None, messages + 1, 0))
        originals = {view.id: view.payload for view in published}
        perf_counter = time.perf_counter
        claims = nacks = dead_answered = 0
        with trio.fail_after(RUN_TIMEOUT), GcWatch() as gc_watch:
            started, cpu = perf_counter(), time.process_time()
            while True:
                outcome = await source.request(Claim("dead-letter-bench", BATCH))
                claims += 1
                if not outcome.deliveries:
                    break
                settled = await source.request(Nack([record.lease_id for record, _ in outcome.deliveries]))
                nacks += 1
                dead_answered += settled.dead_lettered
            source_done = perf_counter()
            # The copies travel to the dead-letter queue's actor as Receive commands, which it applies
            # in its own time: the run ends when its stats show them all.
            dlq = registry.get("work.dlq")
            polls = 0
            while (dlq_stats := await dlq.request(GetStats())).ready < messages:
                polls += 1
                await trio.sleep(0.001)
            finished, cpu = perf_counter(), time.process_time() - cpu
        source_stats = await source.request(GetStats())
        moved = await dlq.request(Browse(None, messages + 1, 0))
        registry.stop_all()
    problems = _check_dead_letters(originals, moved, max_attempts)
    if source_stats.ready or source_stats.delayed or source_stats.in_flight:
        problems.append(f"the source queue still holds messages: {source_stats}")
    if source_stats.dead_lettered_total != messages or dead_answered != messages:
        problems.append(
            f"dead_lettered_total {source_stats.dead_lettered_total}, nack answers {dead_answered}, "
            f"of {messages}"
        )
    if dlq_stats.ready != messages or dlq_stats.published_total != messages:
        problems.append(f"the dead-letter queue's stats: {dlq_stats}")
    elapsed = finished - started
    return {
        "messages": messages,
        "max_attempts": max_attempts,
        "seconds": round(elapsed, 4),
        "per_second": messages / elapsed,
        "cpu_seconds": round(cpu, 4),
        "gc": gc_watch.snapshot(),
        "source_seconds": round(source_done - started, 4),
        "dlq_catch_up_seconds": round(finished - source_done, 4),
        "dlq_polls": polls,
        "claims": claims,
        "nacks": nacks,
        "nacked_total": source_stats.nacked_total,
        "dlq_ready": dlq_stats.ready,
        "dlq_published_total": dlq_stats.published_total,
        "check_problems": problems,
    }


def _check_dead_letters(originals: dict[str, Any], moved: list[Any], max_attempts: int) -> list[str]:
    """The dead-letter queue must hold exactly one copy of every original, with the §6 headers."""
    problems: list[str] = []
    seen: set[str] = set()
    bad_headers = bad_payloads = duplicates = 0
    for view in moved:
        headers = view.headers or {}
        original = headers.get("x-original-id")
        if original is None:  # a bad header, and a copy matched with no original: that one is missing
            bad_headers += 1
            continue
        if original in seen:
            duplicates += 1
        seen.add(original)
        if (
            headers.get("x-dead-letter-from") != "work"
            or headers.get("x-dead-letter-reason") != "max_attempts"
            or headers.get("x-dead-letter-attempts") != str(max_attempts)
        ):
            bad_headers += 1
        if originals.get(original) != view.payload:
            bad_payloads += 1
    missing = len(originals.keys() - seen)
    if len(moved) != len(originals) or missing or duplicates:
        problems.append(
            f"the dead-letter queue holds {len(moved)} messages for {len(originals)} originals: "
            f"{missing} missing, {duplicates} duplicated"
        )
    if bad_headers:
        problems.append(
            f"{bad_headers} dead letters lack the §6 headers expected (x-original-id, x-dead-letter-*)"
        )
    if bad_payloads:
        problems.append(f"{bad_payloads} dead letters do not carry their original's payload")
    return problems


CHILDREN = {"cohort": child_cohort, "dead_letter": child_dead_letter}


# -- the group, run from the parent -------------------------------------------------------------------


def run_policies(scale: str) -> list[Result]:
    return [*run_cohorts(scale), *run_dead_letters(scale)]


def run_cohorts(scale: str) -> list[Result]:
    counts = COHORT[scale]
    messages, claimers = counts["messages"], counts["claimers"]
    runs: dict[float, list[dict[str, Any]]] = {window: [] for window in CLAIM_WINDOWS}
    error = None
    try:
        # The two windows alternate so that a slow minute on a shared machine hits both alike.
        for _ in repetitions(counts["repeats"]):
            for window in CLAIM_WINDOWS:
                kwargs = {"messages": messages, "claimers": claimers, "claim_window": window}
                runs[window].append(run_child("bench.policies", "cohort", kwargs, timeout=CHILD_TIMEOUT))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    results = []
    for window in CLAIM_WINDOWS:
        label = f"claim_window {window * 1000:g} ms" if window else "no claim_window"
        prefix = f"{label}, {claimers} claimers x max {BATCH}"
        names = (f"{prefix}: claim+ack rate", f"{prefix}: Jain's index of shares", f"{prefix}: max/min share")
        if error is not None:
            results += [
                failed("policies", name, unit, error) for name, unit in zip(names, UNITS, strict=True)
            ]
            continue
        window_runs = runs[window]
        samples = [
            [run["per_second"] for run in window_runs],
            [run["jain_index"] for run in window_runs],
            [run["max_over_min"] for run in window_runs],
        ]
        details = {"messages": messages, "claimers": claimers, "claim_window": window, "runs": window_runs}
        results += [
            Result("policies", name, median(values), unit, samples=values, details=details if i == 0 else {})
            for i, (name, unit, values) in enumerate(zip(names, UNITS, samples, strict=True))
        ]
    return results


UNITS = ("msg/s", "index", "ratio")


def run_dead_letters(scale: str) -> list[Result]:
    counts = DEAD_LETTER[scale]
    messages, max_attempts = counts["messages"], counts["max_attempts"]
    name = f"dead-letter: {messages:,} msgs nacked to exhaustion (max_attempts {max_attempts}) into .dlq"
    kwargs = {"messages": messages, "max_attempts": max_attempts}
    try:
        runs = [
            run_child("bench.policies", "dead_letter", kwargs, timeout=CHILD_TIMEOUT)
            for _ in repetitions(counts["repeats"])
        ]
    except Exception as exc:
        return [failed("policies", name, "msg/s", f"{type(exc).__name__}: {exc}")]
    problems = [problem for run in runs for problem in run["check_problems"]]
    if problems:
        return [failed("policies", name, "msg/s", "; ".join(dict.fromkeys(problems)))]
    samples = [run["per_second"] for run in runs]
    return [
        Result(
            "policies",
            name,
            median(samples),
            "msg/s",
            samples=samples,
            details={"messages": messages, "max_attempts": max_attempts, "runs": runs},
        )
    ]
