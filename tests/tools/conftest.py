"""Fixtures of the journal audit's tests: one SparkSession for the whole run, and one data directory
written by a real ``broker serve`` (two incarnations, the first killed with SIGKILL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bench.crash import start_server

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test that takes the ``spark`` fixture, so ``-m "not spark"`` leaves out every test that
    needs Java: a fixture alone is not a keyword ``-m`` or ``-k`` can select on."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from tools.journal_audit.session import spark_session

    session = spark_session("local[2]", app_name="broker-tests", shuffle_partitions=2)
    try:
        yield session
    finally:
        session.stop()


@dataclass
class RealRun:
    """A data directory a real broker wrote, and what the test drove it to do."""

    data_dir: Path
    #: Ids of messages acked by a 2xx.
    acked: set[str] = field(default_factory=set)
    queues: tuple[str, ...] = ()


class _Client:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    def call(
        self, method: str, path: str, body: Any = None, expect: tuple[int, ...] = (200, 201, 204)
    ) -> Any:
        response = self.http.request(method, path, json=body)
        assert response.status_code in expect, (method, path, response.status_code, response.text)
        return response.json() if response.content else None

    def publish(self, queue: str, count: int, **extra: Any) -> list[str]:
        body = {"messages": [{"payload": {"n": n}, **extra} for n in range(count)]}
        return [m["id"] for m in self.call("POST", f"/v1/queues/{queue}/messages", body)["messages"]]

    def claim(self, queue: str, count: int, lease: float | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"consumer": "tester", "max": count}
        if lease is not None:
            body["lease"] = lease
        messages: list[dict[str, Any]] = self.call("POST", f"/v1/queues/{queue}/claim", body)["messages"]
        return messages

    def settle(self, queue: str, verb: str, deliveries: list[dict[str, Any]], **extra: Any) -> Any:
        body = {"leases": [d["lease_id"] for d in deliveries], **extra}
        return self.call("POST", f"/v1/queues/{queue}/{verb}", body)

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    """Publishes, claims, acks, nacks (retryable and not), defers, extends, lease expiries, TTL expiries,
    dead letters at max_attempts, a redrive, a delete, a purge, an admin snapshot; SIGKILL; a restart
    that recovers and carries on (another snapshot, more work); SIGKILL again."""
    data_dir = tmp_path_factory.mktemp("real-run") / "data"
    run = RealRun(data_dir, queues=("jobs", "jobs.dlq", "ttl", "ttl.dlq", "misc"))
    used: set[int] = set()
    server, url = start_server(data_dir, used)
    client = _Client(url)
    try:
        client.call("PUT", "/v1/queues/jobs", {"lease": 1, "max_attempts": 2})
        client.call("PUT", "/v1/queues/ttl", {"message_ttl": 0.5})
        client.call("PUT", "/v1/queues/misc", {})
        client.publish("ttl", 3)  # never claimed: they expire into ttl.dlq
        client.publish("jobs", 10)
        first = client.claim("jobs", 10)
        assert len(first) == 10
        client.settle("jobs", "ack", first[:4])
        run.acked |= {d["id"] for d in first[:4]}
        client.settle("jobs", "nack", first[4:6], delay=0, reason="flaky")
        client.settle("jobs", "defer", first[6:7], retry_after=0)
        client.settle("jobs", "nack", first[7:8], retryable=False, reason="poison")  # rejected
        client.settle("jobs", "extend", first[8:9], lease=30)
        client.settle("jobs", "ack", first[8:9])
        run.acked.add(first[8]["id"])
        # first[9] is left to expire (lease 1 s), like the TTL messages (0.5 s).
        time.sleep(1.3)
        second = client.claim("jobs", 10)  # the two nacked, the deferred, the expired one
        assert len(second) == 4, second
        by_attempt = {d["id"]: d["attempt"] for d in second}
        spent = [d for d in second if by_attempt[d["id"]] == 2]
        client.settle("jobs", "nack", spent, delay=0)  # attempt 2 of 2: dead-lettered (max_attempts)
        rest = [d for d in second if by_attempt[d["id"]] != 2]
        client.settle("jobs", "ack", rest)
        run.acked |= {d["id"] for d in rest}
        stats = client.call("GET", "/v1/queues/ttl")["stats"]
        assert stats["expired_total"] == 3, stats
        misc = client.publish("misc", 5)
        client.call("DELETE", f"/v1/queues/misc/messages/{misc[0]}")
        assert client.call("POST", "/v1/queues/misc/purge")["purged"] == 4
        client.publish("misc", 3)
        client.claim("misc", 1, lease=60)  # in flight at the kill
        assert client.call("POST", "/v1/queues/jobs.dlq/redrive", {"all": True})["redriven"] >= 1
        client.call("POST", "/v1/admin/snapshots")
        client.publish("jobs", 5)
        assert len(client.claim("jobs", 3, lease=60)) == 3  # leased at the kill
    finally:
        client.close()
        server.kill()

    server, url = start_server(data_dir, used)
    client = _Client(url)
    try:
        again = client.claim("jobs", 2)  # leases survive a restart: these were ready at the kill
        assert len(again) == 2
        client.settle("jobs", "ack", again)
        run.acked |= {d["id"] for d in again}
        client.call("POST", "/v1/admin/snapshots")
        client.publish("misc", 2)
        delivered = client.claim("misc", 1)
        client.settle("misc", "ack", delivered)
        run.acked |= {d["id"] for d in delivered}
    finally:
        client.close()
        server.kill()
    return run
