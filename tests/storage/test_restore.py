"""The offline snapshot tools: ``broker snapshot list|verify|restore [--until]``."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest
import structlog

from broker import clock as clock_module
from broker.cli import main
from broker.clock import format_time
from broker.commands import snapshots as snapshot_commands
from broker.config import Settings
from broker.server import open_broker
from broker.storage import restore as restore_module
from broker.storage import snapshots as snapshots_module
from broker.storage.format import FRAME_OVERHEAD
from broker.storage.retention import Retention
from broker.storage.segments import HEADER_SIZE, read_entries, segment_header, segments
from broker.storage.snapshots import SNAPSHOTS_DIR, SnapshotStoreError, list_snapshots
from broker.storage.store import lock_data_dir, open_data_dir
from tests.conftest import drop_snapshot, start_refusal


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


async def test_restore_until_a_time_past_damage_in_the_journal_is_refused_naming_the_latest_it_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replay stops at the first bad frame. Restoring "as of" a later time used to exit 0 with the state
    as of the damage, say nothing, and move the damaged journal out of sight: the operator got less
    than asked for, unawares. The refusal names the damage and the latest time it reaches, and that time
    restores."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)  # a clean shutdown snapshots [1]
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for payload in (2, 3, 4):
            await client.post("/v1/queues/jobs/messages", json={"payload": payload})
    shutdown, *kept = [s.id for s in list_snapshots(tmp_path)]
    drop_snapshot(tmp_path, shutdown)  # so the restore replays 2, 3 and 4
    entries = list(read_entries(tmp_path / "journal"))
    times = {entry.record.payload: entry.at for entry in entries if hasattr(entry.record, "payload")}
    (segment,) = segments(tmp_path / "journal")
    data = bytearray(segment.path.read_bytes().rstrip(b"\0"))
    offset, last = HEADER_SIZE, HEADER_SIZE
    while offset < len(data):  # to the last frame, the record that publishes 4
        last = offset
        offset += FRAME_OVERHEAD + int.from_bytes(data[offset : offset + 4], "little")
    data[last + FRAME_OVERHEAD + 3] ^= 0x01
    segment.path.write_bytes(bytes(data))
    asked = format_time(times[b"4"] + 60)

    assert main(["snapshot", "restore", "--until", asked, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    latest = format_time(times[b"3"], round_up=True)
    assert err.startswith(
        f"broker: restore_refused: cannot restore as of {asked}: the journal is damaged after lsn "
    )
    assert "a frame fails its checksum" in err and f"The latest time that can be restored is {latest}" in err
    assert err.rstrip().endswith("Nothing was changed.") and not archived_journals(tmp_path)
    assert [s.id for s in list_snapshots(tmp_path)] == kept
    assert main(["snapshot", "restore", "--until", latest, "--data-dir", str(tmp_path)]) == 0
    assert await ready_payloads(settings) == [1, 2, 3]


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
    ("args", "code", "status"),
    [
        (["restore"], "bad_input: say what to restore", 2),
        (["restore", "42", "--until", "2026-11-22T10:00:00Z"], "bad_input: say what to restore", 2),
        (["restore", "--until", "yesterday"], "bad_input: 'yesterday' is not a time", 2),
        (["restore", "--until", "2026-11-22T10:00:00"], "bad_input: '2026-11-22T10:00:00' has no", 2),
        # ISO 8601 that is not RFC 3339: a week date restored to 2026-11-16 without a word.
        (["restore", "--until", "2026-W47-1T10:00Z"], "bad_input: '2026-W47-1T10:00Z' is not a time", 2),
        (["restore", "--until", "20261122T100000Z"], "bad_input: '20261122T100000Z' is not a time", 2),
        (["restore", "--until", "2026-11-22T10Z"], "bad_input: '2026-11-22T10Z' is not a time", 2),
        (["restore", "--until", "2026-11-22T10:00:00+0100"], "bad_input: '2026-11-22T10:00:00+0100' is", 2),
        (["restore", "--until", "2026-11-22t10:00:00.5z"], "nothing_to_restore", 1),  # RFC 3339 allows t, z
        (["restore", "42"], "snapshot_not_found: there is no snapshot 42", 4),
        (["restore", "--until", "2020-01-01T00:00:00Z"], "nothing_to_restore: nothing was recorded", 1),
        (
            ["restore", "--until", "0001-01-01T00:00:00+14:00"],
            "bad_input: '0001-01-01T00:00:00+14:00' is out",
            2,
        ),
    ],
)
def test_bad_restore_requests_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: str, status: int
) -> None:
    assert main(["snapshot", *args, "--data-dir", str(tmp_path)]) == status
    err = capsys.readouterr().err
    assert err.startswith(f"broker: {code}") and len(err.splitlines()) == 1, err


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what ran before (the broker's log lines)
    try:
        status = main(["snapshot", *argv])
    except SystemExit as stop:  # argparse's usage errors
        status = stop.code if isinstance(stop.code, int) else 2
    out, err = capsys.readouterr()
    return status, out, err


ACTIONS = [["list"], ["verify"], ["restore", "1"]]


def walk_dies(store: Path) -> bool:
    walker = Path(snapshots_module.__file__).with_name("lmdb_walk.py")
    walked = subprocess.run([sys.executable, str(walker), str(store)], check=False)
    return walked.returncode < 0


def test_a_snapshot_file_lmdb_merely_refuses_is_not_called_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The walker's read-only open refuses an empty ``data.mdb`` that the broker's own open takes (as an
    empty store): only the walker's death by a signal is damage, not an error LMDB raised."""
    (tmp_path / SNAPSHOTS_DIR).mkdir()
    (tmp_path / SNAPSHOTS_DIR / "data.mdb").write_bytes(b"")
    status, out, err = run(capsys, "list", "--data-dir", str(tmp_path))
    assert (status, out.strip(), err) == (0, f"no snapshots in {tmp_path}", "")


