"""Fuzz target: Connect envelope decoding and the envd pb/JSON decoders.

Feeds arbitrary bytes (in arbitrary chunks) to `EnvelopeDecoder` and every
envelope payload to every envd message type, binary and JSON, asserting that
malformed input only ever raises `DecodeError` and that whatever decodes
re-encodes to something that decodes to the same message. Runs briefly as a
pytest test; set `AENV_FUZZ_EXAMPLES` (e.g. 200000) for a long run:

    AENV_FUZZ_EXAMPLES=200000 .venv/bin/python -m pytest fuzz/fuzz_connect.py
"""

from __future__ import annotations

import contextlib

from _harness import FUZZ
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto import connect
from aenv.proto.envd_schema import ALL_MESSAGES
from aenv.proto.pb import DecodeError, MessageType

TYPES = [m for m in ALL_MESSAGES if m.wkt is None]


def _check_message(mtype: MessageType, payload: bytes) -> None:
    try:
        msg = mtype.decode(payload)
    except DecodeError:
        pass
    else:
        assert mtype.decode(mtype.encode(msg)) == msg
        assert mtype.decode_json(mtype.encode_json(msg)) == msg
    try:
        msg = mtype.decode_json(payload)
    except DecodeError:
        pass
    else:
        assert mtype.decode_json(mtype.encode_json(msg)) == msg


def _envelope_stream() -> st.SearchStrategy[bytes]:
    framed = st.lists(
        st.tuples(st.integers(0, 3), st.binary(max_size=64)).map(
            lambda t: bytes([t[0]]) + len(t[1]).to_bytes(4, "big") + t[1]
        ),
        max_size=5,
    ).map(b"".join)
    return st.one_of(st.binary(max_size=256), framed)


@FUZZ
@given(_envelope_stream(), st.lists(st.integers(1, 64), max_size=16), st.sampled_from(TYPES))
def test_fuzz_envelopes_and_messages(data: bytes, sizes: list[int], mtype: MessageType) -> None:
    decoder = connect.EnvelopeDecoder(max_message_size=1024)
    pos = 0
    envelopes = []
    try:
        for size in [*sizes, len(data)]:
            envelopes.extend(decoder.feed(data[pos : pos + size]))
            pos += size
        decoder.close()
    except DecodeError:
        pass
    for env in envelopes:
        if env.end_stream:
            with contextlib.suppress(DecodeError):
                connect.parse_end_stream(env.data)
        else:
            _check_message(mtype, env.data)


@FUZZ
@given(st.binary(max_size=512), st.sampled_from(TYPES))
def test_fuzz_raw_messages(data: bytes, mtype: MessageType) -> None:
    _check_message(mtype, data)
