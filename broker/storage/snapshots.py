"""Snapshots in LMDB: every queue's state as of one lsn, so that recovery replays only what came after.

A snapshot is never read off the live queues. It is made the way recovery works: the newest snapshot
plus the committed journal after it, replayed into fresh cores (``compact``), then dumped
(``QueueCore.dump``) and written in one LMDB transaction. So taking one never stops the world: the
actors keep serving while a child process (``broker.storage.compactor``) replays files that no longer
change.

Layout of ``<data dir>/snapshots.lmdb`` (one key space, keys sort by snapshot id = lsn, 20 digits)::

    s/<id>/q/<queue no>/f/<chunk no> CBOR array of the columns of up to 10,000 finished messages
    s/<id>/q/<queue no>/h            CBOR [QueueCreated entry (journal format), next_seq, counters, keys,
                                     and since version 7 its rate window, if any: [[time, deliveries] …]]
    s/<id>/q/<queue no>/m/<chunk no> CBOR array of the columns of up to 10,000 live messages (below)

(Up to 10,000 messages, and fewer once their histories hold 10,000 entries: ``_chunk_bounds``. A reader
takes chunks of any length.)
    s/<id>/t                         CBOR array of moves in transit at the lsn (see recovery)
    s/<id>/meta                      CBOR map: version, lsn, at, taken_at, queues, messages, bytes, crc,
                                     meta_crc

``meta`` is written last and holds the CRC32 of every other value in key order (``crc``): a snapshot
without it is unfinished, one whose values do not match it is corrupt and recovery falls back to the one
before. ``meta`` checks itself too: ``meta_crc`` is the CRC32 of its other fields packed as
``struct.pack("<QQddQQQQ", version, lsn, at, taken_at, queues, messages, bytes, crc)``, and ``lsn``
must be the id's. A header that fails either, or does not decode, is reported (``read_headers``,
``broker snapshot verify``) and its snapshot skipped like one whose values fail their checksum: a
damaged lsn would otherwise start the replay at the wrong record. ``meta_crc`` was added with a default
(absent: not checked; snapshots written before it hold no such field), so it needed no new format version
(a broker of before it reads these snapshots, ignoring the field); the id check covers its lsn.

A chunk holds its messages (the tuples of ``QueueCore.dump``) column by column: one array of ids, one of
seqs, one of payloads, and so on, so a chunk decodes about three times faster than the same messages row
by row, and restarts are bounded by it (docs/benchmarks.md). Since version 3, a column whose messages all
hold the same value (a backlog's state, attempt, lease, key, headers …: most of its columns) is an array
of that one value (``codec.one_value``). A chunk's ids always differ, so its length is that of its ids,
and a shorter column can only be such a one. A chunk decodes in about half the time of version 2's,
which still reads.

Since version 4, a chunk has a last column, each message's history (``QueueCore.dump``): null, or an
array of its records, each the map the journal writes for it (``format.encode_entry``), with the
snapshot's lsn and the queue's name in the place of their own (a queue does not keep the lsn of what
happened to a message; a reader ignores both). And the ``f`` chunks hold the finished messages get-one
still shows (acked, dead-lettered, expired, redriven: ``FinishedHistory``), oldest first, as the ``m``
chunks hold the live ones. So a message's history, and an acked one's state, outlive a restart (§6).
Chunks of versions 2 and 3 have no history column: their messages read with none, and their
snapshots with no finished messages. A broker of before version 4 skips a version 4 snapshot, as
corrupt, and falls back to an older one or to the journal (docs/operations.md).

Since version 5, the payload of a finished message may be null: past ``FinishedHistory.payload_bytes``
the oldest finished messages let their payloads go and get-one shows them without one. They come first
in the ``f`` chunks. A broker of version 4 would take such a null for a payload, so it skips version 5
snapshots as it skips any version it does not know.

Since version 6, a message's history may hold, second (third after a replace's ``published``), an
entry of a type the journal never holds: ``omitted`` with its ``count`` (``HistoryOmitted``), for the
oldest entries dropped past ``MAX_HISTORY`` (``broker.core.queue``). A broker of version 5 skips such
a snapshot for its version (``read_snapshot`` checks it before reading any chunk), as it skips any
version it does not know, and falls back to an older snapshot or to the journal. Versions 2 to 5 still
read: their histories hold no such entry.

Since version 7, the head of a queue whose ``rate_limit`` window counts deliveries has a fifth item:
that window, ``[time, deliveries]`` pairs, oldest first, so that a restart does not start the window
over. A broker of version 6 would refuse such a head, so it skips version 7 snapshots for their
version. A head of four items (every head of versions 2 to 6) reads with an empty window: the replayed
journal's ``claimed`` records fill it from there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from broker.clock import format_time
from broker.core import FinishedHistory, NewMessage, QueueCore
from broker.core.config import DEFAULT_HISTORY
from broker.core.queue import MESSAGE_FIELDS, Columns, QueueImage
from broker.core.records import QueueCreated
from broker.errors import BrokerError
from broker.storage.codec import CBOR_NULL, cbor_array_head, cbor_dumps, cbor_loads, one_value
from broker.storage.format import CorruptRecord, decode_entry, encode_entry, entry_of
from broker.storage.lmdb_walk import DAMAGE, FOUND_DAMAGE, open_readonly
from broker.storage.recovery import Recovered, replay
from broker.storage.segments import JournalGap, check_follows, read_entries, sync_path

#: 7: a queue's head holds its ``rate_limit`` window.
#: 6: a message's history may hold an ``omitted`` entry (``HistoryOmitted``), which is no journal record.
#: 5: a finished message's payload may be null (let go past ``FinishedHistory.payload_bytes``).
#: 4: chunks gain a history column, and queues the finished messages (``f`` chunks). 3: a column of
#: one value shared by a chunk's messages holds it once. 2: chunks hold columns, each value of each
#: message. 1 held rows; such snapshots are skipped, the journal replayed instead.
SNAPSHOT_VERSION = 7
READABLE_VERSIONS = frozenset({2, 3, 4, 5, 6, 7})
SNAPSHOTS_DIR = "snapshots.lmdb"
#: The journal's segments, beside the snapshots in the data directory (see store.py for the layout).
JOURNAL_DIR = "journal"
CHUNK = 10_000
#: Snapshots kept; older ones are deleted when a new one is written.
KEEP = 3
MAP_SIZE = 1 << 38  # address space only: LMDB's file grows with what is written


class CorruptSnapshot(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    id: str
    lsn: int
    at: float
    taken_at: float
    queues: int
    messages: int
    bytes: int
    crc: int
    version: int = SNAPSHOT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "lsn": self.lsn,
            "at": format_time(self.at),  # its newest change's time: what restore --until compares
            "taken_at": format_time(self.taken_at),  # §2: RFC 3339
            "queues": self.queues,
            "messages": self.messages,
            "bytes": self.bytes,
        }


class SnapshotStoreError(OSError):
    """LMDB cannot open or use the snapshot file (I/O error, disk full, not a database)."""


class DamagedPages(SnapshotStoreError):
    """LMDB reached a page that is not what its B-tree says (``lmdb_walk.DAMAGE``): what was read through
    it cannot be read, but other snapshots in the file may be (``newest_valid``)."""


#: The fields of a snapshot's header that its ``meta_crc`` covers, and how they are packed for it.
_META_FIELDS = ("version", "lsn", "at", "taken_at", "queues", "messages", "bytes", "crc")
_META_PACKING = struct.Struct("<QQddQQQQ")


def _meta_crc(meta: dict[str, Any]) -> int:
    """The CRC32 of a header's fields (module docstring); ``struct.error``, ``KeyError`` or
    ``TypeError`` when one is missing or not a number of its kind."""
    return zlib.crc32(_META_PACKING.pack(*(meta[field] for field in _META_FIELDS)))


@dataclass(frozen=True, slots=True)
class DamagedSnapshot:
    """A snapshot whose header (``meta``) does not decode or fails its checks: its lsn is only what its
    id says, and it is never read."""

    id: str
    problem: str

    @property
    def lsn(self) -> int:
        return int(self.id)


# py-lmdb refuses to open one environment twice in a process (LMDB's locks are fcntl locks of the
# process: a second open would share them and its close drop them), so every use in this process goes
# through one open environment, shared while anyone uses it and closed after the last: calls of the
# server's worker threads at once (GET and POST /v1/admin/snapshots, the periodic snapshot) read side
# by side instead of failing. py-lmdb opens it with MDB_NOTLS, so each thread's transactions are its own.
_environments_lock = threading.Lock()
_environments: dict[str, tuple[lmdb.Environment, int]] = {}


@contextmanager
def environment(data_dir: Path, *, readonly: bool = False) -> Iterator[lmdb.Environment]:
    """The LMDB environment of ``data_dir``'s snapshots (created when missing), shared with the other
    threads of this process that use it meanwhile. ``SnapshotStoreError`` when LMDB cannot open it, or
    fails while it is used (``MDB_CORRUPTED`` from damaged pages, an I/O error, a full disk): the
    storage seam translates what LMDB raises, so that callers see an ``OSError``.

    ``readonly``: opened for reading only, and not created (for a reader that must not write the data
    directory: the Spark audit), if this process does not have it open already; the functions of this
    module called meanwhile share it."""
    path = os.path.realpath(data_dir / SNAPSHOTS_DIR)
    with _environments_lock:
        env, users = _environments.get(path) or (_open(path, readonly), 0)
        _environments[path] = (env, users + 1)
    try:
        yield env
    except DAMAGE as error:
        raise DamagedPages(str(error)) from None
    except lmdb.Error as error:
        raise SnapshotStoreError(str(error)) from None
    finally:
        with _environments_lock:
            env, users = _environments.pop(path)
            if users > 1:
                _environments[path] = (env, users - 1)
            else:
                env.close()


_WALKER = str(Path(__file__).with_name("lmdb_walk.py"))
#: How LMDB dies on a damaged page: an assertion (abort), or a read through a wild pointer.
_DAMAGE_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS})


def check_pages(data_dir: Path) -> None:
    """Raise ``SnapshotStoreError`` when walking the snapshot file kills the walker, or LMDB reports a
    damaged page to it (``walk_pages``): for the offline tools, which read the file as it is."""
    damage = walk_pages(data_dir)
    if damage is not None:
        raise SnapshotStoreError(
            f"{data_dir / SNAPSHOTS_DIR} is damaged: {damage}. The next `broker serve` rebuilds it from the "
            "newest snapshot it can read and the journal, and keeps this one beside it"
        )


def walk_pages(data_dir: Path) -> str | None:
    """What LMDB reports damaged in the snapshot file (None when it walks whole), or raise
    ``SnapshotStoreError`` when walking it kills the walker: LMDB aborts the process on some damaged
    pages rather than raising (``lmdb_walk``), so whoever is about to read the file asks a process of
    its own to walk it first (~0.1 s, and the pages it reads are then cached). A page LMDB reports
    damaged may be one of an older snapshot that a start never reads, but every snapshot written later
    deletes that one and fails on it (``SystemError`` from py-lmdb's ``Cursor.delete``): a start that
    can read a snapshot rebuilds the file (``rebuild``)."""
    path = data_dir / SNAPSHOTS_DIR
    if not (path / "data.mdb").exists():
        return None
    # Run as a script, not ``-m``: the package's __init__ would import the journal and the core (85 ms).
    walked = subprocess.run([sys.executable, _WALKER, str(path)], capture_output=True, check=False)
    said = walked.stderr.decode(errors="replace").strip().splitlines()
    if walked.returncode == FOUND_DAMAGE:
        return f"LMDB finds a damaged page in it ({said[-1] if said else 'MDB_CORRUPTED'})"
    if -walked.returncode not in _DAMAGE_SIGNALS:  # walked, or an error the caller's own open reports
        return None
    stopped = f"reading it stopped LMDB ({said[-1] if said else signal.Signals(-walked.returncode).name})"
    raise SnapshotStoreError(
        f"{path} is damaged: {stopped}. Move it aside "
        "(mv snapshots.lmdb snapshots.lmdb.damaged) and the next start recovers from the journal alone, "
        "if retention kept all of it (broker snapshot verify tells)"
    )


#: Where ``rebuild`` writes the new snapshot file before it swaps it in.
REBUILD_DIR = "snapshots.rebuild"
#: ``renameat2``'s flag that swaps two paths at once (Linux 3.15; ext4, xfs, btrfs, tmpfs).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def rebuild(data_dir: Path, recovered: Recovered) -> Path:
    """Replace ``data_dir``'s damaged snapshot file by a new one holding ``recovered`` (what a start
    recovered from a snapshot it could read and the journal) as its only snapshot, and keep the damaged
    one beside it: returns where. The new file is written and fsynced in ``REBUILD_DIR``, then the two
    are swapped at once (``renameat2`` with ``RENAME_EXCHANGE``), or, on a file system without that, the
    damaged one is moved aside and the new one moved in. A crash at any point leaves either the damaged
    file in place (the next start rebuilds again) or a whole new file, in place or in ``REBUILD_DIR``,
    where ``finish_rebuild`` takes it up."""
    building = data_dir / REBUILD_DIR
    shutil.rmtree(building, ignore_errors=True)  # a start that stopped while it wrote left it
    building.mkdir()
    write_snapshot(building, recovered)
    for child in (building / SNAPSHOTS_DIR).iterdir():
        sync_path(child)
    sync_path(building / SNAPSHOTS_DIR)
    sync_path(building)
    aside = _aside(data_dir)
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28
    exchanged = (
        renameat2 is not None
        and renameat2(
            _AT_FDCWD,
            os.fsencode(building / SNAPSHOTS_DIR),
            _AT_FDCWD,
            os.fsencode(data_dir / SNAPSHOTS_DIR),
            _RENAME_EXCHANGE,
        )
        == 0
    )
    if exchanged:
        os.rename(building / SNAPSHOTS_DIR, aside)  # the damaged one, now
    else:  # EINVAL where the file system has no exchange: two steps, which ``finish_rebuild`` completes
        os.rename(data_dir / SNAPSHOTS_DIR, aside)
        sync_path(data_dir)
        os.rename(building / SNAPSHOTS_DIR, data_dir / SNAPSHOTS_DIR)
    building.rmdir()
    sync_path(data_dir)
    return aside


def finish_rebuild(data_dir: Path, *, damaged: bool) -> Path | None:
    """Complete a ``rebuild`` a crash cut short, at the start after it (``damaged``: whether the file in
    place has pages LMDB reports damaged). The damaged file is in place: the rebuild had not swapped,
    and is made again. No file in place: the new one waits in ``REBUILD_DIR`` (written and fsynced before
    any move) and goes in. A sound one in place: the damaged one waits there after the swap, and is kept
    beside. Returns where the damaged file is kept when this completed a rebuild, else None."""
    building = data_dir / REBUILD_DIR
    left = building / SNAPSHOTS_DIR
    if not building.exists():
        return None
    kept = None
    if damaged:
        pass  # made again
    elif not left.exists():  # the moves were done, the clean-up not: maybe the log line neither
        kept = _newest_aside(data_dir)
    elif not (data_dir / SNAPSHOTS_DIR).exists():
        os.rename(left, data_dir / SNAPSHOTS_DIR)
        kept = _newest_aside(data_dir)
    elif _damaged(building):  # the damaged file, swapped out
        kept = _aside(data_dir)
        os.rename(left, kept)
    # Else no rebuild left it (its scratch space holds something else): nothing is completed.
    shutil.rmtree(building, ignore_errors=True)
    sync_path(data_dir)
    return kept


def _damaged(data_dir: Path) -> bool:
    try:
        return walk_pages(data_dir) is not None
    except SnapshotStoreError:  # reading it stopped LMDB
        return True


def _newest_aside(data_dir: Path) -> Path | None:
    return max(data_dir.glob(f"{SNAPSHOTS_DIR}.damaged-*"), default=None)


def _aside(data_dir: Path) -> Path:
    """Where a damaged snapshot file is kept: ``snapshots.lmdb.damaged-<UTC time, to the millisecond>``."""
    now = time.time()
    stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1000) % 1000:03d}Z"
    return data_dir / f"{SNAPSHOTS_DIR}.damaged-{stamp}"


def _open(path: str, readonly: bool = False) -> lmdb.Environment:
    try:
        if readonly:
            return open_readonly(path)
        return lmdb.open(path, map_size=MAP_SIZE, max_dbs=0)
    except lmdb.Error as error:
        raise SnapshotStoreError(str(error)) from None


def _decode(data: bytes, where: str) -> Any:
    try:
        return cbor_loads(data)
    except BrokerError as error:
        raise CorruptSnapshot(f"{where}: {error.message}") from None


def read_headers(data_dir: Path) -> tuple[list[SnapshotInfo], list[DamagedSnapshot]]:
    """Every finished snapshot whose header is sound, and every one whose header is damaged (module
    docstring), each newest first; their values are not checked here (``read_snapshot`` does), nor read:
    only the headers are (``_finished``)."""
    if not (data_dir / SNAPSHOTS_DIR).exists():
        return [], []
    found: list[SnapshotInfo] = []
    damaged: list[DamagedSnapshot] = []
    with environment(data_dir) as env, env.begin() as txn:
        for raw_id, meta in _finished(txn):
            snapshot_id = raw_id.decode(errors="replace")
            try:
                found.append(_header(snapshot_id, meta))
            except CorruptSnapshot as error:
                damaged.append(DamagedSnapshot(snapshot_id, str(error)))
    found.sort(key=lambda info: info.lsn, reverse=True)
    damaged.sort(key=lambda snapshot: snapshot.lsn, reverse=True)
    return found, damaged


def _finished(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
    """The id and header (``meta``) of every snapshot in ``txn``'s file that has one, oldest first.

    One cursor jump per snapshot, past all of its keys, and never a value but the headers': a walk of
    every key and value copied hundreds of megabytes out of the file (three snapshots of 500,000
    messages) for every ``GET /v1/admin/snapshots`` and every snapshot taken, holding the interpreter
    lock from the event loop's requests (docs/benchmarks.md, "Reading snapshots")."""
    found: list[tuple[bytes, bytes]] = []
    cursor = txn.cursor()
    positioned = cursor.set_range(b"s/")
    while positioned:
        key = bytes(cursor.key())
        if not key.startswith(b"s/"):
            break
        snapshot_id = key[2:].split(b"/", 1)[0]
        meta = txn.get(b"s/" + snapshot_id + b"/meta")
        if meta is not None:
            found.append((snapshot_id, bytes(meta)))
        # "0" is the byte after "/": the first key past every key under "s/<id>/".
        positioned = cursor.set_range(b"s/" + snapshot_id + b"0")
    return found


