"""``broker queues …`` against a real broker: human tables, ``--json`` documents, exit statuses."""

from __future__ import annotations

import json
import time
import uuid

import httpx

from tests.cli.conftest import Run


def fresh_name() -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


def publish(cli: Run, queue: str, *payloads: object) -> None:
    for payload in payloads:
        assert cli("publish", queue, "--payload", json.dumps(payload)).status == 0


def test_list_shows_every_queue_with_its_depths(cli: Run, queue: str) -> None:
    publish(cli, queue, 1, 2)
    listed = cli("queues", "list", "--json")
    assert listed.status == 0
    [mine] = [q for q in listed.json()["queues"] if q["name"] == queue]
    assert mine["stats"]["ready"] == 2

    table = cli("queues", "list")
    assert table.status == 0
    header, *rows = table.out.splitlines()
    assert header.split()[:4] == ["queue", "ready", "delayed", "in"]
    [row] = [row for row in rows if row.startswith(queue)]
    assert row.split()[1:3] == ["2", "0"]


def test_create_takes_every_config_field_as_a_flag(cli: Run) -> None:
    name = fresh_name()
    created = cli(
        "queues", "create", name, "--json",
        "--lease", "1m", "--max-attempts", "3", "--dead-letter", "none",
        "--retry-backoff", "exponential:1s:5m", "--max-depth", "100", "--rate-limit", "50/2s",
        "--message-ttl", "1h", "--claim-window", "50ms", "--no-durable", "--dedup-window", "600",
    )  # fmt: skip
    assert created.status == 0, created.err
    body = created.json()
    assert body["created"] is True and body["name"] == name
    config = body["config"]
    assert config["lease"] == 60 and config["max_attempts"] == 3 and config["dead_letter"] is None
    assert config["retry_backoff"] == {"type": "exponential", "base": 1, "max": 300}
    assert config["max_depth"] == 100 and config["rate_limit"] == {"max": 50, "per": 2}
    assert (config["message_ttl"], config["claim_window"], config["durable"]) == (3600, 0.05, False)
    assert config["dedup_window"] == 600

    updated = cli("queues", "create", name, "--lease", "45", "--config", '{"max_depth": 7}')
    assert updated.status == 0
    assert updated.out.startswith(f"updated queue {name}\n")
    again = cli("queues", "inspect", name, "--json").json()["config"]
    assert (again["lease"], again["max_depth"], again["max_attempts"]) == (45, 7, 3)


def test_create_with_a_value_the_broker_refuses_is_a_usage_error(cli: Run) -> None:
    name = fresh_name()
    refused = cli("queues", "create", name, "--lease", "0")
    assert refused.status == 2
    assert refused.err.startswith("broker: invalid_request: ") and "lease" in refused.err
    assert refused.err.count("\n") == 1
    assert cli("queues", "inspect", name).status == 4  # nothing half-made

    for flags in (["--retry-backoff", "sometimes"], ["--rate-limit", "lots"], ["--config", "[1]"]):
        bad = cli("queues", "create", name, *flags)
        assert bad.status == 2 and bad.err.startswith("broker: bad_input: "), bad.err


def test_inspect_shows_config_stats_and_the_first_messages(cli: Run, queue: str) -> None:
    publish(cli, queue, "a", "b", "c")
    body = cli("queues", "inspect", queue, "--limit", "2", "--json").json()
    assert body["name"] == queue and body["stats"]["ready"] == 3
    assert [m["payload"] for m in body["messages"]] == ["a", "b"]

    text = cli("queues", "inspect", queue, "--limit", "2").out
    assert f"queue {queue}" in text and "dead_letter" in text and "published_total" in text
    assert "messages (first 2 of 3)" in text


def test_inspect_shows_the_push_state_of_a_queue_with_webhook_push(cli: Run, broker_url: str) -> None:
    name = f"q-{uuid.uuid4().hex[:10]}"
    created = httpx.put(f"{broker_url}/v1/queues/{name}", json={"push": {"url": "http://127.0.0.1:9/hook"}})
    assert created.status_code == 201
    deadline = time.monotonic() + 10  # the push supervisor starts its dispatcher within 0.5 s
    while (body := cli("queues", "inspect", name, "--json").json()).get("push") is None:
        assert time.monotonic() < deadline, "no push dispatcher started for the queue"
        time.sleep(0.05)
    assert body["push"]["state"] == "running" and body["push"]["pushed_total"] == 0
    lines = cli("queues", "inspect", name).out.splitlines()
    assert "push" in lines and any(line.split()[:2] == ["state", "running"] for line in lines)


def test_a_missing_queue_is_exit_4_in_one_line(cli: Run) -> None:
    for argv in (["queues", "inspect", "ghost"], ["queues", "peek", "ghost"], ["consume", "ghost"]):
        missing = cli(*argv)
        assert missing.status == 4, argv
        assert missing.err.startswith("broker: queue_not_found: ") and missing.err.count("\n") == 1
        assert missing.out == ""
    as_json = cli("queues", "inspect", "ghost", "--json")
    assert as_json.status == 4
    assert json.loads(as_json.err)["error"]["code"] == "queue_not_found"


def test_peek_browses_ready_messages_without_claiming_them(cli: Run, queue: str) -> None:
    publish(cli, queue, {"n": 1}, {"n": 2})
    assert cli("publish", queue, "--payload", "3", "--delay", "1h").status == 0
    peeked = cli("queues", "peek", queue, "--json").json()
    assert [m["payload"] for m in peeked["messages"]] == [{"n": 1}, {"n": 2}]
    assert all(m["state"] == "ready" and m["attempt"] == 0 for m in peeked["messages"])
    everything = cli("queues", "peek", queue, "--state", "all", "--json").json()["messages"]
    assert [m["state"] for m in everything] == ["ready", "ready", "delayed"]
    stats = cli("queues", "inspect", queue, "--json").json()["stats"]
    assert (stats["ready"], stats["in_flight"]) == (2, 0)

    table = cli("queues", "peek", queue).out.splitlines()
    assert table[0].split() == ["id", "seq", "state", "attempt", "priority", "key", "published", "payload"]
    assert table[2].split()[-1] == '{"n":1}'

    empty = fresh_name()
    assert cli("queues", "create", empty).status == 0
    assert cli("queues", "peek", empty).out == f"no ready messages in {empty}\n"


