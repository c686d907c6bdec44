"""Bounded JSON decoding of request bodies (`aenv.proto.jsonbody`)."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.jsonbody import MAX_DEPTH, JSONBodyError, depth, loads

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\', max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=20,
)


def test_deep_nesting_is_a_value_error_not_a_recursion_error() -> None:
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        with pytest.raises(JSONBodyError, match="nested deeper"):
            loads(opener * 100_000 + closer * 100_000)


def test_unclosed_deep_nesting_is_refused_too() -> None:
    with pytest.raises(JSONBodyError):
        loads(b"[" * 100_000)


def test_brackets_inside_strings_do_not_count() -> None:
    body = json.dumps({"cmd": "[" * 1000 + '\\"{' * 100})
    assert loads(body) == json.loads(body)
    assert depth(body.encode()) == 1


def test_the_limit_itself_is_accepted() -> None:
    doc = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert depth(doc.encode()) == MAX_DEPTH
    assert loads(doc) == json.loads(doc)
    with pytest.raises(JSONBodyError):
        loads("[" + doc + "]")


@given(json_values)
def test_agrees_with_json_loads(value: object) -> None:
    text = json.dumps(value)
    assert loads(text) == json.loads(text)


@given(st.binary(max_size=64))
def test_garbage_raises_only_jsonbodyerror(data: bytes) -> None:
    with contextlib.suppress(JSONBodyError):
        loads(data)
