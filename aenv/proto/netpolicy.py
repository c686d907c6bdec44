"""Sandbox egress policy: E2B's `allow_internet_access` / `allowOut` / `denyOut`, sans-IO.

`EgressPolicy.from_request` validates what a client sent and normalises it to
CIDRs; `EgressPolicy.allows` is the reference decision for one destination,
evaluated as E2B's orchestrator does (an `allowOut` entry beats a `denyOut`
entry, `allow_internet_access: false` denies 0.0.0.0/0 except `allowOut`), on
top of ranges a sandbox can never reach whatever its policy says (private,
loopback, link-local, CGNAT, multicast, reserved; the node's own addresses and
other sandboxes are added by the caller). The `render_*` functions turn the
same decision into nftables scripts (`nft -f -` input) for the host's `inet`
table: one for the table with its hooks, one per slot (idempotent, applied in
one atomic transaction, so it both creates and live-replaces a slot's rules),
and one that removes a slot. Host names in `allowOut`/`denyOut` cannot be
matched by a packet filter: a slot with host rules has its TCP redirected to
the node's egress proxy (`render_slot_rules(proxy_port=...)`), which reads
the name the connection claims and asks `EgressPolicy.decide`; everything
else (UDP, ICMP, TCP to allowOut CIDRs) stays in nftables. IPv6 egress is
always dropped (sandboxes get no IPv6 address).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aenv.proto.ingress import IngressError, parse_https_ports, parse_mask
from aenv.proto.socks5 import ProxyConfig, ProxyConfigError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALL_TRAFFIC: Final = "0.0.0.0/0"
# Bound on entries per list, so one request cannot build an unbounded ruleset.
MAX_ENTRIES: Final = 4096
MAX_DNS_SERVERS: Final = 10
# the resolver E2B opens when allowOut names a host and dnsServers is not given
DEFAULT_DNS_SERVERS: Final = ("8.8.8.8",)

# Never reachable from a sandbox, whatever its allowOut says. The IETF
# documentation ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24) are not
# routed on the internet and stay reachable, so tests can stand up a fake
# "internet host" there.
ALWAYS_BLOCKED: Final[tuple[str, ...]] = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # RFC 1918
    "100.64.0.0/10",  # CGNAT / provider-internal services
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, incl. cloud metadata 169.254.169.254
    "172.16.0.0/12",  # RFC 1918
    "192.0.0.0/24",  # IETF protocol assignments
    "192.168.0.0/16",  # RFC 1918
    "198.18.0.0/15",  # benchmarking, used inside data centres
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, incl. broadcast 255.255.255.255
)
_ALWAYS_BLOCKED_NETS: Final = tuple(ipaddress.IPv4Network(c) for c in ALWAYS_BLOCKED)

_DOMAIN_RE: Final = re.compile(
    r"^(\*\.)?(?=.{1,253}\.?$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
    r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.?$",
    re.IGNORECASE,
)
_NFT_NAME_RE: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
_IFNAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")


class PolicyError(ValueError):
    """A network policy a client sent that aenv cannot accept (the API answers 400)."""


def _parse_ip_entry(entry: str, *, what: str) -> IPNetwork:
    try:
        net = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        if what == "allowOut":
            raise PolicyError(f"invalid allowed address {entry}") from None
        raise PolicyError(f"invalid denied CIDR {entry}: expected an IP address or CIDR") from None
    # As E2B: an unspecified address (0.0.0.0, ::, 0.0.0.0/8) is refused, but
    # 0.0.0.0/0 (ALL_TRAFFIC) is the spelling for "everything".
    ip_part = ipaddress.ip_address(entry.split("/", 1)[0])
    if ip_part.is_unspecified and entry != ALL_TRAFFIC:
        label = "allowed address" if what == "allowOut" else "denied CIDR"
        raise PolicyError(f"invalid {label} {entry}: unspecified address")
    return net


def host_pattern(entry: str) -> str | None:
    """`entry` as a host-name rule (lowercase, no trailing dot; `*.` kept), or
    None if it is not one (an IP address or CIDR is not)."""
    if not _DOMAIN_RE.match(entry):
        return None
    bare = entry.lower().rstrip(".")
    if bare.removeprefix("*.").replace(".", "").isdigit():
        return None  # an IPv4 literal, not a name
    return bare


def _parse_entry(entry: object, *, what: str) -> IPNetwork | str:
    """An entry as a network, or as a host-name pattern (a `str`)."""
    if not isinstance(entry, str):
        raise PolicyError(f"{what} entries must be strings, got {type(entry).__name__}")
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        pattern = host_pattern(entry)
        if pattern is not None:
            return pattern
    return _parse_ip_entry(entry, what=what)


@dataclass(frozen=True)
class _Parsed:
    cidrs: tuple[str, ...]
    hosts: tuple[str, ...]
    given: tuple[str, ...]


def _parse_list(raw: object, *, what: str) -> _Parsed:
    """Normalised CIDRs, host patterns and the entries as given, each de-duplicated in order."""
    if raw is None:
        return _Parsed((), (), ())
    if not isinstance(raw, list | tuple):
        raise PolicyError(f"network.{what} must be a list of strings")
    if len(raw) > MAX_ENTRIES:
        raise PolicyError(f"network.{what} has {len(raw)} entries; at most {MAX_ENTRIES}")
    cidrs: dict[str, None] = {}
    hosts: dict[str, None] = {}
    given: dict[str, None] = {}
    for entry in raw:
        parsed = _parse_entry(entry, what=what)
        if isinstance(parsed, str):
            hosts[parsed] = None
        else:
            cidrs[str(parsed)] = None
        given[str(entry)] = None
    return _Parsed(tuple(cidrs), tuple(hosts), tuple(given))


def _parse_dns_servers(raw: object) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list | tuple) or not all(isinstance(s, str) for s in raw):
        raise PolicyError("network.dnsServers must be a list of IPv4 addresses")
    if len(raw) > MAX_DNS_SERVERS:
        raise PolicyError(f"network.dnsServers has {len(raw)} entries; at most {MAX_DNS_SERVERS}")
    out: dict[str, None] = {}
    for s in raw:
        try:
            out[str(ipaddress.IPv4Address(s))] = None
        except ValueError:
            raise PolicyError(f"invalid DNS server {s!r}: expected an IPv4 address") from None
    return tuple(out)


def _normalise(entries: Iterable[str], *, what: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(_parse_ip_entry(e, what=what)) for e in entries))


def _normalise_hosts(entries: Iterable[str]) -> tuple[str, ...]:
    out: dict[str, None] = {}
    for e in entries:
        pattern = host_pattern(e)
        if pattern is None:
            raise PolicyError(f"invalid host name {e!r}")
        out[pattern] = None
    return tuple(out)


def host_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether host `name` (normalised) matches one of `patterns`: an exact name,
    or `*.suffix`, which matches names below `suffix` at any depth but not
    `suffix` itself (as E2B)."""
    for p in patterns:
        if p.startswith("*."):
            if name.endswith(p[1:]) and len(name) > len(p) - 1:
                return True
        elif name == p:
            return True
    return False


