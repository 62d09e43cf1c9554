"""Process-wide runtime settings shared by the server and the benchmarks."""

from __future__ import annotations

import gc
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: Young-generation threshold for the cyclic garbage collector. The broker allocates a handful of
#: objects per message on its hot paths; at CPython's default (700) the collector runs every ~150
#: messages and took over half of the core's publish/claim time in profiles. Messages form no cycles,
#: so collecting less often costs little memory.
GC_GEN0_THRESHOLD = 50_000

#: Seconds a thread may hold the interpreter lock while another waits for it (CPython's default is
#: 5 ms). The journal's writer thread needs the lock for a moment before and after each fsync; while
#: the event loop is busy serving, it waited up to 5 ms each time, so a flush took ~10 ms when the
#: disk needed 0.2 ms, and every durable request waited for it. bench durable --quick, alternating:
#: 5 ms 0.50/0.55 of the in-memory drain (loaded machine), 0.5 ms 0.63/0.64, 0.1 ms 0.67/0.66 (quiet).
#: Only the few moments two threads want the lock pay for the shorter interval.
SWITCH_INTERVAL = 0.0001


def tune_gc() -> None:
    """Collect less often, and move everything alive at start-up out of the collector's way."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def freeze_survivors() -> None:
    """Move every object alive now out of the cyclic collector's sight (``gc.freeze``, O(1)), for after
    the broker has grown by long-lived objects that form no cycles when they go (queues: a deleted
    queue is freed by reference counts alone). Otherwise every collection of the old generation walks
    them all: with 50,000 queues made at run time (54 objects each), a full collection held every
    request up ~3 s, and collections of the middle generation ~0.2 s every few seconds while they were
    made. Frozen objects are still freed when their last reference goes; only garbage cycles among them
    would never be (so: after growth only, never on a timer). The young generations are collected
    first, so that most garbage cycles made since (a closed connection's objects) are freed rather than
    frozen: growing to 4,000 queues under traffic, then making and deleting them again, freezes kept
    53,120 objects without that, 12,348 with it (5,696 after a full collection, which would walk every
    message published since the start too: ~1 s for a million). What is kept is bounded by the growth:
    connections alive at a freeze that die later, in cycles."""
    gc.collect(1)
    gc.freeze()


#: The most open files ``raise_open_files_limit`` asks for when the hard limit is unlimited.
OPEN_FILES_WANTED = 1 << 20


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, as servers that hold many
    sockets do (Go's runtime, nginx's ``worker_rlimit_nofile``): a shell's soft limit is often 1,024,
    which the sockets of push streams, long polls and webhook pushes (``concurrency`` per queue) reach
    long before the hard limit; past it the listener cannot accept and pushes cannot connect. Returns
    the soft limits before and after (unchanged when it cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError):  # not allowed here (a sandbox): keep what there is
            return soft, soft
        return soft, wanted
    return soft, soft


def tune_threads() -> None:
    """Hand the interpreter lock over sooner (``SWITCH_INTERVAL``)."""
    sys.setswitchinterval(SWITCH_INTERVAL)


@contextmanager
def collector_paused(*, freeze: bool) -> Iterator[None]:
    """Keep the cyclic collector from running while a bulk load (recovery, a snapshot's replay) makes
    millions of objects: it would otherwise walk them again and again as they pile up (5 of 7.5 s of
    loading a 1,000,000-message snapshot). The pause is process-wide.

    ``freeze``: what is alive at the end lives on (the recovered queues), so move it out of the
    collector's sight for good (``gc.freeze``). Only for objects that are never dropped in a cycle,
    which a frozen generation would keep forever."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
