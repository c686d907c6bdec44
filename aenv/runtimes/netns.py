"""Per-sandbox network slots on the host: netns, veth pair, addresses, nftables.

`open_host_network` prepares the host once per node: it reaps what a crashed
node with the same prefix left behind (netns, veths, its nftables table),
enables IPv4 forwarding and installs the node's `inet` table (masquerade for
the slot CIDR, forward/input filtering, see `aenv.proto.netpolicy`). Inside it,
`HostNetwork.open_slot(policy)` gives one sandbox a slot: slot i owns the i-th
/30 of the CIDR, a netns `{prefix}-{i}` whose `eth0` holds the sandbox address
(.2) with a default route to the host end (.1) of the veth `{prefix}h{i}`, and
a chain with that sandbox's egress policy. gVisor's netstack later takes over
`eth0`; the node reaches envd at the sandbox IP from the host netns. Leaving
the slot's block deletes all of it, also on cancellation (shielded, with a
deadline); `set_policy` swaps a slot's rules in one atomic nft transaction.
Everything runs through `ip` and `nft -f -` subprocesses.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from aenv.proto.netpolicy import (
    EgressPolicy,
    render_slot_delete,
    render_slot_rules,
    render_table,
)

log = logging.getLogger("aenv.runtimes.netns")

NETNS_DIR: Final = Path("/run/netns")
GUEST_IFACE: Final = "eth0"
CLEANUP_TIMEOUT_S: Final = 15.0
_PREFIX_RE: Final = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_TABLE_RE: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
_IFNAMSIZ: Final = 15


class NetworkSetupError(RuntimeError):
    """An `ip`/`nft` command failed while building or changing the host network."""


class NoFreeSlot(RuntimeError):
    """Every network slot of this node is in use."""


@dataclass(frozen=True, kw_only=True)
class NetSlot:
    index: int
    netns_name: str
    netns_path: Path
    host_veth: str
    host_ip: str
    sandbox_ip: str
    prefix_len: int


async def _run(argv: Sequence[str], *, stdin: str | None = None) -> str:
    proc = await trio.run_process(
        list(argv),
        stdin=stdin.encode() if stdin is not None else subprocess.DEVNULL,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise NetworkSetupError(f"{' '.join(argv[:4])} failed ({proc.returncode}): {err}")
    return str(proc.stdout.decode(errors="replace"))


async def _nft(script: str) -> None:
    await _run(["nft", "-f", "-"], stdin=script)


def _is_missing(exc: NetworkSetupError) -> bool:
    text = str(exc)
    return "Cannot find device" in text or "No such file or directory" in text


def _ipv6_present() -> bool:
    return Path("/proc/sys/net/ipv6").is_dir()


async def _list_netns() -> list[str]:
    out = await _run(["ip", "-j", "netns", "list"])
    return [str(e["name"]) for e in json.loads(out or "[]") if "name" in e]


async def _list_links() -> list[str]:
    out = await _run(["ip", "-j", "link", "show"])
    return [str(e["ifname"]) for e in json.loads(out or "[]") if "ifname" in e]


async def reap_stale(*, prefix: str, table: str, keep: Collection[int] = ()) -> list[str]:
    """Delete netns `{prefix}-N`, links `{prefix}hN` and table `inet {table}`,
    but the slots numbered in `keep` (and then the table, which the caller
    replaces atomically with their rules in it).

    Returns what was removed. Only names of exactly those shapes are touched,
    so another node's prefix (or a test's) is left alone.
    """
    removed: list[str] = []
    link_re = re.compile(rf"^{re.escape(prefix)}h(\d+)$")
    ns_re = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
    for name in await _list_links():
        if (m := link_re.match(name)) and int(m.group(1)) not in keep:
            try:
                await _run(["ip", "link", "del", "dev", name])
                removed.append(f"link {name}")
            except NetworkSetupError as exc:  # gone already (a peer of one we removed)
                log.warning("reap: %s", exc)
    for name in await _list_netns():
        if (m := ns_re.match(name)) and int(m.group(1)) not in keep:
            await _run(["ip", "netns", "del", name])
            removed.append(f"netns {name}")
    tables = await _run(["nft", "list", "tables", "inet"])
    if not keep and f"table inet {table}" in tables.splitlines():
        await _nft(f"delete table inet {table}\n")
        removed.append(f"table inet {table}")
    return removed


class HostNetwork:
    """The node's network slots; get one with `open_host_network`."""

    def __init__(
        self, *, cidr: ipaddress.IPv4Network, prefix: str, table: str, max_slots: int
    ) -> None:
        self._cidr = cidr
        self._prefix = prefix
        self._table = table
        self._max_slots = max_slots
        # Freed slots go to the back, so an address is reused as late as possible
        # (conntrack entries of the previous sandbox expire meanwhile).
        self._free: deque[int] = deque(range(max_slots))
        self._open: dict[int, NetSlot] = {}
        # slots an earlier node process made, kept for their sandboxes' adoption
        self._adoptable: dict[int, NetSlot] = {}
        self._quarantined: set[int] = set()
        self._closed = False
        self._ipv6 = _ipv6_present()
        self._opened_total = 0
        self._policy_updates = 0
        self._cleanup_failures = 0

    @property
    def cidr(self) -> str:
        return str(self._cidr)

    def _slot(self, index: int) -> NetSlot:
        base = self._cidr.network_address + 4 * index
        name = f"{self._prefix}-{index}"
        return NetSlot(
            index=index,
            netns_name=name,
            netns_path=NETNS_DIR / name,
            host_veth=f"{self._prefix}h{index}",
            host_ip=str(base + 1),
            sandbox_ip=str(base + 2),
            prefix_len=30,
        )

    def _rules(self, slot: NetSlot, policy: EgressPolicy) -> str:
        return render_slot_rules(
            table=self._table,
            index=slot.index,
            iface=slot.host_veth,
            sandbox_ip=slot.sandbox_ip,
            policy=policy,
        )

    def open_slot(self, policy: EgressPolicy) -> AbstractAsyncContextManager[NetSlot]:
        """A fresh slot with `policy`; leaving the block deletes it."""
        return self._open_slot(policy)

    def adopt_slot(self, index: int) -> AbstractAsyncContextManager[NetSlot]:
        """Own slot `index`, which an earlier node process made and this one kept
        (`open_host_network(adopt=...)`), as `open_slot` owns a new one."""
        return self._adopt_slot(index)

    @asynccontextmanager
    async def _adopt_slot(self, index: int) -> AsyncIterator[NetSlot]:
        slot = self._adoptable.pop(index, None)
        if slot is None or self._closed:
            raise RuntimeError(f"network slot {index} was not kept for adoption")
        self._open[index] = slot
        async with self._owned(slot):
            yield slot

    async def release_unadopted(self) -> None:
        """Delete the kept slots nobody adopted (their sandboxes could not be taken back)."""
        for index in list(self._adoptable):
            async with self._adopt_slot(index):
                pass

    @asynccontextmanager
    async def _open_slot(self, policy: EgressPolicy) -> AsyncIterator[NetSlot]:
        if self._closed:
            raise RuntimeError("host network is closed")
        if not self._free:
            raise NoFreeSlot(f"all {self._max_slots} network slots are in use")
        slot = self._slot(self._free.popleft())
        self._open[slot.index] = slot
        async with self._owned(slot):
            await self._create(slot, policy)
            self._opened_total += 1
            yield slot

    @asynccontextmanager
    async def _owned(self, slot: NetSlot) -> AsyncIterator[None]:
        """Delete `slot` when the block is left; its index is free again if that worked."""
        try:
            yield
        finally:
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True) as scope:
                ok = await self._destroy(slot)
            del self._open[slot.index]
            if ok and not scope.cancelled_caught:
                self._free.append(slot.index)
            else:
                # Never hand out an index whose leftovers might still exist.
                self._cleanup_failures += 1
                self._quarantined.add(slot.index)
                log.error("network slot %d not fully removed; quarantined", slot.index)

    async def _create(self, slot: NetSlot, policy: EgressPolicy) -> None:
        host_cidr = f"{slot.host_ip}/{slot.prefix_len}"
        guest_cidr = f"{slot.sandbox_ip}/{slot.prefix_len}"
        # Rules first: the interface is filtered from the moment it exists.
        await _nft(self._rules(slot, policy))
        await _run(["ip", "netns", "add", slot.netns_name])
        host = [
            f"link add {slot.host_veth} type veth peer name {GUEST_IFACE} netns {slot.netns_name}",
            f"addr add {host_cidr} dev {slot.host_veth}",
        ]
        guest = [f"addr add {guest_cidr} dev {GUEST_IFACE}"]
        if self._ipv6:
            # No IPv6 link-local addresses: sandboxes get no IPv6 at all.
            host.insert(1, f"link set dev {slot.host_veth} addrgenmode none")
            guest.insert(0, f"link set dev {GUEST_IFACE} addrgenmode none")
        host.append(f"link set dev {slot.host_veth} up")
        guest += [
            "link set dev lo up",
            f"link set dev {GUEST_IFACE} up",
            f"route add default via {slot.host_ip} dev {GUEST_IFACE}",
        ]
        await _run(["ip", "-batch", "-"], stdin="\n".join(host) + "\n")
        await _run(["ip", "-n", slot.netns_name, "-batch", "-"], stdin="\n".join(guest) + "\n")

    async def _destroy(self, slot: NetSlot) -> bool:
        """Best effort: try every step, report whether all that existed is gone."""
        steps: list[tuple[Sequence[str], str | None]] = [
            (["ip", "link", "del", "dev", slot.host_veth], None),
            (["ip", "netns", "del", slot.netns_name], None),
        ]
        if not self._closed:
            script = render_slot_delete(table=self._table, index=slot.index, iface=slot.host_veth)
            steps.append((["nft", "-f", "-"], script))
        ok = True
        for argv, stdin in steps:
            try:
                await _run(argv, stdin=stdin)
            except NetworkSetupError as exc:
                if not _is_missing(exc):
                    log.error("slot %d: %s", slot.index, exc)
                    ok = False
        return ok

    async def set_policy(self, slot: NetSlot, policy: EgressPolicy) -> None:
        """Replace the slot's egress rules in one atomic transaction.

        New connections follow the new policy; established ones continue.
        """
        if self._open.get(slot.index) != slot or self._closed:
            raise RuntimeError(f"network slot {slot.index} is not open")
        await _nft(self._rules(slot, policy))
        self._policy_updates += 1

    def statistics(self) -> dict[str, int]:
        return {
            "slots_max": self._max_slots,
            "slots_open": len(self._open),
            "slots_free": len(self._free),
            "slots_quarantined": len(self._quarantined),
            "slots_opened_total": self._opened_total,
            "policy_updates_total": self._policy_updates,
            "cleanup_failures_total": self._cleanup_failures,
        }

    async def _close(self) -> None:
        # Slots still open belong to callers that have not left their block;
        # take their links and netns down now, the table goes with the node.
        self._closed = True
        for slot in list(self._open.values()):
            await self._destroy(slot)
        try:
            await _nft(f"delete table inet {self._table}\n")
        except NetworkSetupError as exc:
            if not _is_missing(exc):
                raise


