"""What ``GET /metrics`` shows, in the Prometheus text format (§10).

The counters live where the work is done (``QueueStats`` in each queue's core, ``JournalStats`` in the
journal, ``RequestTimes`` in the HTTP layer); a scrape gathers them and ``render`` writes them out. The
queues' families, a dozen samples per queue, are written here line by line, as prometheus-client's
exposition writes them (a test holds the two to the same bytes): through its objects they cost ~55 µs a
queue, 0.3 s a scrape with 5,000 queues. The rest goes through prometheus-client, from a registry of its
own (not the library's global one, so two brokers in one process, as in tests, never mix).

``Histogram`` is a plain bucket counter, cheap enough to update on the hot paths (one bisect and two
additions), which ``render`` turns into a Prometheus histogram.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker.core.model import QueueStats

#: Bucket bounds: fsync seconds, records per group commit, request seconds.
FSYNC_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FLUSH_RECORDS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class Histogram:
    """Counts of observations at or below each bound (not cumulative), the ones above the last, and
    their sum."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        copied = Histogram(self.bounds)
        copied.counts = list(self.counts)
        copied.total = self.total
        return copied

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count at or below)`` pairs, ending with ``+Inf``, as Prometheus wants them."""
        running = 0
        buckets = []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return buckets


@dataclass(slots=True)
class RequestTimes:
    """Request durations by route (its template, e.g. ``POST /v1/queues/{queue}/claim``) and status."""

    histograms: dict[tuple[str, int], Histogram] = field(default_factory=dict)

    def copy(self) -> RequestTimes:
        """The durations so far, to render while requests go on adding to these."""
        return RequestTimes({key: histogram.copy() for key, histogram in self.histograms.items()})

    def observe(self, route: str, status: int, seconds: float) -> None:
        histogram = self.histograms.get((route, status))
        if histogram is None:
            histogram = self.histograms[(route, status)] = Histogram(REQUEST_BUCKETS)
        histogram.observe(seconds)


@dataclass(frozen=True, slots=True)
class JournalFigures:
    """The journal's side of a scrape (``None`` for a broker that keeps its journal in memory)."""

    healthy: bool
    #: Space left on the journal's filesystem; None when it cannot be read.
    free_bytes: int | None
    flushes: int
    records: int
    bytes: int
    faults: int
    fsync_seconds: Histogram
    flush_records: Histogram


_QUEUE_COUNTERS = (
    ("published", "published_total", "Messages published (a replaced duplicate counts once)."),
    ("acked", "acked_total", "Messages acknowledged."),
    ("nacked", "nacked_total", "Negative acknowledgements (attempts that failed)."),
    ("deferred", "deferred_total", "Deferrals (backpressure that spends no attempt)."),
    ("dead_lettered", "dead_lettered_total", "Messages moved to a dead-letter queue (or dropped)."),
    ("expired", "expired_total", "Messages whose message_ttl ran out."),
    ("lease_expired", "lease_expired_total", "Leases that expired before a settle."),
)


#: The queues' gauges: (family, help, label values and attribute of each sample).
_DEPTH = (
    "broker_queue_messages",
    "Live messages by state.",
    (("ready", "ready"), ("delayed", "delayed"), ("in_flight", "in_flight")),
)
_OLDEST = ("broker_queue_oldest_ready_age_seconds", "Age of the oldest ready message.")


def render(queues: Mapping[str, QueueStats], journal: JournalFigures | None, requests: RequestTimes) -> bytes:
    """The Prometheus text exposition of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(list(_families(journal, requests))))
    return "".join(_queue_lines(queues)).encode() + generate_latest(registry)


def _queue_lines(queues: Mapping[str, QueueStats]) -> Iterator[str]:
    """The queues' families in the text format, as ``generate_latest`` writes them."""
    rows = [(_label_value(queue), stats) for queue, stats in sorted(queues.items())]
    name, text, states = _DEPTH
    yield f"# HELP {name} {text}\n# TYPE {name} gauge\n"
    for queue, stats in rows:
        for state, attribute in states:
            yield f'{name}{{queue="{queue}",state="{state}"}} {_number(getattr(stats, attribute))}\n'
    name, text = _OLDEST
    yield f"# HELP {name} {text}\n# TYPE {name} gauge\n"
    for queue, stats in rows:
        if stats.oldest_ready_age is not None:
            yield f'{name}{{queue="{queue}"}} {_number(stats.oldest_ready_age)}\n'
    for family, attribute, text in _QUEUE_COUNTERS:
        name = f"broker_messages_{family}_total"
        yield f"# HELP {name} {text}\n# TYPE {name} counter\n"
        for queue, stats in rows:
            yield f'{name}{{queue="{queue}"}} {_number(getattr(stats, attribute))}\n'


def _number(value: float) -> str:
    """A sample's value as prometheus-client writes it (``1.0``, ``+Inf``, ``1e+22``)."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Scrape(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _families(journal: JournalFigures | None, requests: RequestTimes) -> Iterator[Metric]:
    if journal is not None:
        yield GaugeMetricFamily(
            "broker_journal_healthy",
            "1 while the journal can be written, else 0.",
            value=int(journal.healthy),
        )
        if journal.free_bytes is not None:
            yield GaugeMetricFamily(
                "broker_journal_disk_free_bytes",
                "Space left on the journal's filesystem; /readyz answers 503 below 1 MiB.",
                value=journal.free_bytes,
            )
        for name, value, text in (
            ("flushes", journal.flushes, "Group commits: one write and one fsync each."),
            ("records", journal.records, "Records written."),
            ("bytes", journal.bytes, "Bytes written, framing included."),
            ("faults", journal.faults, "Writes or fsyncs that failed (disk full, I/O error)."),
        ):
            yield CounterMetricFamily(f"broker_journal_{name}", text, value=value)
        yield _histogram(
            "broker_journal_fsync_seconds", "Time to write and fsync one group.", journal.fsync_seconds
        )
        yield _histogram("broker_journal_flush_records", "Records per group commit.", journal.flush_records)
    duration = HistogramMetricFamily(
        "broker_http_request_duration_seconds",
        "Time from a request's arrival to its answer's end (streams: until they close).",
        labels=["route", "status"],
    )
    for (route, status), histogram in sorted(requests.histograms.items()):
        duration.add_metric([route, str(status)], histogram.cumulative(), histogram.total)
    yield duration


def _histogram(name: str, text: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text)
    family.add_metric([], histogram.cumulative(), histogram.total)
    return family
