"""The node's transparent egress proxy: host-name rules for sandboxes' TCP.

A packet filter sees addresses, not names. When a sandbox's policy names
hosts (`EgressPolicy.has_hosts`), its slot's nat chain redirects each new
TCP connection the address alone does not settle to this proxy's port on
the slot's host address (`aenv.proto.netpolicy.render_slot_rules`). The
proxy runs in the node, on the host side, where code in the sandbox can
neither see nor change it. For each connection it:

1. finds the slot by the peer address (`PolicySource.policy_of`) and the
   address the sandbox dialled (`SO_ORIGINAL_DST`, kept by the redirect);
2. if a host rule could change the verdict (`EgressPolicy.needs_name`),
   reads the client's first bytes until `aenv.proto.sniff` finds the TLS
   server name or HTTP Host (or gives up: no name, a bounded wait);
3. decides (`EgressPolicy.decide`); a name allowed by an allowOut entry
   must prove itself: the dialled address must be one the node's resolver
   (`Resolver`, never the sandbox's) gives for it, so `Host: allowed.test`
   sent to another address is refused;
4. refuses with a reset, or dials exactly the address the sandbox dialled
   (through the sandbox's SOCKS5 `egressProxy` when it has one:
   `aenv.node.socks`, failing closed) and relays both ways (`PassThrough`: the bytes are not touched, TLS stays
   end to end), counting bytes.

Every decided connection becomes an `EgressEvent` (host, address, port,
verdict, reason, bytes) handed to `on_event` (the node puts it in the
sandbox's log) and counted in the proxy's `statistics()`.

How a connection is carried once allowed is a `Relay`: `PassThrough` by
default; for a host the sandbox's `network.rules` name, the `intercept` hook
(`aenv.node.egresstls.interceptor`) returns an `Intercept` that injects the
rules' headers (terminating TLS with the node's egress CA for HTTPS). Such a
name must prove itself against the node's resolver even where the address
alone would allow the connection.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from aenv.kit.metrics import Labels, Registry
from aenv.node.socks import StreamCopy, open_tunnel
from aenv.proto import dnswire
from aenv.proto.netpolicy import Decision, EgressPolicy
from aenv.proto.sniff import MAX_SNIFF, Found, Need, NoName, sniff

log = logging.getLogger("aenv.node.egress")

SO_ORIGINAL_DST: Final = 80  # linux/netfilter_ipv4.h
SNIFF_TIMEOUT_S: Final = 10.0
# how long to wait for a name that could only refuse what the address allows
# (deny-by-name with the internet open): server-speaks-first protocols (SSH,
# SMTP) then start after this, not after SNIFF_TIMEOUT_S
DENY_SNIFF_TIMEOUT_S: Final = 1.0
CONNECT_TIMEOUT_S: Final = 10.0
RESOLVE_TIMEOUT_S: Final = 3.0
PIPE_SIZE: Final = 1024 * 1024  # splice(2) pipe between the two sockets
F_SETPIPE_SZ: Final = 1031  # linux/fcntl.h
MAX_CONNECTIONS: Final = 4096
# bounds on how long a resolver's answer is trusted (s)
MIN_TTL_S: Final = 1.0
MAX_TTL_S: Final = 300.0


class PolicySource(Protocol):
    """Who a redirected connection belongs to (`HostNetwork` is one)."""

    def policy_of(self, sandbox_ip: str) -> tuple[int, EgressPolicy] | None:
        """The slot index and policy of the sandbox at `sandbox_ip`, if one is open."""
        ...


@dataclass(frozen=True, kw_only=True)
class EgressEvent:
    """One decided connection, for the sandbox's egress log."""

    timestamp: float
    slot: int
    sandbox_ip: str
    host: str | None  # the name the connection claimed (None: none read)
    ip: str
    port: int
    proto: str  # tls | http | other | none (decided before any byte)
    allowed: bool
    reason: str
    bytes_out: int = 0  # sandbox -> destination
    bytes_in: int = 0  # destination -> sandbox
    duration_s: float = 0.0


