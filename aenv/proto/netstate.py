"""The node's host network as it should be and as it is, sans-IO.

A node owns host state under its own names: network namespaces `{prefix}-N`,
veths `{prefix}hN`, the nftables table `inet {table}`, and one IPv4 range its
slots are carved from. Other programs (another node, an operator's `nft flush
ruleset`, a script deleting namespaces) can take parts of it away while the
node runs; this module decides, from what the node reads of the host, what is
missing and what to do about it, and, at start, whether the node's names and
address range are free.

- `Shape` is what the watchdog compares of a table: its chains with their
  rule counts, its sets with their element counts, the interfaces in the
  `ifaces` set and the `slots` dispatch map. `shape_of_script` reads the
  shape the node's own nft scripts (`aenv.proto.netpolicy`) install;
  `shape_of_listing` reads it from `nft -j list table`.
- `diagnose` compares the expected table and open slots with what the host
  holds and returns a `Diagnosis`: rebuild the whole table (and why), re-add
  some slots' rules, and which slots lost their namespace or veth.
- `range_users` names the interfaces and routes of other programs inside a
  slot range; `claim_conflicts` the other live nodes that share this node's
  names, home or range; `pick_range` chooses a range when none is configured.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# a node's names prefix: netns `{prefix}-N`, veth `{prefix}hN` (at most 15
# characters: 10 leave room for 10000 slots), nftables table, cgroup parent
PREFIX_RE: Final = re.compile(r"^[a-z][a-z0-9]{0,9}$")

_ADD_RE: Final = re.compile(r"^add (table|chain|rule|set|map|element) inet (\S+)(?: (\S+))?(.*)$")
_BRACES_RE: Final = re.compile(r"\{(.*)\}")
_ELEMENTS_RE: Final = re.compile(r"elements = \{([^}]*)\}")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The parts of one nftables table the watchdog compares."""

    chains: Mapping[str, int] = field(default_factory=dict)  # chain -> rules in it
    sets: Mapping[str, int] = field(default_factory=dict)  # set or map -> elements in it
    ifaces: frozenset[str] = frozenset()  # the `ifaces` set's interface names
    dispatch: Mapping[str, str] = field(default_factory=dict)  # `slots` map: ifname -> chain


def _count_elements(text: str) -> int:
    text = text.strip()
    return 0 if not text else text.count(",") + 1


def shape_of_script(script: str, *, table: str) -> Shape:
    """The shape an `nft -f` script of this node's leaves in `inet {table}`.

    Reads only the statements `aenv.proto.netpolicy` writes (`add table`,
    `add chain`, `add set`, `add map`, `add rule`, `add element`); `flush`
    and `delete` statements empty or remove what an earlier statement of the
    same script made, as they do in the nft transaction.
    """
    chains: dict[str, int] = {}
    sets: dict[str, int] = {}
    ifaces: set[str] = set()
    dispatch: dict[str, str] = {}
    for line in script.splitlines():
        words = line.split()
        if words[:2] == ["delete", "table"] and words[3:4] == [table]:
            chains, sets, ifaces, dispatch = {}, {}, set(), {}
            continue
        if words[:1] == ["flush"] and len(words) >= 5 and words[3] == table:
            if words[1] == "chain":
                chains[words[4]] = 0
            elif words[1] == "set":
                sets[words[4]] = 0
            continue
        m = _ADD_RE.match(line)
        if m is None or m.group(2) != table:
            continue
        kind, name, rest = m.group(1), m.group(3) or "", m.group(4)
        if kind == "chain":
            chains.setdefault(name, 0)
        elif kind == "rule":
            chains[name] = chains.get(name, 0) + 1
        elif kind in ("set", "map"):
            found = _ELEMENTS_RE.search(rest)
            sets.setdefault(name, 0)
            sets[name] += _count_elements(found.group(1)) if found else 0
        elif kind == "element":
            braces = _BRACES_RE.search(rest)
            inner = braces.group(1) if braces else ""
            if name == "ifaces":
                ifaces.update(e.strip().strip('"') for e in inner.split(",") if e.strip())
            elif name == "slots":
                for entry in inner.split(","):
                    key, _, verdict = entry.partition(":")
                    target = verdict.split()
                    if len(target) == 2 and target[0] == "jump":
                        dispatch[key.strip().strip('"')] = target[1]
            sets[name] = sets.get(name, 0) + _count_elements(inner)
    return Shape(chains=chains, sets=sets, ifaces=frozenset(ifaces), dispatch=dispatch)


