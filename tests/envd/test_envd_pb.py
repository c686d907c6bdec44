"""pb codec: round trips, agreement with the SDK's protobuf runtime, garbage.

Rules: pure, no IO. The SDK's generated classes (e2b.envd.*_pb, on the
`protobuf` runtime) are the reference for wire bytes and canonical JSON.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from typing import Any

import pytest
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pb_strategies import message_strategy

from aenv.proto import envd_schema as schema
from aenv.proto.pb import TIMESTAMP, DecodeError, MessageType

SCHEMA_TYPES = [m for m in schema.ALL_MESSAGES if m.wkt is None]


def _sdk_classes() -> dict[str, Any]:
    found: dict[str, Any] = {}

    def walk(obj: Any) -> None:
        for _, cls in inspect.getmembers(obj, inspect.isclass):
            if cls.__module__ not in (process_pb.__name__, filesystem_pb.__name__):
                continue
            desc = getattr(cls, "desc", None)
            try:
                name = desc().type_name if desc else None
            except Exception:
                name = None
            if name and name not in found and hasattr(cls, "to_binary"):
                found[name] = cls
                walk(cls)

    walk(process_pb)
    walk(filesystem_pb)
    return found


SDK = _sdk_classes()


def test_schema_covers_every_sdk_message() -> None:
    ours = {m.full_name for m in SCHEMA_TYPES}
    assert ours == set(SDK)


def test_field_numbers_match_sdk_descriptors() -> None:
    for mtype in SCHEMA_TYPES:
        desc = SDK[mtype.full_name].desc()
        theirs = {f.number: (f.name, f.json_name) for f in desc.fields}
        ours = {f.number: (f.name, f.json_name) for f in mtype.fields}
        assert ours == theirs, mtype.full_name


_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("mtype", SCHEMA_TYPES, ids=lambda m: m.full_name)
@_SETTINGS
@given(data=st.data())
def test_roundtrip_and_sdk_agreement(mtype: MessageType, data: st.DataObject) -> None:
    msg = data.draw(message_strategy(mtype))
    wire = mtype.encode(msg)
    assert mtype.decode(wire) == msg
    assert mtype.decode_json(mtype.encode_json(msg)) == msg
    cls = SDK[mtype.full_name]
    theirs = cls.from_binary(wire)
    assert mtype.decode(theirs.to_binary()) == msg
    assert json.loads(theirs.to_json()) == mtype.to_json(msg)
    assert mtype.decode_json(theirs.to_json()) == msg
    assert cls.from_json(mtype.encode_json(msg)).to_binary() == theirs.to_binary()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(SCHEMA_TYPES))
def test_binary_garbage_raises_only_decode_error(data: bytes, mtype: MessageType) -> None:
    with contextlib.suppress(DecodeError):
        mtype.decode(data)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.sampled_from(SCHEMA_TYPES))
def test_json_garbage_raises_only_decode_error(value: Any, mtype: MessageType) -> None:
    with contextlib.suppress(DecodeError):
        mtype.from_json(value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100))
def test_json_text_garbage(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        schema.START_REQUEST.decode_json(data)


def test_json_accepts_original_names_numbers_and_strings() -> None:
    msg = schema.END_EVENT.decode_json(b'{"exit_code": "3", "exited": true, "error": "x"}')
    assert msg == {"exit_code": 3, "exited": True, "status": "", "error": "x"}
    sig = schema.SEND_SIGNAL_REQUEST.decode_json(b'{"signal": 9, "process": {"pid": 5}}')
    assert sig["signal"] == 9 and sig["process"] == {"pid": 5}
    sig = schema.SEND_SIGNAL_REQUEST.decode_json(b'{"signal": "SIGNAL_SIGTERM", "unknown": 1}')
    assert sig["signal"] == 15
    data = schema.DATA_EVENT.decode_json(b'{"stdout": "aGk"}')  # unpadded base64
    assert data == {"stdout": b"hi"}
    with pytest.raises(DecodeError):
        schema.DATA_EVENT.decode_json(b'{"stdout": "aGk", "stderr": "aGk"}')  # two oneof members
    with pytest.raises(DecodeError):
        schema.PTY_SIZE.decode_json(b'{"cols": -1}')
    with pytest.raises(DecodeError):
        schema.SEND_SIGNAL_REQUEST.decode_json(b'{"signal": "SIGFOO"}')


def test_int64_as_string_and_timestamps() -> None:
    entry = {"size": 2**40, "modified_time": {"seconds": 1, "nanos": 5_000_000}}
    out = schema.ENTRY_INFO.to_json(entry)
    assert out["size"] == str(2**40)
    assert out["modifiedTime"] == "1970-01-01T00:00:01.005Z"
    assert TIMESTAMP.from_json("1970-01-01T01:00:00+01:00") == {"seconds": 0, "nanos": 0}
    assert TIMESTAMP.from_json("2024-02-29T12:00:00.123456789Z")["nanos"] == 123456789
    for bad in ("2024-02-30T00:00:00Z", "0000-01-01T00:00:00Z", "2024-01-01 00:00:00Z", 5):
        with pytest.raises(DecodeError):
            TIMESTAMP.from_json(bad)


def test_unknown_fields_skipped() -> None:
    wire = schema.PTY_SIZE.encode({"cols": 80, "rows": 24})
    extra = bytes([0x18, 0x05, 0x22, 0x01, 0x41, 0x2D, 1, 2, 3, 4, 0x29] + [0] * 8)
    assert schema.PTY_SIZE.decode(wire + extra) == {"cols": 80, "rows": 24}