def list_snapshots(data_dir: Path) -> list[SnapshotInfo]:
    """Every finished snapshot whose header is sound, newest first (``read_headers``)."""
    return read_headers(data_dir)[0]


def _header(snapshot_id: str, value: bytes) -> SnapshotInfo:
    """The header ``value`` of snapshot ``snapshot_id``, checked; ``CorruptSnapshot`` saying what is
    wrong with it."""
    where = f"s/{snapshot_id}/meta"
    meta = _decode(value, where)
    if not isinstance(meta, dict):
        raise CorruptSnapshot(f"{where}: the header is not a map")
    try:
        info = SnapshotInfo(
            snapshot_id,
            meta["lsn"],
            meta["at"],
            meta["taken_at"],
            meta["queues"],
            meta["messages"],
            meta["bytes"],
            meta["crc"],
            meta.get("version", 1),
        )
    except KeyError as missing:
        raise CorruptSnapshot(f"{where}: the header has no {missing}") from None
    if "meta_crc" in meta:  # written by every broker since it was added (module docstring)
        try:
            crc = _meta_crc(meta)
        except (struct.error, TypeError):
            raise CorruptSnapshot(f"{where}: a field of the header is not a number of its kind") from None
        if crc != meta["meta_crc"]:
            raise CorruptSnapshot(
                f"snapshot {snapshot_id}'s header fails its checksum ({crc:#010x}, not {meta['meta_crc']!r})"
            )
    # An id is its snapshot's lsn, written in the same transaction: a header that says otherwise is
    # damaged (checked also for headers written before ``meta_crc``).
    if not (snapshot_id.isascii() and snapshot_id.isdigit()) or info.lsn != int(snapshot_id):
        raise CorruptSnapshot(f"snapshot {snapshot_id}'s header says lsn {info.lsn!r}, not the lsn of its id")
    return info


