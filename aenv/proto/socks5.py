"""SOCKS5 client, sans-IO: E2B's `network.egressProxy` and the handshake it dials with.

`ProxyConfig.from_request` validates the `egressProxy` object a client sent
(`address` as `host:port`, optional RFC 1929 `username`/`password`, optional
`tls` with `serverName` and `caCert`) and `to_api` reports it without the
password or the CA. `Handshake` is the client side of one SOCKS5 CONNECT
(RFC 1928, username/password auth of RFC 1929): `initial()` gives the first
bytes to send, `receive_data(data)` consumes what the proxy answered and
returns what to send next, until `done` (the tunnel is open; bytes the proxy
sent past its reply are in `leftover`) or `Socks5Error`. It never reads a
socket, so any chunking of the proxy's answer gives the same outcome and the
parser can be fuzzed on its own.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

VERSION: Final = 5
NO_AUTH: Final = 0x00
USER_PASS: Final = 0x02
NO_ACCEPTABLE: Final = 0xFF
CMD_CONNECT: Final = 0x01
ATYP_IPV4: Final = 0x01
ATYP_DOMAIN: Final = 0x03
ATYP_IPV6: Final = 0x04
MAX_FIELD: Final = 255  # bytes of a username, password or domain name
MAX_SERVER_NAME: Final = 253
MAX_CA_CERT: Final = 8192

REPLY_TEXT: Final = {
    0x01: "general SOCKS server failure",
    0x02: "connection not allowed by ruleset",
    0x03: "network unreachable",
    0x04: "host unreachable",
    0x05: "connection refused",
    0x06: "TTL expired",
    0x07: "command not supported",
    0x08: "address type not supported",
}


class Socks5Error(Exception):
    """The proxy refused, failed or does not speak SOCKS5 (the connection must fail)."""


class ProxyConfigError(ValueError):
    """An `egressProxy` object a client sent that cannot be used (the API answers 400)."""


def _field(raw: Mapping[str, Any], key: str, limit: int) -> str | None:
    v = raw.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ProxyConfigError(f"network.egressProxy.{key} must be a string")
    if not v or len(v.encode()) > limit:
        raise ProxyConfigError(f"network.egressProxy.{key} must be 1 to {limit} bytes")
    return v


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets) as (host, port); ProxyConfigError if malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ProxyConfigError(f"network.egressProxy.address {address!r}: expected host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ProxyConfigError(f"network.egressProxy.address {address!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    labels = name.split(".")
    if len(name) > 253 or not all(
        0 < len(lab) <= 63 and lab.replace("-", "").replace("_", "").isalnum() and lab.isascii()
        for lab in labels
    ):
        raise ProxyConfigError(f"network.egressProxy.address {address!r}: invalid host")
    return name, port


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Where a sandbox's filtered TCP leaves: a SOCKS5 proxy, maybe over TLS."""

    host: str  # an IP literal or a lowercase host name (resolved at dial time)
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False
    server_name: str | None = None  # TLS: the name to verify and send as SNI
    ca_cert: str | None = None  # TLS: PEM CAs that replace the system trust store

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def host_is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    @classmethod
    def from_request(cls, raw: object) -> ProxyConfig:
        """The `egressProxy` object of a create/update body (E2B wire names)."""
        if not isinstance(raw, Mapping):
            raise ProxyConfigError("network.egressProxy must be an object")
        address = raw.get("address")
        if not isinstance(address, str):
            raise ProxyConfigError("network.egressProxy.address is required (host:port)")
        host, port = split_address(address)
        username = _field(raw, "username", MAX_FIELD)
        password = _field(raw, "password", MAX_FIELD)
        if password is not None and username is None:
            raise ProxyConfigError("network.egressProxy.password needs a username")
        tls_raw = raw.get("tls")
        tls, server_name, ca_cert = False, None, None
        if tls_raw is not None:
            if not isinstance(tls_raw, Mapping):
                raise ProxyConfigError("network.egressProxy.tls must be an object")
            enabled = tls_raw.get("enabled", True)
            if not isinstance(enabled, bool):
                raise ProxyConfigError("network.egressProxy.tls.enabled must be a boolean")
            tls = enabled
            server_name = _field(tls_raw, "serverName", MAX_SERVER_NAME)
            ca_cert = _field(tls_raw, "caCert", MAX_CA_CERT)
            if ca_cert is not None and "-----BEGIN CERTIFICATE-----" not in ca_cert:
                raise ProxyConfigError("network.egressProxy.tls.caCert must be PEM certificates")
        return cls(
            host=host,
            port=port,
            username=username,
            password=password,
            tls=tls,
            server_name=server_name if tls else None,
            ca_cert=ca_cert if tls else None,
        )

    def to_doc(self) -> dict[str, Any]:
        """The whole configuration, for the journal and peers (holds the password)."""
        return {
            "host": self.host,
            "port": self.port,
            "username": self.username,
            "password": self.password,
            "tls": self.tls,
            "serverName": self.server_name,
            "caCert": self.ca_cert,
        }

    @classmethod
    def from_doc(cls, d: Mapping[str, Any]) -> ProxyConfig:
        return cls(
            host=str(d["host"]),
            port=int(d["port"]),
            username=d.get("username"),
            password=d.get("password"),
            tls=bool(d.get("tls")),
            server_name=d.get("serverName"),
            ca_cert=d.get("caCert"),
        )

    def to_api(self) -> dict[str, Any]:
        """`SandboxNetworkConfig.egressProxy` as GET reports it: no password, no CA."""
        out: dict[str, Any] = {"address": self.address}
        if self.username is not None:
            out["username"] = self.username
        if self.tls:
            tls: dict[str, Any] = {"enabled": True}
            if self.server_name is not None:
                tls["serverName"] = self.server_name
            out["tls"] = tls
        return out

    def __repr__(self) -> str:  # never print the password
        return f"ProxyConfig({self.address!r}, user={self.username!r}, tls={self.tls})"


