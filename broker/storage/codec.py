"""The broker's encodings in one place: JSON (orjson, exact for big integers) and CBOR (the only module
that calls cbor2), shared by the HTTP layer now and by the journal and the Spark tool later."""

from __future__ import annotations

import array
import io
import json
import math
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import cbor2
import orjson

from broker.errors import InvalidRequest

# orjson reads integers beyond 64 bits as floats, which would change a payload. A body with a run of 19
# digits might hold one, so it takes the standard library's exact (slower) parser instead. The run is
# found by mapping digits to "1" and everything else to "0", then one bytes.find: both in C, ~15x faster
# than a regular expression (19 µs against 270 µs for a 20 KB body, bench machine).
_DIGIT_MAP = bytes(0x31 if 0x30 <= byte <= 0x39 else 0x30 for byte in range(256))
_DIGIT_RUN = b"1" * 19


def _may_hold_big_integer(data: bytes) -> bool:
    return data.translate(_DIGIT_MAP).find(_DIGIT_RUN) != -1


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: orjson refuses it, and would write the stdlib's inf as null
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def json_loads(data: bytes) -> Any:
    """Decode JSON exactly; any decoding failure becomes ``InvalidRequest``."""
    try:
        if _may_hold_big_integer(data):
            value = json.loads(data, parse_float=_finite_float, parse_constant=_refuse_constant)
            # The standard library reads an escaped lone surrogate ("\udc00") into a str that UTF-8
            # cannot hold, where orjson refuses it: refuse it too, or it fails later, wherever the text
            # is encoded (the journal, an answer), long after the request was accepted.
            json.dumps(value, ensure_ascii=False).encode()
            return value
        return orjson.loads(data)
    except UnicodeEncodeError:
        raise InvalidRequest(
            "the body is not valid JSON: a string holds an unpaired surrogate escape (\\ud800-\\udfff)"
        ) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"the body is not valid JSON: {error}") from None
    except RecursionError:  # the standard library's parser recurses per level; orjson stops at 1024
        raise InvalidRequest("the body is nested too deeply (at most 1024 levels)") from None


#: orjson writes arrays and objects nested at most this deep (a fixed limit of its own).
MAX_DUMP_DEPTH: Final = 254


