"""The one clock: wall time (for timestamps) that advances with Trio's clock (for deadlines).

Reading ``trio.current_time()`` rather than ``time.time()`` keeps wall time and Trio deadlines in step,
so tests with ``autojump_clock`` move both, and lease expiry can be tested without real sleeps.
"""

from __future__ import annotations

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
