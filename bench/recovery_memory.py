"""What reading snapshots costs in memory and in stalls (``python -m bench recovery_memory``).

A data directory holds ``KEEP`` snapshots of one state: a queue of N plain ready messages (200-byte
payloads, each its own bytes object, as the HTTP layer stores them) and a queue of M messages that were
each claimed and nacked until their history held ~40 entries. Each figure is measured in a fresh
interpreter (``bench.child``), after ``broker.runtime.tune_gc`` as the server calls it:

* the live state: the RSS the build process grew by while it published and claimed those queues
  (what a broker that served them holds), and from it the cost of one history entry;
* a start (recovery, ``store.open_data_dir``): the peak RSS (``VmHWM``), the peak of anonymous memory
  (``RssAnon``, sampled every 5 ms: what the kernel cannot reclaim, unlike the snapshot file's pages
  that LMDB maps and that count in ``VmHWM``), and the RSS once it returned, all above the import
  baseline;
* a snapshot process (``storage/compactor.py``: the newest snapshot read, then written anew), measured
  the same way;
* ``read_headers``, which ``GET /v1/admin/snapshots`` and every snapshot taken call: its time.

No targets: the figures size memory (docs/operations.md, "Capacity planning").
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.child import run_child
from bench.core import new_batch, resident_bytes
from bench.report import Result, failed, median, repetitions
from broker.core import QueueConfig, QueueCore
from broker.core.commands import Claim, Nack
from broker.runtime import tune_gc
from broker.storage.recovery import Recovered
from broker.storage.snapshots import JOURNAL_DIR, KEEP, newest_valid, read_headers, write_snapshot
from broker.storage.store import open_data_dir

SIZES = {
    "full": {"plain": 200_000, "with_history": 20_000, "entries": 40, "repeats": 3},
    "quick": {"plain": 20_000, "with_history": 2_000, "entries": 40, "repeats": 1},
}
#: Calls of ``read_headers`` timed per measurement.
HEADER_CALLS = 20
CHILD_TIMEOUT = 600.0
MB = 1024 * 1024


def _status() -> dict[str, int]:
    """The memory lines of /proc/self/status, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


