"""The Prometheus exposition of a scrape: every family, label and value as Prometheus reads them back."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from broker.core.model import QueueStats
from broker.metrics import (
    FLUSH_RECORDS_BUCKETS,
    FSYNC_BUCKETS,
    Histogram,
    JournalFigures,
    RequestTimes,
    render,
)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def stats(**values: float) -> QueueStats:
    fields = dict.fromkeys(QueueStats.__dataclass_fields__, 0)
    fields["oldest_ready_age"] = None
    fields.update(values)
    return QueueStats(**fields)  # type: ignore[arg-type]


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it() -> None:
    histogram = Histogram((1.0, 5.0))
    for value in (0.5, 1.0, 3.0, 5.0, 7.0):
        histogram.observe(value)
    assert histogram.cumulative() == [("1.0", 2), ("5.0", 4), ("+Inf", 5)]
    assert (histogram.count, histogram.total) == (5, 16.5)


def test_queues_journal_and_requests_render_as_prometheus_reads_them() -> None:
    fsyncs = Histogram(FSYNC_BUCKETS)
    fsyncs.observe(0.0003)
    fsyncs.observe(0.004)
    groups = Histogram(FLUSH_RECORDS_BUCKETS)
    groups.observe(150)
    groups.observe(3)
    requests = RequestTimes()
    requests.observe("POST /v1/queues/{queue}/claim", 200, 0.0012)
    requests.observe("POST /v1/queues/{queue}/claim", 200, 0.0007)
    requests.observe("GET /v1/queues/{queue}", 404, 0.0002)
    text = render(
        {
            "emails": stats(ready=3, in_flight=2, published_total=9, acked_total=4, oldest_ready_age=1.5),
            'odd"name': stats(delayed=1, lease_expired_total=7),
        },
        JournalFigures(True, 2, 153, 40_000, 1, fsyncs, groups),
        requests,
    )
    seen = samples(text)
    assert seen[("broker_queue_messages", (("queue", "emails"), ("state", "ready")))] == 3
    assert seen[("broker_queue_messages", (("queue", "emails"), ("state", "in_flight")))] == 2
    assert seen[("broker_queue_messages", (("queue", 'odd"name'), ("state", "delayed")))] == 1
    assert seen[("broker_queue_oldest_ready_age_seconds", (("queue", "emails"),))] == 1.5
    assert ("broker_queue_oldest_ready_age_seconds", (("queue", 'odd"name'),)) not in seen
    assert seen[("broker_messages_published_total", (("queue", "emails"),))] == 9
    assert seen[("broker_messages_acked_total", (("queue", "emails"),))] == 4
    assert seen[("broker_messages_lease_expired_total", (("queue", 'odd"name'),))] == 7
    assert seen[("broker_journal_healthy", ())] == 1
    assert seen[("broker_journal_records_total", ())] == 153
    assert seen[("broker_journal_faults_total", ())] == 1
    assert seen[("broker_journal_fsync_seconds_bucket", (("le", "0.0005"),))] == 1
    assert seen[("broker_journal_fsync_seconds_bucket", (("le", "+Inf"),))] == 2
    assert seen[("broker_journal_fsync_seconds_count", ())] == 2
    assert seen[("broker_journal_flush_records_bucket", (("le", "5.0"),))] == 1
    assert seen[("broker_journal_flush_records_sum", ())] == 153
    claim = (("route", "POST /v1/queues/{queue}/claim"), ("status", "200"))
    assert seen[("broker_http_request_duration_seconds_count", claim)] == 2
    assert seen[("broker_http_request_duration_seconds_bucket", (("le", "0.001"), *claim))] == 1


def test_an_in_memory_broker_has_no_journal_figures() -> None:
    seen = samples(render({}, None, RequestTimes()))
    assert not any(name.startswith("broker_journal") for name, _ in seen)
