"""The record format: every record type round-trips exactly, bad maps are refused by name, old records
still read, and docs/journal-format.md lists the keys the code writes."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.config import DEFAULT_DEAD_LETTER, PushConfig, QueueConfig, RetryBackoff
from broker.core.records import (
    RECORD_TYPES,
    Acked,
    Claimed,
    DeadLettered,
    Deferred,
    Deleted,
    Expired,
    Extended,
    LeaseExpired,
    Nacked,
    Published,
    Purged,
    QueueCreated,
    QueueDeleted,
    QueueUpdated,
    Record,
    Redriven,
    Released,
    Replaced,
)
from broker.storage import format as format_module
from broker.storage.codec import cbor_array_head, cbor_dumps, cbor_loads, cbor_uint_items
from broker.storage.format import (
    ENVELOPE_KEYS,
    FRAME_OVERHEAD,
    GROUP_KEYS,
    GROUP_RECORDS,
    CorruptRecord,
    decode_entry,
    decode_frame,
    encode_entry,
    encode_frames,
    frame,
    frame_span,
)
from broker.storage.journal import JournalEntry

DOC = Path(__file__).resolve().parents[2] / "docs" / "journal-format.md"

#: One of every record type, each field set away from any default.
SAMPLES: list[Record] = [
    QueueCreated(
        QueueConfig(
            lease=12.5,
            max_attempts=4,
            dead_letter="graveyard",
            retry_backoff=RetryBackoff("exponential", 0.5, 60.0),
            max_depth=1000,
            rate_limit=(50, 1.5),
            message_ttl=3600.0,
            claim_window=0.25,
            durable=False,
            dedup_window=60.0,
        ),
        "18c2f1a3b4d-0-",
    ),
    QueueCreated(QueueConfig(), "18c2f1a3b4d-1-"),
    QueueUpdated(QueueConfig(dead_letter=None, rate_limit=(1, 86400.0))),
    QueueDeleted(),
    Published("m-1", 1, b"\x00\xffbinary", True, {"trace": "abc", "": ""}, "key-1", -3, 1763800000.25, None),
    Published(
        "m-2", 2**70, b'{"a":1}', False, None, None, 0, 1763800000.5, 1763800030.5, ("jobs.dlq", "m-9")
    ),
    Replaced("m-1", b"[]", False, None),
    Replaced("m-1", b"\x01", True, {"k": "v"}),
    Claimed("m-1", "m-1.1", "worker-7", 1, 1763800030.0),
    Acked("m-1", "m-1.1"),
    Nacked("m-1", "m-1.2", 2.5, "timeout"),
    Nacked("m-1", "m-1.3", 0.0, None),
    Deferred("m-1", "m-1.4", 30.0, "busy"),
    Deferred("m-1", "m-1.5", 0.0, None),
    Extended("m-1", "m-1.6", 1763800090.0),
    Released("m-1", "m-1.7", True),
    LeaseExpired("m-1", "m-1.8"),
    DeadLettered("m-1", "m-1.9", "max_attempts", 5, "jobs.dlq"),
    DeadLettered("m-1", None, "rejected", 1, None),
    Expired("m-3", "jobs.dlq"),
    Expired("m-4", None),
    Redriven("m-5", "jobs"),
    Deleted("m-6"),
    Purged(17),
]


def exactly(entry: JournalEntry) -> str:
    """Equality that also tells 1 from 1.0, True from 1 and a tuple from a list."""
    return repr(entry)


# -- every type round-trips ---------------------------------------------------------------------------


def test_every_record_class_has_a_journal_type_and_a_sample() -> None:
    assert set(typing.get_args(Record)) == set(RECORD_TYPES)
    assert len(set(RECORD_TYPES.values())) == len(RECORD_TYPES)
    assert {type(record) for record in SAMPLES} == set(RECORD_TYPES)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda record: type(record).__name__)
def test_a_record_round_trips_exactly(record: Record) -> None:
    entry = JournalEntry(123456789, 1763800000.123, "jobs", record)
    decoded = decode_entry(encode_entry(*entry))
    assert decoded == entry
    assert exactly(decoded) == exactly(entry)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda record: type(record).__name__)
def test_a_record_is_one_map_of_its_place_type_and_fields_by_name(record: Record) -> None:
    written = cbor_loads(encode_entry(7, 1.5, "jobs", record))
    names = [field.name for field in dataclasses.fields(record)]
    assert list(written) == [*ENVELOPE_KEYS, *names]
    assert (written["lsn"], written["at"], written["queue"]) == (7, 1.5, "jobs")
    assert written["type"] == RECORD_TYPES[type(record)]


def test_a_config_is_a_plain_map_with_the_dead_letter_placeholder_and_rate_limit_as_max_per() -> None:
    config = QueueConfig(rate_limit=(50, 1.5))
    written = cbor_loads(encode_entry(1, 1.0, "jobs", QueueUpdated(config)))["config"]
    assert written == {
        "lease": 30.0,
        "max_attempts": 0,
        "dead_letter": DEFAULT_DEAD_LETTER,
        "retry_backoff": {"type": "fixed", "base": 0.0, "max": 3600.0},
        "max_depth": 0,
        "rate_limit": {"max": 50, "per": 1.5},
        "message_ttl": 0.0,
        "claim_window": 0.0,
        "durable": True,
        "dedup_window": 86400.0,
        "push": None,
    }
    assert set(written) == {field.name for field in dataclasses.fields(QueueConfig)}
    assert (
        cbor_loads(encode_entry(1, 1.0, "jobs", QueueUpdated(QueueConfig())))["config"]["rate_limit"] is None
    )


def test_a_payload_stays_bytes_and_a_moved_message_s_origin_is_an_array() -> None:
    record = Published("m", 1, b"\x00", True, {"a": "b"}, None, 0, 1.0, None, ("src", "m-0"))
    written = cbor_loads(encode_entry(1, 1.0, "jobs", record))
    assert written["payload"] == b"\x00"
    assert written["headers"] == {"a": "b"}
    assert written["origin"] == ["src", "m-0"]


def test_an_integer_in_a_float_field_reads_back_as_a_float() -> None:
    decoded = decode_entry(encode_entry(1, 1000, "jobs", Claimed("m", "l", "c", 1, 1763800030)))
    assert exactly(decoded) == exactly(
        JournalEntry(1, 1000.0, "jobs", Claimed("m", "l", "c", 1, 1763800030.0))
    )
    config = QueueConfig(lease=5, rate_limit=(2, 1), retry_backoff=RetryBackoff("fixed", 1, 2))
    read = decode_entry(encode_entry(1, 1.0, "jobs", QueueUpdated(config))).record
    assert isinstance(read, QueueUpdated)
    assert repr(read.config) == repr(
        QueueConfig(lease=5.0, rate_limit=(2, 1.0), retry_backoff=RetryBackoff("fixed", 1.0, 2.0))
    )


# -- Hypothesis: any value of every field ---------------------------------------------------------------

floats = st.floats(allow_nan=False)
text = st.text(max_size=12)


def strategy_for(owner: type[Any], name: str, hint: Any) -> st.SearchStrategy[Any]:
    """Any value of a field's type, from its annotation (the test's own oracle, not the module's)."""
    if (owner, name) == (QueueConfig, "dead_letter"):
        return st.none() | st.just(DEFAULT_DEAD_LETTER) | text
    simple: dict[Any, st.SearchStrategy[Any]] = {
        str: text,
        int: st.integers(),
        float: floats,
        bool: st.booleans(),
        bytes: st.binary(max_size=300),
    }
    if hint in simple:
        return simple[hint]
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return st.none() | strategy_for(owner, name, inner)
    if origin is Mapping:
        return st.dictionaries(text, text, max_size=4)
    if origin is tuple:
        return st.tuples(*(strategy_for(owner, name, item) for item in arguments))
    assert dataclasses.is_dataclass(hint), hint
    return instances_of(hint)


