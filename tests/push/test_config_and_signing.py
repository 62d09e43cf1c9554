"""The push config's validation, the signature scheme as docs/push.md documents it (its Python snippet
is run against the dispatcher's signing), Retry-After parsing, and rotating the secret."""

from __future__ import annotations

import email.utils
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.core import QueueConfig, QueueCore
from broker.core.commands import UpdateConfig
from broker.errors import Conflict, InvalidRequest
from broker.push import request
from broker.push.secret import revealed
from tests.push.conftest import Receiver, publish, pushing, put_queue, wait_until

DOCS = Path(__file__).resolve().parents[2] / "docs" / "push.md"


def refused(push: Any) -> str:
    with pytest.raises(InvalidRequest) as caught:
        QueueConfig().updated({"push": push})
    return caught.value.message


def test_defaults_and_null() -> None:
    config = QueueConfig().updated({"push": {"url": "https://example.com/hook"}})
    assert config.to_dict("q")["push"] == {
        "url": "https://example.com/hook",
        "mode": "standard",
        "timeout": 15.0,
        "concurrency": 10,
        "ack_timeout": 300.0,
        "ack_timeout_action": "retry",
        "allow_private": False,
    }
    assert config.push is not None and len(config.push.secret) == 64
    assert config.updated({"push": None}).push is None


@pytest.mark.parametrize(
    ("push", "field"),
    [
        ("https://example.com", "push must be null or an object"),
        ({}, "push.url is required"),
        ({"url": "ftp://example.com/x"}, "push.url must be an http or https URL"),
        ({"url": "https:///nohost"}, "push.url must be an http or https URL"),
        ({"url": 5}, "push.url must be"),
        ({"url": "http://169.254.169.254/latest"}, "push.url names a link-local or metadata address"),
        ({"url": "http://metadata.google.internal/"}, "push.url names a link-local or metadata address"),
        ({"url": "http://[fe80::1]/"}, "push.url names a link-local or metadata address"),
        # The other IPv4 forms a resolver reads as they are: all 169.254.169.254.
        ({"url": "http://2852039166/"}, "push.url names a link-local or metadata address"),
        ({"url": "http://0xa9fea9fe/"}, "push.url names a link-local or metadata address"),
        ({"url": "http://0251.0376.0251.0376/"}, "push.url names a link-local or metadata address"),
        ({"url": "http://169.254.43518/"}, "push.url names a link-local or metadata address"),
        ({"url": "http://a.b/", "mode": "pull"}, "push.mode must be"),
        ({"url": "http://a.b/", "timeout": 0}, "push.timeout must be between"),
        ({"url": "http://a.b/", "concurrency": 0}, "push.concurrency must be an integer"),
        ({"url": "http://a.b/", "ack_timeout": "1y"}, "push.ack_timeout must be"),
        ({"url": "http://a.b/", "ack_timeout_action": "drop"}, "push.ack_timeout_action must be"),
        ({"url": "http://a.b/", "secret": "short"}, "push.secret must be"),
        ({"url": "http://a.b/", "allow_private": "yes"}, "push.allow_private must be"),
        ({"url": "http://a.b/", "headers": {}}, "unknown push field(s): headers"),
        ({"url": "http://exa mple.com/h"}, "push.url must not hold spaces or control characters"),
        ({"url": "http://a.b/\x00"}, "push.url must not hold spaces or control characters"),
    ],
)
def test_bad_push_configs_are_refused_naming_the_field(push: Any, field: str) -> None:
    assert refused(push).startswith(field)


def test_private_targets_may_be_allowed() -> None:
    config = QueueConfig().updated({"push": {"url": "http://169.254.1.1/x", "allow_private": True}})
    assert config.push is not None and config.push.url == "http://169.254.1.1/x"


def test_the_secret_is_kept_across_updates_and_revealed_only_when_new() -> None:
    first = QueueConfig().updated({"push": {"url": "http://a.b/"}})
    second = first.updated({"push": {"url": "http://a.b/other", "mode": "ack"}, "lease": 5})
    assert first.push is not None and second.push is not None
    assert second.push.secret == first.push.secret
    assert revealed(None, first) == first.push.secret
    assert revealed(QueueConfig(), first) == first.push.secret
    assert revealed(first, second) is None
    assert first.push.secret not in repr(first)
    again = second.updated({"push": None}).updated({"push": {"url": "http://a.b/"}})
    assert again.push is not None and again.push.secret != first.push.secret


