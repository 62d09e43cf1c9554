"""Walk every key of an LMDB file, in a process of its own (``python broker/storage/lmdb_walk.py PATH``).

On some damaged pages LMDB does not raise: an assertion in mdb.c aborts the whole process (``IS_LEAF``
in ``mdb_cursor_next``, SIGABRT). The broker and its offline tools would die with it, a line of C on
stderr and exit 134, whatever they were doing. So ``snapshots.check_pages`` runs this walk first and
turns its death into an error that names the file and says what to do. On other damaged pages LMDB
raises (``MDB_CORRUPTED: Located page was wrong type``, ``MDB_PAGE_NOTFOUND``): the walk then exits
``FOUND_DAMAGE``, which ``check_pages`` refuses the same way. Such a page may belong to an older
snapshot that a start never reads, but the next snapshot deletes that one, and fails on it, every time.
The walk reads every branch and leaf page and finds every value (nothing is copied); what the values
hold is checked by their CRCs when a snapshot is read. It imports nothing of the broker, to start fast;
``snapshots`` opens its read-only environments with ``open_readonly``.
"""

from __future__ import annotations

import sys

import lmdb

#: The walk's exit status when LMDB reported a damaged page (an error of ``DAMAGE``); any other error
#: LMDB raises (a file that is not LMDB, one it cannot open) exits 1, for the caller's own open to report.
FOUND_DAMAGE = 3
#: What LMDB raises on reaching a page that is not what the B-tree says it is.
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)


def open_readonly(path: str, map_size: int = 10 << 20) -> lmdb.Environment:
    """The LMDB environment at ``path``, opened for reading only (``map_size``: py-lmdb's default).
    Its lock file records the reader, which keeps a live broker's snapshot process from reusing the
    pages being read; on a read-only file system (a mounted backup) there is no lock file to write, and
    no writer either."""
    try:
        return lmdb.open(path, readonly=True, create=False, max_dbs=0, map_size=map_size)
    except lmdb.Error as error:
        if not isinstance(error, lmdb.ReadonlyError) and "Read-only file system" not in str(error):
            raise
        return lmdb.open(path, readonly=True, create=False, max_dbs=0, lock=False, map_size=map_size)


def walk(path: str) -> int:
    """The number of keys in the LMDB environment at ``path``."""
    with open_readonly(path) as env, env.begin(buffers=True) as txn:
        return sum(1 for _ in txn.cursor().iternext(keys=True, values=True))  # buffers: nothing copied


if __name__ == "__main__":
    try:
        walk(sys.argv[1])
    except DAMAGE as error:
        print(error, file=sys.stderr)
        sys.exit(FOUND_DAMAGE)
    except lmdb.Error as error:  # the parent's own open reports these, worded; damage only is ours
        print(error, file=sys.stderr)
        sys.exit(1)