async def test_a_snapshot_file_lmdb_aborts_on_is_one_line_for_the_tools_and_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On some damaged pages LMDB aborts the process (an assertion in mdb.c): list, verify, restore and
    the broker's start died with SIGABRT and a line of C. A page whose zeroing does that is found by
    trying each (the file's layout is LMDB's business)."""
    settings = Settings(data_dir=tmp_path)
    for round in range(4):  # pages enough: snapshots of a few dozen messages
        await publish(settings, *range(30 * round, 30 * round + 30), snapshot=True)
    data_file = tmp_path / SNAPSHOTS_DIR / "data.mdb"
    whole = data_file.read_bytes()
    page = 4096
    for number in range(2, len(whole) // page):  # pages 0 and 1 are LMDB's meta pages
        damaged = whole[: number * page] + bytes(page) + whole[(number + 1) * page :]
        data_file.write_bytes(damaged)
        if walk_dies(tmp_path / SNAPSHOTS_DIR):
            break
    else:
        pytest.fail("no page whose zeroing makes LMDB abort: the test needs another way to damage the file")
    for action in ACTIONS:
        status, out, err = run(capsys, *action, "--data-dir", str(tmp_path))
        assert status == 1 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("broker: storage_unavailable: ") and "snapshots.lmdb is damaged" in err
        assert "Move it aside" in err
    with pytest.raises(SnapshotStoreError, match=r"snapshots\.lmdb is damaged: reading it stopped LMDB"):
        open_data_dir(tmp_path)
    assert data_file.read_bytes() == damaged  # left as it is, for the operator


@pytest.mark.parametrize("action", ACTIONS, ids=lambda action: action[0])
def test_a_snapshot_file_that_is_not_lmdb_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: list[str]
) -> None:
    (tmp_path / SNAPSHOTS_DIR).mkdir()
    (tmp_path / SNAPSHOTS_DIR / "data.mdb").write_bytes(b"not a database" * 512)
    status, out, err = run(capsys, *action, "--data-dir", str(tmp_path))
    assert status == 1 and out == ""
    assert err.startswith("broker: storage_unavailable: ") and "not an LMDB file" in err
    assert len(err.splitlines()) == 1
    status, _, err = run(capsys, *action, "--data-dir", str(tmp_path), "--json")
    assert status == 1 and json.loads(err)["error"]["code"] == "storage_unavailable"


@pytest.mark.parametrize("action", ACTIONS, ids=lambda action: action[0])
def test_a_data_dir_that_is_a_file_or_missing_is_one_line_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: list[str]
) -> None:
    afile = tmp_path / "data"
    afile.write_text("")
    status, _, err = run(capsys, *action, "--data-dir", str(afile))
    assert (status, err) == (2, f"broker: not_a_directory: {afile} is a file, not a data directory\n")
    missing = tmp_path / "missing"
    status, _, err = run(capsys, *action, "--data-dir", str(missing))
    assert (status, err) == (4, f"broker: data_dir_not_found: there is no data directory {missing}\n")
    assert not missing.exists()
    status, _, err = run(capsys, *action, "--data-dir", str(afile / "below"))
    assert status == 4 and err.startswith("broker: data_dir_not_found: ")


def test_a_permission_error_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tests may run as root, whom file modes do not stop: refuse where the tools open files.
    def refuse(path: Path, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path / "broker.lock"))

    monkeypatch.setattr(restore_module, "lock_data_dir", refuse)
    monkeypatch.setattr(snapshot_commands, "list_snapshots", refuse)
    for action in ACTIONS:
        status, _, err = run(capsys, *action, "--data-dir", str(tmp_path))
        assert status == 1, action
        assert err == (
            f"broker: storage_unavailable: cannot use the data directory {tmp_path}: "
            f"Permission denied: {tmp_path / 'broker.lock'}\n"
        )


def test_usage_mistakes_are_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys)[0] == 2
    assert run(capsys, "prune")[0] == 2
    assert run(capsys, "list", "extra", "--data-dir", str(tmp_path))[0] == 2


async def test_every_action_answers_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1, 2)
    await publish(settings, 3)
    status, out, _ = run(capsys, "list", "--data-dir", str(tmp_path), "--json")
    assert status == 0
    listed = json.loads(out)["snapshots"]
    assert [snapshot["id"] for snapshot in listed] == [info.id for info in list_snapshots(tmp_path)]
    assert set(listed[0]) == {"id", "lsn", "at", "taken_at", "queues", "messages", "bytes"}
    assert listed[0]["at"] == format_time(list_snapshots(tmp_path)[0].at)
    assert listed[0]["taken_at"] == format_time(list_snapshots(tmp_path)[0].taken_at)  # §2: RFC 3339
    assert (listed[0]["queues"], listed[0]["messages"]) == (1, 3)

    status, out, _ = run(capsys, "verify", "--data-dir", str(tmp_path), "--json")
    assert status == 0
    verified = json.loads(out)
    assert verified["ok"] is True and verified["journal"] == {"problem": None}
    assert [(s["id"], s["problem"]) for s in verified["snapshots"]] == [(s["id"], None) for s in listed]

    older = listed[1]["id"]
    status, out, _ = run(capsys, "restore", older, "--data-dir", str(tmp_path), "--json")
    assert status == 0
    restored = json.loads(out)
    assert restored["restored"]["id"] == older and restored["restored"]["messages"] == 2
    assert restored["dropped_snapshots"] == [listed[0]["id"]] and restored["replayed"] == 0
    assert restored["archived_journal"] == str(archived_journals(tmp_path)[0])
    assert await ready_payloads(settings) == [1, 2]


async def test_list_is_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await publish(Settings(data_dir=tmp_path), 1)
    status, out, _ = run(capsys, "list", "--data-dir", str(tmp_path))
    assert status == 0
    header, rule, row = out.splitlines()
    assert header.split() == ["id", "lsn", "as", "of", "taken", "at", "queues", "messages", "bytes"]
    assert set(rule) <= {"─", " "}
    [info] = list_snapshots(tmp_path)
    assert row.split()[:3] == [info.id, str(info.lsn), format_time(info.at)]
    assert row.split()[4:6] == ["1", "1"]


async def test_a_restore_draws_a_progress_bar_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    await publish(settings, 2)
    until = format_time(max(entry.at for entry in read_entries(tmp_path / "journal")) + 1)
    status, _, err = run(capsys, "restore", "--until", until, "--data-dir", str(tmp_path))
    assert status == 0 and err == ""  # stderr is no terminal here: no bar
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's switch: stderr is a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    status, _, err = run(capsys, "restore", "--until", until, "--data-dir", str(tmp_path))
    assert status == 0
    assert "━" in err and ("replaying the journal" in err or "reading snapshot" in err)
    status, out, err = run(capsys, "restore", "--until", until, "--data-dir", str(tmp_path), "--json")
    assert status == 0 and err == "" and json.loads(out)["restored"]


async def test_restore_before_the_snapshots_kept_says_retention_deleted_that_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        journal_segment_bytes=2000,  # about 7 records per segment
        journal_retention=Retention(max_bytes=0, max_age=None),  # keep nothing the snapshots cover
    )
    await publish(settings, *range(20), snapshot=True)
    lost_at = time.time()  # after the first snapshot, which is rotated out below
    for round in range(3):
        await publish(settings, *range(20 * round, 20 * round + 20), snapshot=True)
    kept = list_snapshots(tmp_path)
    assert len(kept) == 3 and kept[-1].at > lost_at
    assert main(["snapshot", "restore", "--until", format_time(lost_at), "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"broker: restore_refused: cannot restore as of {format_time(lost_at)}: ")
    assert "deleted by the journal's retention once the snapshots that covered them were rotated out" in err
    earliest = format_time(kept[-1].at, round_up=True)
    assert f"The earliest time that can be restored is {earliest}" in err
    assert "cannot be read" not in err and err.rstrip().endswith("Nothing was changed.")
    # The time named reaches that snapshot (a time cut to the millisecond fell just before it).
    assert main(["snapshot", "restore", "--until", earliest, "--data-dir", str(tmp_path)]) == 0


async def test_restore_until_the_millisecond_the_api_shows_includes_what_it_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The API rounds times to the millisecond; restore compared the unrounded time, so an ack shown at
    ``…39.639Z`` but recorded at ``…39.6390698`` was left out of ``--until …39.639Z``."""
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for payload in range(20):  # until one is recorded after the millisecond it is shown at
            await client.post("/v1/queues/jobs/messages", json={"payload": payload})
            ids = (await (await client.get("/v1/queues/jobs/messages")).get_json())["messages"]
            shown = ids[-1]["published_at"]
            recorded = payload_times(tmp_path)[str(payload).encode()]
            if recorded > restore_module.parse_time(shown):
                break
        else:
            pytest.skip("every publish was recorded at or before the millisecond shown (20 tries)")
    for snapshot in list_snapshots(tmp_path):
        drop_snapshot(tmp_path, snapshot.id)
    assert main(["snapshot", "restore", "--until", shown, "--data-dir", str(tmp_path)]) == 0
    assert (await ready_payloads(settings))[-1] == payload


