"""The journal's record format, version 2: one CBOR map per record, or per run of records of one type
that one command made (a group, written column by column: ``encode_frames``), each map in a frame
(length, CRC32) of its own (docs/journal-format.md). Version 1 had no groups; it reads as it is.

A record is written as a map of its place in the journal (``lsn``, ``at``, ``queue``), its ``type`` (the
name ``RECORD_TYPES`` gives its class) and its own fields by name. How each field is written follows from
its type annotation: text, integers, floats, booleans and byte strings as they are, ``X | None`` as the
value or null, ``Mapping[str, str]`` as a map, a fixed-length tuple as an array, a nested dataclass
(``QueueConfig``, ``RetryBackoff``) as a map of its fields, and ``QueueConfig.rate_limit`` as
``{"max", "per"}``. A field of any other type is refused when this module is imported, so a record can
never gain a field the journal cannot hold.

Compatibility, the rule that keeps old journals readable:

- A field may be added to a record (or to ``QueueConfig``) only with a default. A reader fills a field
  missing from the map with its default, so records written before the field existed still read.
- A reader ignores keys it does not know, so an older reader can still read a newer record that only
  gained fields (the Spark tool, a rolled-back broker).
- Renaming or removing a field, changing a field's type or meaning, adding a record type, or a new kind
  of frame (groups were version 2's) is a new format: it takes a new ``JOURNAL_VERSION``, and readers
  refuse segments of a version they do not know rather than guess
  (``broker.storage.segments.UnsupportedVersion``).

Float fields are read from a CBOR float or integer, always as a Python ``float``.

A snapshot writes each entry of a message's history as the map of its record (``encode_entry``,
``entry_of``). One type of entry is no journal record: ``omitted`` (``HistoryOmitted``, counting the
entries dropped from a long history). Only those two functions know it; the journal's writer refuses
it and its readers take it for an unknown type.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import types
import typing
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from broker.core.config import QueueConfig
from broker.core.records import HISTORY_ONLY_TYPES, RECORD_TYPES, HistoryOmitted, Record
from broker.errors import InvalidRequest
from broker.storage.codec import (
    CBOR_NULL,
    INLINE,
    INLINE_NAMES,
    CborReader,
    cbor_array_head,
    cbor_bool,
    cbor_bytes,
    cbor_dumps,
    cbor_float,
    cbor_int,
    cbor_loads,
    cbor_map_head,
    cbor_text,
    cbor_uint_items,
    one_value,
)
from broker.storage.journal import JournalEntry

JOURNAL_VERSION: Final = 2
#: The versions this broker reads: 1 holds one record per frame, 2 also groups (below).
READABLE_VERSIONS: Final = frozenset({1, 2})

#: The keys every record map has besides its fields; no record field may take one of these names.
ENVELOPE_KEYS: Final = ("lsn", "at", "queue", "type")


# -- frames: how a record sits in a segment file (broker.storage.segments) ------------------------------

#: A frame's head: the payload's length and its CRC32, little-endian.
FRAME: Final = struct.Struct("<II")
FRAME_OVERHEAD: Final = FRAME.size
MAX_PAYLOAD: Final = 0xFFFF_FFFF


def frame(payload: bytes) -> bytes:
    """One record's payload as a frame: length, CRC32, payload."""
    if not 0 < len(payload) <= MAX_PAYLOAD:
        raise ValueError(f"a frame holds 1 to {MAX_PAYLOAD} bytes, not {len(payload)}")
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class CorruptRecord(ValueError):
    """Bytes that are not a journal record of this format: not one CBOR map, an unknown type, or a
    missing or mistyped key. The message names the record (its lsn and type, when readable) and the key."""


# -- values: how each type of field is written and read back --------------------------------------------

_MISSING: Final = object()
_NONE = type(None)