def test_a_urls_password_is_shown_masked_and_kept_when_sent_back_masked() -> None:
    config = QueueConfig().updated({"push": {"url": "https://alice:s3cret@hooks.example/in"}})
    shown = config.to_dict("q")["push"]["url"]
    assert shown == "https://alice:***@hooks.example/in"
    assert "s3cret" not in repr(config.to_dict("q"))
    # A client that reads the config and PUTs it back (changing something else) keeps the password.
    again = config.updated({"push": {"url": shown, "timeout": 5}})
    assert again.push is not None and again.push.url == "https://alice:s3cret@hooks.example/in"
    # So does one whose path or query changed: the URL as shown, edited.
    edited = config.updated({"push": {"url": "https://alice:***@hooks.example/v2?x=1"}})
    assert edited.push is not None and edited.push.url == "https://alice:s3cret@hooks.example/v2?x=1"
    # With another host or user, or nothing to keep, the mask is refused, never saved as the password.
    for url in ("https://alice:***@elsewhere.example/in", "https://bob:***@hooks.example/in"):
        with pytest.raises(InvalidRequest, match=r"the mask answers show"):
            config.updated({"push": {"url": url}})
    with pytest.raises(InvalidRequest, match=r"the mask answers show"):
        QueueConfig().updated({"push": {"url": "https://alice:***@hooks.example/in"}})
    # No password, nothing to mask; and a refusal never repeats the password of a URL it cannot read.
    assert (
        QueueConfig().updated({"push": {"url": "http://bob:@h/"}}).to_dict("q")["push"]["url"]
        == "http://bob:@h/"
    )
    for bad in ("htp://u:s3cret@h/x", "http://u:s3cret@h:99999/", "http://u:s3cret@[::1/"):
        assert "s3cret" not in refused({"url": bad}) and "u:***@" in refused({"url": bad})


def documented_python_verify() -> Any:
    text = DOCS.read_text()
    code = re.search(r"Python:\n\n```python\n(.*?)```", text, flags=re.DOTALL)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)  # the snippet as published
    return namespace["verify"]


def test_the_documented_python_snippet_verifies_the_broker_signature() -> None:
    import time

    verify = documented_python_verify()
    body = b'{"id":"x","payload":{"a":1}}'
    now = time.time()
    headers = request.headers("s3cret-s3cret-s3cret", now, body, "x", 1)
    timestamp, signature = headers["x-broker-timestamp"], headers["x-broker-signature"]
    assert verify("s3cret-s3cret-s3cret", timestamp, body, signature)
    assert not verify("another-secret-value", timestamp, body, signature)
    assert not verify("s3cret-s3cret-s3cret", timestamp, body + b" ", signature)
    assert not verify("s3cret-s3cret-s3cret", str(int(timestamp) + 1), body, signature)
    old = request.headers("s3cret-s3cret-s3cret", now - 3600, body, "x", 1)
    assert not verify("s3cret-s3cret-s3cret", old["x-broker-timestamp"], body, old["x-broker-signature"])


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    import hashlib
    import hmac

    expected = hmac.new(b"key", b"1700000000.{}", hashlib.sha256).hexdigest()
    assert request.sign("key", 1700000000, b"{}") == f"sha256={expected}"


def test_retry_after_values() -> None:
    now = 1_800_000_000.0
    assert request.retry_after(None, now) == 60
    assert request.retry_after("12", now) == 12
    # At least a second: a defer spends no attempt, so "0" would push the message again at once, for ever.
    assert request.retry_after(" 0 ", now) == 1
    assert request.retry_after("999999999", now) == 86400
    assert request.retry_after(email.utils.formatdate(now + 90, usegmt=True), now) == pytest.approx(90)
    assert request.retry_after(email.utils.formatdate(now - 90, usegmt=True), now) == 1
    assert request.retry_after("soon", now) == 60
    assert request.retry_after("-5", now) == 60
    # A digit str.isdigit takes and float() refuses: it crashed the dispatcher, for any receiver to send.
    assert request.retry_after("\u00b2", now) == 60


def test_outcomes_by_status() -> None:
    outcome = request.outcome_of
    assert [outcome(s) for s in (200, 204, 299)] == [request.Outcome.DONE] * 3
    assert [outcome(s) for s in (429, 503, 529)] == [request.Outcome.DEFER] * 3
    assert [outcome(s) for s in (401, 403)] == [request.Outcome.REFUSED] * 2
    assert [outcome(s) for s in (None, 301, 400, 404, 410, 500, 502)] == [request.Outcome.FAILED] * 7


