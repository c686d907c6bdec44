"""Fuzz the SOCKS5 client core (`aenv.proto.socks5`): reply parser and handshake.

A proxy's answers are arbitrary bytes, valid replies (every address type,
every reply code, random bound addresses) and valid replies mangled
(truncated, a byte flipped, extended). The rules: `parse_reply` and
`Handshake.receive_data` raise nothing but `Socks5Error`; a valid success
reply parses to its own bound address and length, and any proper prefix of it
asks for more; a reply code other than 0 is always an error; any chunking of
the proxy's answer gives the same outcome (sent bytes, bound address,
leftover, or the error) as one piece. Runs under pytest (short) or standalone
(`python fuzz/fuzz_socks5.py`).
"""

from __future__ import annotations

import ipaddress
import itertools
import sys

from _harness import FUZZ, main
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.socks5 import Handshake, Socks5Error, parse_reply

ipv4 = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
ipv6 = st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n)))
domain = st.binary(min_size=0, max_size=255).map(lambda b: b.decode("latin-1"))
ports = st.integers(0, 65535)


def encode_reply(rep: int, host: str, port: int, atyp: int) -> bytes:
    if atyp == 1:
        addr = bytes([1]) + ipaddress.IPv4Address(host).packed
    elif atyp == 4:
        addr = bytes([4]) + ipaddress.IPv6Address(host).packed
    else:
        raw = host.encode("latin-1")
        addr = bytes([3, len(raw)]) + raw
    return bytes([5, rep, 0]) + addr + port.to_bytes(2, "big")


replies = st.one_of(
    st.tuples(ipv4, ports).map(lambda t: (t, encode_reply(0, t[0], t[1], 1))),
    st.tuples(ipv6, ports).map(lambda t: (t, encode_reply(0, t[0], t[1], 4))),
    st.tuples(domain, ports).map(lambda t: (t, encode_reply(0, t[0], t[1], 3))),
)


def outcome(answer: bytes, cuts: list[int]) -> tuple[object, ...]:
    """What a handshake with credentials does with `answer`, fed in pieces at `cuts`."""
    shake = Handshake("a.test", 443, username="u", password="p")
    sent = [shake.initial()]
    edges = [0, *sorted(c for c in set(cuts) if 0 < c < len(answer)), len(answer)]
    try:
        for a, b in itertools.pairwise(edges):
            out = shake.receive_data(answer[a:b])
            if out:
                sent.append(out)
    except Socks5Error as exc:
        return ("error", str(exc))
    return (b"".join(sent), shake.done, shake.bound, shake.leftover)


@FUZZ
@given(data=st.binary(max_size=600))
def test_arbitrary_replies(data: bytes) -> None:
    try:
        parsed = parse_reply(data)
    except Socks5Error:
        return
    if parsed is not None:
        _bound, used = parsed
        assert 10 <= used <= len(data)


@FUZZ
@given(reply=replies, extra=st.binary(max_size=16))
def test_valid_replies_parse_and_prefixes_need_more(
    reply: tuple[tuple[str, int], bytes], extra: bytes
) -> None:
    bound, raw = reply
    assert parse_reply(raw + extra) == (bound, len(raw))
    for i in range(len(raw)):
        assert parse_reply(raw[:i]) is None


@FUZZ
@given(reply=replies, rep=st.integers(1, 255))
def test_failure_codes_always_fail(reply: tuple[tuple[str, int], bytes], rep: int) -> None:
    raw = bytearray(reply[1])
    raw[1] = rep
    for i in range(2, len(raw) + 1):
        try:
            parse_reply(bytes(raw[:i]))
        except Socks5Error:
            continue
        raise AssertionError("a failure reply code was not an error")


@FUZZ
@given(
    reply=replies,
    method=st.sampled_from([b"\x05\x00", b"\x05\x02\x01\x00", b"\x05\x02\x01\x01"]),
    mangle=st.one_of(
        st.none(),
        st.tuples(st.integers(0, 400), st.integers(0, 255)),
        st.integers(0, 400),
    ),
    tail=st.binary(max_size=32),
    cuts=st.lists(st.integers(0, 500), max_size=12),
)
def test_any_chunking_same_outcome(
    reply: tuple[tuple[str, int], bytes],
    method: bytes,
    mangle: tuple[int, int] | int | None,
    tail: bytes,
    cuts: list[int],
) -> None:
    answer = bytearray(method + reply[1] + tail)
    if isinstance(mangle, tuple):
        answer[mangle[0] % len(answer)] = mangle[1]
    elif isinstance(mangle, int):
        del answer[mangle % len(answer) :]
    whole = outcome(bytes(answer), [])
    assert outcome(bytes(answer), cuts) == whole
    if mangle is None and method != b"\x05\x02\x01\x01":
        assert whole[1] is True and whole[2] == reply[0] and whole[3] == tail


if __name__ == "__main__":
    sys.exit(
        main(
            [
                test_arbitrary_replies,
                test_valid_replies_parse_and_prefixes_need_more,
                test_failure_codes_always_fail,
                test_any_chunking_same_outcome,
            ],
            __doc__ or "",
        )
    )
