"""The calls' arguments as the API takes them (broker/client/calls.py): a claim's ``wait`` with a unit,
the dicts of a batch publish in the API's own shape, and an error answer whose body is not JSON."""

from __future__ import annotations

import socket
import types
from collections.abc import Callable

import pytest

from broker.client import AsyncClient, BrokerError, Client, InvalidRequest, calls
from tests.client.conftest import RawServer, read_request

# -- a claim's wait: seconds, or a string with a unit ------------------------------------------------


@pytest.mark.parametrize(("wait", "seconds"), [("200ms", 0.2), ("2m", 120.0), (1.5, 1.5), (" 1 s ", 1.0)])
def test_a_claims_wait_is_sent_as_given_and_read_as_a_duration(wait: float | str, seconds: float) -> None:
    call = calls.claim("jobs", None, 1, None, wait)
    assert call.json["wait"] == wait  # the broker reads it
    assert call.wait == seconds  # added to the read timeout


@pytest.mark.parametrize("wait", ["soon", "-1", -3, [1]])
def test_a_wait_that_is_no_duration_is_left_to_the_broker_to_refuse(wait: object) -> None:
    call = calls.claim("jobs", None, 1, None, wait)  # type: ignore[arg-type]
    assert (call.json["wait"], call.wait) == (wait, 0.0)


def test_a_wait_with_a_unit_long_polls_past_the_clients_timeout(thread_url: str) -> None:
    with Client(thread_url, timeout=0.5) as broker:
        broker.create_queue("jobs")
        # An empty queue: the broker answers after the wait, past the client's 0.5 s, which only the
        # wait read as 1 s (and added to the timeout) keeps from being a ReadTimeout.
        assert len(broker.claim("jobs", wait="1000ms")) == 0
        with pytest.raises(InvalidRequest, match="wait"):
            broker.claim("jobs", wait="soon")


async def test_the_async_client_takes_a_wait_with_a_unit(live_url: str) -> None:
    async with AsyncClient(live_url, timeout=0.5) as broker:
        await broker.create_queue("jobs")
        assert len(await broker.claim("jobs", wait="1s")) == 0


# -- batch publish: dicts in the API's shape ---------------------------------------------------------


def test_a_batch_takes_dicts_with_every_field_of_the_apis_message(thread_url: str) -> None:
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        published = broker.publish_batch(
            "jobs",
            [
                {"payload": "AAE=", "payload_encoding": "base64", "priority": 9},  # as the API takes it
                types.MappingProxyType({"payload": 1, "headers": types.MappingProxyType({"h": "v"})}),
                {"payload": 2, "key": "k", "on_duplicate": "replace", "delay": None},
                {"payload": 3, "delay": "1m"},
            ],
        )
        assert len(published) == 4
        claimed = broker.claim("jobs", max=10)
        assert [delivery.payload for delivery in claimed] == [b"\x00\x01", 1, 2]
        assert claimed.messages[1].headers == {"h": "v"}
        assert claimed.messages[2].key == "k"
        assert broker.stats("jobs")["delayed"] == 1


def test_a_batch_dict_with_a_field_the_api_does_not_have_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"no field 'dealy'.*payload_encoding"):
        calls.publish_batch("jobs", [{"payload": 1}, {"payload": 1, "dealy": 3}])
    with pytest.raises(TypeError, match="base64"):
        calls.publish_batch("jobs", [{"payload": b"\x00", "payload_encoding": "base64"}])


# -- an error answer whose body is not JSON ----------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"<html>bad gateway 12345678901234567890123</html>",  # digits: the standard library's parser
        b"\xff\xfe 12345678901234567890123",  # not UTF-8 either
        b"<html>bad gateway</html>",
    ],
)
def test_an_error_answer_that_is_not_json_is_a_broker_error(
    raw_server: Callable[..., RawServer], body: bytes
) -> None:
    def bad_gateway(connection: socket.socket) -> None:
        while read_request(connection):
            head = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n" % len(body)
            connection.sendall(head + body)

    with Client(raw_server(bad_gateway).url) as broker, pytest.raises(BrokerError) as error:
        broker.list_queues()
    assert (error.value.status, error.value.well_formed) == (502, False)
