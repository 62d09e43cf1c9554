"""What reading snapshots costs: headers listed without their snapshots' values, a snapshot checked
whole and then loaded a chunk at a time, histories read back as compact as the live queue held them,
and the heap freed by a start handed back (docs/benchmarks.md, "Reading snapshots")."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest

from broker.core import FinishedHistory, NewMessage, QueueCore
from broker.core.commands import Ack, Claim, Nack, Publish
from broker.core.config import QueueConfig
from broker.core.records import Claimed, Nacked, QueueDeleted
from broker.storage import restore, snapshots, store
from broker.storage.codec import cbor_dumps, cbor_loads
from broker.storage.format import encode_entry
from broker.storage.recovery import Recovered
from broker.storage.snapshots import (
    JOURNAL_DIR,
    KEEP,
    SNAPSHOTS_DIR,
    CorruptSnapshot,
    list_snapshots,
    read_headers,
    read_snapshot,
    write_snapshot,
)
from broker.storage.store import open_data_dir


class ValuesRead:
    """The keys whose values LMDB handed out through the transactions of ``snapshots.environment``."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []


class _Cursor:
    def __init__(self, cursor: Any, read: ValuesRead) -> None:
        self._cursor = cursor
        self._read = read

    def __iter__(self) -> Iterator[Any]:
        return self.iternext()

    def iternext(self, keys: bool = True, values: bool = True) -> Iterator[Any]:
        for item in self._cursor.iternext(keys=keys, values=values):
            if values:
                self._read.keys.append(bytes(item[0]) if keys else b"?")
            yield item

    def value(self) -> Any:
        self._read.keys.append(bytes(self._cursor.key()))
        return self._cursor.value()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class _Transaction:
    def __init__(self, txn: Any, read: ValuesRead) -> None:
        self._txn = txn
        self._read = read

    def __enter__(self) -> _Transaction:
        self._txn.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._txn.__exit__(*exc_info)

    def get(self, key: bytes, default: Any = None) -> Any:
        value = self._txn.get(key, default)
        if value is not None:
            self._read.keys.append(bytes(key))
        return value

    def cursor(self) -> _Cursor:
        return _Cursor(self._txn.cursor(), self._read)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class _Environment:
    def __init__(self, env: Any, read: ValuesRead) -> None:
        self._env = env
        self._read = read

    def begin(self, **options: Any) -> _Transaction:
        return _Transaction(self._env.begin(**options), self._read)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


@pytest.fixture
def values_read(monkeypatch: pytest.MonkeyPatch) -> ValuesRead:
    read = ValuesRead()
    real = snapshots.environment

    @contextmanager
    def counting(data_dir: Path, *, readonly: bool = False) -> Iterator[Any]:
        with real(data_dir, readonly=readonly) as env:
            yield _Environment(env, read)

    monkeypatch.setattr(snapshots, "environment", counting)
    return read


def a_backlog(count: int, name: str = "jobs") -> QueueCore:
    core = QueueCore(name, QueueConfig(), f"{name}-")
    core.apply(Publish([NewMessage(f'"{name} {n}"'.encode()) for n in range(count)]), 1_000.0)
    return core


def a_queue_that_retried(count: int, rounds: int, name: str = "worked") -> QueueCore:
    """``count`` messages, each claimed and nacked ``rounds`` times (two history entries a round), then
    the first acked (a finished message, with its history)."""
    core = a_backlog(count, name)
    for round_no in range(rounds):
        claimed, _ = core.apply(Claim("worker", max_count=count), 1_001.0 + round_no)
        core.apply(Nack([claim.lease_id for claim, _ in claimed.deliveries]), 1_001.5 + round_no)
    claimed, _ = core.apply(Claim("worker", max_count=1), 1_100.0)
    core.apply(Ack([claim.lease_id for claim, _ in claimed.deliveries]), 1_100.5)
    return core


def keys_of(data_dir: Path) -> list[bytes]:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), readonly=True, lock=False) as env, env.begin() as txn:
        return [bytes(key) for key in txn.cursor().iternext(values=False)]