async def test_a_snapshot_shows_its_newest_change_at_the_millisecond_the_api_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A snapshot's ``at`` was cut to the millisecond where the API rounds: a publish shown at ``…35.827Z``
    was in a snapshot shown at ``…35.826Z``, and ``--until`` that snapshot's ``at`` dropped it (the
    newest change it holds was past the time asked) and the publish with it."""
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        for payload in range(40):  # until one is recorded in the second half of its millisecond
            answer = await client.post("/v1/queues/jobs/messages", json={"payload": payload})
            [message] = (await answer.get_json())["messages"]
            recorded = payload_times(tmp_path)[str(payload).encode()]
            if round(recorded * 1000) != math.floor(recorded * 1000):
                break
        else:
            pytest.skip("no publish was recorded in the second half of its millisecond (40 tries)")
        assert (await client.post("/v1/admin/snapshots")).status_code == 201
        shown = await (await client.get(f"/v1/queues/jobs/messages/{message['id']}")).get_json()
    newest = max(list_snapshots(tmp_path), key=lambda info: info.lsn)
    assert newest.to_dict()["at"] == shown["published_at"]

    until = ["--until", shown["published_at"]]
    capsys.readouterr()
    assert main(["snapshot", "restore", *until, "--data-dir", str(tmp_path), "--json"]) == 0
    restored = json.loads(capsys.readouterr().out)
    assert restored["restored"]["id"] == newest.id and restored["dropped_snapshots"] == []
    assert (await ready_payloads(settings))[-1] == payload


async def test_the_tools_name_a_journal_of_a_newer_format_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollback to an older broker: verify and restore --until printed UnsupportedVersion's traceback."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    (segment,) = segments(tmp_path / "journal")
    data = bytearray(segment.path.read_bytes())
    data[:HEADER_SIZE] = segment_header(segment.first_lsn, version=99)
    segment.path.write_bytes(bytes(data))
    for action in (["verify"], ["restore", "--until", "2999-01-01T00:00:00Z"]):
        status, _, err = run(capsys, *action, "--data-dir", str(tmp_path))
        assert status == 1 and len(err.splitlines()) == 1, err
        assert err.startswith("broker: unsupported_format: ") and "journal format version 99" in err


def payload_times(data_dir: Path, journal: str = "journal") -> dict[Any, float]:
    return {
        entry.record.payload: entry.at
        for entry in read_entries(data_dir / journal)
        if hasattr(entry.record, "payload")
    }


async def test_a_restore_does_not_reach_back_past_an_earlier_one_without_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first restore moves the journal aside. A second, as of a time before it, found the newest
    snapshot before that time, nothing to replay after it, and restored that snapshot as the state of
    the time asked: what was recorded between them (3 here) was silently not there."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1, 2)  # a clean shutdown snapshots [1, 2]
    await publish(settings, 3)  # [1, 2, 3]: dropped below, so that no snapshot covers 3 alone
    drop_snapshot(tmp_path, list_snapshots(tmp_path)[0].id)
    await publish(settings, 4)  # [1, 2, 3, 4], a session (milliseconds at least) after 3
    newest = list_snapshots(tmp_path)[0]
    times = payload_times(tmp_path)
    until = format_time(math.ceil(times[b"3"] * 1000) / 1000)
    assert round(times[b"4"] * 1000) > round(times[b"3"] * 1000) + 1  # 4 is after the time asked
    assert main(["snapshot", "restore", newest.id, "--data-dir", str(tmp_path)]) == 0
    [archived] = archived_journals(tmp_path)
    capsys.readouterr()
    kept = list_snapshots(tmp_path)

    assert main(["snapshot", "restore", "--until", until, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"broker: restore_refused: cannot restore as of {until}: snapshot ")
    assert f"an earlier restore moved them aside, to {archived.name}/" in err
    assert err.rstrip().endswith("Nothing was changed.") and len(err.splitlines()) == 1
    assert list_snapshots(tmp_path) == kept and archived_journals(tmp_path) == [archived]
    assert await ready_payloads(settings) == [1, 2, 3, 4]


async def test_records_later_than_the_host_clock_are_still_known_as_moved_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal written ahead of the host's clock (``clock_behind_journal``): the first restore wrote
    the host's time as when it moved the journal aside, an hour before records it moved, so a second
    restore as of a time between them took them for later than the move and restored without them."""
    settings = Settings(data_dir=tmp_path)
    with monkeypatch.context() as patched:
        ahead = types.SimpleNamespace(
            time=lambda: time.time() + 3600, strftime=time.strftime, gmtime=time.gmtime
        )
        patched.setattr(clock_module, "time", ahead)
        await publish(settings, 1, 2)
        await publish(settings, 3)
    times = payload_times(tmp_path)
    first = format_time(math.ceil(times[b"2"] * 1000) / 1000)
    assert main(["snapshot", "restore", "--until", first, "--data-dir", str(tmp_path)]) == 0
    [archived] = archived_journals(tmp_path)
    capsys.readouterr()

    second = format_time(math.ceil(times[b"3"] * 1000) / 1000)
    assert main(["snapshot", "restore", "--until", second, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"broker: restore_refused: cannot restore as of {second}: ")
    assert archived.name in err and await ready_payloads(settings) == [1, 2]


async def test_a_restore_whose_archive_name_is_taken_moves_the_journal_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is the journal's time when later than the host's: two restores could pick the same one,
    and the second failed at the rename after it had dropped and written snapshots, every time."""
    settings = Settings(data_dir=tmp_path)
    with monkeypatch.context() as patched:  # a journal ahead of the host's clock names its archive
        ahead = types.SimpleNamespace(
            time=lambda: time.time() + 3600, strftime=time.strftime, gmtime=time.gmtime
        )
        patched.setattr(clock_module, "time", ahead)
        await publish(settings, 1, 2)
        await publish(settings, 3)
    taken = restore_module._plan_archive(tmp_path / "journal")
    assert taken is not None
    taken.target.mkdir()
    until = format_time(math.ceil(payload_times(tmp_path)[b"2"] * 1000) / 1000)
    assert main(["snapshot", "restore", "--until", until, "--data-dir", str(tmp_path)]) == 0
    assert archived_journals(tmp_path) == [taken.target, taken.target.with_name(taken.target.name + "-2")]
    assert await ready_payloads(settings) == [1, 2]


async def test_a_restore_to_a_time_after_an_earlier_restore_point_names_the_journal_it_moved_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator restores as of a time, finds it too early, and restores as of a later one. The
    first restore moved the journal holding what came later aside, and dropped the snapshots after its
    point: the second replayed nothing and restored the first's state as that of the later time."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    await publish(settings, 2)
    await publish(settings, 3)
    times = payload_times(tmp_path)
    first, later = (format_time(math.ceil(times[payload] * 1000) / 1000) for payload in (b"1", b"2"))
    assert main(["snapshot", "restore", "--until", first, "--data-dir", str(tmp_path)]) == 0
    restored_by = time.time()
    [archived] = archived_journals(tmp_path)
    capsys.readouterr()
    # Just after the restore, the broker is on the timeline it began, however soon: no refusal (the
    # archive's time was taken from its name, to the second, and the rest of that second refused).
    just_after = format_time(restored_by + 0.002, round_up=True)
    assert main(["snapshot", "restore", "--until", just_after, "--data-dir", str(tmp_path)]) == 0
    assert archived_journals(tmp_path) == [archived]  # the journal since was empty: nothing moved
    capsys.readouterr()

    assert main(["snapshot", "restore", "--until", later, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"broker: restore_refused: cannot restore as of {later}: an earlier restore moved")
    assert f"aside, to {archived.name}/" in err and err.rstrip().endswith("Nothing was changed.")
    assert await ready_payloads(settings) == [1]
    # What the message says to do reaches the time asked.
    (tmp_path / "journal").rename(tmp_path / "journal.since-restore")
    archived.rename(tmp_path / "journal")
    assert main(["snapshot", "restore", "--until", later, "--data-dir", str(tmp_path)]) == 0
    assert await ready_payloads(settings) == [1, 2]
    # A time after a restore is on the timeline that restore began: the journal it moved aside is not
    # asked about (here the broker served [1, 2] from the restore on, whatever the journal moved holds).
    assert (
        main(["snapshot", "restore", "--until", format_time(time.time() + 1), "--data-dir", str(tmp_path)])
        == 0
    )
    assert await ready_payloads(settings) == [1, 2]


async def test_restore_until_a_time_before_the_first_record_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "nothing was recorded before": a journal whose times go back (the host's clock stepped back
    between two runs, before 2026-11-24) has records from before that time further on."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    for snapshot in list_snapshots(tmp_path):
        drop_snapshot(tmp_path, snapshot.id)
    first_at = min(entry.at for entry in read_entries(tmp_path / "journal"))
    until = format_time(first_at - 10)
    assert main(["snapshot", "restore", "--until", until, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"broker: nothing_to_restore: the journal's first record (lsn 1) is from {format_time(first_at)}, "
        f"after {until}: nothing was recorded before it"
    )


async def test_restore_until_a_time_with_the_journal_damaged_from_its_start_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It answered nothing_to_restore ("nothing was recorded before ..."), which was not so."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1, 2)
    for snapshot in list_snapshots(tmp_path):
        drop_snapshot(tmp_path, snapshot.id)
    until = format_time(payload_times(tmp_path)[b"2"] + 1)
    (segment,) = segments(tmp_path / "journal")
    data = bytearray(segment.path.read_bytes())
    data[HEADER_SIZE + FRAME_OVERHEAD + 3] ^= 0x01  # the first record
    segment.path.write_bytes(bytes(data))

    assert main(["snapshot", "restore", "--until", until, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"broker: restore_refused: cannot restore as of {until}: the journal is damaged before its first "
        "record (00000000000000000001.journal from byte 20"
    ), err
    assert "a frame fails its checksum" in err and err.rstrip().endswith("Nothing was changed.")
    assert not archived_journals(tmp_path)


@pytest.mark.parametrize("snapshot", [False, True])
def test_verify_reports_a_journal_tail_without_cutting_it_as_what_the_next_start_does(
    tmp_path: Path, snapshot: bool
) -> None:
    """The last frame torn: with no snapshot the next start cuts it; with the snapshot that the clean
    shutdown took, which covers it, the start steps over it, cuts nothing, and writes on in a new
    segment (verify used to say it cuts it)."""
    import shutil

    import trio

    trio.run(publish, Settings(data_dir=tmp_path), 1, 2)
    (segment,) = segments(tmp_path / "journal")
    torn = segment.path.read_bytes().rstrip(b"\0")[:-3]
    segment.path.write_bytes(torn)
    if not snapshot:
        shutil.rmtree(tmp_path / SNAPSHOTS_DIR)
    problem = restore_module.verify(tmp_path).journal_problem
    assert segment.path.read_bytes() == torn
    assert problem is not None
    if snapshot:
        assert problem.startswith("damage under snapshot") and "which the next start steps over" in problem
        assert "a frame is torn" in problem and "cuts" not in problem, problem
    else:
        assert problem.startswith("a torn or corrupt tail, which the next start cuts: ")


def find_a_page_lmdb_reports_damaged_under_an_older_snapshot(data_dir: Path) -> bytes:
    """Damage ``data_dir``'s snapshot file so that LMDB raises ``MDB_CORRUPTED`` on walking it (no
    abort), on a page of an older snapshot: the newest still reads whole. Returns the damaged file's
    bytes."""
    return damage_a_page(data_dir, unreadable=lambda readable: readable[0] and not all(readable))


def damage_a_page(data_dir: Path, unreadable: Callable[[list[bool]], bool]) -> bytes:
    """Damage one page of ``data_dir``'s snapshot file so that LMDB raises ``MDB_CORRUPTED`` on walking
    it (no abort), and ``unreadable`` holds of which snapshots still read (newest first). The page is
    found by trying each (the file's layout is LMDB's business): its header's flags flipped, LMDB finds
    a page of the wrong type. Returns the damaged file's bytes."""
    data_file = data_dir / SNAPSHOTS_DIR / "data.mdb"
    whole = data_file.read_bytes()
    infos = list_snapshots(data_dir)
    walker = Path(snapshots_module.__file__).with_name("lmdb_walk.py")
    page = 4096
    for number in range(2, len(whole) // page):  # pages 0 and 1 are LMDB's meta pages
        damaged = bytearray(whole)
        damaged[number * page + 10] ^= 0xFF  # mp_flags, after mp_pgno (8 bytes) and mp_pad (2)
        damaged[number * page + 11] ^= 0xFF
        data_file.write_bytes(damaged)
        walked = subprocess.run([sys.executable, str(walker), str(data_file.parent)], capture_output=True)
        if walked.returncode < 0 or b"MDB_CORRUPTED" not in walked.stderr:
            continue
        try:
            if list_snapshots(data_dir) != infos:
                continue  # a page of the headers
            readable = [reads(data_dir, info) for info in infos]
        except SnapshotStoreError:
            continue
        if unreadable(readable):
            return bytes(damaged)
    pytest.fail("no page LMDB reports damaged where the test needs it: the test needs another way")


def damage_the_listing(data_dir: Path) -> None:
    """Damage a page of ``data_dir``'s snapshot file that LMDB reports (``MDB_CORRUPTED``) when the
    snapshots' headers are listed, as ``damage_a_page`` damages one."""
    data_file = data_dir / SNAPSHOTS_DIR / "data.mdb"
    whole = data_file.read_bytes()
    walker = Path(snapshots_module.__file__).with_name("lmdb_walk.py")
    for number in range(2, len(whole) // 4096):
        damaged = bytearray(whole)
        damaged[number * 4096 + 10] ^= 0xFF
        damaged[number * 4096 + 11] ^= 0xFF
        data_file.write_bytes(damaged)
        walked = subprocess.run([sys.executable, str(walker), str(data_file.parent)], capture_output=True)
        if walked.returncode < 0 or b"MDB_CORRUPTED" not in walked.stderr:
            continue
        try:
            list_snapshots(data_dir)
        except SnapshotStoreError:
            return
    pytest.fail("no page LMDB reports damaged where the headers are listed: the test needs another way")


def reads(data_dir: Path, info: snapshots_module.SnapshotInfo) -> bool:
    try:
        snapshots_module.read_snapshot(data_dir, info)
    except SnapshotStoreError:
        return False
    return True


async def test_a_snapshot_file_lmdb_reports_damaged_is_rebuilt_by_the_start_and_kept_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A page of an older snapshot that LMDB reports damaged (``MDB_CORRUPTED``, as in a data.mdb
    copied while snapshots were committed): the walker exited 1, which the start let through. The
    newest snapshot read, the broker served, and every snapshot failed deleting the damaged one
    (``SystemError``), so retention never pruned again. The offline tools refuse the file as it is; a
    start replaces it by a snapshot of what it recovered, keeps it beside it, and snapshots again."""
    settings = Settings(data_dir=tmp_path)
    for round in range(4):  # pages enough: snapshots of a few dozen messages
        await publish(settings, *range(30 * round, 30 * round + 30), snapshot=True)
    damaged = find_a_page_lmdb_reports_damaged_under_an_older_snapshot(tmp_path)
    for action in ACTIONS:
        status, out, err = run(capsys, *action, "--data-dir", str(tmp_path))
        assert status == 1 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("broker: storage_unavailable: ") and "MDB_CORRUPTED" in err
        assert "The next `broker serve` rebuilds it" in err
    assert (tmp_path / SNAPSHOTS_DIR / "data.mdb").read_bytes() == damaged  # the tools change nothing
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            stats = (await (await client.get("/v1/queues/jobs")).get_json())["stats"]
            assert stats["ready"] == 120
            assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)  # they work again
    [rebuilt] = [line for line in logs if line["event"] == "snapshots_rebuilt"]
    assert "MDB_CORRUPTED" in rebuilt["detail"] and rebuilt["log_level"] == "error"
    [aside] = [path for path in os.scandir(tmp_path) if path.name.startswith(f"{SNAPSHOTS_DIR}.damaged-")]
    assert aside.name == rebuilt["damaged_kept_as"]
    assert (tmp_path / aside.name / "data.mdb").read_bytes() == damaged
    assert not (tmp_path / snapshots_module.REBUILD_DIR).exists()
    assert snapshots_module.walk_pages(tmp_path) is None
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 0


def damaged_data_dir(data_dir: Path) -> bytes:
    """A data directory whose snapshot file LMDB reports damaged under an older snapshot, 120 messages
    ready in queue ``jobs``; the damaged file's bytes."""
    import trio

    for round in range(4):
        trio.run(
            functools.partial(
                publish, Settings(data_dir=data_dir), *range(30 * round, 30 * round + 30), snapshot=True
            )
        )
    return find_a_page_lmdb_reports_damaged_under_an_older_snapshot(data_dir)


def ready_after_start(data_dir: Path) -> tuple[int, list[str]]:
    """How many messages a start on ``data_dir`` finds ready in ``jobs``, and the events it logged."""
    with structlog.testing.capture_logs() as logs:
        opened = open_data_dir(data_dir)
    try:
        ready = opened.recovered.queues["jobs"].stats(0.0)[0].ready
    finally:
        opened.release()
    return ready, [line["event"] for line in logs]


def damaged_kept(data_dir: Path) -> list[str]:
    return [
        entry.name for entry in os.scandir(data_dir) if entry.name.startswith(f"{SNAPSHOTS_DIR}.damaged-")
    ]


async def test_a_start_steps_over_a_newest_snapshot_on_pages_lmdb_reports_damaged(tmp_path: Path) -> None:
    """Damage under the snapshot a start reads (a data.mdb copied while a snapshot committed) refused
    every start: the older snapshots read, and the journal after them, which retention keeps, holds
    the rest. The start now recovers from the newest that reads, as it does past a checksum that
    fails, and rebuilds the file."""
    settings = Settings(data_dir=tmp_path)
    for round in range(4):
        await publish(settings, *range(30 * round, 30 * round + 30), snapshot=True)
    newest = list_snapshots(tmp_path)[0]
    damaged = damage_a_page(tmp_path, unreadable=lambda readable: not readable[0] and readable[1])
    with structlog.testing.capture_logs() as logs:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            stats = (await (await client.get("/v1/queues/jobs")).get_json())["stats"]
            assert stats["ready"] == 120
            assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)
    [skipped] = [line for line in logs if line["event"] == "snapshot_skipped"]
    assert skipped["detail"].startswith(f"snapshot {newest.id} skipped: ")
    assert "MDB_CORRUPTED" in skipped["detail"]
    [rebuilt] = [line for line in logs if line["event"] == "snapshots_rebuilt"]
    [kept] = damaged_kept(tmp_path)
    assert kept == rebuilt["damaged_kept_as"] and (tmp_path / kept / "data.mdb").read_bytes() == damaged
    assert snapshots_module.walk_pages(tmp_path) is None
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 0


async def test_a_start_on_a_file_damaged_where_it_lists_its_snapshots_says_what_to_do(tmp_path: Path) -> None:
    """It stopped with LMDB's own words alone (``mdb_cursor_get: MDB_CORRUPTED: …``), naming neither the
    file nor a way out."""
    settings = Settings(data_dir=tmp_path)
    for round in range(4):
        await publish(settings, *range(30 * round, 30 * round + 30), snapshot=True)
    damage_the_listing(tmp_path)
    with pytest.raises(SnapshotStoreError) as refused:
        open_data_dir(tmp_path)
    said = str(refused.value)
    assert said.startswith(f"{tmp_path / SNAPSHOTS_DIR} is damaged where it lists its snapshots (")
    assert "MDB_CORRUPTED" in said and "mv snapshots.lmdb snapshots.lmdb.damaged" in said
    (tmp_path / SNAPSHOTS_DIR).rename(tmp_path / f"{SNAPSHOTS_DIR}.damaged")  # as it says
    ready, _ = ready_after_start(tmp_path)
    assert ready == 120


def test_where_the_file_system_cannot_swap_a_rebuild_moves_the_files_in_two_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    damaged = damaged_data_dir(tmp_path)
    monkeypatch.setattr(snapshots_module, "_RENAME_EXCHANGE", 1 << 30)  # a flag no kernel knows: EINVAL
    ready, events = ready_after_start(tmp_path)
    assert (ready, events.count("snapshots_rebuilt")) == (120, 1)
    [kept] = damaged_kept(tmp_path)
    assert (tmp_path / kept / "data.mdb").read_bytes() == damaged
    assert snapshots_module.walk_pages(tmp_path) is None
    assert not (tmp_path / snapshots_module.REBUILD_DIR).exists()


def test_a_backup_of_a_damaged_snapshot_file_says_where_it_is_and_a_start_on_it_rebuilds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LMDB's copy moves pages as they are: the backup's check found the damage and the CLI blamed the
    data directory, printing no word of the backup it had made."""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    damaged_data_dir(data_dir)
    status, out, err = run(capsys, "backup", str(dest), "--data-dir", str(data_dir))
    assert (status, out) == (1, "") and len(err.splitlines()) == 1, err
    assert err.startswith(
        f"broker: snapshot_corrupt: the backup is in {dest}, and its snapshot file is damaged"
    )
    assert "MDB_CORRUPTED" in err and "The next `broker serve` rebuilds it" in err
    ready, events = ready_after_start(dest)
    assert (ready, events.count("snapshots_rebuilt")) == (120, 1)


def test_a_rebuild_a_crash_cut_short_is_completed_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the swap, the damaged file waited in snapshots.rebuild/ for good, with nothing logged (a
    re-check killed the start there); between the two-step moves, no file was in place."""
    damaged = damaged_data_dir(tmp_path)
    rename = os.rename

    def crash_after_the_first(source: Any, target: Any) -> None:
        monkeypatch.setattr(os, "rename", crash)
        rename(source, target)

    def crash(*_: Any) -> None:
        raise KeyboardInterrupt("killed")

    for exchange in (snapshots_module._RENAME_EXCHANGE, 1 << 30):  # swapped, then in two steps
        monkeypatch.setattr(snapshots_module, "_RENAME_EXCHANGE", exchange)
        monkeypatch.setattr(os, "rename", crash if exchange != 1 << 30 else crash_after_the_first)
        with pytest.raises(KeyboardInterrupt):
            open_data_dir(tmp_path)
        monkeypatch.setattr(os, "rename", rename)
        assert (tmp_path / snapshots_module.REBUILD_DIR / SNAPSHOTS_DIR).exists()
        ready, events = ready_after_start(tmp_path)
        assert (ready, events.count("snapshots_rebuilt")) == (120, 1)
        assert not (tmp_path / snapshots_module.REBUILD_DIR).exists()
        assert snapshots_module.walk_pages(tmp_path) is None
        [kept] = damaged_kept(tmp_path)
        assert (tmp_path / kept / "data.mdb").read_bytes() == damaged
        shutil.rmtree(tmp_path / kept)
        (tmp_path / SNAPSHOTS_DIR / "data.mdb").write_bytes(damaged)  # damaged again, for the next round
        (tmp_path / SNAPSHOTS_DIR / "lock.mdb").unlink()
    # Killed once the moves were done, before the clean-up and the log line: the next start logs it.
    monkeypatch.setattr(Path, "rmdir", crash)
    with pytest.raises(KeyboardInterrupt):
        open_data_dir(tmp_path)
    monkeypatch.undo()
    assert not list((tmp_path / snapshots_module.REBUILD_DIR).iterdir())
    ready, events = ready_after_start(tmp_path)
    assert (ready, events.count("snapshots_rebuilt")) == (120, 1)
    assert not (tmp_path / snapshots_module.REBUILD_DIR).exists() and len(damaged_kept(tmp_path)) == 1
    # Something else in the rebuild's scratch space, beside a sound file: no rebuild is claimed.
    (tmp_path / snapshots_module.REBUILD_DIR / SNAPSHOTS_DIR).mkdir(parents=True)
    (tmp_path / snapshots_module.REBUILD_DIR / SNAPSHOTS_DIR / "data.mdb").write_bytes(os.urandom(8192))
    ready, events = ready_after_start(tmp_path)
    assert (ready, events.count("snapshots_rebuilt")) == (120, 0)
    assert not (tmp_path / snapshots_module.REBUILD_DIR).exists() and len(damaged_kept(tmp_path)) == 1


async def test_verify_refuses_a_journal_that_the_start_refuses_for_not_reaching_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Retention pruned the journal that the snapshots covered, and snapshots.lmdb was moved aside (as
    the advice for a damaged one says, or a copy left it out): every frame checks, so verify said ok,
    and the start refused (the journal starts at lsn N, and no snapshot covers the lsns before it)."""
    settings = Settings(
        data_dir=tmp_path,
        journal_segment_bytes=2000,  # about 7 records per segment
        journal_retention=Retention(max_bytes=0, max_age=None),  # keep nothing the snapshots cover
    )
    for round in range(2):
        await publish(settings, *range(20 * round, 20 * round + 20), snapshot=True)
    assert segments(tmp_path / "journal")[0].first_lsn > 1, "the test needs a pruned journal"
    (tmp_path / SNAPSHOTS_DIR).rename(tmp_path / "snapshots.lmdb.damaged")
    refusal = start_refusal(tmp_path)
    assert refusal.startswith("cannot start: the journal starts at lsn ") and "no snapshot covers" in refusal
    status, out, err = run(capsys, "verify", "--data-dir", str(tmp_path))
    assert (status, err) == (1, ""), err
    assert out.split() == f"journal: ok start: {refusal}".split()  # lines wrap at the pipe's width
    status, out, _ = run(capsys, "verify", "--data-dir", str(tmp_path), "--json")
    verified = json.loads(out)
    assert status == 1 and verified == {
        "ok": False,
        "snapshots": [],
        "journal": {"problem": None},
        "start": {"problem": refusal},
    }


def test_verify_says_the_start_refuses_a_snapshot_that_cannot_be_read_and_nothing_else_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a restore, its snapshot is the only copy of its state: damaged, verify named its checksum
    and not that the start refuses the directory (and why)."""
    import trio

    trio.run(publish, Settings(data_dir=tmp_path), 1, 2)  # a clean shutdown snapshots [1, 2]
    [info] = list_snapshots(tmp_path)
    assert main(["snapshot", "restore", info.id, "--data-dir", str(tmp_path)]) == 0  # journal moved aside
    with lmdb.open(str(tmp_path / SNAPSHOTS_DIR), map_size=1 << 30) as env, env.begin(write=True) as txn:
        key = f"s/{info.id}/q/000000/m/00000000".encode()
        value = bytearray(txn.get(key))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value))
    refusal = start_refusal(tmp_path)
    assert refusal.startswith(
        f"cannot start: the journal starts at lsn {info.lsn + 1}, and no snapshot covers the lsns before it"
    )
    assert "a restore moved them aside" in refusal and f"Snapshot {info.id} skipped" in refusal
    status, out, _ = run(capsys, "verify", "--data-dir", str(tmp_path), "--json")
    verified = json.loads(out)
    assert status == 1 and verified["start"] == {"problem": refusal}
    assert (
        verified["journal"] == {"problem": None}
        and "fails its checksum" in verified["snapshots"][0]["problem"]
    )
    status, out, _ = run(capsys, "verify", "--data-dir", str(tmp_path))
    assert status == 1 and " ".join(out.split()).endswith(f"journal: ok start: {refusal}")


