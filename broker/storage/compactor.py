"""``python -m broker.storage.compactor DATA_DIR UNTIL_LSN [--finished-history=COUNT,BYTES]
[--with-parent]``: make one snapshot in a process of its own, keeping as many finished messages as the
broker does (``FinishedHistory``; its defaults without the option).

A snapshot is made from files (``snapshots.compact``: the newest snapshot plus the committed journal,
replayed and dumped), which is pure Python work on every message. In a thread of the server it held
the interpreter lock for most of its run and stretched the requests served meanwhile; in a child
process it runs on another core and the server only waits for it. LMDB lets the two processes share
the snapshot file; the child takes no lock on the data directory (the server holds ``LOCK`` for it).

It must not outlive its broker: after a ``kill -9`` of the broker, a ``broker snapshot restore`` run
at once would otherwise be undone when this process committed a snapshot of the timeline restored
away from. The broker (``store.Snapshotter._compact``) hands it ``LOCK.snapshot`` locked, which the
offline tools and a starting broker wait for (``store.lock_data_dir``), and, with ``--with-parent``,
a stdin pipe that only the broker holds and never writes: its end means the broker is gone, and this
process then exits at once, without committing (an LMDB transaction not committed leaves nothing).
The check before the commit closes the gap between the broker's end and the watch noticing it.

Prints the new snapshot's ``SnapshotInfo`` as one JSON line (``null`` when nothing changed since the
last one); on failure prints one line to stderr and exits 1; exits 3 when its broker is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import select
import sys
import threading
from pathlib import Path

from broker.core import FinishedHistory
from broker.storage.snapshots import compact

USAGE = (
    "usage: python -m broker.storage.compactor DATA_DIR UNTIL_LSN [--finished-history=COUNT,BYTES] "
    "[--with-parent]"
)
HISTORY_OPTION = "--finished-history="
#: The exit status when the broker that started this process is gone.
PARENT_GONE = 3


class ParentGone(RuntimeError):
    """The broker that started this snapshot is gone: nothing is committed for it."""


def _exit_when_parent_ends(fd: int) -> None:
    """Block on the parent's pipe; at its end (the parent exited or was killed), exit at once."""
    while os.read(fd, 4096):  # the parent never writes: only the end comes
        pass
    with contextlib.suppress(OSError):  # stderr is a pipe to the broker: most likely gone with it
        print("the broker that started this snapshot is gone: nothing was written", file=sys.stderr)
        sys.stderr.flush()
    os._exit(PARENT_GONE)  # no clean-up to run: an LMDB transaction not committed leaves nothing


def _check_parent(fd: int) -> None:
    """Raise ``ParentGone`` when the parent's pipe has ended (it is readable: it only ever ends)."""
    readable, _, _ = select.select([fd], [], [], 0)
    if readable:
        raise ParentGone("the broker that started this snapshot is gone: nothing was written")


def history_argument(history: FinishedHistory) -> str:
    """The argument that tells this process to keep ``history``'s finished messages (``main`` reads it)."""
    return f"{HISTORY_OPTION}{history.count},{history.payload_bytes}"


def main(argv: list[str]) -> int:
    gc.disable()  # a short-lived process that builds millions of objects and drops them all at exit
    with_parent = "--with-parent" in argv
    history = FinishedHistory()
    arguments = []
    try:
        for argument in argv:
            if argument.startswith(HISTORY_OPTION):
                count, payload_bytes = argument.removeprefix(HISTORY_OPTION).split(",")
                history = FinishedHistory(int(count), int(payload_bytes))
            elif argument != "--with-parent":
                arguments.append(argument)
        [directory, lsn] = arguments
        data_dir, until = Path(directory), int(lsn)
    except ValueError:
        print(USAGE, file=sys.stderr)
        return 2
    before_commit = None
    if with_parent:
        parent = sys.stdin.fileno()
        threading.Thread(target=_exit_when_parent_ends, args=(parent,), daemon=True).start()
        before_commit = functools.partial(_check_parent, parent)
    try:
        info = compact(data_dir, until, before_commit=before_commit, history=history)
    except ParentGone as error:
        print(error, file=sys.stderr)
        return PARENT_GONE
    except Exception as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(None if info is None else dataclasses.asdict(info)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