def instances_of(cls: Any) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(
        cls,
        **{field.name: strategy_for(cls, field.name, hints[field.name]) for field in dataclasses.fields(cls)},
    )


records = st.one_of([instances_of(cls) for cls in RECORD_TYPES])


@settings(max_examples=400, deadline=None)
@given(lsn=st.integers(1, 2**64 - 1), at=floats, queue=text, record=records)
def test_any_record_round_trips_exactly(lsn: int, at: float, queue: str, record: Record) -> None:
    entry = JournalEntry(lsn, at, queue, record)
    decoded = decode_entry(encode_entry(lsn, at, queue, record))
    assert decoded == entry
    assert exactly(decoded) == exactly(entry)


def written_as_cbor2_writes_it(encoded: bytes) -> bool:
    """Whether ``encoded`` is what cbor2 writes for the map it holds (same items, same order, same
    lengths of heads and floats): decoding and encoding again with cbor2 gives the same bytes."""
    return cbor_dumps(cbor_loads(encoded)) == encoded


@settings(max_examples=400, deadline=None)
@given(lsn=st.integers(1, 2**64 - 1), at=floats | st.sampled_from([math.inf, -math.inf]), record=records)
def test_the_compiled_encoder_writes_what_cbor2_writes_for_the_record_map(
    lsn: int, at: float, record: Record
) -> None:
    assert written_as_cbor2_writes_it(encode_entry(lsn, at, "jobs", record))


