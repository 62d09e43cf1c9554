"""A capped history's ``omitted`` entry in snapshots (format version 6), and never in the journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.core import NewMessage, QueueConfig, QueueCore
from broker.core.queue import MAX_HISTORY
from broker.core.records import HISTORY_ONLY_TYPES, RECORD_TYPES, Claimed, Deferred, HistoryOmitted
from broker.storage import snapshots
from broker.storage.codec import cbor_loads
from broker.storage.format import (
    CorruptRecord,
    decode_entry,
    decode_frame,
    encode_entry,
    encode_frames,
    entry_of,
)
from broker.storage.recovery import Recovered
from broker.storage.snapshots import list_snapshots, newest_valid, read_snapshot, write_snapshot
from tests.storage.test_format import documented_table, in_code


def a_queue_with_a_capped_history() -> tuple[QueueCore, str]:
    """A message claimed and deferred 700 times (1,400 entries: trimmed), and a second, plain one."""
    core = QueueCore("jobs", QueueConfig(), "m-")
    refs, _ = core.publish([NewMessage(b'"loops"'), NewMessage(b'"waits"', key="k")], 1_000.0)
    now = 1_000.0
    for _ in range(700):
        now += 1.0
        outcome, _ = core.claim("worker", 1, None, now)
        [(claimed, _)] = outcome.deliveries
        core.defer([claimed.lease_id], 0.0, None, now)  # back first in line: the same one every time
    return core, refs[0][0]


def test_a_snapshot_keeps_a_capped_history_with_its_omitted_entry(tmp_path: Path) -> None:
    core, message_id = a_queue_with_a_capped_history()
    history = core.get(message_id, 2_000.0)[0].history
    assert type(history[2][1]) is HistoryOmitted and len(history) <= MAX_HISTORY + 1
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=2_000.0))
    (info,) = list_snapshots(tmp_path)
    assert info.version == snapshots.SNAPSHOT_VERSION
    loaded = read_snapshot(tmp_path, info).queues["jobs"]
    assert loaded.dump() == core.dump()
    assert loaded.get(message_id, 2_000.0)[0].history == history


def test_a_broker_that_reads_up_to_version_5_skips_a_newer_snapshot_for_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, _ = a_queue_with_a_capped_history()
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=40, last_at=2_000.0))
    monkeypatch.setattr(snapshots, "READABLE_VERSIONS", frozenset({2, 3, 4, 5}))
    found, warnings = newest_valid(tmp_path)
    assert found is None
    assert warnings == [
        f"snapshot 00000000000000000040 skipped: snapshot 00000000000000000040 is format version "
        f"{snapshots.SNAPSHOT_VERSION}; "
        "this broker reads versions 2, 3, 4, 5"
    ]


def test_a_version_5_snapshot_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a broker of version 5 wrote: the same chunks, histories without omitted entries.
    core = QueueCore("jobs", QueueConfig(), "m-")
    core.publish([NewMessage(b'"a"'), NewMessage(b'"b"', delay=5.0)], 1_000.0)
    outcome, _ = core.claim("worker", 1, None, 1_001.0)
    core.nack([outcome.deliveries[0][0].lease_id], 3.0, "later", 1_002.0)
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "SNAPSHOT_VERSION", 5)
        write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=9, last_at=1_002.0))
    (info,) = list_snapshots(tmp_path)
    assert info.version == 5
    assert read_snapshot(tmp_path, info).queues["jobs"].dump() == core.dump()


def test_the_omitted_entry_is_written_as_a_record_map_only_snapshots_read() -> None:
    entry = encode_entry(40, 1_001.5, "jobs", HistoryOmitted(300))
    assert cbor_loads(entry) == {"lsn": 40, "at": 1_001.5, "queue": "jobs", "type": "omitted", "count": 300}
    assert entry_of(cbor_loads(entry)).record == HistoryOmitted(300)
    # Journal records still read as entries of a history.
    claimed = Claimed("m-1", "m-1.1", "worker", 1, 1_031.0)
    assert entry_of(cbor_loads(encode_entry(41, 1_001.0, "jobs", claimed))).record == claimed


def test_the_journal_neither_writes_nor_reads_an_omitted_entry() -> None:
    with pytest.raises(TypeError, match="HistoryOmitted is not a journal record type"):
        encode_frames(1, 1.0, "jobs", [HistoryOmitted(100)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="HistoryOmitted is not a journal record type"):
        encode_frames(1, 1.0, "jobs", [Deferred("m", "l", 0.0, None), HistoryOmitted(100)])  # type: ignore[list-item]
    written = encode_entry(7, 1.0, "jobs", HistoryOmitted(100))
    with pytest.raises(CorruptRecord, match=r"'type' must be one of .*, not str 'omitted'"):
        decode_entry(written)
    with pytest.raises(CorruptRecord, match=r"'type' must be one of .*, not str 'omitted'"):
        decode_frame(written)


def test_the_document_lists_every_type_only_snapshots_hold_with_its_keys() -> None:
    documented = documented_table("history-only-types")
    assert documented == {name: in_code(cls) for cls, name in HISTORY_ONLY_TYPES.items()}
    assert not set(documented) & set(RECORD_TYPES.values())


def test_a_snapshot_keeps_the_rate_window_and_a_head_without_one_reads_as_before(tmp_path: Path) -> None:
    """Version 7: a restart started a ``rate_limit`` window over, and so let another ``max`` go."""
    limited = QueueCore("limited", QueueConfig().updated({"rate_limit": {"max": 2, "per": 3600}}), "m-")
    limited.publish([NewMessage(b'"x"') for _ in range(4)], 1_000.0)
    assert len(limited.claim("worker", 4, None, 1_001.0)[0].deliveries) == 2
    plain = QueueCore("plain", QueueConfig(), "n-")
    plain.publish([NewMessage(b'"y"')], 1_000.0)
    write_snapshot(
        tmp_path, Recovered(queues={"limited": limited, "plain": plain}, last_lsn=9, last_at=1_001.0)
    )
    (info,) = list_snapshots(tmp_path)
    queues = read_snapshot(tmp_path, info).queues
    outcome = queues["limited"].claim("worker", 4, None, 1_002.0)[0]
    assert (outcome.deliveries, outcome.retry_after) == ([], 3599.0)
    assert queues["plain"].dump() == plain.dump()  # a head of four items, as before version 7
