"""The snapshot process (storage/compactor.py) never writes for a broker that is gone: after a
``kill -9`` of its broker it exits without committing, and while it runs the data directory is held."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.core import NewMessage, QueueCore
from broker.core.commands import Publish
from broker.core.config import QueueConfig
from broker.core.records import QueueCreated
from broker.storage import snapshots
from broker.storage.compactor import PARENT_GONE
from broker.storage.format import encode_frames
from broker.storage.segments import SegmentWriter
from broker.storage.snapshots import JOURNAL_DIR, list_snapshots
from broker.storage.store import DataDirectoryInUse, lock_data_dir

#: A broker reduced to its ``Snapshotter``: takes one snapshot of ``UNTIL_LSN``, and prints the pid of
#: the snapshot process as soon as it has started (as ``{"pid": …}``), then what ``take`` returned.
BROKER = """
import json, sys, trio
from pathlib import Path
from broker.storage.store import Snapshotter

run_process = trio.run_process


async def announcing(*args, task_status, **options):
    class Announce:
        def started(self, process):
            print(json.dumps({"pid": process.pid}), flush=True)
            task_status.started(process)

    return await run_process(*args, task_status=Announce(), **options)


trio.run_process = announcing


class Committed:
    committed_lsn = int(sys.argv[2])


print(trio.run(Snapshotter(Path(sys.argv[1]), Committed()).take), flush=True)
"""


def a_journal(data_dir: Path, messages: int) -> int:
    """A journal that creates a queue and publishes ``messages`` to it; its last lsn."""
    core = QueueCore("jobs", QueueConfig(), "p0")
    _, published = core.apply(Publish([NewMessage(b"1") for _ in range(messages)]), 1_000.0)
    writer = SegmentWriter(data_dir / JOURNAL_DIR, last_lsn=0)
    for lsn, records in ((1, [QueueCreated(QueueConfig(), "p0")]), (2, published)):
        writer.write(b"".join(encode_frames(lsn, 1_000.0, "jobs", records)), lsn, lsn + len(records) - 1)
    writer.sync()
    writer.close()
    return 1 + messages


def wait_for_exit(pid: int) -> None:
    """Return when process ``pid`` (not a child of this one) has ended; fail if it lives on."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], 60)  # a bound for a failure, not a pause
        assert ready, f"the snapshot process {pid} outlived its broker"
    finally:
        os.close(pidfd)


def test_a_snapshot_process_whose_broker_is_killed_exits_without_writing(tmp_path: Path) -> None:
    until = a_journal(tmp_path, 50)
    # This test holds LMDB's write lock: the snapshot process can replay the journal, never commit.
    with snapshots.environment(tmp_path) as env, env.begin(write=True):
        broker = subprocess.Popen(
            [sys.executable, "-c", BROKER, str(tmp_path), str(until)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert broker.stdout is not None
            pid = json.loads(broker.stdout.readline())["pid"]
            # While it runs, no tool (and no broker) may use the directory: a restore must wait for it.
            # (Its pid is in the message once the broker has written it in the lock file: not awaited.)
            in_use = r"in use by a snapshot process (pid \d+ .*)?that is still running"
            with pytest.raises(DataDirectoryInUse, match=in_use):
                lock_data_dir(tmp_path).close()
            broker.send_signal(signal.SIGKILL)
            broker.wait()
            wait_for_exit(pid)
        finally:
            broker.kill()
            broker.communicate()
    assert list_snapshots(tmp_path) == []
    lock_data_dir(tmp_path).close()  # the directory is free again


def test_a_snapshot_process_that_finds_its_broker_gone_commits_nothing(tmp_path: Path) -> None:
    until = a_journal(tmp_path, 5)
    done = subprocess.run(
        [sys.executable, "-m", "broker.storage.compactor", str(tmp_path), str(until), "--with-parent"],
        stdin=subprocess.DEVNULL,  # a pipe whose writer is gone reads as this: at its end at once
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == PARENT_GONE and done.stdout == ""
    assert "the broker that started this snapshot is gone: nothing was written" in done.stderr
    assert list_snapshots(tmp_path) == []


def test_a_snapshot_process_of_a_broker_that_lives_commits(tmp_path: Path) -> None:
    until = a_journal(tmp_path, 5)
    done = subprocess.run(
        [sys.executable, "-c", BROKER, str(tmp_path), str(until)], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[-1].startswith("SnapshotInfo(id='00000000000000000006'")
    assert [info.lsn for info in list_snapshots(tmp_path)] == [until]