def egress_entry(ev: EgressEvent) -> tuple[str, str, dict[str, str]]:
    """`ev` as a sandbox log entry: (message, level, fields). Fields carry
    `kind: egress`, which `aenv logs --egress` selects."""
    verdict = "allowed" if ev.allowed else "denied"
    where = f"{ev.host} ({ev.ip}:{ev.port})" if ev.host else f"{ev.ip}:{ev.port}"
    message = f"egress {verdict}: {where}: {ev.reason}"
    if ev.allowed:
        message += f"; {ev.bytes_out} B out, {ev.bytes_in} B in"
    fields = {
        "kind": "egress",
        "verdict": verdict,
        "host": ev.host or "",
        "ip": ev.ip,
        "port": str(ev.port),
        "proto": ev.proto,
        "reason": ev.reason,
        "bytesOut": str(ev.bytes_out),
        "bytesIn": str(ev.bytes_in),
    }
    return message, "info" if ev.allowed else "warn", fields


# -- the host-side resolver --------------------------------------------------------


class Resolver:
    """A names' IPv4 addresses as the node's resolver gives them, cached for their TTL.

    `servers` are `host[:port]` of DNS servers the node trusts; without any,
    the C library resolves (`getaddrinfo`, the host's /etc/hosts and
    resolv.conf, no TTL: `MIN_TTL_S`...`fallback_ttl_s`).
    """

    def __init__(self, servers: Sequence[str] = (), *, fallback_ttl_s: float = 30.0) -> None:
        self._servers = [_host_port(s, 53) for s in servers]
        self._fallback_ttl = fallback_ttl_s
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}
        # address -> {name: until when the name's answer holds}
        self._names: dict[str, dict[str, float]] = {}
        self._ids = itertools.count(1)
        self.lookups = 0
        self.failures = 0

    async def addresses(self, name: str) -> frozenset[str]:
        """The addresses of `name` (empty when it does not resolve)."""
        now = trio.current_time()
        hit = self._cache.get(name)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.lookups += 1
        try:
            addrs, ttl = await self._lookup(name)
        except (OSError, dnswire.DnsError, trio.TooSlowError) as exc:
            self.failures += 1
            log.warning("egress: resolving %s failed: %s", name, exc)
            return frozenset()
        found = frozenset(addrs)
        if len(self._cache) > 10_000:
            self._cache.clear()
            self._names.clear()
        until = now + min(max(ttl, MIN_TTL_S), MAX_TTL_S)
        self._cache[name] = (until, found)
        for ip in found:
            self._names.setdefault(ip, {})[name] = until
        return found

    def names_of(self, ip: str) -> list[str]:
        """The names whose cached answers hold `ip` now (no lookup)."""
        now = trio.current_time()
        return [n for n, until in self._names.get(ip, {}).items() if until > now]

    async def _lookup(self, name: str) -> tuple[tuple[str, ...], float]:
        if not self._servers:
            infos = await trio.socket.getaddrinfo(name, None, family=socket.AF_INET)
            return tuple(dict.fromkeys(str(i[4][0]) for i in infos)), self._fallback_ttl
        last: Exception = OSError(f"no DNS server answered for {name}")
        for host, port in self._servers:
            ident = next(self._ids) & 0xFFFF
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            with sock, trio.move_on_after(RESOLVE_TIMEOUT_S):
                try:
                    await sock.connect((host, port))
                    await sock.send(dnswire.query(name, ident))
                    while True:
                        packet = await sock.recv(4096)
                        try:
                            ans = dnswire.parse_answer(packet, ident, name)
                        except dnswire.DnsError as exc:
                            last = exc
                            continue
                        return ans.addresses, float(ans.ttl)
                except OSError as exc:
                    last = exc
        raise last