async def test_rotating_the_secret(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        created = await put_queue(p.client, push={"url": "http://receiver.test/hook"})
        first = created["config"]["push"]["secret"]
        refused = await p.client.post("/v1/queues/jobs/push/rotate-secret", json={"secret": "mine"})
        assert refused.status_code == 400, "it takes no body: a field it does not know must not pass"
        response = await p.client.post("/v1/queues/jobs/push/rotate-secret")
        assert response.status_code == 200
        rotated = await response.get_json()
        assert rotated["queue"] == "jobs" and rotated["secret"] != first and len(rotated["secret"]) == 64
        shown = await (await p.client.get("/v1/queues/jobs")).get_json()
        assert "secret" not in shown["config"]["push"]
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        [sent] = receiver.requests
        timestamp, signature = sent.headers["x-broker-timestamp"], sent.headers["x-broker-signature"]
        assert request.verify(rotated["secret"], timestamp, sent.body, signature)
        assert not request.verify(first, timestamp, sent.body, signature)

        await put_queue(p.client, name="plain")
        no_push = await p.client.post("/v1/queues/plain/push/rotate-secret")
        assert no_push.status_code == 409
        missing = await p.client.post("/v1/queues/nope/push/rotate-secret")
        assert missing.status_code == 404


async def test_a_secret_is_shown_only_to_the_put_that_made_it(autojump_clock: trio.testing.MockClock) -> None:
    """The answer compared the config before the PUT's body was read with the config after it: a PUT of
    another field whose body was still arriving when another PUT made a secret showed that secret."""
    async with pushing(Receiver().transport()) as p:
        await put_queue(p.client)
        headers = {"Content-Type": "application/json"}
        async with p.client.request("/v1/queues/jobs", method="PUT", headers=headers) as slow:
            await slow.send(b'{"lease"')
            made = await put_queue(p.client, push={"url": "http://receiver.test/hook"})
            assert len(made["config"]["push"]["secret"]) == 64  # shown to the PUT that made it
            await slow.send(b": 5}")
            await slow.send_complete()
            answer = await slow.as_response()
        assert answer.status_code == 200
        body = await answer.get_json()
        assert body["config"]["lease"] == 5 and "secret" not in body["config"]["push"]


def test_a_rotation_applies_to_the_push_config_as_it_is_when_it_applies() -> None:
    """The rotation was a change computed from an earlier read of the config: a PUT that removed push
    or changed its URL in between was undone by it."""
    core = QueueCore("jobs", QueueConfig().updated({"push": {"url": "http://a.test/hook"}}), "m-")
    first = core.config.push
    core.apply(UpdateConfig({"push": {"url": "http://b.test/hook"}}), 1.0)  # the PUT in between
    change, _ = core.apply(UpdateConfig({}, new_push_secret=True), 2.0)
    assert change.after.push is not None and first is not None
    assert change.after.push.url == "http://b.test/hook" and change.after.push.secret != first.secret
    core.apply(UpdateConfig({"push": None}), 3.0)
    with pytest.raises(Conflict, match="has no push config"):
        core.apply(UpdateConfig({}, new_push_secret=True), 4.0)
    assert core.config.push is None


async def test_a_secret_set_explicitly_is_used(autojump_clock: trio.testing.MockClock) -> None:
    receiver = Receiver()
    async with pushing(receiver.transport()) as p:
        await put_queue(p.client, push={"url": "http://receiver.test/hook", "secret": "from-the-config-file"})
        await publish(p.client, "x")
        await wait_until(lambda: len(receiver.requests) == 1)
        [sent] = receiver.requests
        assert request.verify(
            "from-the-config-file",
            sent.headers["x-broker-timestamp"],
            sent.body,
            sent.headers["x-broker-signature"],
        )


async def test_bad_push_config_over_http_is_a_400(autojump_clock: trio.testing.MockClock) -> None:
    async with pushing() as p:
        response = await p.client.put("/v1/queues/jobs", json={"push": {"url": "gopher://x"}})
        assert response.status_code == 400
        error = (await response.get_json())["error"]
        assert error["code"] == "invalid_request" and error["message"].startswith("push.url")


def test_the_push_config_and_its_secret_survive_the_journal() -> None:
    from broker.core.records import QueueUpdated
    from broker.storage.codec import cbor_loads
    from broker.storage.format import decode_entry, encode_entry

    config = QueueConfig().updated({"push": {"url": "http://a.b/", "mode": "ack", "concurrency": 3}})
    data = encode_entry(1, 1.0, "jobs", QueueUpdated(config))
    assert decode_entry(data).record == QueueUpdated(config)
    written = cbor_loads(data)["config"]["push"]
    assert written["secret"] == config.push.secret  # type: ignore[union-attr]
    older = cbor_loads(encode_entry(1, 1.0, "jobs", QueueUpdated(QueueConfig())))
    del older["config"]["push"]  # a record written before the field existed reads with push off
    from broker.storage.codec import cbor_dumps

    assert decode_entry(cbor_dumps(older)).record == QueueUpdated(QueueConfig())