def test_a_restored_snapshot_hidden_by_a_damaged_page_is_refused_not_replaced_by_an_older_one(
    tmp_path: Path,
) -> None:
    """After a restore the journal was empty, and an empty journal follows any snapshot: a leaf page
    whose entry count was lowered hid the restored snapshot, header and all, while LMDB still walked
    the file whole, and the start served the older snapshot's state without a word (verify said ok).
    The restore now starts the journal at the lsn after its snapshot, which says so outside LMDB."""
    import trio

    for payloads in ([1], [2], [3]):
        trio.run(publish, Settings(data_dir=tmp_path), *payloads)
    _, middle, oldest = list_snapshots(tmp_path)
    assert main(["snapshot", "restore", middle.id, "--data-dir", str(tmp_path)]) == 0
    assert [segment.first_lsn for segment in segments(tmp_path / "journal")] == [middle.lsn + 1]
    drop_snapshot(tmp_path, middle.id)  # as the damaged page hid it: every key of it, its header's too
    assert list_snapshots(tmp_path) == [oldest]
    refusal = start_refusal(tmp_path)
    assert refusal.startswith(f"cannot start: the journal starts at lsn {middle.lsn + 1}, but")
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 1


async def test_a_restore_leaves_a_journal_the_broker_goes_on_in_and_a_second_restore_moves_nothing(
    tmp_path: Path,
) -> None:
    """The empty segment a restore starts the journal with is where the broker's next records go; a
    restore right after another finds nothing to move aside and starts the journal anew."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    await publish(settings, 2)
    first, second = list_snapshots(tmp_path)[::-1]
    assert main(["snapshot", "restore", second.id, "--data-dir", str(tmp_path)]) == 0
    assert main(["snapshot", "restore", first.id, "--data-dir", str(tmp_path)]) == 0
    assert len(archived_journals(tmp_path)) == 1  # the first restore's; the second moved no mark aside
    assert [segment.first_lsn for segment in segments(tmp_path / "journal")] == [first.lsn + 1]
    await publish(settings, 3)
    assert await ready_payloads(settings) == [1, 3]
    [segment] = segments(tmp_path / "journal")
    assert segment.first_lsn == first.lsn + 1 and segment.size > HEADER_SIZE
    assert main(["snapshot", "verify", "--data-dir", str(tmp_path)]) == 0


async def test_a_time_before_a_restored_snapshot_restores_the_snapshot_of_that_time(
    tmp_path: Path,
) -> None:
    """With the journal started after the restored snapshot, the lsns between an older snapshot and it
    looked pruned: --until the older snapshot's own time was refused (and, with no journal moved aside,
    told to restore that very time), where an empty journal had restored it."""
    settings = Settings(data_dir=tmp_path)
    await publish(settings, 1)
    await publish(settings, 2)
    second, first = list_snapshots(tmp_path)
    for moved_aside in (True, False):
        assert main(["snapshot", "restore", second.id, "--data-dir", str(tmp_path)]) == 0
        if not moved_aside:
            for archive in archived_journals(tmp_path):
                shutil.rmtree(archive)
        first_time = format_time(first.at, round_up=True)
        assert main(["snapshot", "restore", "--until", first_time, "--data-dir", str(tmp_path)]) == 0
        assert await ready_payloads(settings) == [1]
        await publish(settings, 2)  # the second snapshot again, for the next round
        second = list_snapshots(tmp_path)[0]


def test_a_restore_after_a_restore_killed_before_its_mark_leaves_a_directory_that_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to move aside, the first restore's mark stayed until the new one was written: killed
    between, the directory held the snapshot restored to and a journal starting past it, and every start
    refused it."""
    import trio

    trio.run(publish, Settings(data_dir=tmp_path), 1)
    trio.run(publish, Settings(data_dir=tmp_path), 2)
    second, first = list_snapshots(tmp_path)
    assert main(["snapshot", "restore", second.id, "--data-dir", str(tmp_path)]) == 0

    def killed(*_: Any) -> None:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(restore_module, "_mark_journal_start", killed)
    with pytest.raises(KeyboardInterrupt):
        restore_module.restore(tmp_path, snapshot_id=first.id)
    monkeypatch.undo()
    assert [info.id for info in list_snapshots(tmp_path)] == [first.id] and not segments(tmp_path / "journal")
    ready, _ = ready_after_start(tmp_path)
    assert ready == 1


async def test_verify_of_a_sound_directory_says_the_start_is_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await publish(Settings(data_dir=tmp_path), 1)
    [info] = list_snapshots(tmp_path)
    status, out, _ = run(capsys, "verify", "--data-dir", str(tmp_path))
    assert (status, out.splitlines()) == (0, [f"snapshot {info.id}: ok", "journal: ok", "start: ok"])