def write_snapshot(
    data_dir: Path, recovered: Recovered, *, before_commit: Callable[[], None] | None = None
) -> SnapshotInfo:
    """Write the queues of ``recovered`` as the snapshot of its ``last_lsn``; keep the newest ``KEEP``.
    ``before_commit`` is called last inside the write transaction: what it raises aborts it, and
    nothing is written (the compactor refuses to commit for a broker that is gone)."""
    snapshot_id = f"{recovered.last_lsn:020d}"
    prefix = f"s/{snapshot_id}/".encode()
    crc = 0
    size = 0
    messages = 0
    with environment(data_dir) as env:
        with env.begin(write=True) as txn:
            # A snapshot of this lsn may be there already (a restore writes the state it read at the
            # lsn it read it from): its keys go, or those this one does not write again would stay
            # under its prefix, and its checksum, which covers every value there, would fail.
            delete_snapshots(txn, [snapshot_id])
            for key, value, count in _values(prefix, recovered):
                txn.put(key, value)
                crc = zlib.crc32(value, crc)
                size += len(value)
                messages += count
            meta = {
                "version": SNAPSHOT_VERSION,
                "lsn": recovered.last_lsn,
                "at": recovered.last_at,
                "taken_at": time.time(),
                "queues": len(recovered.queues),
                "messages": messages,
                "bytes": size,
                "crc": crc,
            }
            meta["meta_crc"] = _meta_crc(meta)
            txn.put(prefix + b"meta", cbor_dumps(meta))
            _delete_all_but_newest(txn, KEEP)
            if before_commit is not None:
                before_commit()
        env.sync(True)
    return SnapshotInfo(
        snapshot_id,
        recovered.last_lsn,
        recovered.last_at,
        meta["taken_at"],
        len(recovered.queues),
        messages,
        size,
        crc,
    )


