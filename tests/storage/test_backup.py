"""``broker snapshot backup DEST``: a copy of a running broker's data directory that a broker starts from."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.cli import main
from broker.config import Settings
from broker.server import open_broker
from broker.storage import backup as backup_module
from broker.storage.restore import check_directory
from broker.storage.retention import Retention, prune
from broker.storage.segments import scan, segments
from broker.storage.snapshots import JOURNAL_DIR, SNAPSHOTS_DIR, list_snapshots


async def publish(client: Any, count: int, queue: str = "jobs") -> list[str]:
    batch = {"messages": [{"payload": n} for n in range(count)]}
    response = await client.post(f"/v1/queues/{queue}/messages", json=batch)
    assert response.status_code == 201
    return [message["id"] for message in (await response.get_json())["messages"]]


async def ack(client: Any, count: int, queue: str = "jobs") -> list[str]:
    """Claim ``count`` messages and ack them; their ids, once the ack was answered."""
    claim = f"/v1/queues/{queue}/claim"
    claimed = (await (await client.post(claim, json={"max": count})).get_json())["messages"]
    leases = [message["lease_id"] for message in claimed]
    response = await client.post(f"/v1/queues/{queue}/ack", json={"leases": leases})
    assert response.status_code == 200, await response.get_json()
    return [message["id"] for message in claimed]


def files_of(directory: Path) -> dict[str, tuple[int, float]]:
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime)
        for path in directory.rglob("*")
        if path.is_file() and path.name not in ("lock.mdb", "LOCK", "LOCK.snapshot")
    }


async def test_a_backup_of_a_busy_broker_starts_with_every_message_answered_before_it(tmp_path: Path) -> None:
    """The broker publishes, acks and snapshots (each snapshot pruning the journal it covers) all the
    while the backup copies. A broker started on the copy has every message published before the backup
    began that was not acked by then, and none acked by then. (The traffic meanwhile goes to another
    queue, so that no message of the first is acked while the backup runs: the copy may hold such an
    ack or not.)"""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    settings = Settings(
        data_dir=data_dir,
        journal_segment_bytes=2000,  # a few records per segment: pruned under the copy's feet
        journal_retention=Retention(max_bytes=0, max_age=None),  # keep nothing the snapshots cover
    )
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for queue in ("jobs", "busy"):
            assert (await client.put(f"/v1/queues/{queue}", json={})).status_code == 201
        live: set[str] = set()
        acked: set[str] = set()
        for _ in range(3):
            live.update(await publish(client, 20))
            done = await ack(client, 7)
            live.difference_update(done)
            acked.update(done)
            assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)
        live_before, acked_before = set(live), set(acked)  # every answer is in
        command = [
            sys.executable,
            "-m",
            "broker",
            "snapshot",
            "backup",
            str(dest),
            "--data-dir",
            str(data_dir),
        ]
        rounds = 0
        async with trio.open_nursery() as nursery:
            finished: list[subprocess.CompletedProcess[bytes]] = []

            async def back_up() -> None:
                finished.append(
                    await trio.run_process([*command, "--json"], capture_stdout=True, check=False)
                )

            nursery.start_soon(back_up)
            while not finished:  # busy until the backup is done: publishes, acks, snapshots and prunes
                await publish(client, 10, "busy")
                await ack(client, 4, "busy")
                assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)
                rounds += 1
        assert finished[0].returncode == 0, finished[0].stderr
        made = json.loads(finished[0].stdout)
    assert rounds >= 1
    assert made["backup"] == str(dest) and made["verified"]["ok"] is True
    assert made["snapshots"] == [info.id for info in list_snapshots(dest)]
    assert not (tmp_path / "backup.partial").exists()
    assert not {"LOCK", "LOCK.snapshot"} & {path.name for path in dest.iterdir()}
    async with open_broker(Settings(data_dir=dest)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for message_id in live_before:
            body = await (await client.get(f"/v1/queues/jobs/messages/{message_id}")).get_json()
            assert body["state"] in ("ready", "in_flight"), body
        for message_id in acked_before:
            response = await client.get(f"/v1/queues/jobs/messages/{message_id}")
            assert response.status_code == 404 or (await response.get_json())["state"] == "acked"


def test_a_segment_pruned_while_it_is_copied_drops_the_older_ones_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes segments oldest first: one that vanishes before it is copied was pruned with
    every older one. The older copies go too, so the backup's journal has no gap."""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    settings = Settings(
        data_dir=data_dir, journal_segment_bytes=2000, journal_retention=Retention(None, None)
    )

    async def load() -> None:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            for _ in range(16):
                await publish(client, 10)
                await ack(client, 3)

    trio.run(load)
    listed = segments(data_dir / JOURNAL_DIR)
    assert len(listed) >= 4, "the test needs several segments"
    copy_file = backup_module._copy_file
    copied: list[str] = []

    def copy_pruning(source: Path, target: Path, *, replace: bool = False) -> None:
        if source == listed[2].path:  # as the third is reached, retention deletes the first three
            prune(data_dir / JOURNAL_DIR, listed[3].first_lsn - 1, Retention(0, None), 0.0)
        copy_file(source, target, replace=replace)
        copied.append(source.name)

    monkeypatch.setattr(backup_module, "_copy_file", copy_pruning)
    made = backup_module.backup(data_dir, dest)
    assert copied[:2] == [listed[0].path.name, listed[1].path.name]  # copied, then dropped
    assert segments(dest / JOURNAL_DIR)[0].first_lsn == listed[3].first_lsn
    assert made.verification.sound  # the snapshot the clean stop took covers what was dropped