@pytest.mark.parametrize("size", [0, 23, 24, 255, 256, 65535, 65536])
def test_texts_and_byte_strings_of_every_head_size_encode_as_cbor2_does(size: int) -> None:
    record = Published("é" * size, -(2**70), b"x" * size, True, {"k": "v" * size}, None, -25, 0.0, None)
    assert written_as_cbor2_writes_it(encode_entry(2**64 - 1, -0.0, "q" * size, record))
    assert decode_entry(encode_entry(1, 0.0, "jobs", record)).record == record


def test_a_record_alone_has_a_frame_of_its_own_and_a_run_of_one_type_shares_one() -> None:
    group = list({type(record): record for record in SAMPLES}.values())[:3]  # three types, three frames
    assert encode_frames(7, 1.5, "jobs", group) == [
        frame(encode_entry(lsn, 1.5, "jobs", record)) for lsn, record in zip((7, 8, 9), group, strict=True)
    ]
    claims = [Claimed(f"m-{n}", f"l-{n}", "worker", 1, 30.0) for n in range(3)]
    frames = encode_frames(7, 1.5, "jobs", [*claims, Acked("m-0", "l-0")])
    assert len(frames) == 2
    written = cbor_loads(frames[0][FRAME_OVERHEAD:])
    assert list(written) == list(GROUP_KEYS)
    assert (written["lsn"], written["count"], written["type"]) == (7, 3, "claimed")
    # A value all the records share is written once: the consumer, the attempt and the deadline.
    assert written["columns"] == [["m-0", "m-1", "m-2"], ["l-0", "l-1", "l-2"], ["worker"], [1], [30.0]]
    assert [entry for data in frames for entry in decode_frame(data[FRAME_OVERHEAD:])] == [
        *(JournalEntry(7 + n, 1.5, "jobs", claim) for n, claim in enumerate(claims)),
        JournalEntry(10, 1.5, "jobs", Acked("m-0", "l-0")),
    ]
    assert [frame_span(data, FRAME_OVERHEAD, len(data)) for data in frames] == [(7, 3), (10, 1)]