def _values(prefix: bytes, recovered: Recovered) -> Iterator[tuple[bytes, bytes, int]]:
    """The keys and values of the snapshot of ``recovered`` in key order, the order its CRC covers them
    in, each with the live messages it holds. They are encoded one at a time as they are written, so the
    snapshot process holds one chunk's CBOR beside the queues, not the whole snapshot's (docs/benchmarks.md,
    "Reading snapshots"). Under a queue's number, its finished messages' chunks (``f``) sort before its
    head (``h``) and its live messages' chunks (``m``); every queue sorts before those in transit (``t``)."""
    lsn = recovered.last_lsn
    for number, core in enumerate(recovered.queues.values()):
        image = core.dump()
        queue = prefix + b"q/%06d/" % number
        yield from _chunks(queue + b"f/", image.finished, lsn, image.name, live=False)
        created = encode_entry(
            lsn, recovered.last_at, image.name, QueueCreated(image.config, image.id_prefix)
        )
        head = [created, image.next_seq, list(image.counters), image.keys]
        if image.recent:
            head.append([list(delivered) for delivered in image.recent])
        yield queue + b"h", cbor_dumps(head), 0
        yield from _chunks(queue + b"m/", image.messages, lsn, image.name, live=True)
    transit = [
        [to, m.payload, m.binary, m.headers, m.key, m.priority, list(m.origin) if m.origin else None]
        for to, m in recovered.unsent
    ]
    yield prefix + b"t", cbor_dumps(transit), 0