def messages_per_chunk(data_dir: Path, kind: bytes = b"m") -> list[int]:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), readonly=True, lock=False) as env, env.begin() as txn:
        return [len(cbor_loads(bytes(value))[0]) for key, value in txn.cursor() if b"/%s/" % kind in key]


# -- headers ----------------------------------------------------------------------------------------------


def test_listing_snapshots_reads_their_headers_and_no_other_value(
    tmp_path: Path, values_read: ValuesRead
) -> None:
    """``GET /v1/admin/snapshots`` and every snapshot taken list the snapshots: reading every value of
    every snapshot for it held the interpreter lock for 150 ms (three of 90 MB) while requests waited."""
    core = a_queue_that_retried(20, 3)
    for lsn in (10, 20, 30):
        write_snapshot(tmp_path, Recovered(queues={"worked": core}, last_lsn=lsn, last_at=1_200.0 + lsn))
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        txn.put(b"s/00000000000000000020/meta", b"\xff\xff\x00garbage")  # a damaged header
        txn.delete(b"s/00000000000000000010/meta")  # an unfinished snapshot: its values, no header
        txn.put(b"s/00000000000000000025/q/000000/h", b"unfinished too")
    values_read.keys.clear()
    found, damaged = read_headers(tmp_path)
    assert [info.id for info in found] == ["00000000000000000030"]
    assert found[0].lsn == 30 and found[0].at == 1_230.0 and found[0].queues == 1 and found[0].messages == 19
    assert [(bad.id, bad.lsn) for bad in damaged] == [("00000000000000000020", 20)]
    assert "meta: the body is not valid CBOR" in damaged[0].problem
    assert values_read.keys and all(key.endswith(b"/meta") for key in values_read.keys), values_read.keys


def test_a_snapshot_past_keep_deletes_the_oldest_reading_no_value_but_headers(
    tmp_path: Path, values_read: ValuesRead
) -> None:
    core = a_queue_that_retried(20, 3)
    for lsn in range(1, KEEP + 1):
        write_snapshot(tmp_path, Recovered(queues={"worked": core}, last_lsn=lsn, last_at=1_200.0))
    oldest = list_snapshots(tmp_path)[-1]
    values_read.keys.clear()
    write_snapshot(tmp_path, Recovered(queues={"worked": core}, last_lsn=KEEP + 1, last_at=1_200.0))
    assert all(key.endswith(b"/meta") for key in values_read.keys), values_read.keys
    kept = [info.lsn for info in list_snapshots(tmp_path)]
    assert kept == list(range(KEEP + 1, 1, -1))
    assert not [key for key in keys_of(tmp_path) if key.startswith(f"s/{oldest.id}/".encode())]
    assert read_snapshot(tmp_path, list_snapshots(tmp_path)[-1]).queues["worked"].dump() == core.dump()


# -- chunks -----------------------------------------------------------------------------------------------


def test_a_chunk_ends_once_its_histories_hold_chunk_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk decodes whole, each history entry a map of its own: 10,000 messages of 40 entries made
    300 MB of maps at once, which the broker that read them kept. Messages without history still fill
    chunks of ``CHUNK``."""
    monkeypatch.setattr(snapshots, "CHUNK", 10)
    backlog, worked = a_backlog(25, "backlog"), a_queue_that_retried(12, 2)  # 4 entries each, 1 finished
    write_snapshot(
        tmp_path, Recovered(queues={"backlog": backlog, "worked": worked}, last_lsn=9, last_at=2e3)
    )
    assert messages_per_chunk(tmp_path) == [10, 10, 5, 3, 3, 3, 2]  # 3 of 4 entries pass 10; 11 live
    (info,) = list_snapshots(tmp_path)
    loaded = read_snapshot(tmp_path, info).queues
    assert loaded["backlog"].dump() == backlog.dump() and loaded["worked"].dump() == worked.dump()


def test_chunks_are_decoded_one_at_a_time_as_the_queue_loads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never the decoded columns of the whole snapshot at once: a start took 2-3 times the memory of the
    queues it loaded."""
    monkeypatch.setattr(snapshots, "CHUNK", 4)
    core = a_backlog(10)
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=9, last_at=1_000.0))
    events: list[str] = []
    columns, load_block = snapshots._columns, QueueCore._load_block

    def decoded(chunk: Any, where: str) -> list[Any]:
        events.append("decoded")
        return columns(chunk, where)

    def loaded(self: QueueCore, block: Any) -> None:
        events.append("loaded")
        load_block(self, block)

    monkeypatch.setattr(snapshots, "_columns", decoded)
    monkeypatch.setattr(QueueCore, "_load_block", loaded)
    (info,) = list_snapshots(tmp_path)
    assert read_snapshot(tmp_path, info).queues["jobs"].dump() == core.dump()
    assert events == ["decoded", "loaded"] * 3