def test_a_run_over_a_million_records_takes_several_group_frames_and_reads_back_whole() -> None:
    """One command's run of records had no bound, but a reader takes at most ``MAX_GROUP`` from a frame:
    a TTL set on a queue of 1,050,000 messages wrote one group that recovery cut, and with it every
    acknowledged change after it. The writer now splits at ``GROUP_RECORDS``."""
    expired = [Expired(f"m-{n}", None) for n in range(GROUP_RECORDS + 5)]
    frames = encode_frames(3, 1.5, "big", [Acked("m-x", "l-x"), *expired])
    assert [frame_span(data, FRAME_OVERHEAD, len(data)) for data in frames] == [
        (3, 1),
        (4, GROUP_RECORDS),
        (4 + GROUP_RECORDS, 5),
    ]
    tail = [entry for data in frames[2:] for entry in decode_frame(data[FRAME_OVERHEAD:])]
    assert tail == [
        JournalEntry(4 + GROUP_RECORDS + n, 1.5, "big", expired[GROUP_RECORDS + n]) for n in range(5)
    ]


def test_a_group_an_older_writer_made_over_a_million_records_long_still_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Journals written before runs were split may hold such a group: it must not cut the journal."""
    expired = [Expired(f"m-{n}", None) for n in range(GROUP_RECORDS + 1)]
    monkeypatch.setattr(format_module, "GROUP_RECORDS", len(expired))  # as the older writer did
    [data] = encode_frames(1, 1.5, "big", expired)
    assert frame_span(data, FRAME_OVERHEAD, len(data)) == (1, GROUP_RECORDS + 1)
    decoded = decode_frame(data[FRAME_OVERHEAD:])
    assert (len(decoded), decoded[-1]) == (
        GROUP_RECORDS + 1,
        JournalEntry(len(expired), 1.5, "big", expired[-1]),
    )


def test_a_group_over_group_bytes_is_split_in_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame's length is a u32: a run of big records is split before its group would pass it."""
    monkeypatch.setattr(format_module, "GROUP_BYTES", 400)
    published = [Published(f"m-{n}", n, bytes([n]) * 100, True, None, None, 0, 1.0, None) for n in range(8)]
    frames = encode_frames(1, 1.5, "jobs", published)
    spans = [frame_span(data, FRAME_OVERHEAD, len(data)) for data in frames]
    assert spans == [(1, 2), (3, 2), (5, 2), (7, 2)]  # 8 → 4 + 4 → 2 + 2 + 2 + 2, each under 400 bytes
    assert all(len(data) <= 400 for data in frames)
    decoded = [entry for data in frames for entry in decode_frame(data[FRAME_OVERHEAD:])]
    assert decoded == [JournalEntry(1 + n, 1.5, "jobs", record) for n, record in enumerate(published)]


runs = st.sampled_from(list(RECORD_TYPES)).flatmap(
    lambda cls: st.lists(instances_of(cls), min_size=2, max_size=12)
)


@settings(max_examples=300, deadline=None)
@given(first=st.integers(1, 2**63), at=floats, run=runs, before=st.lists(records, max_size=2))
def test_a_group_round_trips_exactly_and_is_what_cbor2_writes(
    first: int, at: float, run: list[Record], before: list[Record]
) -> None:
    group = [*before, *run]
    frames = encode_frames(first, at, "jobs", group)
    decoded = [entry for data in frames for entry in decode_frame(data[FRAME_OVERHEAD:])]
    expected = [JournalEntry(first + n, at, "jobs", record) for n, record in enumerate(group)]
    assert [exactly(entry) for entry in decoded] == [exactly(entry) for entry in expected]
    for data in frames:
        assert frame(data[FRAME_OVERHEAD:]) == data
        assert written_as_cbor2_writes_it(data[FRAME_OVERHEAD:])
        first_lsn, count = frame_span(data, FRAME_OVERHEAD, len(data)) or (0, 0)
        assert [entry.lsn for entry in decode_frame(data[FRAME_OVERHEAD:])] == list(
            range(first_lsn, first_lsn + count)
        )


