"""The Prometheus exposition of a scrape: every family, label and value as Prometheus reads them back."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from broker.config import Settings
from broker.core.model import QueueStats
from broker.metrics import (
    FLUSH_RECORDS_BUCKETS,
    FSYNC_BUCKETS,
    Histogram,
    JournalFigures,
    RequestTimes,
    render,
)
from broker.server import open_broker


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
        JournalFigures(True, 5_000_000, 2, 153, 40_000, 1, fsyncs, groups),
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
    assert seen[("broker_journal_disk_free_bytes", ())] == 5_000_000
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


class Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def as_prometheus_client_writes_them(queues: dict[str, QueueStats]) -> bytes:
    """The queues' families built as prometheus-client objects and written by its own exposition."""
    depth = GaugeMetricFamily("broker_queue_messages", "Live messages by state.", labels=["queue", "state"])
    oldest = GaugeMetricFamily(
        "broker_queue_oldest_ready_age_seconds", "Age of the oldest ready message.", labels=["queue"]
    )
    texts = {
        "published": "Messages published (a replaced duplicate counts once).",
        "acked": "Messages acknowledged.",
        "nacked": "Negative acknowledgements (attempts that failed).",
        "deferred": "Deferrals (backpressure that spends no attempt).",
        "dead_lettered": "Messages moved to a dead-letter queue (or dropped).",
        "expired": "Messages whose message_ttl ran out.",
        "lease_expired": "Leases that expired before a settle.",
    }
    counters = {
        name: CounterMetricFamily(f"broker_messages_{name}", text, labels=["queue"])
        for name, text in texts.items()
    }
    for queue, figures in sorted(queues.items()):
        for state in ("ready", "delayed", "in_flight"):
            depth.add_metric([queue, state], getattr(figures, state))
        if figures.oldest_ready_age is not None:
            oldest.add_metric([queue], figures.oldest_ready_age)
        for name, counter in counters.items():
            counter.add_metric([queue], getattr(figures, f"{name}_total"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families([depth, oldest, *counters.values()]))
    return generate_latest(registry)


counts = st.integers(min_value=0, max_value=2**63)


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=12),
        st.builds(
            stats,
            ready=counts,
            delayed=counts,
            in_flight=counts,
            published_total=counts,
            expired_total=counts,
            oldest_ready_age=st.one_of(st.none(), st.floats(min_value=0, allow_infinity=True)),
        ),
        max_size=6,
    )
)
def test_the_queues_are_written_byte_for_byte_as_prometheus_client_writes_them(
    queues: dict[str, QueueStats],
) -> None:
    """The queues' lines are written directly, for speed; they must be what the library writes (names
    with quotes, backslashes and newlines escaped, counts past 2**53, floats as Go prints them)."""
    no_queues = as_prometheus_client_writes_them({})
    rest = render({}, None, RequestTimes()).removeprefix(no_queues)  # the journal's and requests' families
    assert render(queues, None, RequestTimes()) == as_prometheus_client_writes_them(queues) + rest


def test_an_in_memory_broker_has_no_journal_figures() -> None:
    seen = samples(render({}, None, RequestTimes()))
    assert not any(name.startswith("broker_journal") for name, _ in seen)


async def test_a_scrape_after_a_known_workload_shows_every_gauge_and_counter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each kind of event once (or a known number of times), then every queue's line checked exactly:
    the ack, nack, defer, dead letter, TTL expiry, lease expiry and delayed message each move their own
    counter or gauge and nothing else."""
    async with open_broker(Settings(in_memory=True)) as broker, broker.app.test_app() as app:
        client = app.test_client()

        async def post(path: str, body: dict[str, Any], status: int = 200) -> Any:
            response = await client.post(path, json=body)
            assert response.status_code == status, await response.get_data()
            return await response.get_json()

        assert (await client.put("/v1/queues/jobs", json={"lease": 10})).status_code == 201
        assert (await client.put("/v1/queues/short", json={"message_ttl": 5})).status_code == 201
        await post("/v1/queues/jobs/messages", {"messages": [{"payload": n} for n in range(6)]}, 201)
        await post("/v1/queues/jobs/messages", {"payload": "later", "delay": 3600}, 201)
        await post("/v1/queues/short/messages", {"payload": "soon stale"}, 201)
        leases = [m["lease_id"] for m in (await post("/v1/queues/jobs/claim", {"max": 5}))["messages"]]
        assert len(leases) == 5
        await post("/v1/queues/jobs/ack", {"leases": [leases[0]]})
        await post("/v1/queues/jobs/nack", {"leases": [leases[1]], "delay": 600})
        await post("/v1/queues/jobs/defer", {"leases": [leases[2]], "retry_after": 0})
        await post("/v1/queues/jobs/nack", {"leases": [leases[3]], "retryable": False})
        # leases[4] is left to expire (lease 10 s); the message in "short" outlives its TTL (5 s).
        await trio.sleep(11)
        seen = samples(await (await client.get("/metrics")).get_data())

    def line(queue: str) -> dict[str, float]:
        found = {
            name.removeprefix("broker_messages_").removeprefix("broker_queue_"): value
            for (name, labels), value in seen.items()
            if ("queue", queue) in labels and name != "broker_queue_messages"
        }
        for state in ("ready", "delayed", "in_flight"):
            found[state] = seen[("broker_queue_messages", (("queue", queue), ("state", state)))]
        return found

    counters = dict.fromkeys(
        ("published", "acked", "nacked", "deferred", "dead_lettered", "expired", "lease_expired"), 0
    )
    jobs = line("jobs")
    # ready: the deferred one, the one whose lease expired, the one never claimed; delayed: the nacked
    # one (600 s) and the delayed publish (3600 s).
    assert jobs.pop("oldest_ready_age_seconds") == pytest.approx(11)
    assert jobs == {
        **{f"{name}_total": value for name, value in counters.items()},
        "published_total": 7,
        "acked_total": 1,
        "nacked_total": 2,
        "deferred_total": 1,
        "dead_lettered_total": 1,
        "lease_expired_total": 1,
        "ready": 3,
        "delayed": 2,
        "in_flight": 0,
    }
    assert line("jobs.dlq") == {
        **{f"{name}_total": value for name, value in counters.items()},
        "oldest_ready_age_seconds": pytest.approx(11),
        "published_total": 1,
        "ready": 1,
        "delayed": 0,
        "in_flight": 0,
    }
    assert line("short") == {
        **{f"{name}_total": value for name, value in counters.items()},
        "published_total": 1,
        "expired_total": 1,
        "ready": 0,
        "delayed": 0,
        "in_flight": 0,
    }
    # An expired message moves to the dead-letter queue too, counted as expired, not dead-lettered.
    assert line("short.dlq") == {
        **{f"{name}_total": value for name, value in counters.items()},
        "oldest_ready_age_seconds": pytest.approx(6),
        "published_total": 1,
        "ready": 1,
        "delayed": 0,
        "in_flight": 0,
    }
    assert {labels for name, labels in seen if name == "broker_queue_messages"} == {
        (("queue", queue), ("state", state))
        for queue in ("jobs", "jobs.dlq", "short", "short.dlq")
        for state in ("ready", "delayed", "in_flight")
    }