def _chunks(
    prefix: bytes, blocks: Iterable[Columns], lsn: int, queue: str, *, live: bool
) -> Iterator[tuple[bytes, bytes, int]]:
    """The chunks of one kind of a queue's messages, keyed by their number after ``prefix``, each with
    how many live messages it holds (none if not ``live``)."""
    chunk_no = 0
    for block in blocks:
        for start, stop in _chunk_bounds(block[-1]):
            chunk = _chunk([column[start:stop] for column in block], lsn, queue)
            yield prefix + b"%08d" % chunk_no, chunk, stop - start if live else 0
            chunk_no += 1


def _chunk_bounds(histories: Sequence[Any]) -> Iterator[tuple[int, int]]:
    """Where each chunk of a block of messages starts and stops, given their histories: after ``CHUNK``
    messages, or sooner once their histories hold ``CHUNK`` entries. A chunk is decoded whole when it is
    read, every entry of its histories a map of its own until the message takes its record: 10,000
    messages of 40 entries each made 300 MB of such maps at once, and their memory stayed with the broker
    that read them (docs/benchmarks.md, "Reading snapshots")."""
    count = len(histories)
    if not any(histories):
        yield from ((start, min(start + CHUNK, count)) for start in range(0, count, CHUNK))
        return
    start = entries = 0
    for index, history in enumerate(histories):
        if history:
            entries += len(history)
        if index + 1 - start == CHUNK or entries >= CHUNK:
            yield start, index + 1
            start, entries = index + 1, 0
    if start < count:
        yield start, count