def json_dumps(value: Any) -> bytes:
    """Encode JSON compactly into bytes of exactly the right size, fit to be kept for a long time.

    orjson returns bytes whose buffer is over-allocated to about 4 KiB and never shrunk: kept as a
    stored payload, that cost ~4.5 KiB of memory per 200-byte message (measured by bench/core.py), so
    the result is copied. Raises ``TypeError`` for what JSON cannot hold (bytes, non-string keys), and
    ``ValueError`` for arrays and objects nested more than ``MAX_DUMP_DEPTH`` levels.
    """
    try:
        return b"".join((orjson.dumps(value), b""))
    except TypeError as error:
        if str(error) == "Recursion limit reached":
            raise ValueError(f"it is nested more than {MAX_DUMP_DEPTH} levels deep") from None
        if "64-bit" not in str(error):
            raise
    # Integers beyond 64 bits: the standard library writes them exactly, but it would also quietly turn
    # non-string keys into strings, and nest deeper than orjson does (which it checked after the
    # integer it failed on): refuse both, as orjson does.
    _check_keys_and_depth(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def check_plain_json(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is made only of what JSON holds and gives back unchanged:
    dicts with string keys, lists, strings, integers, finite floats, booleans and ``None``. A value
    decoded from CBOR may hold more (NaN, a date, a UUID...), which orjson would write as ``null`` or
    as a string: a payload changed without a word."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            for key in item:
                if type(key) is not str:
                    raise ValueError(f"an object key is of type {type(key).__name__}, not a string")
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif kind is float:
            if not math.isfinite(item):
                raise ValueError(f"{item} is not a JSON number")
        elif kind is not str and kind is not int and kind is not bool and item is not None:
            raise ValueError(f"{_named(item)} is not JSON")


def _named(item: Any) -> str:
    """What a CBOR-decoded value that JSON cannot hold is, for a refusal: ``a datetime``, ``undefined``."""
    if isinstance(item, bytes | bytearray):
        return "a byte string"
    if isinstance(item, cbor2.CBORTag):
        return f"a CBOR tag ({item.tag})"
    if isinstance(item, cbor2.CBORSimpleValue):
        return f"a CBOR simple value ({item.value})"
    if item is cbor2.undefined:
        return "undefined"
    name = type(item).__name__
    return f"{'an' if name[0] in 'aeioAEIO' else 'a'} {name}"


def _check_keys_and_depth(value: Any) -> None:
    """``TypeError`` for a key that is not a string, ``ValueError`` past ``MAX_DUMP_DEPTH`` levels of
    arrays and objects (iteratively: a deep value must not exhaust Python's stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DUMP_DEPTH:
                raise ValueError(f"it is nested more than {MAX_DUMP_DEPTH} levels deep")
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        raise TypeError(f"JSON object keys must be strings, not {type(key).__name__}")
                stack.extend((inner, depth + 1) for inner in item.values())
            else:
                stack.extend((inner, depth + 1) for inner in item)


def cbor_dumps(value: Any) -> bytes:
    return cbor2.dumps(value)


# -- CBOR items one at a time, for the journal's compiled record encoders ------------------------------
#
# cbor2.dumps makes an encoder and a stream per call: ~2.5 µs for a six-key map of short values, which
# the journal paid three times per message. Records have a fixed set of keys, so the journal writes each
# map as constant bytes (head and keys, ``cbor_dumps`` once) joined with these items, exactly the bytes
# cbor2 writes for them (tests/storage/test_format.py checks it), in about half the time.


def _head(major: int, length: int) -> bytes:
    """The head of a CBOR item of major type ``major`` (0-7) with argument ``length`` (< 2**64)."""
    tag = major << 5
    if length < 24:
        return bytes((tag | length,))
    if length < 0x100:
        return bytes((tag | 24, length))
    if length < 0x10000:
        return bytes((tag | 25,)) + length.to_bytes(2, "big")
    if length < 0x1_0000_0000:
        return bytes((tag | 26,)) + length.to_bytes(4, "big")
    return bytes((tag | 27,)) + length.to_bytes(8, "big")


_TEXT_HEADS: Final = tuple(_head(3, length) for length in range(0x100))
_BYTES_HEADS: Final = tuple(_head(2, length) for length in range(0x100))
_DOUBLE: Final = struct.Struct(">Bd")
CBOR_NULL: Final = b"\xf6"


def cbor_map_head(length: int) -> bytes:
    return _head(5, length)


def cbor_array_head(length: int) -> bytes:
    return _head(4, length)


def cbor_text(value: str) -> bytes:
    data = value.encode()
    length = len(data)
    return (_TEXT_HEADS[length] if length < 0x100 else _head(3, length)) + data


def cbor_bytes(value: bytes) -> bytes:
    length = len(value)
    return (_BYTES_HEADS[length] if length < 0x100 else _head(2, length)) + value


_SMALL_INTS: Final = tuple(_head(0, value) for value in range(0x100))
_U32: Final = struct.Struct(">BI")


def cbor_int(value: int) -> bytes:
    if 0 <= value < 0x100:
        return _SMALL_INTS[value]
    if 0 <= value < 0x1_0000_0000:  # lsns, seqs: the usual case past 255
        return _U32.pack(0x1A, value) if value >= 0x10000 else bytes((0x19,)) + value.to_bytes(2, "big")
    if 0 <= value < 0x1_0000_0000_0000_0000:
        return _head(0, value)
    if -0x1_0000_0000_0000_0000 <= value < 0:
        return _head(1, -1 - value)
    return cbor2.dumps(value)  # a bignum


def _array_code(width: int) -> str:
    """The ``array`` type code of unsigned integers ``width`` bytes wide on this machine."""
    return next(code for code in "BHILQ" if array.array(code).itemsize == width)


#: Unsigned integers of each CBOR width past 23: the least and the most the width holds, the item's first
#: byte, the width in bytes, and the ``array`` type code of that width (``cbor_uint_items``).
_UINT_WIDTHS: Final = tuple(
    (least, most, head, width, _array_code(width))
    for least, most, head, width in (
        (0x18, 0xFF, 0x18, 1),
        (0x100, 0xFFFF, 0x19, 2),
        (0x1_0000, 0xFFFF_FFFF, 0x1A, 4),
        (0x1_0000_0000, 0xFFFF_FFFF_FFFF_FFFF, 0x1B, 8),
    )
)


def cbor_uint_items(values: Sequence[int]) -> bytes | None:
    """The CBOR items of ``values`` (integers, not bools), one after another (an array's items, without
    its head), when they are all unsigned and take the same number of bytes; else None.

    cbor2 writes an integer in ~0.2 µs, the most of a group's encoding for a publish of 100 messages
    (their seqs); here the whole run costs a few C calls."""
    low, high = min(values), max(values)
    if low >= 0 and high < 0x18:
        return bytes(values)  # an integer below 24 is its own item
    for least, most, head, width, code in _UINT_WIDTHS:
        if least <= low and high <= most:
            numbers = array.array(code, values)
            if sys.byteorder == "little":
                numbers.byteswap()  # CBOR's integers are big-endian
            raw = numbers.tobytes()
            stride = width + 1
            items = bytearray(len(values) * stride)
            items[0::stride] = bytes((head,)) * len(values)
            for byte in range(width):
                items[byte + 1 :: stride] = raw[byte::width]
            return bytes(items)
    return None


#: The types of values a column may hold once for all its rows: those equality tells apart (but for a
#: float's sign). A map or a tuple is written per row.
_SHAREABLE: Final = frozenset({type(None), bool, int, float, str, bytes})


def one_value(values: Sequence[Any]) -> bool:
    """Whether ``values`` (a column: the values of one field, so of one type) may be written as the one
    value they all hold, as the journal's groups and the snapshots' chunks write them: two or more,
    all equal to the first, of a type in ``_SHAREABLE``, and floats also alike in sign (0.0 == -0.0,
    and what is read back must be exact). Testing the last value first makes a column of distinct
    values cheap to turn down."""
    first = values[0]
    if len(values) < 2 or first != values[-1] or values.count(first) != len(values):
        return False
    if type(first) not in _SHAREABLE:
        return False
    return type(first) is not float or first != 0.0 or len({math.copysign(1.0, v) for v in values}) == 1


def cbor_float(value: float) -> bytes:
    if value - value == 0.0:  # finite (inf - inf and nan - nan are nan)
        return _DOUBLE.pack(0xFB, value)
    return cbor2.dumps(value)  # cbor2 writes infinities and NaN in half precision


def cbor_bool(value: bool) -> bytes:
    return b"\xf5" if value else b"\xf4"


# The same items as expressions, for encoders compiled from source (``broker.storage.format``): calling
# ``cbor_text`` and the rest costs a Python call per field, more than the work itself for short values.
# Each template takes the expression of the value and a name free for a temporary, and gives an
# expression of the item's bytes that evaluates the value once and falls back to the function above
# outside the common case. ``INLINE_NAMES`` holds the names the expressions use.


def _inline_text(value: str, temp: str) -> str:
    return (
        f"(TEXT_HEADS[len({temp})] + {temp} if len({temp} := {value}.encode()) < 256 else cbor_text({value}))"
    )


def _inline_bytes(value: str, temp: str) -> str:
    return f"(BYTES_HEADS[len({temp})] + {temp} if len({temp} := {value}) < 256 else cbor_bytes({temp}))"


def _inline_int(value: str, temp: str) -> str:
    return (
        f"(SMALL_INTS[{temp}] if 0 <= ({temp} := {value}) < 256 else "
        f"U32(0x1A, {temp}) if 0x10000 <= {temp} < 0x1_0000_0000 else cbor_int({temp}))"
    )


def _inline_float(value: str, temp: str) -> str:
    return f"(DOUBLE(0xFB, {temp}) if ({temp} := {value}) - {temp} == 0.0 else cbor_float({temp}))"


def _inline_bool(value: str, temp: str) -> str:
    return f"(TRUE if {value} else FALSE)"


INLINE: Final = {
    str: _inline_text,
    bytes: _inline_bytes,
    int: _inline_int,
    float: _inline_float,
    bool: _inline_bool,
}
INLINE_NAMES: Final = {
    "TEXT_HEADS": _TEXT_HEADS,
    "BYTES_HEADS": _BYTES_HEADS,
    "SMALL_INTS": _SMALL_INTS,
    "U32": _U32.pack,
    "DOUBLE": _DOUBLE.pack,
    "TRUE": b"\xf5",
    "FALSE": b"\xf4",
    "cbor_text": cbor_text,
    "cbor_bytes": cbor_bytes,
    "cbor_int": cbor_int,
    "cbor_float": cbor_float,
}


def _refuse_references(*_: Any) -> Any:
    raise cbor2.CBORDecodeError("shared and string references (tags 25, 28, 29, 256) are not accepted")


#: Integers of more digits than Python turns into text (4300 by default), as the JSON parser refuses
#: them: an error message or a JSON answer naming one would fail, long after the request was accepted.
_MAX_DIGITS = sys.get_int_max_str_digits() or 4300
_BIGNUM_BOUND = 10**_MAX_DIGITS


def _bignum(negative: bool) -> Callable[[Any, bool], int]:
    def decode(content: Any, _immutable: bool) -> int:
        if type(content) is not bytes:
            raise cbor2.CBORDecodeError("a bignum (tags 2, 3) must hold a byte string")
        value = int.from_bytes(content, "big")
        if value + negative >= _BIGNUM_BOUND:  # tag 3 holds -1 - n
            raise cbor2.CBORDecodeError(f"an integer has more than {_MAX_DIGITS} digits")
        return -1 - value if negative else value

    return decode


def _self_described(content: Any, _immutable: bool) -> Any:
    return content


#: Tags cbor2 would decode into one object referenced from many places (shared references, 28/29) or
#: one string repeated (string references, 25/256). A few bytes then make a value that contains itself,
#: or a tree of 2**depth nodes that every walk, hash, repr or re-encoding of it pays for, synchronously:
#: any client could stall or freeze the broker. Nothing the broker writes uses them, and a body is a
#: JSON value (or bytes), which never needs them. Bignums (tags 2 and 3) are bounded (``_BIGNUM_BOUND``).
#: Tag 55799 only marks bytes as CBOR (RFC 8949 §3.4.6): its content stands as if untagged (without a
#: decoder, cbor2 gave a tag holding a tuple or frozendict, refused as "a tuple is not JSON").
SEMANTIC_DECODERS: dict[int, Callable[[Any, bool], Any]] = {
    **dict.fromkeys((25, 28, 29, 256), _refuse_references),
    2: _bignum(negative=False),
    3: _bignum(negative=True),
    55799: _self_described,
}


def cbor_loads(data: bytes) -> Any:
    """Decode exactly one CBOR item; bad or trailing bytes, references and huge bignums
    (``SEMANTIC_DECODERS``) become ``InvalidRequest``."""
    stream = io.BytesIO(data)
    try:
        value = cbor2.load(stream, semantic_decoders=SEMANTIC_DECODERS)
    except Exception as error:  # cbor2 raises several unrelated types for bad input
        raise InvalidRequest(f"the body is not valid CBOR: {error}") from None
    if stream.tell() != len(data):
        raise InvalidRequest(f"the body has {len(data) - stream.tell()} bytes after its CBOR item")
    return value


class CborReader:
    """Decodes the CBOR items at given places of one buffer (the frames of a journal segment) with one
    decoder: making a decoder per item cost more than decoding a small record (2.7 of 6.8 µs)."""

    __slots__ = ("_decoder", "_stream")

    def __init__(self, data: bytes) -> None:
        self._stream = io.BytesIO(data)  # shares ``data``'s buffer: it is never written
        self._decoder = cbor2.CBORDecoder(self._stream, semantic_decoders=SEMANTIC_DECODERS)

    def item(self, start: int, stop: int) -> Any:
        """The one CBOR item that fills ``data[start:stop]``; else ``InvalidRequest``."""
        stream = self._stream
        stream.seek(start)
        try:
            value = self._decoder.decode()
        except Exception as error:  # cbor2 raises several unrelated types for bad input
            raise InvalidRequest(f"not valid CBOR: {error}") from None
        end = stream.tell()
        if end != stop:
            raise InvalidRequest(
                f"the CBOR item {'ends' if end < stop else 'runs'} {abs(stop - end)} bytes "
                f"{'before' if end < stop else 'past'} the end of its frame"
            )
        return value
