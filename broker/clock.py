"""The one clock: wall time (for timestamps) that advances with Trio's clock (for deadlines).

Reading ``trio.current_time()`` rather than ``time.time()`` keeps wall time and Trio deadlines in step,
so tests with ``autojump_clock`` move both, and lease expiry can be tested without real sleeps.
"""

from __future__ import annotations

import math
import time

import trio


class Clock:
    """Must be made inside ``trio.run``."""

    def __init__(self) -> None:
        self._offset = time.time() - trio.current_time()

    def now(self) -> float:
        """Seconds since the Unix epoch."""
        return trio.current_time() + self._offset

    def deadline_for(self, wall_time: float) -> float:
        """The Trio deadline at which the wall clock reads ``wall_time``."""
        return wall_time - self._offset

    def not_before(self, wall_time: float) -> float:
        """Set this clock forward to ``wall_time`` if it reads earlier; the seconds it moved (0 if none).

        For a start on a journal whose last record is later than the host's clock (stepped back since,
        or the data directory came from a host whose clock was ahead): the recovered deadlines (leases,
        delays, TTLs, dedup windows) would come that much late, and record times would go back
        (point-in-time restores compare them). Ids stay unique by ``storage.store.new_boot``."""
        behind = wall_time - self.now()
        if behind <= 0:
            return 0.0
        self._offset += behind
        return behind


#: ``format_time``'s texts of whole seconds, and its last answer: every delivery, message and history
#: entry shows times, most of them alike (messages of one publish share ``published_at``).
_second_texts: dict[int, str] = {}
_last: tuple[float, str] = (math.nan, "")  # NaN equals no time


def format_time(seconds: float, *, round_up: bool = False) -> str:
    """Wall time ``seconds`` as RFC 3339 UTC with milliseconds, as every answer, listing and message
    shows a time (``2026-11-22T10:00:00.000Z``): rounded to the nearest millisecond, or with
    ``round_up`` to the next one (a time that must be at or after ``seconds`` when read back: an
    ``--until`` that reaches it)."""
    global _last
    last = _last  # one read: a thread's answer may replace it meanwhile (snapshots are listed in threads)
    if seconds == last[0] and not round_up:
        return last[1]
    millis = math.ceil(seconds * 1000) if round_up else round(seconds * 1000)
    whole, fraction = divmod(millis, 1000)
    prefix = _second_texts.get(whole)
    if prefix is None:
        if len(_second_texts) > 4096:
            _second_texts.clear()
        prefix = _second_texts[whole] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    text = f"{prefix}.{fraction:03d}Z"
    if not round_up:
        _last = (seconds, text)
    return text