def dead_lettered_queue(cli: Run, count: int) -> str:
    """A queue with ``max_attempts`` 1 whose ``count`` messages were all nacked into its DLQ."""
    name = fresh_name()
    assert cli("queues", "create", name, "--max-attempts", "1").status == 0
    lines = "".join(json.dumps({"n": n}) + "\n" for n in range(count))
    assert cli("publish", name, "--file", "-", stdin=lines).status == 0
    nacked = cli("consume", name, "--max", str(count), "--nack", "--json")
    assert nacked.status == 0 and nacked.json()["settled"] == count
    return name


def test_dlq_browses_the_dead_letters_of_a_queue(cli: Run) -> None:
    name = dead_lettered_queue(cli, 2)
    body = cli("queues", "dlq", name, "--json").json()
    assert body["dead_letter"] == f"{name}.dlq"
    [first, _] = body["messages"]
    assert first["payload"] == {"n": 0}
    assert first["headers"]["x-dead-letter-reason"] == "max_attempts"
    assert first["headers"]["x-dead-letter-from"] == name

    table = cli("queues", "dlq", name).out.splitlines()
    assert table[0].split()[:4] == ["id", "from", "reason", "attempts"]
    assert table[2].split()[1:4] == [name, "max_attempts", "1"]


def test_dlq_of_a_queue_with_nothing_dead_lettered_yet_is_empty(cli: Run, queue: str) -> None:
    shown = cli("queues", "dlq", queue)
    assert (shown.status, shown.out) == (0, f"no dead letters in {queue}.dlq\n")
    # With nothing to move, --to is still checked (it said "redriven 0 … to bad name" and exit 0)
    assert cli("queues", "redrive", queue, "--all").status == 0
    bad = cli("queues", "redrive", queue, "--all", "--to", "bad name")
    assert bad.status == 2 and bad.err.startswith("broker: bad_input: argument --to: "), bad.err
    ghost = cli("queues", "redrive", queue, "--all", "--to", "ghost")
    assert ghost.status == 4 and ghost.err.startswith("broker: queue_not_found: "), ghost.err


def test_dlq_of_a_queue_that_drops_dead_letters_is_exit_4(cli: Run) -> None:
    name = fresh_name()
    assert cli("queues", "create", name, "--dead-letter", "none").status == 0
    for argv in (["queues", "dlq", name], ["queues", "redrive", name, "--all"]):
        refused = cli(*argv)
        assert refused.status == 4
        assert refused.err.startswith("broker: no_dead_letter_queue: ")


def test_redrive_all_moves_thousands_back_with_attempts_reset(cli: Run) -> None:
    name = dead_lettered_queue(cli, 1500)  # two redrive calls of at most 1000
    redriven = cli("queues", "redrive", name, "--all", "--json")
    assert redriven.status == 0, redriven.err
    assert redriven.json()["redriven"] == 1500
    stats = cli("queues", "inspect", name, "--limit", "0", "--json").json()["stats"]
    assert stats["ready"] == 1500
    back = cli("queues", "peek", name, "--limit", "1", "--json").json()["messages"]
    assert back[0]["attempt"] == 0
    assert cli("queues", "dlq", name, "--json").json()["messages"] == []


def test_redrive_by_id_to_another_queue(cli: Run, queue: str) -> None:
    name = dead_lettered_queue(cli, 2)
    [first, second] = cli("queues", "dlq", name, "--json").json()["messages"]
    moved = cli("queues", "redrive", name, "--id", first["id"], "--id", "no-such-id", "--to", queue)
    assert moved.status == 0
    assert moved.out.splitlines() == [
        f"redriven 1 from {name}.dlq to {queue}",
        f"not in {name}.dlq: no-such-id",
    ]
    assert [m["payload"] for m in cli("queues", "peek", queue, "--json").json()["messages"]] == [{"n": 0}]
    left = cli("queues", "dlq", name, "--json").json()["messages"]
    assert [m["id"] for m in left] == [second["id"]]

    missing = cli("queues", "redrive", name, "--all", "--to", "ghost")
    assert missing.status == 4 and "queue_not_found" in missing.err


def test_redrive_needs_ids_or_all(cli: Run, queue: str) -> None:
    assert cli("queues", "redrive", queue).status == 2
    assert cli("queues", "redrive", queue, "--all", "--id", "x").status == 2


def test_purge_and_delete_refuse_without_force(cli: Run, queue: str) -> None:
    publish(cli, queue, 1, 2, 3)
    for verb in ("purge", "delete"):
        refused = cli("queues", verb, queue)
        assert refused.status == 2
        assert refused.err.startswith(f"broker: force_required: refusing to {verb} {queue} without --force")
    assert cli("queues", "inspect", queue, "--json").json()["stats"]["ready"] == 3

    purged = cli("queues", "purge", queue, "--force", "--json")
    assert (purged.status, purged.json()) == (0, {"queue": queue, "purged": 3})
    deleted = cli("queues", "delete", queue, "--force")
    assert (deleted.status, deleted.out) == (0, f"deleted queue {queue}\n")
    assert cli("queues", "inspect", queue).status == 4
    assert cli("queues", "delete", queue, "--force").status == 4