def _in_any(ip: ipaddress.IPv4Address, nets: Iterable[str | IPNetwork]) -> bool:
    for n in nets:
        net = ipaddress.ip_network(n) if isinstance(n, str) else n
        if net.version == 4 and ip in net:
            return True
    return False


@dataclass(frozen=True)
class Decision:
    """The proxy's verdict on one connection, and why, in words for the egress log.

    `verify` is the host name whose resolution must contain the dialled
    address before the connection may go (None: the address alone decided).
    """

    allowed: bool
    reason: str
    verify: str | None = None


@dataclass(frozen=True, kw_only=True)
class EgressPolicy:
    """What a sandbox may connect to. The default allows the internet."""

    allow_internet: bool = True
    allow_out: tuple[str, ...] = ()  # normalised CIDRs (an IP becomes /32)
    deny_out: tuple[str, ...] = ()
    # host-name rules: exact names and `*.suffix` wildcards, lowercase
    allow_hosts: tuple[str, ...] = ()
    deny_hosts: tuple[str, ...] = ()
    # `network.rules` as `aenv.proto.egressrules.HostRules.rules`: (host pattern,
    # headers) pairs; their hosts' connections are intercepted, never allowed by it
    rules: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # the sandbox's workload tokens (`iam`) as (name, audience, token type):
    # what `${e2b.identity.tokens.NAME}` in its rules resolves to
    iam_tokens: tuple[tuple[str, str, str], ...] = ()
    # resolvers opened when `allow_hosts` is not empty (None: the default, 8.8.8.8)
    dns_servers: tuple[str, ...] | None = None
    # The lists as the client spelled them, reported back by GET as E2B does.
    allow_out_given: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    deny_out_given: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    # `egressProxy`: the SOCKS5 proxy the sandbox's filtered TCP leaves through
    proxy: ProxyConfig | None = None
    # Ingress settings kept with the network config (journaled, forked, moved with
    # it; see `aenv.proto.ingress`): the Host header requests into the sandbox
    # carry, and the sandbox ports the node's proxy reaches over TLS.
    mask_request_host: str | None = None
    https_ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Direct construction gets the same normalisation as from_request.
        object.__setattr__(self, "allow_out", _normalise(self.allow_out, what="allowOut"))
        object.__setattr__(self, "deny_out", _normalise(self.deny_out, what="denyOut"))
        object.__setattr__(self, "allow_hosts", _normalise_hosts(self.allow_hosts))
        object.__setattr__(self, "deny_hosts", _normalise_hosts(self.deny_hosts))
        if self.dns_servers is not None:
            object.__setattr__(self, "dns_servers", _parse_dns_servers(self.dns_servers))

    @property
    def has_hosts(self) -> bool:
        """Whether host-name rules exist: the sandbox's TCP goes through the egress proxy."""
        return bool(self.allow_hosts or self.deny_hosts or self.rules)

    @property
    def tunnels(self) -> bool:
        """Whether the sandbox's TCP goes through the node's egress proxy
        (host-name rules to decide, or an `egressProxy` to leave through)."""
        return self.has_hosts or self.proxy is not None

    @property
    def resolvers(self) -> tuple[str, ...]:
        """The DNS servers opened by host names in allowOut (none without such names)."""
        if not self.allow_hosts:
            return ()
        return DEFAULT_DNS_SERVERS if self.dns_servers is None else self.dns_servers

    @property
    def open_cidrs(self) -> tuple[str, ...]:
        """What allowOut accepts by address: its CIDRs and the opened resolvers."""
        return tuple(dict.fromkeys([*self.allow_out, *(f"{r}/32" for r in self.resolvers)]))

    def to_doc(self) -> dict[str, Any]:
        """The policy as stored in a journal record or sent between nodes."""
        return {
            "allowInternet": self.allow_internet,
            "allowOut": list(self.allow_out),
            "denyOut": list(self.deny_out),
            "allowHosts": list(self.allow_hosts),
            "denyHosts": list(self.deny_hosts),
            "dnsServers": None if self.dns_servers is None else list(self.dns_servers),
            "rules": [[h, [[k, v] for k, v in hs]] for h, hs in self.rules],
            "iamTokens": [list(t) for t in self.iam_tokens],
            "allowOutGiven": None if self.allow_out_given is None else list(self.allow_out_given),
            "denyOutGiven": None if self.deny_out_given is None else list(self.deny_out_given),
            "proxy": None if self.proxy is None else self.proxy.to_doc(),
            "maskRequestHost": self.mask_request_host,
            "httpsPorts": list(self.https_ports),
        }

    @classmethod
    def from_doc(cls, p: Mapping[str, Any]) -> EgressPolicy:
        """The policy `to_doc` wrote (trusted input: this node's or a peer's;
        records written before host names existed lack their keys)."""
        dns = p.get("dnsServers")
        return cls(
            allow_internet=bool(p["allowInternet"]),
            allow_out=tuple(p["allowOut"]),
            deny_out=tuple(p["denyOut"]),
            allow_hosts=tuple(p.get("allowHosts") or ()),
            deny_hosts=tuple(p.get("denyHosts") or ()),
            dns_servers=None if dns is None else tuple(dns),
            rules=tuple(
                (str(h), tuple((str(k), str(v)) for k, v in hs)) for h, hs in p.get("rules") or ()
            ),
            iam_tokens=tuple((str(n), str(a), str(t)) for n, a, t in p.get("iamTokens") or ()),
            allow_out_given=None if p["allowOutGiven"] is None else tuple(p["allowOutGiven"]),
            deny_out_given=None if p["denyOutGiven"] is None else tuple(p["denyOutGiven"]),
            proxy=None if p.get("proxy") is None else ProxyConfig.from_doc(p["proxy"]),
            mask_request_host=p.get("maskRequestHost"),
            https_ports=tuple(int(x) for x in p.get("httpsPorts") or ()),
        )

    @classmethod
    def from_request(
        cls,
        *,
        allow_internet_access: bool | None,
        network: Mapping[str, object] | None,
    ) -> EgressPolicy:
        """Validate a create/update body's egress fields (E2B wire names).

        `allow_internet_access` None means "not given" (the internet is
        allowed). Only `allowOut`, `denyOut`, `dnsServers`, `egressProxy`,
        `maskRequestHost` and `httpsPorts` are read from `network`; the API layer vets its other keys.
        """
        if allow_internet_access is not None and not isinstance(allow_internet_access, bool):
            raise PolicyError("allow_internet_access must be a boolean")
        if network is None:
            network = {}
        elif not isinstance(network, Mapping):
            raise PolicyError("network must be an object")
        allow = _parse_list(network.get("allowOut"), what="allowOut")
        deny = _parse_list(network.get("denyOut"), what="denyOut")
        try:
            mask = parse_mask(network.get("maskRequestHost"))
            https_ports = parse_https_ports(network.get("httpsPorts"))
        except IngressError as e:
            raise PolicyError(str(e)) from None
        return cls(
            allow_internet=allow_internet_access is not False,
            allow_out=allow.cidrs,
            deny_out=deny.cidrs,
            allow_hosts=allow.hosts,
            deny_hosts=deny.hosts,
            dns_servers=_parse_dns_servers(network.get("dnsServers")),
            allow_out_given=allow.given if network.get("allowOut") is not None else None,
            deny_out_given=deny.given if network.get("denyOut") is not None else None,
            proxy=_parse_proxy(network.get("egressProxy")),
            mask_request_host=mask,
            https_ports=https_ports,
        )

    def allows(self, ip: str, *, blocked: Iterable[str] = ()) -> bool:
        """Whether a new connection from the sandbox to `ip` is let through
        by address alone (no host name known: what non-TCP traffic gets).

        `blocked` adds the caller's never-reachable ranges (the slot CIDR) to
        `ALWAYS_BLOCKED`. IPv6 destinations are never allowed.
        """
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            raise PolicyError(f"not an IP address: {ip!r}") from None
        if not isinstance(addr, ipaddress.IPv4Address):
            return False
        if _in_any(addr, _ALWAYS_BLOCKED_NETS) or _in_any(addr, blocked):
            return False
        if _in_any(addr, self.open_cidrs):
            return True
        if not self.allow_internet:
            return False
        return not _in_any(addr, self.deny_out)

    def needs_name(self, ip: str) -> bool:
        """Whether a TCP connection to `ip` (not always-blocked) must name its
        host before it can be decided: some host rule could change the verdict
        the address alone gives."""
        addr = ipaddress.IPv4Address(ip)
        if _in_any(addr, self.open_cidrs):
            return False
        by_address = self.allow_internet and not _in_any(addr, self.deny_out)
        if by_address:
            return bool(self.deny_hosts or self.rules)
        return bool(self.allow_hosts)

    def decide(self, ip: str, name: str | None) -> Decision:
        """The verdict on a TCP connection to `ip` that names host `name` (None:
        none could be read), as E2B evaluates it: an allowOut entry (address
        or name) beats any denyOut entry; without internet, or in a denyOut
        CIDR, only allowOut lets through. An allowed name must still prove
        itself: the caller checks `ip` is an address of `Decision.verify`.
        """
        addr = ipaddress.IPv4Address(ip)
        if _in_any(addr, _ALWAYS_BLOCKED_NETS):
            return Decision(False, "address in a range sandboxes never reach")
        if _in_any(addr, self.open_cidrs):
            return Decision(True, "address in allowOut")
        if name is not None and host_matches(name, self.allow_hosts):
            return Decision(True, "host in allowOut", verify=name)
        if name is not None and host_matches(name, self.deny_hosts):
            return Decision(False, "host in denyOut")
        if not self.allow_internet:
            return Decision(False, "internet access off" if name else "address not in allowOut")
        if _in_any(addr, self.deny_out):
            return Decision(False, "address in denyOut")
        return Decision(True, "internet access on")

    def to_api(self) -> dict[str, object]:
        """The egress part of `SandboxDetail.network` (`allowOut`, `denyOut`, `dnsServers`).

        A list is reported only when the client set one, as it spelled it;
        `allow_internet` is reported separately as `allowInternetAccess`.
        """
        out: dict[str, object] = {}
        allow = self.allow_out_given
        if allow is None:
            allow = (*self.allow_out, *self.allow_hosts)
        deny = self.deny_out_given
        if deny is None:
            deny = (*self.deny_out, *self.deny_hosts)
        if allow or self.allow_out_given is not None:
            out["allowOut"] = list(allow)
        if deny or self.deny_out_given is not None:
            out["denyOut"] = list(deny)
        if self.dns_servers is not None:
            out["dnsServers"] = list(self.dns_servers)
        if self.proxy is not None:
            out["egressProxy"] = self.proxy.to_api()
        if self.rules:
            out["rules"] = {h: [{"transform": {"headers": dict(hs)}}] for h, hs in self.rules}
        if self.mask_request_host is not None:
            out["maskRequestHost"] = self.mask_request_host
        if self.https_ports:
            out["httpsPorts"] = list(self.https_ports)
        return out


