"""Connect protocol core (sans-IO): envelopes, errors, codecs, timeouts.

Implements the pieces of the Connect protocol (connectrpc.com/docs/protocol)
that an HTTP shell needs to serve or call Connect RPCs: the 5-byte envelope
(flags, big-endian length) with an incremental decoder that yields the same
messages however the byte stream is chunked, the JSON end-of-stream message,
unary error bodies, the error-code/HTTP-status tables, content-type
negotiation and `Connect-Timeout-Ms` parsing. Malformed input raises
`pb.DecodeError`.
"""

from __future__ import annotations

import enum
import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aenv.proto.pb import DecodeError

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "FLAG_COMPRESSED",
    "FLAG_END_STREAM",
    "Code",
    "Codec",
    "ConnectError",
    "Envelope",
    "EnvelopeDecoder",
    "code_from_http_status",
    "encode_envelope",
    "end_stream_body",
    "error_body",
    "negotiate",
    "parse_end_stream",
    "parse_error_body",
    "parse_timeout_ms",
]

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_KNOWN_FLAGS = FLAG_COMPRESSED | FLAG_END_STREAM
DEFAULT_MAX_MESSAGE_SIZE = 16 * 1024 * 1024
_HEADER = struct.Struct(">BI")


class Code(enum.Enum):
    """Connect error codes (their wire names are the values)."""

    CANCELED = "canceled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"

    @property
    def http_status(self) -> int:
        return _CODE_TO_HTTP[self]


_CODE_TO_HTTP: dict[Code, int] = {
    Code.CANCELED: 499,
    Code.UNKNOWN: 500,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409,
    Code.OUT_OF_RANGE: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DATA_LOSS: 500,
    Code.UNAUTHENTICATED: 401,
}

_HTTP_TO_CODE: dict[int, Code] = {
    400: Code.INTERNAL,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.UNIMPLEMENTED,
    429: Code.UNAVAILABLE,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
    504: Code.UNAVAILABLE,
}


def code_from_http_status(status: int) -> Code:
    """The code a Connect client infers from a non-Connect HTTP error status."""
    return _HTTP_TO_CODE.get(status, Code.UNKNOWN)


@dataclass(eq=False)
class ConnectError(Exception):
    """An RPC error: a code, a message and optional metadata (trailers)."""

    code: Code
    message: str = ""
    metadata: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(f"{self.code.value}: {self.message}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code.value}
        if self.message:
            out["message"] = self.message
        return out


# ----------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class Envelope:
    flags: int
    data: bytes

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_COMPRESSED)


def encode_envelope(data: bytes, *, end_stream: bool = False, compressed: bool = False) -> bytes:
    flags = (FLAG_END_STREAM if end_stream else 0) | (FLAG_COMPRESSED if compressed else 0)
    return _HEADER.pack(flags, len(data)) + data


class EnvelopeDecoder:
    """Incremental envelope parser: `feed` bytes, take `Envelope`s out.

    Raises `DecodeError` for unknown flag bits, messages above
    `max_message_size`, or (from `close`) a stream that ends mid-envelope.
    """

    def __init__(self, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self.max_message_size = max_message_size
        self._buf = bytearray()
        self._pending: tuple[int, int] | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Envelope]:
        """Add bytes; return every envelope completed by them, in order."""
        self._buf += data
        out: list[Envelope] = []
        while True:
            if self._pending is None:
                if len(self._buf) < _HEADER.size:
                    return out
                flags, length = _HEADER.unpack_from(self._buf)
                if flags & ~_KNOWN_FLAGS:
                    raise DecodeError(f"unknown envelope flags 0x{flags:02x}")
                if length > self.max_message_size:
                    raise DecodeError(
                        f"message of {length} bytes exceeds the limit of {self.max_message_size}"
                    )
                del self._buf[: _HEADER.size]
                self._pending = (flags, length)
            flags, length = self._pending
            if len(self._buf) < length:
                return out
            out.append(Envelope(flags, bytes(self._buf[:length])))
            del self._buf[:length]
            self._pending = None

    @property
    def buffered(self) -> int:
        return len(self._buf) + (_HEADER.size if self._pending else 0)

    def close(self) -> None:
        """Declare end of input; raises if an envelope is incomplete."""
        if self._buf or self._pending is not None:
            raise DecodeError("stream ended inside an envelope")