def _host_port(text: str, default: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default
    return host, int(port)


# -- relays ------------------------------------------------------------------------


@dataclass
class Transfer:
    bytes_out: int = 0
    bytes_in: int = 0


class Relay(Protocol):
    """How an allowed connection is carried to its destination."""

    async def run(
        self,
        client: trio.SocketStream,
        head: bytes,
        target: tuple[str, int],
        done: Transfer,
        *,
        upstream: trio.SocketStream | None = None,
    ) -> None:
        """Carry `client` (whose first bytes, `head`, were read already) to
        `target` (over `upstream` when it is dialled already), counting bytes
        into `done`, until both sides are finished."""
        ...


class PassThrough:
    """Dial the destination and copy bytes both ways, untouched (TLS stays end to end)."""

    async def run(
        self,
        client: trio.SocketStream,
        head: bytes,
        target: tuple[str, int],
        done: Transfer,
        *,
        upstream: trio.SocketStream | None = None,
    ) -> None:
        if upstream is None:
            upstream = await _dial(target)
        async with upstream:
            if head:
                await upstream.send_all(head)
                done.bytes_out += len(head)
            async with trio.open_nursery() as nursery:
                both = nursery.cancel_scope
                nursery.start_soon(_copy, client, upstream, done, "bytes_out", both)
                nursery.start_soon(_copy, upstream, client, done, "bytes_in", both)


class _EarlyDial:
    """A dial started while the client's first bytes are still being read.

    Started only for an address the node's resolver gave, moments ago, for a
    name the policy allows (`EgressProxy._serve_one`): the handshake then
    overlaps the wait for the ClientHello. Discarded (never written to) when
    the connection is refused after all."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.scope = trio.CancelScope()
        self.finished = trio.Event()
        self.stream: trio.SocketStream | None = None
        self.error: OSError | trio.TooSlowError | None = None

    async def run(self) -> None:
        with self.scope:
            try:
                self.stream = await _dial(self.target)
            except (OSError, trio.TooSlowError) as exc:
                self.error = exc
        self.finished.set()

    async def result(self) -> trio.SocketStream:
        await self.finished.wait()
        if self.error is not None:
            raise self.error
        if self.stream is None:
            raise OSError("the early dial was cancelled")
        return self.stream

    async def discard(self) -> None:
        self.scope.cancel()
        if self.stream is not None:
            await trio.aclose_forcefully(self.stream)


async def _dial(target: tuple[str, int]) -> trio.SocketStream:
    """A TCP connection to the IPv4 `target`, Nagle off (no name lookup: the
    address is the one the sandbox dialled)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await sock.connect(target)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _copy(
    src: trio.SocketStream,
    dst: trio.SocketStream,
    done: Transfer,
    what: str,
    both: trio.CancelScope,
) -> None:
    """Move bytes from `src` to `dst` until `src` ends, then end `dst`'s sending side.

    The bytes go through a pipe with splice(2), never through Python's
    memory. A reset on either side cancels `both` directions; the sockets
    are closed by their owner once both have stopped (never here: the other
    direction may still hold their descriptors)."""
    sfd, dfd = src.socket.fileno(), dst.socket.fileno()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
        while True:
            try:
                n = os.splice(sfd, w, PIPE_SIZE, flags=flags)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sfd)
                continue
            if n == 0:
                break
            left = n
            while left:
                try:
                    left -= os.splice(r, dfd, left, flags=flags)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dfd)
            setattr(done, what, getattr(done, what) + n)
            await trio.lowlevel.checkpoint()
        with contextlib.suppress(OSError):
            dst.socket.shutdown(socket.SHUT_WR)
    except OSError:
        both.cancel()
    finally:
        os.close(r)
        os.close(w)


