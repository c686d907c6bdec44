"""Fuzz bounded JSON decoding, `aenv.proto.jsonbody.loads` (sans-IO), with hostile shapes.

Inputs are documents nested from a few to 200,000 levels (arrays, objects,
mixed, unclosed, with brackets inside strings and escapes), prefixes and
garbage. The rules: `loads` returns exactly what `json.loads` returns for
anything nested at most `MAX_DEPTH` deep, and raises only `JSONBodyError`
(a ValueError: the API's 400) otherwise, never `RecursionError` or any
other exception. Runs under pytest (short: 200 examples; `AENV_FUZZ_LONG=1`:
50 000; `AENV_FUZZ_EXAMPLES=N`: N) or standalone with
`python fuzz/fuzz_jsonbody.py` (atheris if importable, else repeated
hypothesis rounds).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from _harness import FUZZ, main
from hypothesis import event, given
from hypothesis import strategies as st

from aenv.proto.jsonbody import MAX_DEPTH, JSONBodyError, loads

openers = st.sampled_from(["[", '{"k":', '[{"a":[', '{"x":"[",'])
closers = {"[": "]", '{"k":': "}", '[{"a":[': "]}]", '{"x":"[",': "}"}


@st.composite
def nested(draw: st.DrawFn) -> str:
    """A document `levels` deep, closed or cut short, with a scalar at the bottom."""
    opener = draw(openers)
    levels = draw(
        st.integers(1, 8) | st.integers(MAX_DEPTH - 2, MAX_DEPTH + 2) | st.integers(1_000, 200_000)
    )
    leaf = draw(st.sampled_from(["1", '"]]]"', "null", '"\\"["', "[]", "{}"]))
    closed = draw(st.booleans())
    tail = closers[opener] * levels if closed else ""
    return opener * levels + leaf + tail


def _check(doc: str | bytes) -> None:
    try:
        got = loads(doc)
    except JSONBodyError as e:
        assert str(e)
        event("refused")
        return
    event("decoded")
    assert got == json.loads(doc)


@FUZZ
@given(doc=nested())
def test_nested_documents(doc: str) -> None:
    _check(doc)


@FUZZ
@given(doc=nested(), cut=st.integers(0, 400))
def test_prefixes_and_garbage_after(doc: str, cut: int) -> None:
    _check(doc[: len(doc) - cut])
    _check(doc + "]}" * (cut % 5))


@FUZZ
@given(data=st.binary(max_size=200))
def test_garbage(data: bytes) -> None:
    _check(data)


TESTS: tuple[Callable[[], None], ...] = (
    test_nested_documents,
    test_prefixes_and_garbage_after,
    test_garbage,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
