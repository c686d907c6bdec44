"""Fuzz the egress proxy's name sniffer and host-rule matcher (sans-IO).

`aenv.proto.sniff.sniff` reads the host name a TLS ClientHello or HTTP/1.x
request names; `aenv.proto.netpolicy` matches names against allowOut/denyOut
patterns. Inputs are real ClientHellos (made by Python's `ssl` for random
names), HTTP request heads with random Host headers, both mangled (bytes
flipped, truncated, extended), and arbitrary bytes. The rules: `sniff` returns
`Need`, `Found` or `NoName` and raises nothing; a proper prefix of a valid
ClientHello or request head is `Need` or names nothing wrong (never another
name); the whole one yields exactly its name; any chunking gives the same
answer once everything has arrived; a `Found` name is always lowercase and
valid. `host_matches` agrees with a reference model of E2B's rule (exact
names, `*.suffix` for names strictly below the suffix). Runs under pytest
(short) or standalone (`python fuzz/fuzz_sniff.py`).
"""

from __future__ import annotations

import contextlib
import ssl
import sys
from collections.abc import Callable

from _harness import FUZZ, main
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.netpolicy import host_matches, host_pattern
from aenv.proto.sniff import Found, Need, NoName, normalise_name, sniff

labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
names = (
    st.lists(labels, min_size=1, max_size=4)
    .map(".".join)
    .filter(lambda n: normalise_name(n) is not None)
)


def client_hello(name: str) -> bytes:
    """The first flight a real TLS client sends for `name`."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def http_head(name: str, *, port: int | None = None, extra: str = "") -> bytes:
    host = name if port is None else f"{name}:{port}"
    return f"GET / HTTP/1.1\r\nHost: {host}\r\n{extra}Accept: */*\r\n\r\n".encode()


@FUZZ
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes(data: bytes) -> None:
    result = sniff(data)
    assert isinstance(result, Need | Found | NoName)
    if isinstance(result, Found):
        assert normalise_name(result.name) == result.name


@FUZZ
@given(name=names, cut=st.integers(0, 4000), http=st.booleans())
def test_prefixes_never_name_another_host(name: str, cut: int, http: bool) -> None:
    whole = http_head(name) if http else client_hello(name)
    assert sniff(whole) == Found(name, "http" if http else "tls")
    part = sniff(whole[: min(cut, len(whole) - 1)])
    assert isinstance(part, Need) or (isinstance(part, Found) and part.name == name)


@FUZZ
@given(name=names, flips=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=4))
def test_mangled_hello(name: str, flips: list[tuple[int, int]]) -> None:
    data = bytearray(client_hello(name))
    for at, value in flips:
        if at < len(data):
            data[at] = value
    result = sniff(bytes(data))
    assert isinstance(result, Need | Found | NoName)
    if isinstance(result, Found):
        assert normalise_name(result.name) == result.name


@FUZZ
@given(name=names, port=st.none() | st.integers(1, 65535), data=st.data())
def test_chunking_does_not_matter(name: str, port: int | None, data: st.DataObject) -> None:
    whole = http_head(name, port=port) if data.draw(st.booleans()) else client_hello(name)
    buf = b""
    result = sniff(buf)
    while len(buf) < len(whole):
        buf += whole[len(buf) : len(buf) + data.draw(st.integers(1, 300))]
        result = sniff(buf)
        if not isinstance(result, Need):
            break
    assert isinstance(result, Found) and result.name == name


def reference_match(name: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        suffix = pattern[2:]
        return name.endswith("." + suffix)
    return name == pattern


@FUZZ
@given(name=names, base=names, wildcard=st.booleans(), prefix=st.sampled_from(["", "x.", "a.b."]))
def test_host_matching(name: str, base: str, wildcard: bool, prefix: str) -> None:
    pattern = host_pattern(("*." if wildcard else "") + base)
    if pattern is None:
        return
    for candidate in (name, prefix + base, base):
        assert host_matches(candidate, [pattern]) == reference_match(candidate, pattern)


TESTS: tuple[Callable[[], None], ...] = (
    test_arbitrary_bytes,
    test_prefixes_never_name_another_host,
    test_mangled_hello,
    test_chunking_does_not_matter,
    test_host_matching,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
