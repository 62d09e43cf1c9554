"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is."""

from __future__ import annotations

import datetime
import logging
import sys
import time
from typing import Any

import orjson
import structlog


def configure(level: str = "info") -> None:
    """JSON lines (orjson, a line per ``write``) when stderr is not a terminal; readable lines when it is.

    A request logs one line (``http/observe.py``), so the JSON path is on every request's way: orjson
    renders it in ~2 µs against ~10 µs for the standard library's ``json``."""
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        UtcStamper(),
        structlog.processors.format_exc_info,
    ]
    factory: Any
    if sys.stderr.isatty():
        processors.append(structlog.dev.ConsoleRenderer())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    else:
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


class UtcStamper:
    """structlog's ``TimeStamper(fmt="iso", utc=True)``, the same text (``2026-11-23T08:00:00.123456Z``,
    the fraction left out when it is zero, as ``datetime.isoformat`` does), with the date and time of
    day formatted once a second: structlog's makes a ``datetime`` and formats it whole for each line,
    ~7 µs of the ~30 µs that a request's log line cost on the benchmark VM."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(
        self, logger: Any, method_name: str, event_dict: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event_dict["timestamp"] = self.format(time.time_ns())
        return event_dict

    def format(self, nanoseconds: int) -> str:
        """The time ``nanoseconds`` after the epoch, truncated to microseconds (as ``datetime.now``)."""
        second, micro = divmod(nanoseconds // 1000, 1_000_000)
        if second != self._second:
            moment = datetime.datetime.fromtimestamp(second, datetime.UTC)
            self._second, self._prefix = second, moment.strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._prefix}.{micro:06d}Z" if micro else f"{self._prefix}Z"