def _nodelay(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


def relay_for(policy: EgressPolicy, decision: Decision, name: str | None) -> Relay:
    """The relay for an allowed connection the `intercept` hook left alone: pass-through."""
    return PASS_THROUGH


PASS_THROUGH: Final = PassThrough()


# -- the proxy ---------------------------------------------------------------------


def original_destination(stream: trio.SocketStream) -> tuple[str, int] | None:
    """Where the sandbox meant to connect, kept by the nat redirect (None: not redirected)."""
    try:
        raw = stream.socket.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port = struct.unpack("!H", raw[2:4])[0]
    return str(ipaddress.IPv4Address(raw[4:8])), port


# (slot, policy, allowed decision, name, proto) -> the relay that intercepts
# the connection (a `network.rules` host), or None: pass through
RelayChooser = Callable[[int, EgressPolicy, Decision, str | None, str], Relay | None]


class EgressProxy:
    """Serves redirected connections on one listening socket for all slots."""

    def __init__(
        self,
        *,
        policies: PolicySource,
        resolver: Resolver,
        on_event: Callable[[EgressEvent], None] = lambda _e: None,
        sniff_timeout_s: float = SNIFF_TIMEOUT_S,
        intercept: RelayChooser | None = None,
    ) -> None:
        self.policies = policies
        self.intercept = intercept
        self.resolver = resolver
        self.on_event = on_event
        self.sniff_timeout_s = sniff_timeout_s
        self._limit = trio.CapacityLimiter(MAX_CONNECTIONS)
        self._counts: dict[tuple[str, str], int] = {}
        self._bytes = {"out": 0, "in": 0}
        self.active = 0

    async def serve(
        self,
        listener: trio.SocketListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        await trio.sleep(0.1)
                        continue
                    raise
                nursery.start_soon(self._handle, stream)

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            try:
                if self._limit.borrowed_tokens >= self._limit.total_tokens:
                    _reset(client)
                    return
                async with self._limit, trio.open_nursery() as nursery:
                    await self._serve_one(client, nursery)
            except Exception:
                log.exception("egress: connection failed")
                _reset(client)

    async def _serve_one(self, client: trio.SocketStream, nursery: trio.Nursery) -> None:
        started = time.time()
        peer = client.socket.getpeername()
        src = str(peer[0])
        owner = self.policies.policy_of(src)
        target = original_destination(client)
        if owner is None or target is None:
            _reset(client)  # not a sandbox's redirected connection
            return
        slot, policy = owner
        ip, port = target
        head = b""
        name: str | None = None
        proto = "none"
        early: _EarlyDial | None = None
        if policy.needs_name(ip):
            names = self.resolver.names_of(ip)
            if policy.proxy is None and any(policy.decide(ip, n).allowed for n in names):
                early = _EarlyDial((ip, port))
                nursery.start_soon(early.run)
            by_address = policy.decide(ip, None).allowed
            wait = min(DENY_SNIFF_TIMEOUT_S, self.sniff_timeout_s) if by_address else None
            head, name, proto = await self._read_name(client, wait)
        decision = policy.decide(ip, name)
        if decision.allowed and decision.verify is not None:
            addresses = await self.resolver.addresses(decision.verify)
            if ip not in addresses:
                why = f"{ip} is not an address of {decision.verify}"
                if not addresses:
                    why = f"{decision.verify} does not resolve on the node"
                decision = Decision(False, why)
        intercepted: Relay | None = None
        if decision.allowed and self.intercept is not None:
            intercepted = self.intercept(slot, policy, decision, name, proto)
        # rules put secrets in the request: its name must prove itself (as
        # allowOut names do) even where the address alone allowed it
        if (
            intercepted is not None
            and name is not None
            and decision.verify is None
            and ip not in await self.resolver.addresses(name)
        ):
            decision = Decision(False, f"{ip} is not an address of {name} (rules)")

        def event(allowed: bool, reason: str, done: Transfer | None = None) -> EgressEvent:
            return EgressEvent(
                timestamp=started,
                slot=slot,
                sandbox_ip=src,
                host=name,
                ip=ip,
                port=port,
                proto=proto,
                allowed=allowed,
                reason=reason,
                bytes_out=done.bytes_out if done else 0,
                bytes_in=done.bytes_in if done else 0,
                duration_s=time.time() - started,
            )

        if not decision.allowed:
            if early is not None:
                await early.discard()
            _reset(client)
            self._record(event(False, decision.reason))
            return
        done = Transfer()
        _nodelay(client)
        self.active += 1
        try:
            upstream = None if early is None else await early.result()
            relay = intercepted or relay_for(policy, decision, name)
            if policy.proxy is not None:  # out through the sandbox's SOCKS5 proxy, never direct
                # by name when a host rule allowed it (and the node verified it), else by address
                tunnel = await open_tunnel(policy.proxy, decision.verify or ip, port, client=client)
                upstream = tunnel.socket_stream
                if upstream is None and intercepted is not None:
                    # rules need the tunnel as a socket: never send without them
                    with trio.CancelScope(shield=True):
                        await tunnel.stream.aclose()
                    raise OSError("rules cannot be applied through a TLS egress proxy")
                relay = relay if upstream is not None else StreamCopy(tunnel.stream)
            await relay.run(client, head, (ip, port), done, upstream=upstream)
        except (OSError, trio.TooSlowError) as exc:
            _reset(client)
            self._record(event(True, f"{decision.reason}; upstream: {_why(exc)}", done))
            return
        finally:
            self.active -= 1
        self._record(
            event(True, decision.reason + ("; rules applied" if intercepted else ""), done)
        )

    async def _read_name(
        self, client: trio.SocketStream, wait_s: float | None = None
    ) -> tuple[bytes, str | None, str]:
        """The client's first bytes and the host name they claim, within
        `wait_s` (default: the sniff timeout)."""
        head = b""
        with trio.move_on_after(self.sniff_timeout_s if wait_s is None else wait_s):
            while len(head) < MAX_SNIFF:
                found = sniff(head)
                if not isinstance(found, Need):
                    break
                try:
                    data = await client.receive_some(MAX_SNIFF - len(head))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                head += data
        found = sniff(head)
        if isinstance(found, Found):
            return head, found.name, found.proto
        if isinstance(found, NoName):
            return head, None, found.proto
        return head, None, "none"

    def _record(self, ev: EgressEvent) -> None:
        verdict = "allowed" if ev.allowed else "denied"
        self._counts[(verdict, ev.proto)] = self._counts.get((verdict, ev.proto), 0) + 1
        self._bytes["out"] += ev.bytes_out
        self._bytes["in"] += ev.bytes_in
        try:
            self.on_event(ev)
        except Exception:
            log.exception("egress: recording an event failed")

    def statistics(self) -> dict[str, object]:
        return {
            "connections": dict(self._counts),
            "bytes_out": self._bytes["out"],
            "bytes_in": self._bytes["in"],
            "active": self.active,
            "dns_lookups": self.resolver.lookups,
            "dns_failures": self.resolver.failures,
        }


def _why(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _reset(stream: trio.SocketStream) -> None:
    """Make the close a reset, so the sandbox's connect or first read fails at once."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def open_egress_listener(host: str = "0.0.0.0", port: int = 0) -> trio.SocketListener:
    """The proxy's listening socket (port 0: one the kernel picks)."""
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
    return listeners[0]


def listener_port(listener: trio.SocketListener) -> int:
    return int(listener.socket.getsockname()[1])


def egress_metrics(registry: Registry, proxy: EgressProxy) -> None:
    """Put the proxy's counts in the node's metrics registry (read at scrape time)."""

    def connections() -> list[tuple[Labels, float]]:
        counts = proxy.statistics()["connections"]
        assert isinstance(counts, dict)
        return [((("proto", p), ("verdict", v)), float(n)) for (v, p), n in counts.items()]

    def scalar(key: str) -> Callable[[], list[tuple[Labels, float]]]:
        return lambda: [((), float(proxy.statistics()[key]))]  # type: ignore[arg-type]

    registry.counter(
        "aenv_egress_connections_total",
        "Sandbox TCP connections the egress proxy decided, by verdict and protocol",
        connections,
    )
    registry.counter(
        "aenv_egress_bytes_out_total",
        "Bytes sandboxes sent through the egress proxy",
        scalar("bytes_out"),
    )
    registry.counter(
        "aenv_egress_bytes_in_total",
        "Bytes sandboxes received through the egress proxy",
        scalar("bytes_in"),
    )
    registry.gauge(
        "aenv_egress_active_connections",
        "Connections the egress proxy is relaying now",
        scalar("active"),
    )
    registry.counter(
        "aenv_egress_dns_lookups_total",
        "Host-side DNS lookups of the egress proxy",
        scalar("dns_lookups"),
    )
    registry.counter(
        "aenv_egress_dns_failures_total",
        "Host-side DNS lookups that failed",
        scalar("dns_failures"),
    )
