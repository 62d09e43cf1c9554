"""``python -m tools.journal_audit``'s exit status 2, "could not run", for what it cannot read: one line
on stderr, no traceback, so that 1 always means violations were found."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from broker.core.config import QueueConfig
from broker.core.records import QueueCreated
from broker.storage.format import encode_frames
from broker.storage.segments import segment_header
from tools.journal_audit.__main__ import main


def test_a_journal_of_a_version_it_cannot_read_is_exit_2_in_one_line(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    frames = encode_frames(1, 1_763_800_000.0, "q", [QueueCreated(QueueConfig(), "p-")])
    (journal / f"{1:020d}.journal").write_bytes(segment_header(1, 99) + b"".join(frames))
    assert main(["audit", str(journal), "--master", "local[1]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the audit could not run: ") and "99" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_export_over_an_existing_directory_says_so(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(tmp_path / "anything"), str(out), "--master", "local[1]"]) == 2
    assert capsys.readouterr().err == f"error: {out} exists: pass --overwrite to replace it\n"