#: The unsigned integers of each CBOR width: an item of one byte, then a head and 1, 2, 4 or 8 bytes.
UINT_WIDTHS = [(0, 23), (24, 255), (256, 65535), (65536, 2**32 - 1), (2**32, 2**64 - 1)]
one_width = st.sampled_from(UINT_WIDTHS).flatmap(lambda bounds: st.lists(st.integers(*bounds), min_size=1))


@settings(max_examples=300, deadline=None)
@given(values=one_width | st.lists(st.integers(-(2**65), 2**65), min_size=1))
def test_unsigned_integers_of_one_width_are_the_items_cbor2_writes_and_any_others_are_left_to_it(
    values: list[int],
) -> None:
    items = cbor_uint_items(values)
    same_width = any(all(low <= value <= high for value in values) for low, high in UINT_WIDTHS)
    assert (items is not None) == same_width
    if items is not None:
        assert cbor_array_head(len(values)) + items == cbor_dumps(values)


@settings(max_examples=100, deadline=None)
@given(seqs=one_width.filter(lambda values: len(values) >= 2))
def test_a_group_s_integers_of_one_width_are_written_as_cbor2_writes_them(seqs: list[int]) -> None:
    run = [Published(f"m-{n}", seq, b"x", False, None, None, 0, 1.0, None) for n, seq in enumerate(seqs)]
    (data,) = encode_frames(1, 1.0, "jobs", run)
    assert written_as_cbor2_writes_it(data[FRAME_OVERHEAD:])
    assert [entry.record for entry in decode_frame(data[FRAME_OVERHEAD:])] == run


def test_equal_floats_of_other_signs_are_not_shared() -> None:
    claims = [Claimed("a", "l", "c", 1, 0.0), Claimed("b", "l", "c", 1, -0.0)]
    (data,) = encode_frames(1, 1.0, "jobs", claims)
    assert [repr(entry.record.deadline) for entry in decode_frame(data[FRAME_OVERHEAD:])] == ["0.0", "-0.0"]


def group_of(records: list[Record], **changes: Any) -> bytes:
    """The payload of the group frame of ``records`` with keys changed (``...`` removes the key)."""
    (data,) = encode_frames(5, 1.0, "jobs", records)
    return changed(data[FRAME_OVERHEAD:], **changes)


def test_a_group_without_a_trailing_column_reads_the_fields_default_and_extra_columns_are_ignored() -> None:
    moved = [Published(f"m-{n}", n, b"x", False, None, None, 0, 1.0, None, ("q", f"o-{n}")) for n in (1, 2)]
    columns = cbor_loads(group_of(moved))["columns"]
    older = decode_frame(group_of(moved, columns=columns[:-1]))  # written before Published.origin
    assert [entry.record for entry in older] == [dataclasses.replace(m, origin=None) for m in moved]
    newer = decode_frame(group_of(moved, columns=[*columns, ["a later field"]]))
    assert [entry.record for entry in newer] == moved


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"count": 0}, "'count' must be an integer from 1"),
        ({"count": 3}, "'columns.0.id' must be an array of 1 or 3 values"),
        ({"columns": {"id": []}}, "'columns' must be an array of columns"),
        ({"columns": [["m-1", "m-2"]]}, "'columns.1.lease_id' is missing"),
        ({"columns": [["m-1", 2], ["l"]]}, "'columns.0.id' must be text"),
        ({"type": "shipped"}, "'type' must be one of"),
        ({"lsn": ...}, "'lsn' is missing"),
    ],
)
def test_a_malformed_group_is_a_corrupt_record_that_names_the_column(
    changes: dict[str, Any], message: str
) -> None:
    acks = [Acked("m-1", "l"), Acked("m-2", "l")]
    with pytest.raises(CorruptRecord, match=re.escape(message)):
        decode_frame(group_of(acks, **changes))


def test_a_group_is_not_one_record() -> None:
    with pytest.raises(CorruptRecord, match="a group of records where one record was due"):
        decode_entry(group_of([Acked("m-1", "l"), Acked("m-2", "l")]))


