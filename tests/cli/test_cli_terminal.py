"""The detach-key scanner: any chunking of the keyboard stream gives the same result."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aenv.client.terminal import DetachFilter


def run(chunks: list[bytes]) -> tuple[bytes, bool]:
    f = DetachFilter()
    out = b""
    for c in chunks:
        data, leave = f.feed(c)
        out += data
        if leave:
            return out, True
    return out, False


def test_detach_sequence() -> None:
    assert run([b"ls\r\x1dd rest"]) == (b"ls\r", True)
    assert run([b"ab\x1d", b"d"]) == (b"ab", True)


def test_escape_twice_sends_one() -> None:
    assert run([b"\x1d\x1dd"]) == (b"\x1dd", False)


def test_escape_then_other_key_sends_both() -> None:
    assert run([b"\x1dx", b"\x1d", b"\x03"]) == (b"\x1dx\x1d\x03", False)


def test_plain_bytes_pass_through() -> None:
    assert run([b"echo hi\r\x03\x04"]) == (b"echo hi\r\x03\x04", False)


keys = st.binary(max_size=64).map(lambda b: bytes(x if x % 7 else 0x1D for x in b))


@given(keys, st.lists(st.integers(min_value=0, max_value=64), max_size=8))
def test_chunking_does_not_matter(data: bytes, cuts: list[int]) -> None:
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert run(chunks) == run([data])