def decode_envelopes(
    chunks: Iterable[bytes], *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
) -> list[Envelope]:
    """All envelopes of a complete stream given as chunks."""
    decoder = EnvelopeDecoder(max_message_size=max_message_size)
    out: list[Envelope] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    decoder.close()
    return out


# ----------------------------------------------------- end stream and errors


def end_stream_body(
    error: ConnectError | None = None, metadata: Mapping[str, Iterable[str]] | None = None
) -> bytes:
    """The JSON payload of an end-of-stream envelope."""
    obj: dict[str, Any] = {}
    if error is not None:
        obj["error"] = error.to_json()
        if error.metadata:
            obj["metadata"] = {k: list(v) for k, v in error.metadata.items()}
    if metadata:
        obj.setdefault("metadata", {}).update({k: list(v) for k, v in metadata.items()})
    return json.dumps(obj, separators=(",", ":")).encode()


def _parse_json_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DecodeError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DecodeError("expected a JSON object")
    return obj


def _parse_error(obj: Any) -> ConnectError:
    if not isinstance(obj, dict):
        raise DecodeError("error must be an object")
    raw_code = obj.get("code")
    try:
        code = Code(raw_code) if isinstance(raw_code, str) else Code.UNKNOWN
    except ValueError:
        code = Code.UNKNOWN
    message = obj.get("message", "")
    if not isinstance(message, str):
        raise DecodeError("error message must be a string")
    return ConnectError(code, message)


def _parse_metadata(obj: Any) -> dict[str, list[str]]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise DecodeError("metadata must be an object")
    out: dict[str, list[str]] = {}
    for k, v in obj.items():
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise DecodeError("metadata values must be arrays of strings")
        out[k] = list(v)
    return out


def parse_end_stream(data: bytes) -> tuple[ConnectError | None, dict[str, list[str]]]:
    """Parse an end-of-stream payload into (error or None, metadata)."""
    obj = _parse_json_object(data)
    metadata = _parse_metadata(obj.get("metadata"))
    err = obj.get("error")
    if err is None:
        return None, metadata
    error = _parse_error(err)
    error.metadata = dict(metadata)
    return error, metadata


def error_body(error: ConnectError) -> bytes:
    """The JSON body of a unary error response."""
    return json.dumps(error.to_json(), separators=(",", ":")).encode()


def parse_error_body(data: bytes) -> ConnectError:
    return _parse_error(_parse_json_object(data))


# ------------------------------------------------------- content negotiation


class Codec(enum.Enum):
    PROTO = "proto"
    JSON = "json"


_UNARY_TYPES = {"application/proto": Codec.PROTO, "application/json": Codec.JSON}
_STREAM_TYPES = {
    "application/connect+proto": Codec.PROTO,
    "application/connect+json": Codec.JSON,
}


def negotiate(content_type: str | None, *, streaming: bool) -> Codec | None:
    """The codec for a request's Content-Type, or None if unsupported."""
    if not content_type:
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    return (_STREAM_TYPES if streaming else _UNARY_TYPES).get(media)


def content_type(codec: Codec, *, streaming: bool) -> str:
    if streaming:
        return f"application/connect+{codec.value}"
    return f"application/{codec.value}"


_TIMEOUT_RE = re.compile(r"[0-9]{1,10}")


def parse_timeout_ms(value: str | None) -> float | None:
    """`Connect-Timeout-Ms` in seconds; None when absent. Raises DecodeError."""
    if value is None:
        return None
    value = value.strip()
    if not _TIMEOUT_RE.fullmatch(value):
        raise DecodeError(f"invalid Connect-Timeout-Ms {value!r}")
    return int(value) / 1000.0