# -- compatibility ----------------------------------------------------------------------------------------


def rewritten(record: Record, **changes: Any) -> bytes:
    """The encoding of ``record`` with keys changed (a value of ``...`` removes the key)."""
    return changed(encode_entry(5, 1.0, "jobs", record), **changes)


def changed(data: bytes, /, **changes: Any) -> bytes:
    """The CBOR map ``data`` with keys changed (a value of ``...`` removes the key)."""
    written = cbor_loads(data)
    for key, value in changes.items():
        if value is ...:
            del written[key]
        else:
            written[key] = value
    return cbor_dumps(written)


def test_a_field_added_later_with_a_default_reads_as_its_default_from_older_records() -> None:
    # Published.origin came after the first records were written: a map without it still reads.
    moved = Published("m", 1, b"x", False, None, None, 0, 1.0, None, ("a", "b"))
    assert decode_entry(rewritten(moved, origin=...)).record == dataclasses.replace(moved, origin=None)
    config_map = {"lease": 9.0, "retry_backoff": {"type": "exponential"}}
    read = decode_entry(rewritten(QueueUpdated(QueueConfig()), config=config_map)).record
    assert read == QueueUpdated(QueueConfig(lease=9.0, retry_backoff=RetryBackoff("exponential")))


def test_keys_a_reader_does_not_know_are_ignored() -> None:
    record = Acked("m", "l")
    assert decode_entry(rewritten(record, shard=3, note={"x": [1]})).record == record


def test_a_missing_field_without_a_default_is_corrupt_and_named() -> None:
    with pytest.raises(CorruptRecord, match=r"lsn 5, type 'claimed'\): 'consumer' is missing"):
        decode_entry(rewritten(Claimed("m", "l", "c", 1, 2.0), consumer=...))


# -- what is refused --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "one CBOR item"),
        (b"\xff", "one CBOR item"),
        (cbor_dumps({"lsn": 1}) + b"\x00", "one CBOR item"),
        (cbor_dumps([1, 2]), "must be a CBOR map, not list"),
        (cbor_dumps("published"), "must be a CBOR map, not str"),
        (cbor_dumps({"lsn": 1, "at": 1.0, "queue": "q", "type": "shipped"}), "'type' must be one of acked"),
        (cbor_dumps({"lsn": 1, "at": 1.0, "queue": "q", "id": "m"}), "'type' must be one of"),
        (cbor_dumps({"lsn": 1, "at": 1.0, "queue": "q", "type": 3}), "'type' must be one of"),
    ],
)
def test_bytes_that_are_not_a_record_map_are_corrupt(data: bytes, message: str) -> None:
    with pytest.raises(CorruptRecord, match=re.escape(message)):
        decode_entry(data)


CLAIMED = Claimed("m", "l", "c", 1, 2.0)
PUBLISHED = Published("m", 1, b"x", False, None, None, 0, 1.0, None)