def _chunk(columns: list[Sequence[Any]], lsn: int, queue: str) -> bytes:
    """The CBOR of one chunk: its columns (``QueueImage``'s), the history last (see the module
    docstring), and each column of one value shared (``_shared``)."""
    *plain, histories = columns
    parts = [cbor_array_head(len(columns))]
    parts.extend(cbor_dumps(_shared(column)) for column in plain)
    parts.append(_history_column(lsn, queue, histories))
    return b"".join(parts)


def _history_column(lsn: int, queue: str, histories: Sequence[Any]) -> bytes:
    """The CBOR of a chunk's history column (see the module docstring): an array of one null when no
    message has any (a backlog's), else each message's null or array of record maps."""
    if not any(histories):
        return cbor_dumps([None])
    parts = [cbor_array_head(len(histories))]
    for history in histories:
        if history is None:
            parts.append(CBOR_NULL)
            continue
        parts.append(cbor_array_head(len(history)))
        parts.extend(encode_entry(lsn, at, queue, record) for at, record in history)
    return b"".join(parts)


def _shared(values: Sequence[Any]) -> Sequence[Any]:
    """``values``, or an array of the one value they all hold (``codec.one_value``)."""
    return values[:1] if one_value(values) else values


def _columns(chunk: Any, where: str) -> list[Any]:
    """A chunk's columns, each as long as its ids (a shared one repeated), and its history column of
    (time, record) pairs (of nulls, for a chunk of before version 4)."""
    if not isinstance(chunk, list) or not chunk or not all(isinstance(column, list) for column in chunk):
        raise CorruptSnapshot(f"{where}: a chunk is not an array of columns")
    count = len(chunk[0])
    for index, column in enumerate(chunk):
        if len(column) == 1 and count > 1:
            chunk[index] = column * count
        elif len(column) != count:
            raise CorruptSnapshot(f"{where}: column {index} holds {len(column)} values for {count} messages")
    if len(chunk) == len(MESSAGE_FIELDS) - 1:
        chunk.append([None] * count)
    elif len(chunk) != len(MESSAGE_FIELDS):
        raise CorruptSnapshot(f"{where}: a chunk holds {len(chunk)} columns, not {len(MESSAGE_FIELDS)}")
    histories = chunk[-1]
    if any(histories):
        # One str object for each text the records repeat (the message's id, a lease id that its
        # claim and settle both name, a consumer), as the live queue shares them: decoded, each record
        # held copies of its own, a history entry took 315 bytes against 185 before the restart.
        try:
            share = {message_id: message_id for message_id in chunk[0]}.setdefault
            for history in histories:
                if history:
                    for entry in history:
                        for field in _SHARED_FIELDS:
                            if field in entry:
                                text = entry[field]
                                entry[field] = share(text, text)
            chunk[-1] = [
                None if history is None else [(entry.at, entry.record) for entry in map(entry_of, history)]
                for history in histories
            ]
        except (CorruptRecord, TypeError) as error:
            raise CorruptSnapshot(f"{where}: a message's history: {error}") from None
    return chunk


#: The fields of history records whose texts repeat between records and messages (``_columns``).
_SHARED_FIELDS = ("id", "lease_id", "consumer")


def _delete_all_but_newest(txn: lmdb.Transaction, keep: int) -> None:
    ids = [snapshot_id for snapshot_id, _ in _finished(txn)]
    delete_snapshots(txn, [snapshot_id.decode() for snapshot_id in ids[: max(len(ids) - keep, 0)]])


def delete_snapshots(txn: lmdb.Transaction, ids: list[str]) -> None:
    """Remove every key of the snapshots ``ids`` in a write transaction (their keys only are walked)."""
    cursor = txn.cursor()
    for snapshot_id in ids:
        prefix = f"s/{snapshot_id}/".encode()
        if not cursor.set_range(prefix):
            continue
        while bytes(cursor.key()).startswith(prefix):
            cursor.delete()  # and on to the next key


def read_snapshot(
    data_dir: Path,
    info: SnapshotInfo,
    *,
    progress: Callable[[int, int], None] | None = None,
    history: FinishedHistory = DEFAULT_HISTORY,
) -> Recovered:
    """The queues of one snapshot, checked against its CRC; ``CorruptSnapshot`` if they do not match.
    ``progress(done, total)`` is told the bytes of values decoded so far; the queues keep ``history``'s
    finished messages.

    Two passes over one read transaction, whose values are LMDB's own pages (``buffers``), never copied
    whole: the first checks the CRC of every value before anything is decoded; the second decodes a chunk
    at a time and hands it to ``QueueCore.load`` at once (``QueueImage`` takes its chunks as they come),
    so the decoded columns of one chunk exist at a time rather than the whole snapshot's beside its copied
    values (2-3 times the live state's memory at a start, docs/benchmarks.md, "Reading snapshots")."""
    if info.version not in READABLE_VERSIONS:
        raise CorruptSnapshot(
            f"snapshot {info.id} is format version {info.version}; this broker reads versions "
            f"{', '.join(map(str, sorted(READABLE_VERSIONS)))}"
        )
    prefix = f"s/{info.id}/".encode()
    with environment(data_dir) as env, env.begin(buffers=True) as txn:
        layout = _checked_layout(txn, prefix, info)
        reading = _Reader(txn, layout.total, progress)
        recovered = Recovered(last_lsn=info.lsn, last_at=info.at)
        for queue_no, head_key in sorted(layout.heads.items()):
            queue, record, next_seq, counters, keys, recent = _head(
                reading.value(head_key), head_key.decode()
            )
            image = QueueImage(
                queue,
                record.config,
                record.id_prefix,
                next_seq,
                tuple(counters),
                [tuple(key) for key in keys],
                reading.chunks(layout.chunks.get((queue_no, b"m"), [])),
                reading.chunks(layout.chunks.get((queue_no, b"f"), [])),
                [(at, count) for at, count in recent],
            )
            recovered.queues[queue] = QueueCore.load(image, history=history)
        transit = (
            [] if layout.transit is None else _decode(reading.value(layout.transit), layout.transit.decode())
        )
    recovered.unsent = [
        (
            to,
            NewMessage(
                payload, binary, headers, key, 0.0, priority, origin=tuple(origin) if origin else None
            ),
        )
        for to, payload, binary, headers, key, priority, origin in transit
    ]
    if progress is not None:
        progress(layout.total, layout.total)
    return recovered


