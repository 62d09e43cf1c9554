"""``live.recovered_state`` refuses what ``broker serve`` refuses to start on, so that the audit reports
``unrecoverable`` for it rather than auditing a state no broker would serve (no Spark needed here)."""

from __future__ import annotations

from pathlib import Path

import lmdb

from broker.core import NewMessage, QueueConfig, QueueCore
from broker.core.commands import Claim
from broker.storage.format import encode_frames
from broker.storage.recovery import Recovered
from broker.storage.segments import JournalGap, SegmentWriter
from broker.storage.snapshots import JOURNAL_DIR, SNAPSHOTS_DIR, write_snapshot
from broker.storage.store import open_data_dir
from tools.journal_audit.live import recovered_state


def a_snapshot_and_the_journal_after_it(data_dir: Path, *, journal_from: int = 7) -> QueueCore:
    """A snapshot of two messages at lsn 6, and a claim of one journaled from lsn ``journal_from`` on
    (7: the journal goes on from the snapshot; later: the lsns between were lost)."""
    core = QueueCore("jobs", QueueConfig(), "j-")
    core.publish([NewMessage(b"1"), NewMessage(b"2")], 1_000.0)
    write_snapshot(data_dir, Recovered(queues={"jobs": core}, last_lsn=6, last_at=1_000.0))
    _, records = core.apply(Claim("worker"), 1_001.0)
    writer = SegmentWriter(data_dir / JOURNAL_DIR, last_lsn=journal_from - 1)
    last = journal_from - 1 + len(records)
    writer.write(b"".join(encode_frames(journal_from, 1_001.0, "jobs", records)), journal_from, last)
    writer.sync()
    writer.close()
    return core


def flip_a_bit_of_the_snapshot(data_dir: Path) -> None:
    with lmdb.open(str(data_dir / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = b"s/00000000000000000006/q/000000/m/00000000"
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value))


def test_a_sound_directory_recovers_its_messages(tmp_path: Path) -> None:
    a_snapshot_and_the_journal_after_it(tmp_path)
    live = recovered_state(tmp_path, tmp_path / JOURNAL_DIR)
    assert live is not None and live.failure is None
    assert (live.snapshot_lsn, live.last_lsn, len(live.messages)) == (6, 7, 2)


def test_a_journal_that_does_not_go_on_from_the_snapshot_is_a_refused_start(tmp_path: Path) -> None:
    a_snapshot_and_the_journal_after_it(tmp_path, journal_from=9)  # lsns 7-8 are gone
    live = recovered_state(tmp_path, tmp_path / JOURNAL_DIR)
    assert live is not None and live.failure is not None
    assert live.failure[0] == 7 and "the broker refuses to start" in live.failure[1]
    assert live.failure[1].startswith("the journal starts at lsn 9")
    try:
        open_data_dir(tmp_path).lock.close()
    except JournalGap as refused:
        assert str(refused).split(".")[0] == live.failure[1].split(".")[0]  # what the broker says
    else:
        raise AssertionError("the broker started")


def test_a_sole_snapshot_that_fails_its_checksum_with_nothing_else_reaching_it_is_a_refused_start(
    tmp_path: Path,
) -> None:
    """As after a restore, whose snapshot is the only copy of its state: the broker refuses to start,
    and the audit said "no valid snapshot" and audited the journal alone as if all were well."""
    core = QueueCore("jobs", QueueConfig(), "j-")
    core.publish([NewMessage(b"1")], 1_000.0)
    write_snapshot(tmp_path, Recovered(queues={"jobs": core}, last_lsn=6, last_at=1_000.0))
    (tmp_path / JOURNAL_DIR).mkdir()
    flip_a_bit_of_the_snapshot(tmp_path)
    live = recovered_state(tmp_path, tmp_path / JOURNAL_DIR)
    assert live is not None and live.failure is not None and live.snapshot_id is None
    assert live.failure[1].startswith("snapshot 00000000000000000006 covers lsns up to 6, but the journal")
    assert "the broker refuses to start" in live.failure[1]
