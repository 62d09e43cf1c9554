"""The log set-up (broker/logging.py): its timestamps are structlog's ISO ones, made cheaper."""

from __future__ import annotations

import datetime
import errno
import logging
import random
import re

import orjson
import pytest
import structlog

from broker import logging as broker_logging
from broker.logging import UtcStamper, configure

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def isoformat(nanoseconds: int) -> str:
    """What structlog's ``TimeStamper(fmt="iso", utc=True)`` writes for ``datetime.now`` at that instant
    (``datetime`` keeps whole microseconds, dropping the rest)."""
    moment = EPOCH + datetime.timedelta(microseconds=nanoseconds // 1000)
    return moment.isoformat().replace("+00:00", "Z")


def test_the_stamper_writes_what_structlogs_iso_utc_stamper_writes() -> None:
    stamper = UtcStamper()
    rng = random.Random(7)
    start = 1_795_000_000 * 10**9  # November 2026
    instants = [
        start,
        start + 999,
        start + 1000,
        start + 10**9 - 1,
        start + 10**9,
        start + 10**9 + 500_000_000,
    ]
    instants += sorted(start + rng.randrange(3 * 10**9) for _ in range(2000))  # in order, across seconds
    instants += [rng.randrange(4 * 10**18) for _ in range(200)]  # and jumping about, to 2096
    for nanoseconds in instants:
        assert stamper.format(nanoseconds) == isoformat(nanoseconds)


def test_a_json_log_line_carries_the_timestamp(capfd: pytest.CaptureFixture[str]) -> None:
    configure("info")
    try:
        structlog.get_logger("test").info("hello", n=1)
        line = orjson.loads(capfd.readouterr().err.strip().splitlines()[-1])
    finally:
        structlog.reset_defaults()
    assert (line["event"], line["level"], line["n"]) == ("hello", "info", 1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z", line["timestamp"])
    parsed = datetime.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))
    assert abs((datetime.datetime.now(datetime.UTC) - parsed).total_seconds()) < 60


def test_library_logs_are_json_lines_and_repeats_are_counted(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """trio's accept loop, out of file descriptors, wrote a 7-line plain traceback every 0.1 s."""
    configure("info")
    clock = [1000.0]
    monkeypatch.setattr(broker_logging.time, "monotonic", lambda: clock[0])
    accept_loop = logging.getLogger("trio.serve_listeners")
    try:
        for step in range(25):  # 2.5 s of failed accepts, as trio retries them
            clock[0] = 1000.0 + step * 0.1
            try:
                raise OSError(errno.EMFILE, "Too many open files")
            except OSError:
                accept_loop.error(
                    "accept returned %s (%s); retrying in %s seconds", "EMFILE", "x", 0.1, exc_info=True
                )
        accept_loop.error("accept returned %s (%s); retrying in %s seconds", "ENOBUFS", "x", 0.1)  # its own
        clock[0] = 1011.0
        accept_loop.error("accept returned %s (%s); retrying in %s seconds", "EMFILE", "x", 0.1)
        logging.getLogger("some.library").warning("odd %d", 5)
        lines = [orjson.loads(line) for line in capfd.readouterr().err.strip().splitlines()]
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers = []
    assert [(line["event"], line.get("error"), line.get("repeated")) for line in lines] == [
        ("accept_failed", "EMFILE", None),
        ("accept_failed", "ENOBUFS", None),
        ("accept_failed", "EMFILE", 24),
        ("library_log", None, None),
    ]
    assert lines[0]["level"] == "error" and "exception" not in lines[0]
    assert (lines[3]["message"], lines[3]["logger"], lines[3]["level"]) == (
        "odd 5",
        "some.library",
        "warning",
    )