def connect_request(host: str, port: int) -> bytes:
    """A CONNECT to `host` (an IP literal, or a name the proxy resolves) and `port`."""
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = host.encode("idna")
        if not 0 < len(name) <= MAX_FIELD:
            raise ValueError(f"host name too long for SOCKS5: {host!r}") from None
        addr = bytes([ATYP_DOMAIN, len(name)]) + name
    else:
        atyp = ATYP_IPV4 if ip.version == 4 else ATYP_IPV6
        addr = bytes([atyp]) + ip.packed
    return bytes([VERSION, CMD_CONNECT, 0]) + addr + port.to_bytes(2, "big")


def auth_request(username: str, password: str) -> bytes:
    """RFC 1929 username/password sub-negotiation."""
    u, p = username.encode(), password.encode()
    if not 0 < len(u) <= MAX_FIELD or len(p) > MAX_FIELD:
        raise ValueError("SOCKS5 username and password are 1..255 and 0..255 bytes")
    return bytes([1, len(u)]) + u + bytes([len(p)]) + p


def parse_reply(buf: bytes) -> tuple[tuple[str, int], int] | None:
    """A CONNECT reply at the start of `buf`: ((bound address, port), its length),
    or None when more bytes are needed. Socks5Error for a refusal or garbage."""
    # refuse as soon as a byte is wrong, not only once the whole reply is in
    if buf[:1] and buf[0] != VERSION:
        raise Socks5Error(f"not a SOCKS5 reply (version byte {buf[0]})")
    if len(buf) >= 2 and buf[1] != 0:
        rep = buf[1]
        raise Socks5Error(f"proxy: {REPLY_TEXT.get(rep, f'reply code {rep}')}")
    atyp = buf[3] if len(buf) >= 4 else None
    if atyp is not None and atyp not in (ATYP_IPV4, ATYP_DOMAIN, ATYP_IPV6):
        raise Socks5Error(f"proxy replied with address type {atyp}")
    if len(buf) < 5:
        return None
    if atyp == ATYP_IPV4:
        end = 4 + 4
    elif atyp == ATYP_IPV6:
        end = 4 + 16
    else:
        end = 5 + buf[4]
    if len(buf) < end + 2:
        return None
    raw = buf[4:end]
    host = raw[1:].decode("latin-1") if atyp == ATYP_DOMAIN else str(ipaddress.ip_address(raw))
    port = int.from_bytes(buf[end : end + 2], "big")
    return (host, port), end + 2


class Handshake:
    """One SOCKS5 CONNECT, client side: feed it what the proxy sends."""

    def __init__(
        self, host: str, port: int, *, username: str | None = None, password: str | None = None
    ) -> None:
        self._request = connect_request(host, port)
        self._auth = None if username is None else auth_request(username, password or "")
        self._buf = b""
        self._state = "method"
        self.done = False
        self.bound: tuple[str, int] | None = None
        self.leftover = b""

    def initial(self) -> bytes:
        """The greeting: no auth, plus username/password when there are credentials."""
        methods = bytes([NO_AUTH]) if self._auth is None else bytes([NO_AUTH, USER_PASS])
        return bytes([VERSION, len(methods)]) + methods

    def receive_data(self, data: bytes) -> bytes:
        """Consume `data` from the proxy; the bytes to send next (maybe none)."""
        if self.done:
            self.leftover += data
            return b""
        if not data:
            raise Socks5Error(f"proxy closed the connection during the handshake ({self._state})")
        self._buf += data
        out = b""
        while not self.done:
            step = self._step()
            if step is None:
                break
            out += step
        return out

    def _step(self) -> bytes | None:
        buf = self._buf
        if self._state == "method":
            if len(buf) < 2:
                if buf[:1] not in (b"", bytes([VERSION])):
                    raise Socks5Error(f"not a SOCKS5 proxy (version byte {buf[0]})")
                return None
            ver, method = buf[0], buf[1]
            self._buf = buf[2:]
            if ver != VERSION:
                raise Socks5Error(f"not a SOCKS5 proxy (version byte {ver})")
            if method == NO_AUTH:
                self._state = "reply"
                return self._request
            if method == USER_PASS and self._auth is not None:
                self._state = "auth"
                return self._auth
            if method == NO_ACCEPTABLE:
                raise Socks5Error("proxy accepts none of our authentication methods")
            raise Socks5Error(f"proxy chose an authentication method we did not offer ({method})")
        if self._state == "auth":
            if len(buf) < 2:
                return None
            status = buf[1]
            self._buf = buf[2:]
            if buf[0] != 1:
                raise Socks5Error(f"bad authentication reply (version {buf[0]})")
            if status != 0:
                raise Socks5Error("proxy rejected the username/password")
            self._state = "reply"
            return self._request
        parsed = parse_reply(buf)
        if parsed is None:
            return None
        self.bound, used = parsed
        self.leftover = buf[used:]
        self._buf = b""
        self.done = True
        self._state = "done"
        return b""
