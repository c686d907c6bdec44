"""The egress proxy's way out through a sandbox's own SOCKS5 proxy (`network.egressProxy`).

`open_tunnel` is the trio shell around `aenv.proto.socks5.Handshake`: it
resolves the proxy's host name on the node (at dial time, pinning the
address for this one connection), refuses an address in a range sandboxes
never reach, dials it, wraps the connection in TLS when the configuration
asks (certificate always verified, TLS 1.2 or newer, the configured CA
replacing the system store), runs the handshake, and hands back a `Tunnel`.
Every failure is a `TunnelError` (an `OSError`), so the egress proxy resets
the sandbox's connection: egress fails closed and never falls back to a
direct connection.

A plain tunnel is a TCP socket, carried by the egress proxy's own relay
(splice, untouched); a TLS tunnel is carried by `StreamCopy`, which moves
bytes through Python. TLS has no half-close: when the sandbox ends its
sending side, the tunnel keeps carrying the answer until the far side ends.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from aenv.proto.netpolicy import proxy_address_allowed
from aenv.proto.socks5 import Handshake, ProxyConfig, Socks5Error

HANDSHAKE_TIMEOUT_S: Final = 10.0
COPY_CHUNK: Final = 256 * 1024


class TunnelError(OSError):
    """The SOCKS5 proxy could not be reached, refused, or failed (the connection must fail)."""


@dataclass
class Tunnel:
    """An open CONNECT through the proxy: `stream` carries the sandbox's bytes."""

    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]

    @property
    def socket_stream(self) -> trio.SocketStream | None:
        """The plain TCP stream (None over TLS, which `StreamCopy` carries)."""
        return self.stream if isinstance(self.stream, trio.SocketStream) else None


async def _proxy_addresses(proxy: ProxyConfig, blocked: Sequence[str]) -> list[str]:
    if proxy.host_is_ip:
        found = [proxy.host]
    else:
        try:
            infos = await trio.socket.getaddrinfo(proxy.host, proxy.port, family=socket.AF_INET)
        except OSError as exc:
            raise TunnelError(f"egress proxy {proxy.host} does not resolve: {exc}") from None
        found = list(dict.fromkeys(str(i[4][0]) for i in infos))
    usable = [ip for ip in found if proxy_address_allowed(ip, blocked=blocked)]
    if not usable:
        raise TunnelError(f"egress proxy {proxy.address}: no address the node may dial")
    return usable


def _tls_context(proxy: ProxyConfig) -> ssl.SSLContext:
    if proxy.ca_cert is not None:
        ctx = ssl.create_default_context(cadata=proxy.ca_cert)
    else:
        ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


async def open_tunnel(
    proxy: ProxyConfig,
    host: str,
    port: int,
    *,
    client: trio.abc.SendStream,
    blocked: Sequence[str] = (),
) -> Tunnel:
    """A CONNECT to `host` (a name the proxy resolves, or an IPv4 literal) and
    `port` through `proxy`. Bytes the proxy sent past its reply go to `client`.
    `blocked` adds ranges the proxy itself must not be in (the slot CIDR)."""
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream] | None = None
    plain: trio.SocketStream | None = None
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            last: OSError = TunnelError(f"egress proxy {proxy.address} unreachable")
            for ip in await _proxy_addresses(proxy, blocked):
                sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await sock.connect((ip, proxy.port))
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                stream = plain = trio.SocketStream(sock)
                break
            if plain is None:
                raise TunnelError(f"egress proxy {proxy.address}: {last.strerror or last}")
            conn: trio.SocketStream | trio.SSLStream[trio.SocketStream] = plain
            if proxy.tls:
                conn = stream = trio.SSLStream(
                    plain,
                    _tls_context(proxy),
                    server_hostname=proxy.server_name or proxy.host,
                    https_compatible=True,
                )
                await conn.do_handshake()
            shake = Handshake(host, port, username=proxy.username, password=proxy.password)
            await conn.send_all(shake.initial())
            while not shake.done:
                data = await conn.receive_some(4096)
                reply = shake.receive_data(bytes(data))
                if reply:
                    await conn.send_all(reply)
        if shake.leftover:
            await client.send_all(shake.leftover)
        return Tunnel(conn)
    except BaseException as exc:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        if isinstance(exc, TunnelError):
            raise
        if isinstance(exc, Socks5Error):
            raise TunnelError(f"egress proxy {proxy.address}: {exc}") from None
        if isinstance(exc, trio.TooSlowError):
            raise TunnelError(f"egress proxy {proxy.address}: handshake timed out") from None
        if isinstance(exc, ssl.SSLError | trio.BrokenResourceError):
            raise TunnelError(f"egress proxy {proxy.address}: TLS: {exc}") from None
        raise


class StreamCopy:
    """Carries a sandbox connection over a tunnel that is not a plain socket (TLS)."""

    def __init__(self, upstream: trio.abc.Stream) -> None:
        self.upstream = upstream

    async def run(
        self,
        client: trio.SocketStream,
        head: bytes,
        target: tuple[str, int],
        done: _Counts,
        *,
        upstream: trio.SocketStream | None = None,
    ) -> None:
        async with self.upstream:
            if head:
                await self.upstream.send_all(head)
                done.bytes_out += len(head)
            async with trio.open_nursery() as nursery:
                both = nursery.cancel_scope

                async def out() -> None:
                    try:
                        while data := await client.receive_some(COPY_CHUNK):
                            await self.upstream.send_all(data)
                            done.bytes_out += len(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        both.cancel()

                async def back() -> None:
                    try:
                        while data := await self.upstream.receive_some(COPY_CHUNK):
                            await client.send_all(data)
                            done.bytes_in += len(data)
                        await client.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    both.cancel()  # the far side is done: so is the connection

                nursery.start_soon(out)
                nursery.start_soon(back)


class _Counts(Protocol):
    bytes_out: int
    bytes_in: int