class _Mismatch(Exception):
    """A value is not of its field's type, or is missing; ``path`` names the field, outermost first."""

    def __init__(self, expected: str, value: Any = _MISSING) -> None:
        self.expected = expected
        self.value = value
        self.path: list[str] = []

    def describe(self) -> str:
        name = ".".join(self.path)
        if self.value is _MISSING:
            return f"{name!r} is missing"
        shown = repr(self.value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return f"{name!r} must be {self.expected}, not {type(self.value).__name__} {shown}"

    def at(self, *path: str) -> _Mismatch:
        """This mismatch, found within ``path`` (outermost first)."""
        self.path[:0] = path
        return self


_Write = Callable[[Any], Any]
_Read = Callable[[Any], Any]


class _Form(NamedTuple):
    """How values of one type are written and read back."""

    #: Turns the value into what is written; None: the value is written as it is.
    write: _Write | None
    #: Checks a decoded value and turns it back into the field's value; raises ``_Mismatch``.
    read: _Read
    #: The exact types of decoded values that ``read`` returns unchanged (its fast path skips ``read``).
    unchanged: frozenset[type[Any]]
    #: The CBOR bytes of a value, as ``cbor_dumps`` of what ``write`` makes of it would be.
    encode: Callable[[Any], bytes] = cbor_dumps
    #: For ``X | None``: the encoder of an ``X`` (compiled encoders test for None in line).
    encode_present: Callable[[Any], bytes] | None = None
    #: ``encode`` as a template of source (``codec.INLINE``), for compiled encoders; None: not inlined.
    inline: Callable[[str, str], str] | None = None


# ``type(value) is …`` rather than ``isinstance``: a bool is an int to isinstance, and nothing but these
# exact types comes out of the decoder for a well-formed record.


def _read_str(value: Any) -> str:
    if type(value) is str:
        return value
    raise _Mismatch("text", value)


def _read_int(value: Any) -> int:
    if type(value) is int:
        return value
    raise _Mismatch("an integer", value)


def _read_float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Mismatch("a number", value)


def _read_bool(value: Any) -> bool:
    if type(value) is bool:
        return value
    raise _Mismatch("true or false", value)


def _read_bytes(value: Any) -> bytes:
    if type(value) is bytes:
        return value
    raise _Mismatch("a byte string", value)


def _read_string_map(value: Any) -> dict[str, str]:
    if type(value) is dict and all(type(key) is str and type(item) is str for key, item in value.items()):
        return value
    raise _Mismatch("a map of text to text", value)


_SCALARS: dict[Any, _Form] = {
    str: _Form(None, _read_str, frozenset({str}), cbor_text, inline=INLINE[str]),
    int: _Form(None, _read_int, frozenset({int}), cbor_int, inline=INLINE[int]),
    float: _Form(None, _read_float, frozenset({float}), cbor_float, inline=INLINE[float]),
    bool: _Form(None, _read_bool, frozenset({bool}), cbor_bool, inline=INLINE[bool]),
    bytes: _Form(None, _read_bytes, frozenset({bytes}), cbor_bytes, inline=INLINE[bytes]),
}


def _optional(form: _Form) -> _Form:
    write = form.write
    read = form.read
    encode = form.encode

    def read_optional(value: Any) -> Any:
        if value is None:
            return None
        try:
            return read(value)
        except _Mismatch as mismatch:
            if not mismatch.path:  # the value itself, not an item within it
                mismatch.expected += " or null"
            raise

    inline = form.inline

    def inline_optional(value: str, temp: str) -> str:
        assert inline is not None
        return f"(NULL if ({temp}_ := {value}) is None else {inline(temp + '_', temp)})"

    return _Form(
        None if write is None else (lambda value: None if value is None else write(value)),
        read_optional,
        form.unchanged | {_NONE},
        lambda value: CBOR_NULL if value is None else encode(value),
        encode,
        None if inline is None else inline_optional,
    )


def _tuple_form(forms: list[_Form]) -> _Form:
    """A fixed-length tuple, written as a CBOR array (the encoder writes a tuple as an array)."""
    if any(form.write is not None for form in forms):
        raise TypeError("the journal format holds tuples of plain values only")
    reads = [form.read for form in forms]

    def read_tuple(value: Any) -> tuple[Any, ...]:
        if type(value) is not list or len(value) != len(reads):
            raise _Mismatch(f"an array of {len(reads)} items", value)
        items = []
        for index, (read, item) in enumerate(zip(reads, value, strict=True)):
            try:
                items.append(read(item))
            except _Mismatch as mismatch:
                mismatch.path.insert(0, str(index))
                raise
        return tuple(items)

    return _Form(None, read_tuple, frozenset())


def _write_rate_limit(value: tuple[int, float]) -> dict[str, Any]:
    return {"max": value[0], "per": value[1]}


def _read_rate_limit(value: Any) -> tuple[int, float]:
    if type(value) is not dict:
        raise _Mismatch('a map {"max", "per"}', value)
    return (_read_key(value, "max", _read_int), _read_key(value, "per", _read_float))


def _read_key(value: dict[Any, Any], key: str, read: _Read) -> Any:
    try:
        if key not in value:
            raise _Mismatch("present")
        return read(value[key])
    except _Mismatch as mismatch:
        mismatch.path.insert(0, key)
        raise


#: Fields whose map form is not the one their type gives.
_SPECIAL: dict[tuple[type[Any], str], _Form] = {
    (QueueConfig, "rate_limit"): _optional(
        _Form(
            _write_rate_limit,
            _read_rate_limit,
            frozenset(),
            lambda value: cbor_dumps(_write_rate_limit(value)),
        )
    ),
}


# -- fields: a dataclass as a map -----------------------------------------------------------------------


class _Field(NamedTuple):
    name: str
    form: _Form
    default: Any  # _MISSING when the field has none


def _fields_of(cls: type[Any]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = _MISSING
        fields.append(_Field(field.name, _form_of(cls, field.name, hints[field.name]), default))
    return tuple(fields)


def _form_of(owner: type[Any], name: str, hint: Any) -> _Form:
    """How the field ``owner.name`` of type ``hint`` is written and read back."""
    special = _SPECIAL.get((owner, name))
    if special is not None:
        return special
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and len(arguments) == 2 and _NONE in arguments:
        return _optional(_form_of(owner, name, arguments[0] if arguments[1] is _NONE else arguments[1]))
    if origin is Mapping and arguments == (str, str):
        return _Form(None, _read_string_map, frozenset())
    if origin is tuple and arguments and Ellipsis not in arguments:
        return _tuple_form([_form_of(owner, name, item) for item in arguments])
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        fields = _fields_of(hint)
        nested: type[Any] = hint
        return _Form(
            lambda value: _write_map(fields, value),
            lambda value: _read_map(nested, fields, value),
            frozenset(),
            lambda value: cbor_dumps(_write_map(fields, value)),
        )
    raise TypeError(f"the journal format has no form for {owner.__name__}.{name}: {hint!r}")


def _write_map(fields: tuple[_Field, ...], value: Any) -> dict[str, Any]:
    written = {}
    for field in fields:
        item = getattr(value, field.name)
        written[field.name] = item if field.form.write is None else field.form.write(item)
    return written


def _read_fields(fields: tuple[_Field, ...], value: dict[Any, Any]) -> list[Any]:
    """The values of ``fields`` from the map ``value``: missing ones take their default, unknown keys
    are ignored. Raises ``_Mismatch`` naming the field."""
    values = []
    for field in fields:
        try:
            item = value.get(field.name, _MISSING)
            if item is not _MISSING:
                values.append(field.form.read(item))
            elif field.default is not _MISSING:
                values.append(field.default)
            else:
                raise _Mismatch("present")
        except _Mismatch as mismatch:
            mismatch.path.insert(0, field.name)
            raise
    return values


def _read_map(cls: type[Any], fields: tuple[_Field, ...], value: Any) -> Any:
    if type(value) is not dict:
        raise _Mismatch(f"a map of {cls.__name__} fields", value)
    return cls(*_read_fields(fields, value))


def _read_lsn(value: Any) -> int:
    if type(value) is int and value >= 1:
        return value
    raise _Mismatch("a positive integer", value)


_ENVELOPE: Final = (
    _Field("lsn", _Form(None, _read_lsn, frozenset({int}), cbor_int), _MISSING),
    _Field("at", _SCALARS[float], _MISSING),
    _Field("queue", _SCALARS[str], _MISSING),
)


# -- records -------------------------------------------------------------------------------------------


class _RecordForm(NamedTuple):
    cls: type[Any]
    type_name: str
    fields: tuple[_Field, ...]
    #: ``(lsn, at, queue, record) -> the CBOR bytes of that map``, without building it; ``at`` and
    #: ``queue`` come as their CBOR bytes, which a group of records shares.
    encode: Callable[[int, bytes, bytes, Any], bytes]
    #: The values of the envelope's keys and then of every field, from a decoded map, as one tuple.
    values: Callable[[dict[Any, Any]], tuple[Any, ...]]
    #: For each of those values, the exact types the fast path of ``decode_entry`` takes as they are.
    unchanged: tuple[frozenset[type[Any]], ...]
    #: A group frame's constant run after its queue: the type, the key "columns" and their array's head.
    group_type: bytes
    #: How each field is written as a group's column.
    columns: tuple[_Column, ...]
    #: ``records -> each field's values``: the columns of a run of records, as lists.
    transpose: Callable[[Sequence[Any]], tuple[list[Any], ...]]


def _record_form(cls: type[Any], type_name: str) -> _RecordForm:
    fields = _fields_of(cls)
    clashes = {field.name for field in fields} & {*ENVELOPE_KEYS, "columns"}
    if clashes:
        raise TypeError(f"{cls.__name__} has fields named like journal keys: {sorted(clashes)}")
    every = _ENVELOPE + fields
    return _RecordForm(
        cls,
        type_name,
        fields,
        _compile_encoder(type_name, fields),
        operator.itemgetter(*(field.name for field in every)),
        tuple(field.form.unchanged for field in every),
        cbor_dumps("type") + cbor_dumps(type_name) + cbor_dumps("columns") + cbor_array_head(len(fields)),
        tuple(_column(field) for field in fields),
        _transposer(fields),
    )


def _transposer(fields: tuple[_Field, ...]) -> Callable[[Sequence[Any]], tuple[list[Any], ...]]:
    """``lambda records: ([record.<field> for record in records], …)``, one list per field, compiled as
    ``_compile_encoder`` is: CPython reads a slot in line there (``operator.attrgetter`` took ~190
    instructions a value, most of a publish's encoding after cbor2's)."""
    lists = "".join(f"[record.{field.name} for record in records], " for field in fields)
    transpose: Callable[[Sequence[Any]], tuple[list[Any], ...]] = eval(f"lambda records: ({lists})")
    return transpose


def _compile_encoder(type_name: str, fields: tuple[_Field, ...]) -> Callable[..., bytes]:
    """``lambda lsn, at, queue, record: <the frame of the record's map>``: the bytes ``frame`` makes of
    what ``cbor_dumps`` writes for the record's map (``{"lsn": …, "at": …, "queue": …, "type": …}`` and
    then its fields by name, in that order), built from constant runs (the map's head, its keys, the
    type) and each value's bytes, in line where the value's form has a template (``_Form.inline``), else
    through its encoder. ``at`` and ``queue`` come encoded (``encode_frames`` encodes them once per
    group). Written out as source and compiled once per record class, as ``dataclasses`` does for
    ``__init__``; field names are identifiers (dataclass fields), everything else enters by name. A
    message's three records (published, claimed, acked), framed: 46k user instructions against 51k with
    a call per value and ``frame`` apart (``perf stat``), about half the time of maps through cbor2."""
    namespace: dict[str, Any] = {"join": b"".join, "FRAME": FRAME.pack, "crc32": zlib.crc32}
    namespace.update(INLINE_NAMES)
    parts: list[str] = []
    constant = cbor_map_head(len(ENVELOPE_KEYS) + len(fields)) + cbor_dumps("lsn")

    def emit(value_code: str) -> None:
        nonlocal constant
        namespace[f"constant_{len(parts)}"] = constant
        parts.append(f"constant_{len(parts)}")
        parts.append(value_code)
        constant = b""

    emit(INLINE[int]("lsn", "lsn_"))
    constant += cbor_dumps("at")
    emit("at")
    constant += cbor_dumps("queue")
    emit("queue")
    constant += cbor_dumps("type") + cbor_dumps(type_name)
    namespace["NULL"] = CBOR_NULL
    for index, field in enumerate(fields):
        constant += cbor_dumps(field.name)
        value = f"record.{field.name}"
        if field.form.inline is not None:
            emit(field.form.inline(value, f"value_{index}"))
        elif field.form.encode_present is None:
            namespace[f"encode_{index}"] = field.form.encode
            emit(f"encode_{index}({value})")
        else:
            namespace[f"encode_{index}"] = field.form.encode_present
            emit(f"NULL if {value} is None else encode_{index}({value})")
    if constant:
        namespace["constant_end"] = constant
        parts.append("constant_end")
    payload = f"join(({', '.join(parts)},))"
    encoder: Callable[..., bytes] = eval(
        f"lambda lsn, at, queue, record: FRAME(len(payload := {payload}), crc32(payload)) + payload",
        namespace,
    )
    return encoder


def encode_entry(lsn: int, at: float, queue: str, record: Record | HistoryOmitted) -> bytes:
    """The CBOR map of one journal record, or of an entry of a message's history that only snapshots
    hold (``HISTORY_ONLY_TYPES``). Raises ``TypeError`` for an object that is neither."""
    if isinstance(record, HistoryOmitted):
        form = _HISTORY_ONLY_FORMS[HistoryOmitted]
        return form.encode(lsn, cbor_float(at), cbor_text(queue), record)[FRAME_OVERHEAD:]
    return encode_frames(lsn, at, queue, (record,))[0][FRAME_OVERHEAD:]


def encode_frames(first_lsn: int, at: float, queue: str, records: Sequence[Record]) -> list[bytes]:
    """The frames of the records of a group that shares its time and queue (what one command
    produced), with lsns from ``first_lsn`` on: each run of two or more records of one type in one
    group frame (``_encode_group``), a record alone in a frame of its own (``frame(encode_entry(…))``).
    The time and the queue name are encoded once."""
    at_bytes, queue_bytes = cbor_float(at), cbor_text(queue)
    encoded = []
    lsn = first_lsn
    count = len(records)
    start = 0
    while start < count:
        cls = type(records[start])
        form = _FORMS.get(cls)
        if form is None:
            raise TypeError(f"{cls.__name__} is not a journal record type")
        end = start + 1
        while end < count and type(records[end]) is cls:
            end += 1
        if end - start == 1:
            encoded.append(form.encode(lsn, at_bytes, queue_bytes, records[start]))
        elif end - start <= GROUP_RECORDS:
            encoded += _encode_groups(form, lsn, at_bytes, queue_bytes, records[start:end])
        else:  # a command over a million messages (a TTL set on a huge queue): groups of a bounded size
            for first in range(start, end, GROUP_RECORDS):
                run = records[first : min(first + GROUP_RECORDS, end)]
                encoded += _encode_groups(form, lsn + first - start, at_bytes, queue_bytes, run)
        lsn += end - start
        start = end
    return encoded


def _encode_groups(
    form: _RecordForm, first_lsn: int, at: bytes, queue: bytes, records: Sequence[Any]
) -> list[bytes]:
    """A run of records as one group frame, or as several when one would pass ``GROUP_BYTES``."""
    if len(records) == 1:
        return [form.encode(first_lsn, at, queue, records[0])]
    frame = _encode_group(form, first_lsn, at, queue, records)
    if len(frame) <= GROUP_BYTES:
        return [frame]
    half = len(records) // 2
    return _encode_groups(form, first_lsn, at, queue, records[:half]) + _encode_groups(
        form, first_lsn + half, at, queue, records[half:]
    )


# -- groups: a run of records of one type in one frame, column by column (version 2) --------------------
#
# A command's records are mostly of one type (a publish of 100 messages: 100 published records), and
# most of their fields hold the same value (the consumer, the deadline and the attempt of a claim's
# leases). Written one map per record, CPython's per-record work (a call, some 80 bytecodes, a frame)
# was the whole of what the journal cost the drain (issue 4). A group frame is one map:
#
#     {"lsn": first lsn, "count": n, "at": …, "queue": …, "type": …, "columns": [column, …]}
#
# with a column per field of the type, in declaration order: an array of the n values, or of one value
# that all n records share. A reader fills a missing trailing column with the field's default and
# ignores extra ones, as it does for map keys.

#: The keys of a group frame's map, in the order they are written.
GROUP_KEYS: Final = ("lsn", "count", "at", "queue", "type", "columns")
#: The most records a writer puts in one group frame, and the most bytes (a frame's length is a u32):
#: a longer run of one command's records (a TTL set on a queue of millions) takes several frames.
GROUP_RECORDS: Final = 1 << 20
GROUP_BYTES: Final = 1 << 30
#: The most records a reader takes from one group frame: more than a writer puts in one, because
#: writers before 2026-11-23 did not split runs (and their journals must still be read whole).
MAX_GROUP: Final = 1 << 26
#: How every payload, a record's or a group's, begins after its map's head: the key ``"lsn"``.
LSN_KEY: Final = cbor_dumps("lsn")
_COUNT_KEY: Final = cbor_dumps("count")
_AT_KEY: Final = cbor_dumps("at")
_QUEUE_KEY: Final = cbor_dumps("queue")
_GROUP_HEAD: Final = cbor_map_head(len(GROUP_KEYS)) + LSN_KEY
_SHARED: Final = b"\x81"  # an array of one item: the value all the records of the group share
#: From this many values on, a column is written by cbor2 in one call rather than value by value.
_CBOR2_COLUMN: Final = 8


def _encode_group(
    form: _RecordForm, first_lsn: int, at: bytes, queue: bytes, records: Sequence[Any]
) -> bytes:
    count = len(records)
    parts = [_GROUP_HEAD, cbor_int(first_lsn), _COUNT_KEY, cbor_int(count), _AT_KEY, at, _QUEUE_KEY, queue]
    parts.append(form.group_type)
    for column, values in zip(form.columns, form.transpose(records), strict=True):
        if one_value(values):
            parts.append(_SHARED)
            parts.append(column.encode_one(values[0]))
        elif column.encode_items is not None and (items := column.encode_items(values)) is not None:
            parts.append(cbor_array_head(count))
            parts.append(items)
        elif column.plain and count >= _CBOR2_COLUMN:
            parts.append(cbor_dumps(values))  # cbor2 in C: ~0.15 µs a value, ~2.5 µs a call
        else:
            parts.append(cbor_array_head(count))
            parts += column.encode_all(values)
    payload = b"".join(parts)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class _Column(NamedTuple):
    encode_one: Callable[[Any], bytes]
    #: The bytes of each value, in a list (in line where the form has a template).
    encode_all: Callable[[list[Any]], list[bytes]]
    #: The items of all the values in one string, or None when they do not suit it; None: no such way.
    encode_items: Callable[[list[Any]], bytes | None] | None
    #: Whether cbor2 writes the field's values as they are (no ``write`` step, as for ``QueueConfig``).
    plain: bool


def _column(field: _Field) -> _Column:
    form = field.form
    if form.inline is not None:
        namespace: dict[str, Any] = {"NULL": CBOR_NULL, **INLINE_NAMES}
        encode_all: Callable[[list[Any]], list[bytes]] = eval(
            f"lambda values: [{form.inline('value', 'item')} for value in values]", namespace
        )
    else:
        encode = form.encode
        encode_all = lambda values: list(map(encode, values))  # noqa: E731
    return _Column(
        form.encode,
        encode_all,
        cbor_uint_items if form is _SCALARS[int] else None,
        form.write is None,
    )


def _group_entries(value: dict[Any, Any]) -> list[JournalEntry]:
    """The records of a decoded group frame. Raises ``CorruptRecord``."""
    type_name = value.get("type")
    try:
        lsn, count, at, queue = _read_fields(_GROUP_ENVELOPE, value)
        form = _FORMS_BY_TYPE.get(type_name) if type(type_name) is str else None
        if form is None:
            mismatch = _Mismatch(f"one of {', '.join(sorted(_FORMS_BY_TYPE))}", type_name)
            mismatch.path.append("type")
            raise mismatch
        columns = value.get("columns", _MISSING)
        if type(columns) is not list:
            mismatch = _Mismatch("an array of columns", columns)
            mismatch.path.append("columns")
            raise mismatch
        rows = [_read_column(field, columns, index, count) for index, field in enumerate(form.fields)]
    except _Mismatch as mismatch:
        where = f"journal group (lsn {value.get('lsn')!r}, type {type_name!r})"
        raise CorruptRecord(f"{where}: {mismatch.describe()}") from None
    cls = form.cls
    records = [cls(*fields) for fields in zip(*rows, strict=True)] if rows else [cls() for _ in range(count)]
    return [JournalEntry(lsn + offset, at, queue, record) for offset, record in enumerate(records)]


def _read_column(field: _Field, columns: list[Any], index: int, count: int) -> list[Any]:
    if index >= len(columns):
        if field.default is _MISSING:
            raise _Mismatch("present").at("columns", str(index), field.name)
        return [field.default] * count
    column = columns[index]
    if type(column) is not list or len(column) not in (1, count):
        raise _Mismatch(f"an array of 1 or {count} values", column).at("columns", str(index), field.name)
    form = field.form
    if not all(type(item) in form.unchanged for item in column):
        try:
            column = [form.read(item) for item in column]
        except _Mismatch as mismatch:
            raise mismatch.at("columns", str(index), field.name) from None
    return column * count if len(column) == 1 else column


def _read_count(value: Any) -> int:
    if type(value) is int and 1 <= value <= MAX_GROUP:
        return value
    raise _Mismatch(f"an integer from 1 to {MAX_GROUP}", value)


_GROUP_ENVELOPE: Final = (
    _ENVELOPE[0],
    _Field("count", _Form(None, _read_count, frozenset({int})), _MISSING),
    _ENVELOPE[1],
    _ENVELOPE[2],
)


_FORMS: Final[dict[type[Any], _RecordForm]] = {
    cls: _record_form(cls, name) for cls, name in RECORD_TYPES.items()
}
_FORMS_BY_TYPE: Final[dict[str, _RecordForm]] = {form.type_name: form for form in _FORMS.values()}
#: The record types only a snapshot's message histories hold (``HISTORY_ONLY_TYPES``): ``encode_entry``
#: writes them and ``entry_of`` reads them, but never the journal's writer (``encode_frames``) nor its
#: readers (``decode_frame``, ``decode_entry``), for which they are not records.
_HISTORY_ONLY_FORMS: Final[dict[type[Any], _RecordForm]] = {
    cls: _record_form(cls, name) for cls, name in HISTORY_ONLY_TYPES.items()
}
_HISTORY_FORMS_BY_TYPE: Final[dict[str, _RecordForm]] = {
    **_FORMS_BY_TYPE,
    **{form.type_name: form for form in _HISTORY_ONLY_FORMS.values()},
}


def frame_span(data: bytes, start: int, stop: int) -> tuple[int, int] | None:
    """The lsn of the first record that the payload ``data[start:stop]`` holds, and how many records
    it holds, read from its first bytes without decoding the rest: every record's map and every group's
    begins with its lsn, and a group's goes on with its count. None when the bytes do not begin so."""
    if stop - start < 6 or data[start] & 0xE0 != 0xA0:
        return None
    at = start + (2 if data[start] & 0x1F == 24 else 1)
    if data[at : at + 4] != LSN_KEY:
        return None
    lsn, at = _uint_at(data, at + 4, stop)
    if lsn < 1:
        return None
    if data[at : at + 6] != _COUNT_KEY:
        return lsn, 1
    count, _ = _uint_at(data, at + 6, stop)
    return (lsn, count) if 1 <= count <= MAX_GROUP else None


_UINT_SIZES: Final = {24: 1, 25: 2, 26: 4, 27: 8}


def _uint_at(data: bytes, at: int, stop: int) -> tuple[int, int]:
    """The CBOR unsigned integer at ``data[at:]`` and where it ends; (-1, stop) when there is none."""
    if at >= stop or data[at] & 0xE0 != 0:
        return -1, stop
    info = data[at] & 0x1F
    if info < 24:
        return info, at + 1
    size = _UINT_SIZES.get(info)
    if size is None or at + 1 + size > stop:
        return -1, stop
    return int.from_bytes(data[at + 1 : at + 1 + size], "big"), at + 1 + size


def decode_frame(data: bytes) -> list[JournalEntry]:
    """The records a frame's payload holds, in lsn order: one, or a group's. Raises ``CorruptRecord``."""
    try:
        value = cbor_loads(data)
    except InvalidRequest as error:  # the codec speaks HTTP; here it is a bad record
        raise CorruptRecord(f"a journal record must be one CBOR item: {error.message}") from None
    return _entries(value)


def decode_frame_at(reader: CborReader, start: int, stop: int) -> list[JournalEntry]:
    """``decode_frame`` of the bytes ``start:stop`` of ``reader``'s buffer, reusing its decoder."""
    try:
        value = reader.item(start, stop)
    except InvalidRequest as error:
        raise CorruptRecord(f"a journal record must be one CBOR item: {error.message}") from None
    return _entries(value)


def _entries(value: Any) -> list[JournalEntry]:
    if type(value) is dict and "columns" in value:
        return _group_entries(value)
    return [_entry(value, _FORMS_BY_TYPE)]


def decode_entry(data: bytes) -> JournalEntry:
    """The record ``data`` holds, with its place in the journal; a single record's payload (a group's
    is a ``CorruptRecord``: ``decode_frame`` reads both). Raises ``CorruptRecord``."""
    try:
        value = cbor_loads(data)
    except InvalidRequest as error:  # the codec speaks HTTP; here it is a bad record
        raise CorruptRecord(f"a journal record must be one CBOR item: {error.message}") from None
    return _entry(value, _FORMS_BY_TYPE)


def entry_of(value: Any) -> JournalEntry:
    """The entry of a message's history that a decoded CBOR item holds (one record's map, as
    ``encode_entry`` writes it, within a larger item: a snapshot's message histories): a journal
    record or one of ``HISTORY_ONLY_TYPES``. Raises ``CorruptRecord``."""
    return _entry(value, _HISTORY_FORMS_BY_TYPE)


def _entry(value: Any, forms_by_type: dict[str, _RecordForm]) -> JournalEntry:
    """The record of one of the types of ``forms_by_type`` that a decoded record map holds."""
    if type(value) is dict and "columns" in value:
        raise CorruptRecord("a group of records where one record was due")
    if type(value) is not dict:
        raise CorruptRecord(f"a journal record must be a CBOR map, not {type(value).__name__}")
    type_name = value.get("type")
    form = forms_by_type.get(type_name) if type(type_name) is str else None
    if form is not None:
        # The fast path, all in C: every key present and every value of a type taken as it is. Anything
        # else (an integer for a float, a map, an array, a missing key) goes the checked way below.
        try:
            values = form.values(value)
        except KeyError:
            pass
        else:
            if all(map(operator.contains, form.unchanged, map(type, values))) and values[0] >= 1:
                return JournalEntry(values[0], values[1], values[2], form.cls(*values[3:]))
    try:
        if form is None:
            mismatch = _Mismatch(f"one of {', '.join(sorted(forms_by_type))}", type_name)
            mismatch.path.append("type")
            raise mismatch
        lsn, at, queue = _read_fields(_ENVELOPE, value)
        record = form.cls(*_read_fields(form.fields, value))
    except _Mismatch as mismatch:
        where = f"journal record (lsn {value.get('lsn')!r}, type {type_name!r})"
        raise CorruptRecord(f"{where}: {mismatch.describe()}") from None
    return JournalEntry(lsn, at, queue, record)