def _head(data: bytes, where: str) -> tuple[str, QueueCreated, int, list[Any], list[Any], list[Any]]:
    """A queue's head value: its name, the record that made it, its next sequence number, counters,
    idempotency keys and rate window (none before version 7); ``CorruptSnapshot`` naming ``where`` when
    it holds anything else."""
    value = _decode(data, where)
    try:
        created, next_seq, counters, keys, *rest = value
        (recent,) = rest or [[]]
        if not all(len(delivered) == 2 for delivered in recent):
            raise ValueError("a rate window entry is not (time, deliveries)")
        entry = decode_entry(created)
    except (CorruptRecord, TypeError, ValueError) as error:
        raise CorruptSnapshot(f"{where}: a queue's head: {error}") from None
    if not isinstance(entry.record, QueueCreated):
        raise CorruptSnapshot(
            f"{where}: a queue's head holds {type(entry.record).__name__}, not QueueCreated"
        )
    return entry.queue, entry.record, next_seq, counters, keys, recent


@dataclass(slots=True)
class _Layout:
    """The keys of a snapshot's values, by what they hold, and the bytes of all of them."""

    heads: dict[bytes, bytes]  # queue no → key
    chunks: dict[tuple[bytes, bytes], list[bytes]]  # (queue no, b"m" or b"f") → keys, in order
    transit: bytes | None
    total: int


def _checked_layout(txn: lmdb.Transaction, prefix: bytes, info: SnapshotInfo) -> _Layout:
    """The layout of the snapshot under ``prefix`` once the CRC of its values (all but ``meta``, in key
    order) is ``info``'s; else ``CorruptSnapshot``. Reads the values in place (``txn`` has ``buffers``)."""
    crc = 0
    total = 0
    keys: list[bytes] = []
    cursor = txn.cursor()
    if cursor.set_range(prefix):
        for raw_key, value in cursor:
            key = bytes(raw_key)
            if not key.startswith(prefix):
                break
            if key == prefix + b"meta":
                continue
            keys.append(key)
            crc = zlib.crc32(value, crc)
            total += len(value)
    if crc != info.crc:
        raise CorruptSnapshot(f"snapshot {info.id} fails its checksum ({crc:#010x}, not {info.crc:#010x})")
    layout = _Layout({}, {}, None, total)
    for key in keys:
        rest = key[len(prefix) :]
        if rest == b"t":
            layout.transit = key
        elif rest.endswith(b"/h"):
            layout.heads[rest.split(b"/")[1]] = key
        else:
            parts = rest.split(b"/")
            if len(parts) != 4:
                raise CorruptSnapshot(f"{key.decode(errors='replace')}: not a key a snapshot holds")
            layout.chunks.setdefault((parts[1], parts[2]), []).append(key)
    return layout


class _Reader:
    """The values of one snapshot, read in place from ``txn`` a value at a time, telling ``progress``
    the bytes read so far out of ``total``."""

    def __init__(
        self, txn: lmdb.Transaction, total: int, progress: Callable[[int, int], None] | None
    ) -> None:
        self._txn = txn
        self._total = total
        self._progress = progress
        self._done = 0

    def value(self, key: bytes) -> Any:
        """The value of ``key``: a view of LMDB's page, valid while the transaction is."""
        value = self._txn.get(key)
        assert value is not None  # a key ``_checked_layout`` found in this same transaction
        if self._progress is not None:
            self._progress(self._done, self._total)
        self._done += len(value)
        return value

    def chunks(self, keys: list[bytes]) -> Iterator[list[Any]]:
        """The columns of the chunks ``keys``, decoded one at a time as they are asked for."""
        for key in keys:
            where = key.decode()
            yield _columns(_decode(self.value(key), where), where)


