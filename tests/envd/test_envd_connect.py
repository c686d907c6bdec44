"""Connect core: envelopes under any chunking, end-stream/error bodies, tables.

Rules: pure, no IO.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.proto import connect
from aenv.proto.connect import Code, Codec, ConnectError, EnvelopeDecoder
from aenv.proto.pb import DecodeError

_payloads = st.lists(st.tuples(st.binary(max_size=300), st.booleans()), max_size=8)


def _chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@settings(max_examples=300, deadline=None)
@given(_payloads, st.lists(st.integers(0, 10_000), max_size=20))
def test_any_chunking_yields_the_same_messages(
    payloads: list[tuple[bytes, bool]], cuts: list[int]
) -> None:
    stream = b"".join(connect.encode_envelope(p, end_stream=e) for p, e in payloads)
    envelopes = connect.decode_envelopes(_chunked(stream, cuts))
    assert [(e.data, e.end_stream) for e in envelopes] == payloads


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.integers(0, 300), max_size=6))
def test_garbage_raises_only_decode_error(data: bytes, cuts: list[int]) -> None:
    decoder = EnvelopeDecoder(max_message_size=64)
    try:
        for chunk in _chunked(data, cuts):
            decoder.feed(chunk)
        decoder.close()
    except DecodeError:
        pass


def test_limits_and_flags() -> None:
    decoder = EnvelopeDecoder(max_message_size=4)
    with pytest.raises(DecodeError):
        decoder.feed(connect.encode_envelope(b"12345"))
    with pytest.raises(DecodeError):
        EnvelopeDecoder().feed(b"\x80\x00\x00\x00\x00")
    decoder = EnvelopeDecoder()
    assert decoder.feed(b"\x00\x00\x00") == []
    with pytest.raises(DecodeError):
        decoder.close()
    env = EnvelopeDecoder().feed(connect.encode_envelope(b"x", compressed=True))[0]
    assert env.compressed and not env.end_stream


def test_end_stream_and_error_bodies() -> None:
    assert connect.parse_end_stream(connect.end_stream_body()) == (None, {})
    err = ConnectError(Code.NOT_FOUND, "no such process", {"x-a": ["1"]})
    parsed, meta = connect.parse_end_stream(connect.end_stream_body(err, {"x-b": ["2"]}))
    assert parsed is not None and parsed.code is Code.NOT_FOUND
    assert parsed.message == "no such process"
    assert meta == {"x-a": ["1"], "x-b": ["2"]}
    body = connect.error_body(ConnectError(Code.ALREADY_EXISTS, "exists"))
    assert connect.parse_error_body(body).code is Code.ALREADY_EXISTS
    assert connect.parse_error_body(b'{"code": "bogus"}').code is Code.UNKNOWN
    for bad in (b"", b"[]", b"{", b'{"error": 1}', b'{"metadata": {"a": "b"}}'):
        with pytest.raises(DecodeError):
            connect.parse_end_stream(bad)


def test_codes_and_statuses() -> None:
    assert Code.NOT_FOUND.http_status == 404
    assert Code.UNAUTHENTICATED.http_status == 401
    assert Code.DEADLINE_EXCEEDED.http_status == 504
    assert Code.ALREADY_EXISTS.http_status == 409
    assert Code.CANCELED.http_status == 499
    assert connect.code_from_http_status(503) is Code.UNAVAILABLE
    assert connect.code_from_http_status(418) is Code.UNKNOWN
    assert len({c.value for c in Code}) == 16


def test_negotiation_and_timeouts() -> None:
    assert connect.negotiate("application/json; charset=utf-8", streaming=False) is Codec.JSON
    assert connect.negotiate("application/proto", streaming=False) is Codec.PROTO
    assert connect.negotiate("application/connect+json", streaming=True) is Codec.JSON
    assert connect.negotiate("Application/Connect+Proto", streaming=True) is Codec.PROTO
    assert connect.negotiate("application/json", streaming=True) is None
    assert connect.negotiate("application/grpc", streaming=False) is None
    assert connect.negotiate(None, streaming=False) is None
    assert connect.parse_timeout_ms(None) is None
    assert connect.parse_timeout_ms("1500") == 1.5
    for bad in ("", "-1", "1.5", "12345678901", "abc"):
        with pytest.raises(DecodeError):
            connect.parse_timeout_ms(bad)
