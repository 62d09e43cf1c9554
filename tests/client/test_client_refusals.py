"""What the client refuses before sending anything: numbers JSON cannot carry (orjson would write them as
``null``, changing the message silently), and tokens an HTTP header cannot carry (http.client and httpx
would refuse them with an error quoting the whole ``Authorization`` header, the secret included)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from broker.client import AsyncClient, Client

# -- NaN and infinite numbers -------------------------------------------------------------------------


def test_a_payload_with_a_non_finite_number_is_refused_and_nothing_is_published(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        for number, where in [(math.inf, "['payload']['x']"), (-math.inf, "['payload']['x']")]:
            with pytest.raises(ValueError) as refused:
                broker.publish("jobs", {"note": "private text", "x": number})
            assert repr(number) in str(refused.value) and where in str(refused.value)
            assert "private text" not in str(refused.value), "the problem is named, the payload is not"
        with pytest.raises(ValueError, match=r"cannot send nan \(at \['payload'\]\[1\]\['y'\]\)"):
            broker.publish("jobs", [None, {"y": math.nan}])
        with pytest.raises(ValueError, match=r"\['messages'\]\[1\]\['payload'\]"):
            broker.publish_batch("jobs", [{"payload": 1}, {"payload": float("1e400")}])  # out of range: inf
        with pytest.raises(ValueError, match="cannot send nan"):
            broker.publish("jobs", {"big": 2**70, "f": math.nan})  # the path for integers beyond 64 bits
        assert broker.stats("jobs")["ready"] == 0
        # Nulls are what a non-finite number looks like once encoded: real ones still go through.
        broker.publish("jobs", {"coupon": None, "price": 19.99, "items": [None, 1.5]})
        [delivery] = broker.claim("jobs")
        assert delivery.payload == {"coupon": None, "price": 19.99, "items": [None, 1.5]}


def test_a_non_finite_duration_is_refused_by_every_call_that_takes_one(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        broker.publish("jobs", "job")
        refusals: list[tuple[Callable[[], Any], str]] = [
            (lambda: broker.claim("jobs", lease=math.nan), "['lease']"),
            (lambda: broker.claim("jobs", wait=math.inf), "['wait']"),
            (lambda: broker.nack("jobs", "lease-id", delay=math.inf), "['delay']"),
            (lambda: broker.defer("jobs", "lease-id", retry_after=math.nan), "['retry_after']"),
            (lambda: broker.extend("jobs", "lease-id", lease=-math.inf), "['lease']"),
            (lambda: broker.publish("jobs", "job", delay=math.inf), "['delay']"),
            (lambda: broker.update_queue("jobs", lease=math.nan), "['lease']"),
        ]
        for call, field in refusals:
            with pytest.raises(ValueError) as refused:
                call()
            assert field in str(refused.value)
        queue = broker.get_queue("jobs")
        assert (queue["stats"]["ready"], queue["stats"]["in_flight"], queue["config"]["lease"]) == (1, 0, 30)


async def test_the_async_client_refuses_non_finite_numbers_too(live_url: str) -> None:
    async with AsyncClient(live_url) as broker:
        await broker.create_queue("jobs")
        with pytest.raises(ValueError, match=r"cannot send inf \(at \['payload'\]\['x'\]\)"):
            await broker.publish("jobs", {"x": math.inf})
        with pytest.raises(ValueError, match=r"\['lease'\]"):
            await broker.claim("jobs", lease=math.nan)
        assert (await broker.stats("jobs"))["ready"] == 0


def test_through_httpx_non_finite_numbers_are_refused_the_same_way() -> None:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"messages": [{"id": "m", "seq": 1, "duplicate": False}]})

    with Client("http://broker.invalid", transport=httpx.MockTransport(record)) as broker:
        with pytest.raises(ValueError, match=r"cannot send inf \(at \['payload'\]\['x'\]\)"):
            broker.publish("jobs", {"x": math.inf})
        assert sent == []
        broker.publish("jobs", {"big": 2**70, "none": None})  # what orjson cannot write goes as JSON text
    [request] = sent
    assert request.headers["content-type"] == "application/json"
    assert request.content == b'{"payload":{"big":1180591620717411303424,"none":null}}'


# -- tokens ------------------------------------------------------------------------------------------

SECRET = "s3cr3t-value"
UNSENDABLE_TOKENS = [
    SECRET + "\r\nX-Injected: 1",
    SECRET + "\n",
    SECRET + "\x00",
    SECRET + " more",
    SECRET + "\t",
    SECRET + "é",  # latin-1, but not ASCII
    SECRET + "☃",  # not even latin-1
]


@pytest.mark.parametrize("token", UNSENDABLE_TOKENS)
@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_a_token_a_header_cannot_carry_is_refused_without_quoting_it(
    client_class: type[Client] | type[AsyncClient], token: str
) -> None:
    with pytest.raises(ValueError) as refused:
        client_class("http://127.0.0.1:19601", token=token)
    assert "token holds a character an HTTP header cannot carry" in str(refused.value)
    assert SECRET not in str(refused.value) and SECRET not in repr(refused.value)


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_a_token_from_the_environment_is_checked_the_same_way(
    client_class: type[Client] | type[AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BROKER_TOKEN", SECRET + "\r\n")
    with pytest.raises(ValueError) as refused:
        client_class("http://127.0.0.1:19601")
    assert SECRET not in str(refused.value)


def test_every_printable_ascii_character_may_be_in_a_token() -> None:
    token = "".join(chr(code) for code in range(0x21, 0x7F))
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"queues": []})

    with Client("http://broker.invalid", token=token, transport=httpx.MockTransport(record)) as broker:
        assert broker.list_queues() == []
    assert sent[0].headers["authorization"] == f"Bearer {token}"