def shape_of_listing(listing: str | Mapping[str, Any], *, table: str) -> Shape:
    """The shape of `inet {table}` in `nft -j list table inet {table}` output."""
    doc = json.loads(listing) if isinstance(listing, str) else listing
    chains: dict[str, int] = {}
    sets: dict[str, int] = {}
    ifaces: set[str] = set()
    dispatch: dict[str, str] = {}
    for obj in doc.get("nftables", []):
        if not isinstance(obj, dict) or len(obj) != 1:
            continue
        ((kind, body),) = obj.items()
        if not isinstance(body, dict) or body.get("family") != "inet":
            continue
        if body.get("table") != table:
            continue
        if kind == "chain":
            chains.setdefault(str(body.get("name")), 0)
        elif kind == "rule":
            chain = str(body.get("chain"))
            chains[chain] = chains.get(chain, 0) + 1
        elif kind in ("set", "map"):
            name = str(body.get("name"))
            elems = body.get("elem") or []
            sets[name] = len(elems)
            if name == "ifaces":
                ifaces.update(e for e in elems if isinstance(e, str))
            elif name == "slots":
                for e in elems:
                    if isinstance(e, list) and len(e) == 2 and isinstance(e[1], dict):
                        target = (e[1].get("jump") or {}).get("target")
                        if isinstance(e[0], str) and isinstance(target, str):
                            dispatch[e[0]] = target
    return Shape(chains=chains, sets=sets, ifaces=frozenset(ifaces), dispatch=dispatch)


def shape_gaps(expected: Shape, observed: Shape) -> list[str]:
    """What of `expected` `observed` lacks, in words ([] if nothing).

    A chain must exist with as many rules; a set that should hold elements
    must hold some (an interval set's elements may be listed merged); every
    expected interface must be in `ifaces` and dispatch to its chain.
    """
    gaps: list[str] = []
    for chain, rules in expected.chains.items():
        have = observed.chains.get(chain)
        if have is None:
            gaps.append(f"chain {chain} is missing")
        elif have != rules:
            gaps.append(f"chain {chain} has {have} of its {rules} rules")
    for name, elements in expected.sets.items():
        have = observed.sets.get(name)
        if have is None:
            gaps.append(f"set {name} is missing")
        elif elements and not have:
            gaps.append(f"set {name} is empty")
    gaps += [f"{i} is not in set ifaces" for i in sorted(expected.ifaces - observed.ifaces)]
    for iface, chain in sorted(expected.dispatch.items()):
        if observed.dispatch.get(iface) != chain:
            gaps.append(f"{iface} does not jump to {chain}")
    return gaps


@dataclass(frozen=True, kw_only=True)
class SlotNames:
    """What one open slot owns on the host."""

    netns: str
    veth: str
    rules: Shape  # its chain, sets and entries in the table (`shape_of_script`)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    # why the whole table must be written again (None: it is whole)
    table: str | None = None
    # slot -> what of its rules is missing (re-add them); empty when `table` is set
    rules: Mapping[int, str] = field(default_factory=dict)
    # slot -> its network namespace's name is gone (the namespace may live on)
    netns_gone: tuple[int, ...] = ()
    # slot -> its veth is gone: its network is gone, it cannot be repaired
    veth_gone: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        return not (self.table or self.rules or self.netns_gone or self.veth_gone)


def diagnose(
    *,
    table: Shape,
    slots: Mapping[int, SlotNames],
    observed: Shape | None,
    netns: Collection[str],
    links: Collection[str],
) -> Diagnosis:
    """Compare the node's table (`table`: its base, without slots) and its open
    `slots` with what the host holds: `observed` (None: no such table), the
    names of the network namespaces and of the links."""
    rebuild: str | None = None
    rules: dict[int, str] = {}
    if observed is None:
        rebuild = "the table is gone"
    else:
        gaps = shape_gaps(table, observed)
        if gaps:
            rebuild = "; ".join(gaps)
        else:
            for index, slot in sorted(slots.items()):
                if slot_gaps := shape_gaps(slot.rules, observed):
                    rules[index] = "; ".join(slot_gaps)
    return Diagnosis(
        table=rebuild,
        rules=rules,
        netns_gone=tuple(i for i, s in sorted(slots.items()) if s.netns not in netns),
        veth_gone=tuple(i for i, s in sorted(slots.items()) if s.veth not in links),
    )