@pytest.mark.parametrize(
    ("record", "changes", "message"),
    [
        (CLAIMED, {"lsn": 0}, "'lsn' must be a positive integer, not int 0"),
        (CLAIMED, {"lsn": True}, "'lsn' must be a positive integer, not bool True"),
        (CLAIMED, {"lsn": ...}, "'lsn' is missing"),
        (CLAIMED, {"at": "now"}, "'at' must be a number, not str 'now'"),
        (CLAIMED, {"queue": None}, "'queue' must be text, not NoneType None"),
        (CLAIMED, {"attempt": 1.0}, "'attempt' must be an integer, not float 1.0"),
        (CLAIMED, {"attempt": True}, "'attempt' must be an integer, not bool True"),
        (CLAIMED, {"deadline": None}, "'deadline' must be a number, not NoneType None"),
        (PUBLISHED, {"payload": "x"}, "'payload' must be a byte string, not str 'x'"),
        (PUBLISHED, {"binary": 1}, "'binary' must be true or false, not int 1"),
        (PUBLISHED, {"headers": {"a": 1}}, "'headers' must be a map of text to text or null"),
        (PUBLISHED, {"headers": ["a"]}, "'headers' must be a map of text to text or null"),
        (PUBLISHED, {"key": 5}, "'key' must be text or null, not int 5"),
        (PUBLISHED, {"origin": ["a"]}, "'origin' must be an array of 2 items or null"),
        (PUBLISHED, {"origin": ["a", 2]}, "'origin.1' must be text, not int 2"),
        (QueueUpdated(QueueConfig()), {"config": None}, "'config' must be a map of QueueConfig fields"),
        (QueueUpdated(QueueConfig()), {"config": {"lease": "30s"}}, "'config.lease' must be a number"),
        (
            QueueUpdated(QueueConfig()),
            {"config": {"retry_backoff": {"base": []}}},
            "'config.retry_backoff.base' must be a number",
        ),
        (QueueUpdated(QueueConfig()), {"config": {"rate_limit": 5}}, "'config.rate_limit' must be a map"),
        (
            QueueUpdated(QueueConfig()),
            {"config": {"rate_limit": {"max": 5}}},
            "'config.rate_limit.per' is missing",
        ),
        (
            QueueUpdated(QueueConfig()),
            {"config": {"rate_limit": {"max": 5.5, "per": 1}}},
            "'config.rate_limit.max' must be an integer",
        ),
    ],
)
def test_a_mistyped_or_missing_key_is_corrupt_and_named(
    record: Record, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(CorruptRecord, match=re.escape(message)):
        decode_entry(rewritten(record, **changes))


def test_only_records_can_be_encoded() -> None:
    with pytest.raises(TypeError, match="not a journal record type"):
        encode_entry(1, 1.0, "jobs", QueueConfig())  # type: ignore[arg-type]


# -- the document matches the code -----------------------------------------------------------------------


def described(owner: type[Any], name: str, hint: Any) -> str:
    """How docs/journal-format.md names a field's type."""
    if (owner, name) == (QueueConfig, "rate_limit"):
        return 'map {"max": integer, "per": float} or null'
    simple = {str: "text", int: "integer", float: "float", bool: "boolean", bytes: "bytes"}
    if hint in simple:
        return simple[hint]
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return f"{described(owner, name, inner)} or null"
    if origin is Mapping:
        return "map text → text"
    if origin is tuple:
        return f"array [{', '.join(described(owner, name, item) for item in arguments)}]"
    return {QueueConfig: "config map", RetryBackoff: "retry_backoff map", PushConfig: "push map"}[hint]


def documented_table(marker: str) -> dict[str, list[tuple[str, str]]]:
    """Rows ``| `name` | `key`: type; `key`: type |`` between ``<!-- marker -->`` comments."""
    table = DOC.read_text().split(f"<!-- {marker} -->", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    rows = {}
    for name, fields in re.findall(r"^\| `(\w+)` \| (.*?) \|$", table, flags=re.MULTILINE):
        rows[name] = [] if fields == "—" else re.findall(r"`(\w+)`: ([^;]+?)(?:;|$)", fields)
    return rows


def in_code(cls: type[Any]) -> list[tuple[str, str]]:
    hints = typing.get_type_hints(cls)
    return [(field.name, described(cls, field.name, hints[field.name])) for field in dataclasses.fields(cls)]


def test_the_document_lists_every_record_type_with_its_keys_and_their_types() -> None:
    documented = documented_table("record-types")
    assert documented == {name: in_code(cls) for cls, name in RECORD_TYPES.items()}


def test_the_document_lists_every_config_key_with_its_type() -> None:
    assert documented_table("config") == {
        "config": in_code(QueueConfig),
        "retry_backoff": in_code(RetryBackoff),
        "push": in_code(PushConfig),
    }