def return_freed_memory() -> None:
    """Hand the heap that a bulk load freed back to the system (glibc's ``malloc_trim``; nothing where
    the C library is another). Reading a snapshot and replaying the journal free much of what they
    decode, and glibc keeps freed heap for reuse: a start that decoded a whole snapshot at once settled
    200 MB higher without it (386 MB of queues). Decoded a chunk at a time, a snapshot leaves little
    (5 MB of 290 in docs/benchmarks.md, "Reading snapshots"); a long journal replay may leave more."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # no glibc: musl, macOS
        return None
    return trim


def newest_valid(
    data_dir: Path,
    *,
    until_lsn: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    history: FinishedHistory = DEFAULT_HISTORY,
    read: Callable[[SnapshotInfo], Recovered] | None = None,
) -> tuple[Recovered | None, list[str]]:
    """The newest snapshot that passes its checksums (at or before ``until_lsn``), and a warning for
    each newer one skipped as corrupt, its header included, or on pages LMDB reports damaged (the
    start then rebuilds the file: ``walk_pages``) (``progress`` and ``history`` as for
    ``read_snapshot``). ``read`` reads a snapshot in its stead (``broker snapshot verify`` notes what
    each one read said, so that it reads none twice)."""
    warnings: list[str] = []
    found, damaged = read_headers(data_dir)
    candidates: list[SnapshotInfo | DamagedSnapshot] = [*found, *damaged]
    candidates.sort(key=lambda snapshot: snapshot.lsn, reverse=True)
    for info in candidates:
        if until_lsn is not None and info.lsn > until_lsn:
            continue
        if isinstance(info, DamagedSnapshot):
            warnings.append(f"snapshot {info.id} skipped: {info.problem}")
            continue
        try:
            if read is not None:
                return read(info), warnings
            return read_snapshot(data_dir, info, progress=progress, history=history), warnings
        except (CorruptSnapshot, ValueError, KeyError) as error:
            warnings.append(f"snapshot {info.id} skipped: {error}")
        except DamagedPages as error:
            warnings.append(f"snapshot {info.id} skipped: LMDB finds a damaged page under it ({error})")
    return None, warnings


def compact(
    data_dir: Path,
    until_lsn: int,
    *,
    before_commit: Callable[[], None] | None = None,
    history: FinishedHistory = DEFAULT_HISTORY,
) -> SnapshotInfo | None:
    """Make the snapshot of ``until_lsn`` from the newest snapshot and the journal (committed records
    only: the caller passes the journal's committed lsn). None when there is nothing new.
    ``before_commit`` as for ``write_snapshot``; the snapshot keeps ``history``'s finished messages."""
    base, skipped = newest_valid(data_dir, history=history)
    start = base.last_lsn if base is not None else 0
    if until_lsn <= start:
        return None
    # With every snapshot that covered the pruned journal unreadable now, what is left of it would
    # make a snapshot of the queues' later records alone: every queue lost, retention then deleting
    # the rest. Refused, naming the snapshots; the broker serves on from memory meanwhile.
    check_journal_follows(data_dir / JOURNAL_DIR, base, skipped, "No snapshot was written.")
    entries = _until(read_entries(data_dir / JOURNAL_DIR, after_lsn=start), until_lsn)
    recovered = replay(entries, base, history=history)
    return write_snapshot(data_dir, recovered, before_commit=before_commit)


def check_journal_follows(
    journal_dir: Path, base: Recovered | None, skipped: Sequence[str], consequence: str
) -> None:
    """Refuse (``JournalGap``) to rebuild the queues from a journal that does not go on from the
    snapshot ``base``, naming the snapshots that could not be read (with a rolled-back broker, ones of
    a newer format) after ``consequence``, what the refusal means."""
    try:
        if base is None:
            check_follows(journal_dir, 0, None)
        else:
            check_follows(journal_dir, base.last_lsn, "the newest snapshot that could be read")
    except JournalGap as gap:
        reasons = "".join(f" {warning[0].upper()}{warning[1:]}." for warning in skipped)
        raise JournalGap(f"{gap}. {consequence}{reasons}") from None


def check_snapshots_reached(data_dir: Path, reached: int, skipped: Sequence[str], consequence: str) -> None:
    """Refuse (``JournalGap``) when a snapshot that could not be read covers lsns past ``reached`` (what
    the journal and the snapshots that could be read give back): those lsns were recorded, and going on
    without them would serve their loss as the state. (The journal normally runs past every snapshot; a
    restore moves it aside, leaving the snapshot it wrote as the only copy of its state.)"""
    found, damaged = read_headers(data_dir)
    covered = [(info.lsn, info.id) for info in found] + [(bad.lsn, bad.id) for bad in damaged]
    newest_lsn, newest_id = max(covered, default=(0, ""))
    if newest_lsn <= reached:
        return
    reasons = "".join(f" {warning[0].upper()}{warning[1:]}." for warning in skipped)
    raise JournalGap(
        f"snapshot {newest_id} covers lsns up to {newest_lsn}, but the journal and the snapshots that can "
        f"be read reach lsn {reached} only: lsns {reached + 1}-{newest_lsn} would be lost. {consequence}"
        f"{reasons} To go on from an older state, restore it (broker snapshot restore), which drops the "
        "snapshots after it"
    )


def _until(entries: Iterator[Any], lsn: int) -> Iterator[Any]:
    for entry in entries:
        if entry.lsn > lsn:
            return
        yield entry