# -- names and address ranges at start ------------------------------------------


# the ranges a node picks its slots from when none is configured, in order
AUTO_SLOT_CIDRS: Final = tuple(f"10.{b}.0.0/16" for b in range(231, 199, -1))


def range_users(
    cidr: str,
    *,
    addresses: Iterable[tuple[str, str]],
    routes: Iterable[tuple[str, str]],
    own: re.Pattern[str],
) -> list[str]:
    """The interfaces and routes of others inside `cidr`, in words.

    `addresses` are (interface, "address/prefixlen"), `routes` (interface,
    destination) as the host lists them; an interface whose name `own`
    matches is this node's. An address counts if it lies in `cidr` (or its
    network does); a route if its destination does (a wider route, such as a
    VPN's 10.0.0.0/8, is not a collision: the slots' routes are more specific).
    """
    net = ipaddress.IPv4Network(cidr)
    found: list[str] = []
    for dev, text in addresses:
        if own.match(dev):
            continue
        try:
            iface = ipaddress.ip_interface(text)
        except ValueError:
            continue
        if not isinstance(iface, ipaddress.IPv4Interface):
            continue
        if iface.ip in net or iface.network.subnet_of(net):
            found.append(f"address {text} on {dev}")
    for dev, dst in routes:
        if own.match(dev) or dst == "default":
            continue
        try:
            route = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if isinstance(route, ipaddress.IPv4Network) and route.subnet_of(net):
            found.append(f"route to {dst} via {dev}")
    return sorted(set(found))


@dataclass(frozen=True, kw_only=True)
class Claim:
    """What a running node holds on its host: its names, its home, its range."""

    prefix: str
    home: str
    cidr: str
    pid: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {"prefix": self.prefix, "home": self.home, "cidr": self.cidr, "pid": self.pid}
        )

    @classmethod
    def from_json(cls, text: str) -> Claim | None:
        try:
            d = json.loads(text)
            return cls(
                prefix=str(d["prefix"]), home=str(d["home"]), cidr=str(d["cidr"]), pid=int(d["pid"])
            )
        except (ValueError, KeyError, TypeError):
            return None


def _who(claim: Claim) -> str:
    return f"the aenv node with home {claim.home} (pid {claim.pid})"


def claim_conflicts(
    *, prefix: str, home: str, cidr: str | None, others: Sequence[Claim]
) -> list[str]:
    """Why this node cannot hold `prefix`, `home` and `cidr` (None: not chosen
    yet) beside the live nodes `others`, in words with the setting to change
    ([] if it can)."""
    found: list[str] = []
    for other in others:
        if other.home == home:  # the rest follows from that
            found.append(
                f"{_who(other)} runs on this home already (each node needs its own AENV_HOME)"
            )
            continue
        if other.prefix == prefix:
            found.append(
                f"{_who(other)} uses the network names prefix {prefix!r} (give each node its "
                "own AENV_NET_PREFIX, or unset it to derive one from AENV_HOME)"
            )
        if cidr is not None and _overlap(cidr, other.cidr):
            found.append(
                f"{_who(other)} has its sandboxes in {other.cidr} (set AENV_SLOT_CIDR to a "
                "free range, or unset it to have one picked)"
            )
    return found


def _overlap(a: str, b: str) -> bool:
    try:
        return ipaddress.IPv4Network(a).overlaps(ipaddress.IPv4Network(b))
    except ValueError:
        return False


def pick_range(
    *,
    candidates: Sequence[str],
    own_addresses: Iterable[str],
    previous: str | None,
    taken: Callable[[str], bool],
) -> str | None:
    """The slot range for a node with none configured, or None if all are taken.

    The range this node's own slots are in (sandboxes still running from its
    earlier process) comes first, then the one it used last (`previous`),
    then the first of `candidates`; one that `taken` says others use is skipped.
    """
    ordered: list[str] = []
    for text in own_addresses:
        try:
            ip = ipaddress.ip_interface(text).ip
        except ValueError:
            continue
        ordered += [c for c in candidates if ip in ipaddress.ip_network(c)]
    if previous is not None:
        ordered.append(previous)
    ordered += candidates
    for cidr in dict.fromkeys(ordered):
        if not taken(cidr):
            return cidr
    return None