def test_a_snapshot_of_many_chunks_reads_back_every_queue_and_reports_its_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshots, "CHUNK", 3)
    queues = {"backlog": a_backlog(10, "backlog"), "worked": a_queue_that_retried(7, 2)}
    worked = queues["worked"]
    claimed, _ = worked.apply(Claim("worker", max_count=3), 1_200.0)
    for claim, _ in claimed.deliveries:  # more finished messages, acked one by one: several f chunks
        worked.apply(Ack([claim.lease_id]), 1_201.0)
    unsent = [("elsewhere", NewMessage(b'"moved"', origin=("worked", "worked-1")))]
    write_snapshot(tmp_path, Recovered(queues=queues, last_lsn=50, last_at=1_300.0, unsent=unsent))
    assert len(messages_per_chunk(tmp_path, b"f")) > 1 and len(messages_per_chunk(tmp_path, b"m")) > 3
    (info,) = list_snapshots(tmp_path)
    told: list[tuple[int, int]] = []
    history = FinishedHistory(count=100)
    read = read_snapshot(
        tmp_path, info, progress=lambda done, total: told.append((done, total)), history=history
    )
    assert {name: core.dump() for name, core in read.queues.items()} == {
        name: core.dump() for name, core in queues.items()
    }
    assert [(to, message.payload, message.origin) for to, message in read.unsent] == [
        ("elsewhere", b'"moved"', ("worked", "worked-1"))
    ]
    assert told[-1] == (info.bytes, info.bytes)
    assert [done for done, _ in told] == sorted(done for done, _ in told)
    assert {total for _, total in told} == {info.bytes}


def test_a_chunk_that_fails_the_checksum_is_refused_before_any_queue_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshots, "CHUNK", 3)
    write_snapshot(tmp_path, Recovered(queues={"jobs": a_backlog(10)}, last_lsn=9, last_at=1_000.0))
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = b"s/00000000000000000009/q/000000/m/00000003"  # the last chunk
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value))
    loads: list[str] = []
    monkeypatch.setattr(QueueCore, "load", classmethod(lambda cls, image, **_: loads.append(image.name)))
    (info,) = list_snapshots(tmp_path)
    with pytest.raises(CorruptSnapshot, match="snapshot 00000000000000000009 fails its checksum"):
        read_snapshot(tmp_path, info)
    assert loads == []


