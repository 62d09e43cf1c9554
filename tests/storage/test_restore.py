"""The offline snapshot tools: ``broker snapshot list|verify|restore [--until]``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lmdb
import pytest

from broker.cli import main
from broker.config import Settings
from broker.server import open_broker
from broker.storage.restore import format_time
from broker.storage.segments import read_entries
from broker.storage.snapshots import SNAPSHOTS_DIR, list_snapshots
from broker.storage.store import lock_data_dir


def archived_journals(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("journal.before-restore-*"))


async def ready_payloads(settings: Settings) -> list[Any]:
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        body = await (await app.test_client().get("/v1/queues/jobs/messages")).get_json()
        return [message["payload"] for message in body["messages"]]


async def publish(settings: Settings, *payloads: int, snapshot: bool = False) -> None:
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for payload in payloads:
            assert (
                await client.post("/v1/queues/jobs/messages", json={"payload": payload})
            ).status_code == 201
        if snapshot:
            assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)


async def test_restore_a_snapshot_then_serve_from_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1, 2)  # a clean shutdown snapshots [1, 2]
    [first] = list_snapshots(tmp_path)
    await publish(settings, 3)  # and then [1, 2, 3]
    assert main(["snapshot", "list", "--data-dir", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("000")]
    assert len(rows) == 2 and rows[1].startswith(first.id)  # newest first

    assert main(["snapshot", "restore", first.id, "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"restored: snapshot {first.id}" in out and "journal.before-restore-" in out
    assert await ready_payloads(settings) == [1, 2]
    # The journal as it was is kept, whole, for audits.
    [archived] = archived_journals(tmp_path)
    assert [entry.record.payload for entry in read_entries(archived) if hasattr(entry.record, "payload")] == [
        b"1",
        b"2",
        b"3",
    ]
    # And the broker carries on from the restored state.
    await publish(settings, 4)
    assert await ready_payloads(settings) == [1, 2, 4]


async def test_restore_until_a_time_replays_the_journal_up_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    await publish(settings, 2)  # each session snapshots at its end: the newest is past the time asked
    await publish(settings, 3)
    times = {
        entry.record.payload: entry.at
        for entry in read_entries(tmp_path / "journal")
        if hasattr(entry.record, "payload")
    }
    until = math.ceil(times[b"2"] * 1000) / 1000  # the time as an operator types it, to the millisecond
    assert until < times[b"3"]  # a restart lies between them
    assert main(["snapshot", "restore", "--until", format_time(until), "--data-dir", str(tmp_path)]) == 0
    assert await ready_payloads(settings) == [1, 2]


def test_verify_reports_a_corrupt_snapshot_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import trio

    trio.run(publish, Settings(data_dir=tmp_path), 1)
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 0
    [info] = list_snapshots(tmp_path)
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = f"s/{info.id}/q/000000/h".encode()
        value = bytearray(txn.get(key))
        value[-1] ^= 0x40
        txn.put(key, bytes(value))
    capsys.readouterr()
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 1
    assert "fails its checksum" in capsys.readouterr().out


def test_the_tools_refuse_a_directory_a_broker_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = lock_data_dir(tmp_path)
    try:
        assert main(["snapshot", "restore", "1", "--data-dir", str(tmp_path)]) == 1
        assert "in use by pid" in capsys.readouterr().err
    finally:
        held.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["restore"], "say what to restore"),
        (["restore", "42"], "there is no snapshot 42"),
        (["restore", "--until", "yesterday"], "is not a time"),
        (["restore", "--until", "2026-11-22T10:00:00"], "no time zone"),
    ],
)
def test_bad_restore_requests_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["snapshot", *args, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("broker: ") and says in err and len(err.splitlines()) == 1