@contextmanager
def peak_anonymous() -> Iterator[dict[str, int]]:
    """The highest ``RssAnon`` seen while the block runs (sampled every 5 ms by a thread), in
    ``["peak"]`` once it ends."""
    seen = {"peak": _status()["RssAnon"]}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            seen["peak"] = max(seen["peak"], _status()["RssAnon"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()
        seen["peak"] = max(seen["peak"], _status()["RssAnon"])


# -- the children ------------------------------------------------------------------------------------


def child_build(data_dir: str, plain: int, with_history: int, entries: int) -> dict[str, Any]:
    """Publish the two queues (module docstring), measuring what each adds to the RSS; write ``KEEP``
    snapshots of them."""
    tune_gc()
    now = time.time()
    before = resident_bytes()
    backlog = QueueCore("plain", QueueConfig(), "bench0")
    for _ in range(plain // 100):
        backlog.publish(new_batch(), now)
    with_plain = resident_bytes()
    worked = QueueCore("worked", QueueConfig(), "bench1")
    for _ in range(with_history // 100):
        worked.publish(new_batch(), now)
    for _ in range(entries // 2):  # a claim and a nack: two entries per round
        claimed, _ = worked.apply(Claim("bench", max_count=with_history), now)
        worked.apply(Nack([claim.lease_id for claim, _ in claimed.deliveries], delay=0.0), now)
    after = resident_bytes()
    plain_bytes = with_plain - before
    history_bytes = after - with_plain
    first_history = next(iter(worked.dump().messages))[-1][0]
    started = time.perf_counter()
    path = Path(data_dir)
    path.mkdir(parents=True)
    for lsn in range(1, KEEP + 1):
        recovered = Recovered(queues={"plain": backlog, "worked": worked}, last_lsn=lsn, last_at=now)
        info = write_snapshot(path, recovered)
    (path / JOURNAL_DIR).mkdir()
    per_plain = plain_bytes / plain
    per_worked = history_bytes / with_history
    return {
        "live_bytes": after - before,
        "plain_bytes_per_message": per_plain,
        "history_bytes_per_message": per_worked,
        "history_bytes_per_entry": (per_worked - per_plain) / entries,
        "history_entries_of_the_first": len(first_history),
        "snapshot_bytes": info.bytes,
        "write_seconds": time.perf_counter() - started,
    }


def child_recover(data_dir: str) -> dict[str, Any]:
    """A start: ``open_data_dir`` on the directory, as ``broker serve`` runs it."""
    tune_gc()
    baseline = _status()
    started = time.perf_counter()
    with peak_anonymous() as anonymous:
        opened = open_data_dir(Path(data_dir))
    seconds = time.perf_counter() - started
    settled = _status()
    opened.release()
    return _memory(baseline, settled, anonymous["peak"]) | {"seconds": seconds}


def child_snapshot(data_dir: str, scratch: str) -> dict[str, Any]:
    """A snapshot process: the newest snapshot read, then written anew (into ``scratch``)."""
    Path(scratch).mkdir()
    tune_gc()
    baseline = _status()
    started = time.perf_counter()
    with peak_anonymous() as anonymous:
        recovered, _ = newest_valid(Path(data_dir))
        assert recovered is not None
        write_snapshot(Path(scratch), recovered)
    seconds = time.perf_counter() - started
    return _memory(baseline, _status(), anonymous["peak"]) | {"seconds": seconds}


def child_headers(data_dir: str) -> dict[str, Any]:
    """``read_headers``, ``HEADER_CALLS`` times: each call's milliseconds."""
    calls = []
    for _ in range(HEADER_CALLS):
        started = time.perf_counter()
        found, _ = read_headers(Path(data_dir))
        calls.append((time.perf_counter() - started) * 1000)
        assert len(found) == KEEP
    return {"milliseconds": calls}


def _memory(baseline: dict[str, int], settled: dict[str, int], anonymous_peak: int) -> dict[str, Any]:
    return {
        "baseline_rss_bytes": baseline["VmRSS"],
        "peak_rss_bytes": settled["VmHWM"] - baseline["VmRSS"],
        "peak_anonymous_bytes": anonymous_peak - baseline["RssAnon"],
        "settled_rss_bytes": settled["VmRSS"] - baseline["VmRSS"],
        "settled_anonymous_bytes": settled["RssAnon"] - baseline["RssAnon"],
    }


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "build": child_build,
    "recover": child_recover,
    "snapshot": child_snapshot,
    "headers": child_headers,
}


def _child(name: str, **kwargs: Any) -> dict[str, Any]:
    return run_child("bench.recovery_memory", name, kwargs, timeout=CHILD_TIMEOUT)


# -- the group -----------------------------------------------------------------------------------------


def run_recovery_memory(scale: str) -> list[Result]:
    sizes = SIZES[scale]
    plain, with_history, entries = sizes["plain"], sizes["with_history"], sizes["entries"]
    state = f"{plain:,} plain + {with_history:,} msgs of {entries} history entries"
    #: (name, which runs, field of a run, unit) of each row after the build's two.
    rows = [
        (f"start (recovery) of {state}: peak RSS", "recover", "peak_rss_bytes", "MB"),
        (f"start of {state}: peak anonymous RSS", "recover", "peak_anonymous_bytes", "MB"),
        (f"start of {state}: RSS once recovered", "recover", "settled_rss_bytes", "MB"),
        (f"start of {state}: seconds", "recover", "seconds", "s"),
        (f"snapshot process of {state}: peak RSS", "snapshot", "peak_rss_bytes", "MB"),
        (f"snapshot process of {state}: peak anonymous RSS", "snapshot", "peak_anonymous_bytes", "MB"),
        (f"read_headers, {KEEP} snapshots of {state}", "headers", "median_milliseconds", "ms"),
    ]
    names = [f"live state, {state}: RSS", "one history entry: RSS", *(row[0] for row in rows)]
    try:
        with tempfile.TemporaryDirectory(prefix="broker-bench-recovery-memory-") as tmp:
            data_dir = str(Path(tmp) / "data")
            built = _child(
                "build", data_dir=data_dir, plain=plain, with_history=with_history, entries=entries
            )
            runs: dict[str, list[dict[str, Any]]] = {"recover": [], "snapshot": [], "headers": []}
            for rep in repetitions(sizes["repeats"]):
                runs["recover"].append(_child("recover", data_dir=data_dir))
                runs["snapshot"].append(_child("snapshot", data_dir=data_dir, scratch=f"{tmp}/scratch-{rep}"))
                headers = _child("headers", data_dir=data_dir)
                runs["headers"].append(headers | {"median_milliseconds": median(headers["milliseconds"])})
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return [failed("recovery_memory", name, "", error) for name in names]
    results = [
        Result("recovery_memory", names[0], built["live_bytes"] / MB, "MB", details=built),
        Result("recovery_memory", names[1], built["history_bytes_per_entry"], "B"),
    ]
    for name, kind, field, unit in rows:
        samples: list[float] = [run[field] / (MB if unit == "MB" else 1) for run in runs[kind]]
        row = Result("recovery_memory", name, median(samples), unit, samples=samples)
        row.details = {"runs": runs[kind]}
        results.append(row)
    return results