def test_a_snapshot_taken_between_the_journals_copy_and_the_snapshots_copy_is_covered_by_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal is copied before the snapshots, so a snapshot taken in between holds lsns past the
    journal copied. The backup copies the journal's newest segments again after the snapshots: a broker
    started on it then journals on without a gap, which every later scan would report as damage."""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    published: list[str] = []

    async def session(directory: Path, queue: str) -> None:
        async with open_broker(Settings(data_dir=directory)) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put(f"/v1/queues/{queue}", json={})
            published.extend(await publish(client, 5, queue))
            assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)

    trio.run(session, data_dir, "before")
    copy_snapshots = backup_module._copy_snapshots

    def broker_busy_meanwhile(store: Path, target: Path, progress: Any) -> None:
        trio.run(session, data_dir, "meanwhile")  # records and a snapshot after the journal's copy
        copy_snapshots(store, target, progress)

    monkeypatch.setattr(backup_module, "_copy_snapshots", broker_busy_meanwhile)
    made = backup_module.backup(data_dir, dest)
    assert made.verification.sound
    assert made.lsn == scan(data_dir / JOURNAL_DIR).last_lsn
    trio.run(session, dest, "after")  # a broker started on the backup journals on
    checked = check_directory(dest)
    assert checked.sound, (checked.journal_problem, checked.start_problem)
    assert scan(dest / JOURNAL_DIR).tail is None

    async def read_back() -> list[str]:
        async with open_broker(Settings(data_dir=dest)) as broker, broker.app.test_app() as app:
            client = app.test_client()
            found = []
            for queue in ("before", "meanwhile", "after"):
                answer = await (await client.get(f"/v1/queues/{queue}/messages?state=ready")).get_json()
                found += [message["id"] for message in answer["messages"]]
            return found

    assert sorted(trio.run(read_back)) == sorted(published)


@pytest.mark.parametrize("first_pass", ["copied", "all pruned"])
def test_journal_pruned_between_the_snapshots_copy_and_the_journals_second_pass_is_copied_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_pass: str
) -> None:
    """Retention pruned the newest segment the first pass copied, and more, after the snapshots were
    copied: the second pass skipped what was gone, and the copy's journal had a gap that its snapshots
    did not cover (a review: "the segment starts at lsn 569302 where 320792 was due (a gap)"). Now the
    older copies are dropped and the snapshots copied again, which then cover what was pruned. With
    nothing copied by the first pass (every segment pruned under it), the copy's journal started past
    what its snapshots covered, and no broker could start on it (a re-check)."""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    settings = Settings(
        data_dir=data_dir,
        journal_segment_bytes=2000,  # a few records per segment
        journal_retention=Retention(max_bytes=0, max_age=None),  # keep nothing the snapshots cover
    )
    published: list[str] = []

    async def session(directory: Path, rounds: int) -> None:
        here = dataclasses.replace(settings, data_dir=directory)
        async with open_broker(here) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            for _ in range(rounds):
                published.extend(await publish(client, 10))
                assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)

    trio.run(session, data_dir, 2)
    copied_first = [segment.path.name for segment in segments(data_dir / JOURNAL_DIR)]
    copy_snapshots = backup_module._copy_snapshots
    copies = 0

    def pruned_meanwhile(store: Path, target: Path, progress: Any) -> None:
        nonlocal copies
        copy_snapshots(store, target, progress)
        copies += 1
        if copies == 1:  # snapshots and pruning after the snapshots were copied, before the journal
            trio.run(session, data_dir, 5)
            assert copied_first[-1] not in {segment.path.name for segment in segments(data_dir / JOURNAL_DIR)}

    monkeypatch.setattr(backup_module, "_copy_snapshots", pruned_meanwhile)
    if first_pass == "all pruned":
        monkeypatch.setattr(backup_module, "_copy_journal", lambda _, target, __: target.mkdir())
    made = backup_module.backup(data_dir, dest)
    assert made.verification.sound, (made.verification.journal_problem, made.verification.start_problem)
    assert copies == 2
    trio.run(session, dest, 1)  # a broker started on the backup journals on, and restarts
    checked = check_directory(dest)
    assert checked.sound, (checked.journal_problem, checked.start_problem)

    async def read_back() -> list[str]:
        async with open_broker(Settings(data_dir=dest)) as broker, broker.app.test_app() as app:
            answer = await (
                await app.test_client().get("/v1/queues/jobs/messages?state=ready&limit=1000")
            ).get_json()
            return [message["id"] for message in answer["messages"]]

    assert sorted(trio.run(read_back)) == sorted(published)


def test_a_backup_that_retention_outpaces_in_every_round_keeps_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It exited 1 saying the data directory had the copy's problem too, which it did not (a re-check)."""
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    settings = Settings(
        data_dir=data_dir,
        journal_segment_bytes=2000,
        journal_retention=Retention(max_bytes=0, max_age=None),
    )

    async def session() -> None:
        async with open_broker(settings) as broker, broker.app.test_app() as app:
            client = app.test_client()
            await client.put("/v1/queues/jobs", json={})
            for _ in range(4):
                await publish(client, 10)
                assert (await client.post("/v1/admin/snapshots")).status_code in (200, 201)

    trio.run(session)
    copy_snapshots = backup_module._copy_snapshots

    def pruned_every_time(store: Path, target: Path, progress: Any) -> None:
        copy_snapshots(store, target, progress)
        copied = segments(target.parent / JOURNAL_DIR)[-1].path.name
        while copied in {segment.path.name for segment in segments(data_dir / JOURNAL_DIR)}:
            trio.run(session)  # until retention pruned the newest segment copied

    monkeypatch.setattr(backup_module, "_copy_snapshots", pruned_every_time)
    with pytest.raises(
        backup_module.BackupOutpaced, match="retention deleted journal faster than the backup"
    ):
        backup_module.backup(data_dir, dest)
    assert not dest.exists() and not (tmp_path / "backup.partial").exists()
    assert check_directory(data_dir).sound


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        status = main(["snapshot", "backup", *argv])
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 2
    out, err = capsys.readouterr()
    return status, out, err