def _parse_proxy(raw: object) -> ProxyConfig | None:
    """`egressProxy`, refused when its address is a literal in a range the node
    never lets sandboxes reach (a name is checked when it is resolved, at dial time)."""
    if raw is None:
        return None
    try:
        proxy = ProxyConfig.from_request(raw)
    except ProxyConfigError as e:
        raise PolicyError(str(e)) from None
    if proxy.host_is_ip and not proxy_address_allowed(proxy.host):
        raise PolicyError(f"network.egressProxy.address {proxy.address}: an internal address")
    return proxy


def proxy_address_allowed(ip: str, *, blocked: Iterable[str] = ()) -> bool:
    """Whether the node may dial an egress proxy at `ip`: an IPv4 address outside
    the ranges sandboxes never reach (`blocked` adds the caller's own)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if not isinstance(addr, ipaddress.IPv4Address):
        return False
    return not (_in_any(addr, _ALWAYS_BLOCKED_NETS) or _in_any(addr, blocked))


# -- nftables rendering -------------------------------------------------------


def _check_name(name: str, what: str) -> str:
    if not _NFT_NAME_RE.match(name):
        raise ValueError(f"invalid nftables {what} name {name!r}")
    return name


def _check_ifname(name: str) -> str:
    if not _IFNAME_RE.match(name):
        raise ValueError(f"invalid interface name {name!r}")
    return name


def _v4_elements(cidrs: Iterable[str | IPNetwork]) -> str:
    nets = [
        n
        for n in (ipaddress.ip_network(c) if isinstance(c, str) else c for c in cidrs)
        if isinstance(n, ipaddress.IPv4Network)
    ]
    return ", ".join(str(n) for n in ipaddress.collapse_addresses(nets))


def slot_chain(index: int) -> str:
    return f"slot{index}"


REJECT = "reject with icmpx type admin-prohibited"


def render_table(
    *,
    table: str,
    cidr: str,
    egress_cap: Sequence[str] = ("0.0.0.0/0",),
    proxy_port: int | None = None,
) -> str:
    """The node's `inet` table, replacing any earlier one of that name atomically.

    Slot interfaces are known by name only through the `ifaces` set (and the
    `slots` dispatch map), which the slot scripts fill, so the table never
    matches another node's or program's interfaces. Traffic between the
    internet and sandboxes is forwarded only as the sandbox's own connections
    and their replies; anything from a slot to the host itself is dropped
    unless it answers a connection the host opened. `egress_cap` is the
    operator's bound on every sandbox's egress: destinations outside it are
    refused whatever a sandbox's own policy allows. Refusals are rejects
    (ICMP administratively prohibited), so a blocked connect or DNS query fails
    at once instead of timing out. With `proxy_port`, the host accepts from a
    slot only the connections a slot's `redirects` chain sent to the egress
    proxy listening there (`ct status dnat`); a sandbox dialling the port
    itself is refused like any other host port, and the port is closed to
    every other interface (the proxy listens on all addresses).
    """
    t = _check_name(table, "table")
    net = ipaddress.IPv4Network(cidr)
    blocked = _v4_elements([*_ALWAYS_BLOCKED_NETS, net])
    cap = _v4_elements([str(ipaddress.IPv4Network(c, strict=False)) for c in egress_cap])
    cap_set = (
        f"add set inet {t} egress_cap {{ type ipv4_addr; flags interval; elements = {{ {cap} }}; }}"
        if cap
        else f"add set inet {t} egress_cap {{ type ipv4_addr; flags interval; }}"
    )
    return "\n".join(
        [
            f"add table inet {t}",
            f"delete table inet {t}",
            f"add table inet {t}",
            f"add set inet {t} blocked {{ type ipv4_addr; flags interval; elements = {{ {blocked} }}; }}",
            f"add set inet {t} ifaces {{ type ifname; }}",
            cap_set,
            f"add map inet {t} slots {{ type ifname : verdict; }}",
            f"add map inet {t} redirects {{ type ifname : verdict; }}",
            f"add chain inet {t} forward {{ type filter hook forward priority filter; policy accept; }}",
            f"add rule inet {t} forward oifname @ifaces ct state established,related accept",
            f"add rule inet {t} forward oifname @ifaces drop",
            f"add rule inet {t} forward iifname @ifaces ip daddr != @egress_cap {REJECT}",
            f"add rule inet {t} forward iifname vmap @slots",
            f"add rule inet {t} forward iifname @ifaces drop",
            f"add chain inet {t} input {{ type filter hook input priority filter; policy accept; }}",
            f"add rule inet {t} input iifname @ifaces ct state established,related accept",
            *(
                [
                    f"add rule inet {t} input iifname @ifaces tcp dport {int(proxy_port)} ct status dnat accept",
                    f"add rule inet {t} input iifname != @ifaces tcp dport {int(proxy_port)} drop",
                ]
                if proxy_port is not None
                else []
            ),
            f"add rule inet {t} input iifname @ifaces {REJECT}",
            f"add chain inet {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}",
            f"add rule inet {t} prerouting iifname vmap @redirects",
            f"add chain inet {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
            f"add rule inet {t} postrouting ip saddr {net} ip daddr != {net} masquerade",
            "",
        ]
    )


def render_slot_rules(
    *,
    table: str,
    index: int,
    iface: str,
    sandbox_ip: str,
    policy: EgressPolicy,
    proxy_port: int | None = None,
) -> str:
    """One slot's chain and sets; creates them or atomically replaces their contents.

    Order, as E2B: always-blocked ranges drop, then allowOut accepts, then
    (without internet) everything else drops, then denyOut drops, else accept.
    Packets with another source address than the sandbox's, and IPv6, drop.
    A policy with host names (and a `proxy_port`) also fills the slot's nat
    chain: new TCP connections that the address alone does not settle (not
    always-blocked, inside the egress cap, not to the host itself, not in
    allowOut) are redirected to the egress proxy on the slot's host address.
    A policy with an `egressProxy` redirects all such TCP, allowOut included,
    so every allowed connection leaves through the SOCKS5 proxy. Without
    either the nat chain stays empty, so the proxy costs nothing.
    """
    t = _check_name(table, "table")
    ch = _check_name(slot_chain(index), "chain")
    ifn = _check_ifname(iface)
    src = ipaddress.IPv4Address(sandbox_ip)
    lines = [f"add chain inet {t} {ch}", f"flush chain inet {t} {ch}"]
    for kind, cidrs in (("allow", policy.open_cidrs), ("deny", policy.deny_out)):
        s = f"{ch}_{kind}"
        lines.append(f"add set inet {t} {s} {{ type ipv4_addr; flags interval; }}")
        lines.append(f"flush set inet {t} {s}")
        elements = _v4_elements(cidrs)
        if elements:
            lines.append(f"add element inet {t} {s} {{ {elements} }}")
    rule = f"add rule inet {t} {ch}"
    lines += [
        f"{rule} meta nfproto != ipv4 drop",
        f"{rule} ip saddr != {src} drop",
        f"{rule} ip daddr @blocked {REJECT}",
        f"{rule} ip daddr @{ch}_allow accept",
    ]
    if not policy.allow_internet:
        lines.append(f"{rule} {REJECT}")
    else:
        lines += [f"{rule} ip daddr @{ch}_deny {REJECT}", f"{rule} accept"]
    lines.append(f'add element inet {t} ifaces {{ "{ifn}" }}')
    lines.append(f'add element inet {t} slots {{ "{ifn}" : jump {ch} }}')
    nat = f"{ch}_nat"
    lines += [f"add chain inet {t} {nat}", f"flush chain inet {t} {nat}"]
    if policy.tunnels and proxy_port is not None:
        rule = f"add rule inet {t} {nat}"
        lines += [
            f"{rule} ip saddr != {src} return",
            f"{rule} ip daddr @blocked return",
            f"{rule} ip daddr != @egress_cap return",
            f"{rule} fib daddr type local return",
            # with an egressProxy, TCP to allowOut addresses leaves through it too
            *([] if policy.proxy is not None else [f"{rule} ip daddr @{ch}_allow return"]),
            f"{rule} meta l4proto tcp redirect to :{int(proxy_port)}",
        ]
    lines.append(f'add element inet {t} redirects {{ "{ifn}" : jump {nat} }}')
    lines.append("")
    return "\n".join(lines)


def render_slot_delete(*, table: str, index: int, iface: str) -> str:
    """Remove one slot's interface entries, chain and sets (fails if any is missing).

    Run after the interface is gone: traffic never sees a slot interface that
    is not in `ifaces`.
    """
    t = _check_name(table, "table")
    ch = _check_name(slot_chain(index), "chain")
    ifn = _check_ifname(iface)
    return "\n".join(
        [
            f'delete element inet {t} slots {{ "{ifn}" }}',
            f'delete element inet {t} redirects {{ "{ifn}" }}',
            f"flush chain inet {t} {ch}_nat",
            f"delete chain inet {t} {ch}_nat",
            f'delete element inet {t} ifaces {{ "{ifn}" }}',
            f"flush chain inet {t} {ch}",
            f"delete chain inet {t} {ch}",
            f"delete set inet {t} {ch}_allow",
            f"delete set inet {t} {ch}_deny",
            "",
        ]
    )
