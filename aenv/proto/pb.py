"""A small table-driven protobuf codec (binary wire format and canonical JSON).

Message types are declared as `MessageType` tables of `Field`s (see
`aenv.proto.envd_schema`); messages themselves are plain dicts keyed by the
fields' proto (snake_case) names. Decoding fills implicit-presence scalars with
their defaults, repeated fields with lists and maps with dicts; singular
message fields, proto3 `optional` fields and oneof members appear only when
present. Covers what envd's schema uses: string, bytes, bool, uint32, int32,
sint32, int64, uint64, enums, nested messages, repeated fields,
map<string, string>, oneofs, optional presence and google.protobuf.Timestamp.
Unknown fields are skipped; malformed input raises `DecodeError` and nothing
else. No IO and no dependency on the protobuf runtime.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TIMESTAMP",
    "DecodeError",
    "EnumType",
    "Field",
    "Kind",
    "Message",
    "MessageType",
    "which_oneof",
]

Message = dict[str, Any]


class DecodeError(ValueError):
    """Input that is not a valid encoding of the expected message."""


class Kind(enum.Enum):
    STRING = "string"
    BYTES = "bytes"
    BOOL = "bool"
    UINT32 = "uint32"
    INT32 = "int32"
    SINT32 = "sint32"
    INT64 = "int64"
    UINT64 = "uint64"
    ENUM = "enum"
    MESSAGE = "message"
    MAP = "map"  # map<string, string>


_VARINT_KINDS = frozenset(
    {Kind.BOOL, Kind.UINT32, Kind.INT32, Kind.SINT32, Kind.INT64, Kind.UINT64, Kind.ENUM}
)
_LEN_KINDS = frozenset({Kind.STRING, Kind.BYTES, Kind.MESSAGE, Kind.MAP})
_RANGES: dict[Kind, tuple[int, int]] = {
    Kind.UINT32: (0, 2**32 - 1),
    Kind.INT32: (-(2**31), 2**31 - 1),
    Kind.SINT32: (-(2**31), 2**31 - 1),
    Kind.ENUM: (-(2**31), 2**31 - 1),
    Kind.INT64: (-(2**63), 2**63 - 1),
    Kind.UINT64: (0, 2**64 - 1),
}
_MASK64 = 2**64 - 1
_MAX_FIELD_NUMBER = 2**29 - 1
_MAX_DEPTH = 64


@dataclass(frozen=True)
class EnumType:
    """A proto enum: value names (as in the .proto) to numbers."""

    name: str
    values: Mapping[str, int]
    by_number: Mapping[int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_number: dict[int, str] = {}
        for name, number in self.values.items():
            by_number.setdefault(number, name)
        object.__setattr__(self, "by_number", by_number)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclass(frozen=True)
class Field:
    """One field of a message table."""

    number: int
    name: str
    kind: Kind
    repeated: bool = False
    optional: bool = False
    oneof: str | None = None
    message: MessageType | None = None
    enum: EnumType | None = None
    json_name: str = ""

    def __post_init__(self) -> None:
        if not self.json_name:
            object.__setattr__(self, "json_name", _camel(self.name))
        if (self.kind is Kind.MESSAGE) != (self.message is not None):
            raise TypeError(f"field {self.name}: message type iff kind is MESSAGE")
        if (self.kind is Kind.ENUM) != (self.enum is not None):
            raise TypeError(f"field {self.name}: enum type iff kind is ENUM")

    @property
    def has_presence(self) -> bool:
        return (
            self.optional
            or self.oneof is not None
            or (self.kind is Kind.MESSAGE and not self.repeated)
        )


def which_oneof(msg: Mapping[str, Any], mtype: MessageType, oneof: str) -> str | None:
    """The name of the member of `oneof` set in `msg`, or None."""
    for f in mtype.oneofs.get(oneof, ()):
        if f.name in msg and msg[f.name] is not None:
            return f.name
    return None


# --------------------------------------------------------------------------- wire


def _encode_varint(value: int, out: bytearray) -> None:
    value &= _MASK64
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _decode_varint(data: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift >= 70:
            raise DecodeError("varint too long")
    if result > _MASK64:
        raise DecodeError("varint overflows 64 bits")
    return result, pos


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _check_int(f: Field, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if f.kind is Kind.ENUM and isinstance(value, enum.IntEnum):
            return int(value)
        raise TypeError(f"field {f.name}: expected int, got {type(value).__name__}")
    lo, hi = _RANGES[f.kind]
    if not lo <= value <= hi:
        raise ValueError(f"field {f.name}: {value} out of range for {f.kind.value}")
    return value


def _varint_value(f: Field, value: Any) -> int:
    if f.kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise TypeError(f"field {f.name}: expected bool")
        return int(value)
    v = _check_int(f, value)
    if f.kind is Kind.SINT32:
        return ((v << 1) ^ (v >> 31)) & 0xFFFFFFFF
    return v


def _from_varint(f: Field, raw: int) -> Any:
    kind = f.kind
    if kind is Kind.BOOL:
        return raw != 0
    if kind is Kind.UINT32:
        return raw & 0xFFFFFFFF
    if kind in (Kind.INT32, Kind.ENUM):
        return _signed(raw, 32)
    if kind is Kind.SINT32:
        raw &= 0xFFFFFFFF
        return (raw >> 1) ^ -(raw & 1)
    if kind is Kind.INT64:
        return _signed(raw, 64)
    return raw  # UINT64


def _default(f: Field) -> Any:
    if f.kind is Kind.MAP:
        return {}
    if f.repeated:
        return []
    return {
        Kind.STRING: "",
        Kind.BYTES: b"",
        Kind.BOOL: False,
    }.get(f.kind, 0)


def _is_default(f: Field, value: Any) -> bool:
    if f.kind is Kind.MAP or f.repeated:
        return not value
    if f.kind is Kind.MESSAGE:
        return False
    return bool(value == _default(f))


class MessageType:
    """A message table: encodes and decodes dict messages."""

    def __init__(self, full_name: str, fields: Sequence[Field], *, wkt: str | None = None) -> None:
        self.full_name = full_name
        self.fields = tuple(sorted(fields, key=lambda f: f.number))
        self.wkt = wkt
        self.by_number = {f.number: f for f in self.fields}
        self.by_name: dict[str, Field] = {}
        for f in self.fields:
            self.by_name[f.name] = f
            self.by_name.setdefault(f.json_name, f)
        oneofs: dict[str, list[Field]] = {}
        for f in self.fields:
            if f.oneof is not None:
                oneofs.setdefault(f.oneof, []).append(f)
        self.oneofs = {k: tuple(v) for k, v in oneofs.items()}
        if len(self.by_number) != len(self.fields):
            raise TypeError(f"{full_name}: duplicate field numbers")

    def __repr__(self) -> str:
        return f"MessageType({self.full_name!r})"

    # ---- construction

    def default(self) -> Message:
        """A message with every implicit-presence field at its default."""
        return {f.name: _default(f) for f in self.fields if not f.has_presence}

    def new(self, **values: Any) -> Message:
        """`default()` updated with `values` (names checked)."""
        msg = self.default()
        for key, value in values.items():
            if key not in self.by_name or self.by_name[key].name != key:
                raise TypeError(f"{self.full_name} has no field {key!r}")
            if value is not None:
                msg[key] = value
        return msg

    # ---- binary

    def encode(self, msg: Mapping[str, Any]) -> bytes:
        out = bytearray()
        self._encode_into(msg, out)
        return bytes(out)

    def _encode_into(self, msg: Mapping[str, Any], out: bytearray) -> None:
        for f in self.fields:
            value = msg.get(f.name)
            if value is None:
                continue
            if not f.has_presence and _is_default(f, value):
                continue
            if f.kind is Kind.MAP:
                for k, v in value.items():
                    entry = bytearray()
                    if k:
                        _encode_len(1, k.encode(), entry)
                    if v:
                        _encode_len(2, v.encode(), entry)
                    _encode_len(f.number, bytes(entry), out)
            elif f.repeated:
                if f.kind in _VARINT_KINDS:
                    packed = bytearray()
                    for item in value:
                        _encode_varint(_varint_value(f, item), packed)
                    _encode_len(f.number, bytes(packed), out)
                else:
                    for item in value:
                        self._encode_single(f, item, out)
            else:
                self._encode_single(f, value, out)

    @staticmethod
    def _encode_single(f: Field, value: Any, out: bytearray) -> None:
        if f.kind in _VARINT_KINDS:
            _encode_varint(f.number << 3, out)
            _encode_varint(_varint_value(f, value), out)
        elif f.kind is Kind.STRING:
            if not isinstance(value, str):
                raise TypeError(f"field {f.name}: expected str")
            _encode_len(f.number, value.encode(), out)
        elif f.kind is Kind.BYTES:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"field {f.name}: expected bytes")
            _encode_len(f.number, bytes(value), out)
        else:
            assert f.message is not None
            inner = bytearray()
            f.message._encode_into(value, inner)
            _encode_len(f.number, bytes(inner), out)

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        msg = self.default()
        view = memoryview(bytes(data)) if not isinstance(data, bytes) else memoryview(data)
        self._decode_into(view, 0, len(view), msg, 0)
        return msg

    def _decode_into(self, data: memoryview, pos: int, end: int, msg: Message, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise DecodeError("message nesting too deep")
        while pos < end:
            tag, pos = _decode_varint(data, pos, end)
            number, wire = tag >> 3, tag & 7
            if number == 0 or number > _MAX_FIELD_NUMBER:
                raise DecodeError(f"invalid field number {number}")
            f = self.by_number.get(number)
            if wire == 0:
                raw, pos = _decode_varint(data, pos, end)
                if f is None:
                    continue
                if f.kind not in _VARINT_KINDS:
                    raise DecodeError(f"wrong wire type for {f.name}")
                value = _from_varint(f, raw)
                if f.repeated:
                    msg.setdefault(f.name, []).append(value)
                else:
                    self._set(msg, f, value)
            elif wire == 2:
                length, pos = _decode_varint(data, pos, end)
                if length > end - pos:
                    raise DecodeError("truncated length-delimited field")
                chunk_start, pos = pos, pos + length
                if f is None:
                    continue
                self._decode_len_field(f, data, chunk_start, pos, msg, depth)
            elif wire == 1:
                if end - pos < 8:
                    raise DecodeError("truncated fixed64")
                pos += 8
                if f is not None:
                    raise DecodeError(f"wrong wire type for {f.name}")
            elif wire == 5:
                if end - pos < 4:
                    raise DecodeError("truncated fixed32")
                pos += 4
                if f is not None:
                    raise DecodeError(f"wrong wire type for {f.name}")
            else:
                raise DecodeError(f"unsupported wire type {wire}")
        if pos != end:
            raise DecodeError("field overruns its message")

    def _decode_len_field(
        self, f: Field, data: memoryview, start: int, stop: int, msg: Message, depth: int
    ) -> None:
        kind = f.kind
        if kind is Kind.STRING:
            try:
                value: Any = bytes(data[start:stop]).decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError(f"invalid UTF-8 in {f.name}") from e
        elif kind is Kind.BYTES:
            value = bytes(data[start:stop])
        elif kind is Kind.MAP:
            key, val = _decode_map_entry(data, start, stop)
            msg.setdefault(f.name, {})[key] = val
            return
        elif kind is Kind.MESSAGE:
            assert f.message is not None
            if f.repeated:
                value = f.message.default()
                f.message._decode_into(data, start, stop, value, depth + 1)
            else:
                existing = msg.get(f.name)
                value = existing if isinstance(existing, dict) else f.message.default()
                f.message._decode_into(data, start, stop, value, depth + 1)
        elif f.repeated and kind in _VARINT_KINDS:
            items = msg.setdefault(f.name, [])
            pos = start
            while pos < stop:
                raw, pos = _decode_varint(data, pos, stop)
                items.append(_from_varint(f, raw))
            return
        else:
            raise DecodeError(f"wrong wire type for {f.name}")
        if f.repeated:
            msg.setdefault(f.name, []).append(value)
        else:
            self._set(msg, f, value)

    def _set(self, msg: Message, f: Field, value: Any) -> None:
        if f.oneof is not None:
            for other in self.oneofs[f.oneof]:
                if other is not f:
                    msg.pop(other.name, None)
        msg[f.name] = value

    # ---- JSON

    def to_json(self, msg: Mapping[str, Any]) -> Any:
        """The canonical proto3 JSON value of `msg` (a dict, or a str for WKTs)."""
        if self.wkt == "timestamp":
            return _format_timestamp(int(msg.get("seconds", 0)), int(msg.get("nanos", 0)))
        out: dict[str, Any] = {}
        for f in self.fields:
            value = msg.get(f.name)
            if value is None:
                continue
            if not f.has_presence and _is_default(f, value):
                continue
            if f.kind is Kind.MAP:
                out[f.json_name] = {str(k): str(v) for k, v in value.items()}
            elif f.repeated:
                out[f.json_name] = [_scalar_to_json(f, item) for item in value]
            else:
                out[f.json_name] = _scalar_to_json(f, value)
        return out

    def encode_json(self, msg: Mapping[str, Any]) -> bytes:
        return json.dumps(self.to_json(msg), separators=(",", ":"), ensure_ascii=False).encode()

    def decode_json(self, data: bytes | bytearray | memoryview | str) -> Message:
        try:
            text = data if isinstance(data, str) else bytes(data).decode("utf-8")
            obj = json.loads(text, parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise DecodeError(f"invalid JSON: {e}") from None
        return self.from_json(obj)

    def from_json(self, obj: Any, _depth: int = 0) -> Message:
        if _depth > _MAX_DEPTH:
            raise DecodeError("message nesting too deep")
        if self.wkt == "timestamp":
            if not isinstance(obj, str):
                raise DecodeError("Timestamp must be an RFC 3339 string")
            seconds, nanos = _parse_timestamp(obj)
            return {"seconds": seconds, "nanos": nanos}
        if not isinstance(obj, dict):
            raise DecodeError(f"{self.full_name}: expected a JSON object")
        msg = self.default()
        seen: set[str] = set()
        for key, value in obj.items():
            f = self.by_name.get(key)
            if f is None:
                continue
            if f.name in seen:
                raise DecodeError(f"duplicate field {f.name}")
            seen.add(f.name)
            if value is None:
                continue
            if f.kind is Kind.MAP:
                if not isinstance(value, dict):
                    raise DecodeError(f"{f.name}: expected an object")
                entries: dict[str, str] = {}
                for k, v in value.items():
                    if not isinstance(v, str):
                        raise DecodeError(f"{f.name}: map values must be strings")
                    entries[k] = v
                msg[f.name] = entries
            elif f.repeated:
                if not isinstance(value, list):
                    raise DecodeError(f"{f.name}: expected an array")
                msg[f.name] = [_scalar_from_json(f, item, _depth) for item in value]
            else:
                if f.oneof is not None and which_oneof(msg, self, f.oneof) is not None:
                    raise DecodeError(f"several members of oneof {f.oneof} set")
                msg[f.name] = _scalar_from_json(f, value, _depth)
        return msg


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _encode_len(number: int, payload: bytes, out: bytearray) -> None:
    _encode_varint((number << 3) | 2, out)
    _encode_varint(len(payload), out)
    out += payload


def _decode_map_entry(data: memoryview, pos: int, end: int) -> tuple[str, str]:
    key = value = ""
    while pos < end:
        tag, pos = _decode_varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("invalid field number 0")
        if wire == 0:
            _, pos = _decode_varint(data, pos, end)
            if number in (1, 2):
                raise DecodeError("wrong wire type in map entry")
        elif wire == 2:
            length, pos = _decode_varint(data, pos, end)
            if length > end - pos:
                raise DecodeError("truncated map entry")
            raw, pos = bytes(data[pos : pos + length]), pos + length
            if number in (1, 2):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DecodeError("invalid UTF-8 in map entry") from e
                if number == 1:
                    key = text
                else:
                    value = text
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire}")
    if pos != end:
        raise DecodeError("map entry overruns its field")
    return key, value


def _scalar_to_json(f: Field, value: Any) -> Any:
    kind = f.kind
    if kind in (Kind.INT64, Kind.UINT64):
        return str(int(value))
    if kind is Kind.BYTES:
        return base64.b64encode(bytes(value)).decode("ascii")
    if kind is Kind.ENUM:
        assert f.enum is not None
        return f.enum.by_number.get(int(value), int(value))
    if kind is Kind.MESSAGE:
        assert f.message is not None
        return f.message.to_json(value)
    if kind is Kind.BOOL:
        return bool(value)
    if kind is Kind.STRING:
        return str(value)
    return int(value)


def _scalar_from_json(f: Field, value: Any, depth: int) -> Any:
    kind = f.kind
    if kind is Kind.STRING:
        if not isinstance(value, str):
            raise DecodeError(f"{f.name}: expected a string")
        return value
    if kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise DecodeError(f"{f.name}: expected a boolean")
        return value
    if kind is Kind.BYTES:
        return _b64decode(f, value)
    if kind is Kind.ENUM:
        assert f.enum is not None
        if isinstance(value, str):
            if value in f.enum.values:
                return f.enum.values[value]
            raise DecodeError(f"{f.name}: unknown enum value {value!r}")
        return _json_int(f, value)
    if kind is Kind.MESSAGE:
        assert f.message is not None
        return f.message.from_json(value, depth + 1)
    return _json_int(f, value)


_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")


def _json_int(f: Field, value: Any) -> int:
    if isinstance(value, bool):
        raise DecodeError(f"{f.name}: expected an integer")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise DecodeError(f"{f.name}: expected an integer")
        result = int(value)
    elif isinstance(value, str):
        if not _INT_RE.fullmatch(value):
            raise DecodeError(f"{f.name}: expected an integer string")
        result = int(value)
    else:
        raise DecodeError(f"{f.name}: expected an integer")
    lo, hi = _RANGES[f.kind]
    if not lo <= result <= hi:
        raise DecodeError(f"{f.name}: {result} out of range")
    return result


def _b64decode(f: Field, value: Any) -> bytes:
    if not isinstance(value, str):
        raise DecodeError(f"{f.name}: expected a base64 string")
    text = value.strip().replace("-", "+").replace("_", "/")
    if not re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", text):
        raise DecodeError(f"{f.name}: invalid base64")
    text = text.rstrip("=")
    if len(text) % 4 == 1:
        raise DecodeError(f"{f.name}: invalid base64 length")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise DecodeError(f"{f.name}: invalid base64") from e


# ---------------------------------------------------------------- Timestamp

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_MIN_SECONDS = -62135596800  # 0001-01-01T00:00:00Z
_MAX_SECONDS = 253402300799  # 9999-12-31T23:59:59Z
_TS_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)


def _format_timestamp(seconds: int, nanos: int) -> str:
    if not _MIN_SECONDS <= seconds <= _MAX_SECONDS or not 0 <= nanos <= 999_999_999:
        raise ValueError("Timestamp out of range")
    moment = _EPOCH + _dt.timedelta(seconds=seconds)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if len(text) < 19:  # years below 1000 are not zero-padded by every libc
        text = f"{moment.year:04d}" + text[text.index("-") :]
    if nanos:
        if nanos % 1_000_000 == 0:
            text += f".{nanos // 1_000_000:03d}"
        elif nanos % 1000 == 0:
            text += f".{nanos // 1000:06d}"
        else:
            text += f".{nanos:09d}"
    return text + "Z"


def _parse_timestamp(text: str) -> tuple[int, int]:
    m = _TS_RE.fullmatch(text)
    if m is None:
        raise DecodeError(f"invalid RFC 3339 timestamp {text!r}")
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    frac = m.group(7) or ""
    try:
        moment = _dt.datetime(year, month, day, hour, minute, second, tzinfo=_dt.UTC)
    except ValueError as e:
        raise DecodeError(f"invalid timestamp {text!r}") from e
    seconds = (moment - _EPOCH) // _dt.timedelta(seconds=1)
    if m.group(9):
        offset = int(m.group(10)) * 3600 + int(m.group(11)) * 60
        if int(m.group(10)) > 23 or int(m.group(11)) > 59:
            raise DecodeError(f"invalid timestamp offset {text!r}")
        seconds -= offset if m.group(9) == "+" else -offset
    if not _MIN_SECONDS <= seconds <= _MAX_SECONDS:
        raise DecodeError(f"timestamp out of range {text!r}")
    nanos = int(frac.ljust(9, "0")) if frac else 0
    return seconds, nanos


TIMESTAMP = MessageType(
    "google.protobuf.Timestamp",
    [Field(1, "seconds", Kind.INT64), Field(2, "nanos", Kind.INT32)],
    wkt="timestamp",
)