def test_a_backup_is_refused_in_one_line_where_it_cannot_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "data"
    (data_dir / JOURNAL_DIR).mkdir(parents=True)
    before = files_of(data_dir)
    taken = tmp_path / "taken"
    taken.mkdir()
    status, out, err = run(capsys, str(taken), "--data-dir", str(data_dir))
    assert (status, out) == (2, "")
    assert err == f"broker: bad_input: {taken} exists: back up to a new path (nothing is overwritten)\n"
    inside = data_dir / "backup"
    status, out, err = run(capsys, str(inside), "--data-dir", str(data_dir))
    assert (status, out) == (2, "")
    assert err == (
        f"broker: bad_input: {inside} is inside the data directory {data_dir}: back up to another place\n"
    )
    missing = tmp_path / "missing"
    status, _, err = run(capsys, str(tmp_path / "new"), "--data-dir", str(missing))
    assert (status, err) == (4, f"broker: data_dir_not_found: there is no data directory {missing}\n")
    status, _, err = run(capsys, str(tmp_path / "new"), "--data-dir", str(missing), "--json")
    assert status == 4 and json.loads(err)["error"]["code"] == "data_dir_not_found"
    assert not (tmp_path / "new").exists() and not missing.exists()
    nowhere = tmp_path / "nowhere" / "backup"  # blamed the data directory: "No such file or directory"
    status, _, err = run(capsys, str(nowhere), "--data-dir", str(data_dir))
    assert (status, err) == (2, f"broker: bad_input: {nowhere.parent} is not a directory: make it first\n")
    mistyped = tmp_path / "other"  # a directory without a broker's data: backed up "ok", empty
    (mistyped / "notes").mkdir(parents=True)
    status, _, err = run(capsys, str(tmp_path / "new"), "--data-dir", str(mistyped))
    assert (status, err) == (
        2,
        f"broker: bad_input: {mistyped} holds no broker data (no journal/, no snapshots.lmdb/)\n",
    )
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()
    assert files_of(data_dir) == before and sorted(os.listdir(data_dir)) == [JOURNAL_DIR]


async def test_a_backup_of_a_stopped_broker_says_what_it_holds_and_writes_nothing_into_the_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir, dest = tmp_path / "data", tmp_path / "backup"
    async with open_broker(Settings(data_dir=data_dir)) as broker, broker.app.test_app() as app:
        client = app.test_client()
        await client.put("/v1/queues/jobs", json={})
        await publish(client, 3)
    before = files_of(data_dir)
    [info] = list_snapshots(data_dir)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's switch: stderr is a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    status, out, err = run(capsys, str(dest), "--data-dir", str(data_dir))
    assert status == 0, err
    assert "━" in err and ("backing up" in err or "copying" in err)  # the progress bar
    lines = out.splitlines()
    assert lines[0] == f"backup: {dest}" and lines[1].startswith(f"  recovers to lsn {info.lsn} (")
    assert lines[2] == f"  snapshots: {info.id}" and "checked: ok" in lines[-1]
    assert files_of(data_dir) == before
    assert sorted(os.listdir(dest)) == ["boot", JOURNAL_DIR, SNAPSHOTS_DIR]
    async with open_broker(Settings(data_dir=dest)) as broker, broker.app.test_app() as app:
        body = await (await app.test_client().get("/v1/queues/jobs")).get_json()
        assert body["stats"]["ready"] == 3, body
