"""The client's JSON (``broker/client/codec.py``): answers decoded as the broker encodes them, so a
payload makes the round trip unchanged, integers beyond 64 bits included."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import uuid

import pytest

from broker.client import Client, codec
from broker.storage.codec import json_loads

BODIES = [
    b'{"payload": 123456789012345678901234567890}',
    b'{"payload": [-18446744073709551617, 1.5, "12345678901234567890123"]}',
    b'{"payload": {"n": 9223372036854775807, "f": 1e300}}',
    b'{"payload": 12345}',
]


@pytest.mark.parametrize("body", BODIES)
def test_answers_decode_as_the_broker_decodes_them(body: bytes) -> None:
    assert codec.loads(body) == json_loads(body) and codec.loads(body.decode()) == json_loads(body)


def test_an_integer_beyond_64_bits_makes_the_round_trip_unchanged(thread_url: str) -> None:
    """orjson read it as a float: the broker kept 123456789012345678901234567890, and the client handed
    back 1.2345678901234568e+29 from a claim (and from peek, and from the push stream)."""
    big = 123456789012345678901234567890
    with Client(thread_url) as broker:
        broker.create_queue("jobs")
        broker.publish("jobs", {"id": big, "neg": -big})
        [delivery] = broker.claim("jobs")
        assert delivery.payload == {"id": big, "neg": -big} and type(delivery.payload["id"]) is int


def test_a_non_finite_enum_value_is_refused() -> None:
    class Rate(enum.Enum):
        UNKNOWN = math.nan

    with pytest.raises(ValueError, match=r"cannot send nan \(at \['rate'\]\.value\)"):
        codec.dumps({"rate": Rate.UNKNOWN, "note": None})


def test_a_body_with_a_big_integer_takes_what_orjson_takes() -> None:
    """An integer beyond 64 bits sends the body through the standard library's encoder, which knew no
    dataclass, enum, datetime or UUID: the same body without the integer was sent, with it refused."""

    @dataclasses.dataclass
    class Point:
        x: float

    class Colour(enum.Enum):
        RED = "red"

    others = {
        "p": Point(1.5),
        "c": Colour.RED,
        "t": datetime.datetime(2026, 11, 24, 1, 2, 3),
        "u": uuid.UUID(int=5),
    }
    assert json.loads(codec.dumps({**others, "big": 2**70})) == {
        **json.loads(codec.dumps(others)),
        "big": 2**70,
    }


def test_a_non_finite_key_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot send nan \(at \[nan\] \(a key\)\)"):
        codec.dumps({math.nan: 1})
