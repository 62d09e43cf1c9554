"""``python -m broker.storage.compactor DATA_DIR UNTIL_LSN``: make one snapshot in a process of its own.

A snapshot is made from files (``snapshots.compact``: the newest snapshot plus the committed journal,
replayed and dumped), which is pure Python work on every message. In a thread of the server it held
the interpreter lock for most of its run and stretched the requests served meanwhile; in a child
process it runs on another core and the server only waits for it. LMDB lets the two processes share
the snapshot file; the child takes no lock on the data directory, which the server holds for it.

Prints the new snapshot's ``SnapshotInfo`` as one JSON line (``null`` when nothing changed since the
last one); on failure prints one line to stderr and exits 1.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

from broker.storage.snapshots import compact


def main(argv: list[str]) -> int:
    gc.disable()  # a short-lived process that builds millions of objects and drops them all at exit
    try:
        data_dir, until = Path(argv[0]), int(argv[1])
    except (IndexError, ValueError):
        print("usage: python -m broker.storage.compactor DATA_DIR UNTIL_LSN", file=sys.stderr)
        return 2
    try:
        info = compact(data_dir, until)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(None if info is None else dataclasses.asdict(info)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
