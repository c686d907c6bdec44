"""The host name an outbound connection names in its first bytes, sans-IO.

The egress proxy must decide, before it dials anything, which host a
sandbox's TCP connection is for: the server name of a TLS ClientHello
(RFC 6066 `server_name`) or the `Host` header of an HTTP/1.x request. The
client speaks first in both, so the proxy buffers what arrives and asks
`sniff(buffer)` after each read:

- `Need()`: not enough bytes yet to tell (read more, up to `MAX_SNIFF`);
- `Found(name, proto)`: the name, lowercased, without a trailing dot or port;
- `NoName(proto, why)`: the bytes are TLS or HTTP without a usable name, or
  another protocol ("other"); the proxy then decides by address alone.

The buffer is never consumed: the proxy forwards it unchanged upstream (for
pass-through) or, later, hands it to a TLS terminator (interception), so the
parser never needs to produce bytes. Garbage yields `NoName`, never an
exception other than the ones documented (none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

# a ClientHello larger than this (post-quantum key shares reach ~2 KiB; many
# extensions ~8 KiB) or an HTTP head that long is not sniffed further
MAX_SNIFF: Final = 16 * 1024

Proto = Literal["tls", "http", "other"]

_NAME_RE: Final = re.compile(
    r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$"
)
_METHOD_RE: Final = re.compile(rb"^[A-Z]{1,16} ")
_HTTP_PREFIXES: Final = (
    b"GET ",
    b"POST ",
    b"PUT ",
    b"HEAD ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
    b"CONNECT ",
    b"TRACE ",
)


@dataclass(frozen=True)
class Need:
    """More bytes are needed to tell."""


@dataclass(frozen=True)
class Found:
    name: str
    proto: Proto


@dataclass(frozen=True)
class NoName:
    proto: Proto
    why: str


Result = Need | Found | NoName


def normalise_name(raw: str) -> str | None:
    """`raw` as a host name to match rules against (lowercase, no trailing dot), or None.

    An IP literal is not a name (None): rules for names never match it.
    """
    name = raw.strip().lower().rstrip(".")
    if not _NAME_RE.match(name):
        return None
    if name.replace(".", "").isdigit():
        return None
    return name


def sniff(data: bytes) -> Result:
    """What the first bytes of a client's connection name, so far (see module doc)."""
    if not data:
        return Need()
    if data[0] == 0x16:
        return _sniff_tls(data)
    return _sniff_http(data)


# -- TLS --------------------------------------------------------------------------


class _Short(Exception):
    """The record ends before the structure being read."""


class _Bad(Exception):
    """The bytes are not a well-formed ClientHello."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Short
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u24(self) -> int:
        return int.from_bytes(self.take(3), "big")

    def vec(self, size_bytes: int) -> bytes:
        n = int.from_bytes(self.take(size_bytes), "big")
        return self.take(n)


def _handshake_bytes(data: bytes) -> bytes | None:
    """The handshake bytes carried by the TLS records at the head of `data`
    (as far as they go); None when a record header is not TLS handshake."""
    out = bytearray()
    pos = 0
    while pos + 5 <= len(data):
        ctype, major = data[pos], data[pos + 1]
        length = int.from_bytes(data[pos + 3 : pos + 5], "big")
        if ctype != 0x16 or major != 3 or length == 0 or length > 16384 + 2048:
            return None
        out += data[pos + 5 : pos + 5 + length]
        if pos + 5 + length > len(data):
            break
        pos += 5 + length
        # a ClientHello's length is known once its header is in
        if len(out) >= 4 and len(out) >= 4 + int.from_bytes(out[1:4], "big"):
            break
    return bytes(out)


def _sniff_tls(data: bytes) -> Result:
    if len(data) >= 3 and data[1] != 3:
        return NoName("other", "not a TLS record")
    hs = _handshake_bytes(data)
    if hs is None:
        return NoName("tls", "not a TLS handshake record") if len(data) >= 5 else Need()
    try:
        return _client_hello(_Reader(hs))
    except _Short:
        if len(data) >= MAX_SNIFF:
            return NoName("tls", "ClientHello too large")
        return Need()
    except _Bad as exc:
        return NoName("tls", str(exc) or "malformed ClientHello")


def _client_hello(r: _Reader) -> Result:
    if r.u8() != 1:
        raise _Bad("first handshake message is not a ClientHello")
    body = _Reader(r.take(r.u24()))
    body.take(2 + 32)  # legacy_version, random
    body.vec(1)  # session id
    suites = body.vec(2)
    if len(suites) % 2:
        raise _Bad("odd cipher suite list")
    body.vec(1)  # compression methods
    if body.pos == len(body.data):
        return NoName("tls", "no extensions (no server name)")
    exts = _Reader(body.vec(2))
    while exts.pos < len(exts.data):
        try:
            kind = exts.u16()
            ext = exts.vec(2)
        except _Short:
            raise _Bad("truncated extension") from None
        if kind != 0:
            continue
        try:
            names = _Reader(_Reader(ext).vec(2))
            while names.pos < len(names.data):
                name_type = names.u8()
                host = names.vec(2)
                if name_type == 0:
                    name = normalise_name(host.decode("ascii", "replace"))
                    if name is None:
                        raise _Bad("server name is not a host name")
                    return Found(name, "tls")
        except _Short:
            raise _Bad("truncated server_name extension") from None
        raise _Bad("server_name extension without a host name")
    return NoName("tls", "no server name")


# -- HTTP/1.x -----------------------------------------------------------------------


def _sniff_http(data: bytes) -> Result:
    head = data[:MAX_SNIFF]
    known = any(head.startswith(p) or p.startswith(head) for p in _HTTP_PREFIXES)
    if not known and _METHOD_RE.match(head) is None:
        return NoName("other", "neither TLS nor HTTP")
    end = head.find(b"\r\n\r\n")
    if end < 0:
        end = head.find(b"\n\n")
    if end < 0:
        if len(data) >= MAX_SNIFF:
            return NoName("http", "request head too large")
        return Need()
    lines = head[:end].replace(b"\r\n", b"\n").split(b"\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or not request_line[2].startswith(b"HTTP/1."):
        return NoName("http", "not an HTTP/1.x request line")
    hosts = []
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if not sep:
            return NoName("http", "malformed header line")
        if key.strip().lower() == b"host":
            hosts.append(value.strip())
    if len(hosts) != 1:
        # none, or several (a request smuggling shape): refuse to pick one
        return NoName("http", "no Host header" if not hosts else "several Host headers")
    host = hosts[0].decode("ascii", "replace")
    if host.startswith("["):
        return NoName("http", "Host is an IPv6 literal")
    name = normalise_name(host.rsplit(":", 1)[0] if ":" in host else host)
    if name is None:
        return NoName("http", "Host is not a host name")
    return Found(name, "http")
