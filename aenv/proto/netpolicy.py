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
and one that removes a slot. Domain names in `allowOut` are not supported yet.
IPv6 egress is always dropped (sandboxes get no IPv6 address).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALL_TRAFFIC: Final = "0.0.0.0/0"
# Bound on entries per list, so one request cannot build an unbounded ruleset.
MAX_ENTRIES: Final = 4096

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


def _parse_entry(entry: object, *, what: str) -> IPNetwork:
    if not isinstance(entry, str):
        raise PolicyError(f"{what} entries must be strings, got {type(entry).__name__}")
    try:
        net = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        if what == "allowOut" and _DOMAIN_RE.match(entry):
            raise PolicyError(
                f"allowOut entry {entry!r} is a domain name; aenv supports only IP "
                "addresses and CIDR blocks in allowOut for now"
            ) from None
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


def _parse_list(raw: object, *, what: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return (normalised CIDRs, entries as given), both de-duplicated in order."""
    if raw is None:
        return (), ()
    if not isinstance(raw, list | tuple):
        raise PolicyError(f"network.{what} must be a list of strings")
    if len(raw) > MAX_ENTRIES:
        raise PolicyError(f"network.{what} has {len(raw)} entries; at most {MAX_ENTRIES}")
    norm: dict[str, None] = {}
    given: dict[str, None] = {}
    for entry in raw:
        norm[str(_parse_entry(entry, what=what))] = None
        given[str(entry)] = None
    return tuple(norm), tuple(given)


def _normalise(entries: Iterable[str], *, what: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(_parse_entry(e, what=what)) for e in entries))


def _in_any(ip: ipaddress.IPv4Address, nets: Iterable[str | IPNetwork]) -> bool:
    for n in nets:
        net = ipaddress.ip_network(n) if isinstance(n, str) else n
        if net.version == 4 and ip in net:
            return True
    return False


@dataclass(frozen=True, kw_only=True)
class EgressPolicy:
    """What a sandbox may connect to. The default allows the internet."""

    allow_internet: bool = True
    allow_out: tuple[str, ...] = ()  # normalised CIDRs (an IP becomes /32)
    deny_out: tuple[str, ...] = ()
    # The lists as the client spelled them, reported back by GET as E2B does.
    allow_out_given: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    deny_out_given: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Direct construction gets the same normalisation as from_request.
        object.__setattr__(self, "allow_out", _normalise(self.allow_out, what="allowOut"))
        object.__setattr__(self, "deny_out", _normalise(self.deny_out, what="denyOut"))

    def to_doc(self) -> dict[str, Any]:
        """The policy as stored in a journal record or sent between nodes."""
        return {
            "allowInternet": self.allow_internet,
            "allowOut": list(self.allow_out),
            "denyOut": list(self.deny_out),
            "allowOutGiven": None if self.allow_out_given is None else list(self.allow_out_given),
            "denyOutGiven": None if self.deny_out_given is None else list(self.deny_out_given),
        }

    @classmethod
    def from_doc(cls, p: Mapping[str, Any]) -> EgressPolicy:
        """The policy `to_doc` wrote (trusted input: this node's or a peer's)."""
        return cls(
            allow_internet=bool(p["allowInternet"]),
            allow_out=tuple(p["allowOut"]),
            deny_out=tuple(p["denyOut"]),
            allow_out_given=None if p["allowOutGiven"] is None else tuple(p["allowOutGiven"]),
            deny_out_given=None if p["denyOutGiven"] is None else tuple(p["denyOutGiven"]),
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
        allowed). Only `allowOut` and `denyOut` are read from `network`; the
        API layer vets its other keys.
        """
        if allow_internet_access is not None and not isinstance(allow_internet_access, bool):
            raise PolicyError("allow_internet_access must be a boolean")
        if network is None:
            network = {}
        elif not isinstance(network, Mapping):
            raise PolicyError("network must be an object")
        allow, allow_given = _parse_list(network.get("allowOut"), what="allowOut")
        deny, deny_given = _parse_list(network.get("denyOut"), what="denyOut")
        return cls(
            allow_internet=allow_internet_access is not False,
            allow_out=allow,
            deny_out=deny,
            allow_out_given=allow_given if network.get("allowOut") is not None else None,
            deny_out_given=deny_given if network.get("denyOut") is not None else None,
        )

    def allows(self, ip: str, *, blocked: Iterable[str] = ()) -> bool:
        """Whether a new connection from the sandbox to `ip` is let through.

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
        if _in_any(addr, self.allow_out):
            return True
        if not self.allow_internet:
            return False
        return not _in_any(addr, self.deny_out)

    def to_api(self) -> dict[str, object]:
        """The egress part of `SandboxDetail.network` (`allowOut`, `denyOut`).

        A list is reported only when the client set one, as it spelled it;
        `allow_internet` is reported separately as `allowInternetAccess`.
        """
        out: dict[str, object] = {}
        allow = self.allow_out_given if self.allow_out_given is not None else self.allow_out
        deny = self.deny_out_given if self.deny_out_given is not None else self.deny_out
        if allow or self.allow_out_given is not None:
            out["allowOut"] = list(allow)
        if deny or self.deny_out_given is not None:
            out["denyOut"] = list(deny)
        return out


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


def render_table(*, table: str, cidr: str, egress_cap: Sequence[str] = ("0.0.0.0/0",)) -> str:
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
    at once instead of timing out.
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
            f"add chain inet {t} forward {{ type filter hook forward priority filter; policy accept; }}",
            f"add rule inet {t} forward oifname @ifaces ct state established,related accept",
            f"add rule inet {t} forward oifname @ifaces drop",
            f"add rule inet {t} forward iifname @ifaces ip daddr != @egress_cap {REJECT}",
            f"add rule inet {t} forward iifname vmap @slots",
            f"add rule inet {t} forward iifname @ifaces drop",
            f"add chain inet {t} input {{ type filter hook input priority filter; policy accept; }}",
            f"add rule inet {t} input iifname @ifaces ct state established,related accept",
            f"add rule inet {t} input iifname @ifaces {REJECT}",
            f"add chain inet {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
            f"add rule inet {t} postrouting ip saddr {net} ip daddr != {net} masquerade",
            "",
        ]
    )


def render_slot_rules(
    *, table: str, index: int, iface: str, sandbox_ip: str, policy: EgressPolicy
) -> str:
    """One slot's chain and sets; creates them or atomically replaces their contents.

    Order, as E2B: always-blocked ranges drop, then allowOut accepts, then
    (without internet) everything else drops, then denyOut drops, else accept.
    Packets with another source address than the sandbox's, and IPv6, drop.
    """
    t = _check_name(table, "table")
    ch = _check_name(slot_chain(index), "chain")
    ifn = _check_ifname(iface)
    src = ipaddress.IPv4Address(sandbox_ip)
    lines = [f"add chain inet {t} {ch}", f"flush chain inet {t} {ch}"]
    for kind, cidrs in (("allow", policy.allow_out), ("deny", policy.deny_out)):
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
            f'delete element inet {t} ifaces {{ "{ifn}" }}',
            f"flush chain inet {t} {ch}",
            f"delete chain inet {t} {ch}",
            f"delete set inet {t} {ch}_allow",
            f"delete set inet {t} {ch}_deny",
            "",
        ]
    )