@asynccontextmanager
async def open_host_network(
    *,
    cidr: str = "10.231.0.0/16",
    prefix: str = "aenv",
    table: str = "aenv",
    max_slots: int = 1024,
    egress_cap: Sequence[str] = ("0.0.0.0/0",),
    adopt: Mapping[int, EgressPolicy] | None = None,
) -> AsyncIterator[HostNetwork]:
    """Set the host up for sandbox slots; leaving the block removes all of it.

    `adopt` names slots an earlier node process made whose sandboxes this one
    takes over, with their policies: their netns and veths are kept (if they
    are still there), their rules rewritten in the same transaction that
    replaces the table, and `HostNetwork.adopt_slot` hands each out once.

    Needs root, `ip` (iproute2) and `nft` (nftables). Leaves IPv4 forwarding on.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must be 1-10 lowercase alphanumerics, got {prefix!r}")
    if not _TABLE_RE.match(table):
        raise ValueError(f"invalid nftables table name {table!r}")
    net = ipaddress.IPv4Network(cidr)
    if max_slots < 1 or max_slots > net.num_addresses // 4:
        raise ValueError(f"{cidr} holds {net.num_addresses // 4} /30 slots, not {max_slots}")
    if len(f"{prefix}h{max_slots - 1}") > _IFNAMSIZ:
        raise ValueError(f"prefix {prefix!r} too long for {max_slots} slots' interface names")
    adopt = {i: p for i, p in (adopt or {}).items() if 0 <= i < max_slots}
    removed = await reap_stale(prefix=prefix, table=table, keep=adopt.keys())
    if removed:
        log.warning("reaped stale network state: %s", ", ".join(removed))
    await trio.Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    network = HostNetwork(cidr=net, prefix=prefix, table=table, max_slots=max_slots)
    present = set(await _list_netns()) if adopt else set()
    kept = [network._slot(i) for i in sorted(adopt)]
    kept = [slot for slot in kept if slot.netns_name in present]
    script = render_table(table=table, cidr=str(net), egress_cap=egress_cap)
    script += "".join("\n" + network._rules(slot, adopt[slot.index]) for slot in kept)
    await _nft(script)
    for slot in kept:
        network._adoptable[slot.index] = slot
        network._free.remove(slot.index)
    try:
        yield network
    finally:
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            await network._close()