def _reseal(data_dir: Path, snapshot_id: str, key: bytes, value: bytes) -> None:
    """Put ``value`` at ``key`` and the CRC of the new values in the snapshot's header, as a writer with a
    bug would: the snapshot passes its checksums and holds what no broker wrote."""
    prefix = f"s/{snapshot_id}/".encode()
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        txn.put(key, value)
        crc = 0
        for raw_key, raw_value in txn.cursor():
            if bytes(raw_key).startswith(prefix) and bytes(raw_key) != prefix + b"meta":
                crc = zlib.crc32(raw_value, crc)
        meta = cbor_loads(txn.get(prefix + b"meta"))
        meta["crc"] = crc
        meta["meta_crc"] = snapshots._meta_crc(meta)
        txn.put(prefix + b"meta", cbor_dumps(meta))


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        (lambda created: [encode_entry(9, 1_000.0, "jobs", QueueDeleted()), 1, [], []], "holds QueueDeleted"),
        (lambda created: [created, 1], "a queue's head: not enough values"),
        (lambda created: [b"\xff", 1, [], []], "a queue's head: a journal record must be"),
    ],
)
def test_a_queue_head_that_passes_its_checksum_but_is_wrong_names_its_key_and_the_start_steps_back(
    tmp_path: Path, head: Any, problem: str
) -> None:
    write_snapshot(tmp_path, Recovered(queues={"jobs": a_backlog(3)}, last_lsn=5, last_at=1_000.0))
    write_snapshot(tmp_path, Recovered(queues={"jobs": a_backlog(4)}, last_lsn=9, last_at=1_001.0))
    key = b"s/00000000000000000009/q/000000/h"
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), readonly=True, lock=False) as env, env.begin() as txn:
        created = cbor_loads(txn.get(key))[0]
    _reseal(tmp_path, "00000000000000000009", key, cbor_dumps(head(created)))
    newest, _ = list_snapshots(tmp_path)
    with pytest.raises(CorruptSnapshot, match=f"^{key.decode()}: .*{problem}"):
        read_snapshot(tmp_path, newest)
    recovered, warnings = snapshots.newest_valid(tmp_path)
    assert recovered is not None and recovered.last_lsn == 5
    assert len(recovered.queues["jobs"].message_ids()) == 3
    assert warnings and key.decode() in warnings[0]


# -- what the queues read hold ----------------------------------------------------------------------------


def test_records_read_back_share_the_texts_they_repeat_as_the_live_queue_does(tmp_path: Path) -> None:
    """A message's id, a lease id its claim and nack both name, a consumer: one str each, not one per
    record (a history entry took 315 bytes after a restart against 185 before it)."""
    core = a_queue_that_retried(3, 2)
    write_snapshot(tmp_path, Recovered(queues={"worked": core}, last_lsn=9, last_at=1_200.0))
    (info,) = list_snapshots(tmp_path)
    loaded = read_snapshot(tmp_path, info).queues["worked"]
    assert loaded.dump() == core.dump()
    message_id = loaded.message_ids()[-1]
    view, _ = loaded.get(message_id, 1_200.0)
    first_claim, first_nack, second_claim, _ = [record for _, record in view.history[1:]]
    assert isinstance(first_claim, Claimed) and isinstance(first_nack, Nacked)
    assert isinstance(second_claim, Claimed)
    assert first_claim.id is view.id and first_nack.id is view.id
    assert first_nack.lease_id is first_claim.lease_id
    assert second_claim.consumer is first_claim.consumer


# -- freed memory -----------------------------------------------------------------------------------------


def test_a_start_and_a_verify_hand_freed_memory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(store, "return_freed_memory", lambda: calls.append("start"))
    monkeypatch.setattr(restore, "return_freed_memory", lambda: calls.append("verify"))
    write_snapshot(tmp_path, Recovered(queues={"jobs": a_backlog(5)}, last_lsn=5, last_at=1_000.0))
    (tmp_path / JOURNAL_DIR).mkdir()
    opened = open_data_dir(tmp_path)
    opened.release()
    assert calls == ["start"]
    restore.verify(tmp_path)
    assert calls == ["start", "verify"]


def test_handing_freed_memory_back_does_nothing_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_glibc(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    snapshots._malloc_trim.cache_clear()
    try:
        monkeypatch.setattr(snapshots.ctypes, "CDLL", no_glibc)
        snapshots.return_freed_memory()
        assert snapshots._malloc_trim() is None
    finally:
        monkeypatch.undo()
        snapshots._malloc_trim.cache_clear()
    snapshots.return_freed_memory()  # with glibc here, trims; elsewhere, nothing
