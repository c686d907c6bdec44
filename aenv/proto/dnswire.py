"""Just enough of the DNS wire format (RFC 1035) to ask for A records, sans-IO.

The egress proxy checks that the address a sandbox dialled is one the node's
own resolver gives for the name the connection claims. It asks that resolver
directly (`AENV_EGRESS_DNS`) rather than through the C library so the answer,
its TTL and the server are the node's choice, and it needs only A records:
`query(name, id)` builds the question, `parse_answer(packet, id, name)` reads
the addresses and the smallest TTL of a response (following CNAMEs in the
answer section). `answer(query_packet, table)` is the other side, for a small
resolver (tests' fake internet uses it). Malformed input raises `DnsError`.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

TYPE_A: Final = 1
TYPE_CNAME: Final = 5
CLASS_IN: Final = 1
RCODE_NXDOMAIN: Final = 3


class DnsError(ValueError):
    """A DNS message that is malformed or does not answer the question asked."""


@dataclass(frozen=True)
class Answer:
    addresses: tuple[str, ...]
    ttl: int
    rcode: int


def _encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsError(f"bad label in {name!r}")
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\0")


def query(name: str, ident: int) -> bytes:
    """A recursive query for the A records of `name` with message id `ident`."""
    header = struct.pack("!HHHHHH", ident & 0xFFFF, 0x0100, 1, 0, 0, 0)
    return header + _encode_name(name) + struct.pack("!HH", TYPE_A, CLASS_IN)


def _read_name(packet: bytes, pos: int, depth: int = 0) -> tuple[str, int]:
    labels: list[str] = []
    while True:
        if pos >= len(packet):
            raise DnsError("name runs past the message")
        n = packet[pos]
        if n & 0xC0 == 0xC0:
            if pos + 1 >= len(packet) or depth > 16:
                raise DnsError("bad compression pointer")
            target = ((n & 0x3F) << 8) | packet[pos + 1]
            rest, _ = _read_name(packet, target, depth + 1)
            labels.append(rest)
            return ".".join(x for x in labels if x), pos + 2
        if n & 0xC0:
            raise DnsError("unknown label type")
        pos += 1
        if n == 0:
            return ".".join(labels), pos
        if pos + n > len(packet):
            raise DnsError("label runs past the message")
        labels.append(packet[pos : pos + n].decode("ascii", "replace").lower())
        pos += n


def _header(packet: bytes) -> tuple[int, int, int, int]:
    if len(packet) < 12:
        raise DnsError("message shorter than its header")
    ident, flags, qd, an, _, _ = struct.unpack("!HHHHHH", packet[:12])
    return ident, flags, qd, an


def parse_answer(packet: bytes, ident: int, name: str) -> Answer:
    """The A records for `name` in the response `packet` to query `ident`."""
    got, flags, qd, an = _header(packet)
    if got != ident or not flags & 0x8000:
        raise DnsError("not the response to this query")
    pos = 12
    for _ in range(qd):
        _, pos = _read_name(packet, pos)
        pos += 4
    wanted = {name.rstrip(".").lower()}
    addresses: list[str] = []
    ttl = 2**31 - 1
    for _ in range(an):
        owner, pos = _read_name(packet, pos)
        if pos + 10 > len(packet):
            raise DnsError("record runs past the message")
        rtype, rclass, rttl, rdlen = struct.unpack("!HHIH", packet[pos : pos + 10])
        pos += 10
        rdata_at = pos
        pos += rdlen
        if pos > len(packet):
            raise DnsError("record data runs past the message")
        if rclass != CLASS_IN or owner not in wanted:
            continue
        if rtype == TYPE_CNAME:
            target, _ = _read_name(packet, rdata_at)
            wanted.add(target)
            ttl = min(ttl, rttl)
        elif rtype == TYPE_A and rdlen == 4:
            addresses.append(str(ipaddress.IPv4Address(packet[rdata_at:pos])))
            ttl = min(ttl, rttl)
    return Answer(tuple(dict.fromkeys(addresses)), ttl if addresses else 0, flags & 0xF)


def answer(packet: bytes, table: Mapping[str, Sequence[str]], *, ttl: int = 60) -> bytes:
    """The response to query `packet` from the name -> IPv4 addresses `table`
    (NXDOMAIN for a name it lacks; no records for other types)."""
    ident, flags, qd, _ = _header(packet)
    if qd != 1:
        raise DnsError("expected one question")
    name, end = _read_name(packet, 12)
    if end + 4 > len(packet):
        raise DnsError("question runs past the message")
    qtype, _ = struct.unpack("!HH", packet[end : end + 4])
    question = packet[12 : end + 4]
    addrs = table.get(name.lower())
    rcode = 0 if addrs is not None else RCODE_NXDOMAIN
    records = b""
    count = 0
    if addrs is not None and qtype == TYPE_A:
        for a in addrs:
            records += b"\xc0\x0c" + struct.pack("!HHIH", TYPE_A, CLASS_IN, ttl, 4)
            records += ipaddress.IPv4Address(a).packed
            count += 1
    header = struct.pack("!HHHHHH", ident, 0x8180 | (flags & 0x0100) | rcode, 1, count, 0, 0)
    return header + question + records
