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

The host is shared: an operator's `nft flush ruleset` or another tool can
take the table, a slot's rules, a namespace's name or a veth away while the
node runs. `HostNetwork.check` compares what should exist with what does
(`aenv.proto.netstate.diagnose`) and repairs it: the table is written again
with every open slot's rules in one transaction, a slot's missing rules are
added again, a namespace whose name was deleted (the namespace itself lives
on while the sandbox's processes are in it) gets its name back. A slot whose
veth is gone has lost its network for good: `on_lost` hears of it. `guard`
runs `check` every few seconds; a slot that fails to open runs it at once and
tries again if it repaired something, so a create does not fail for what the
node can mend.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from aenv.kit.groupcommit import GroupCommit
from aenv.kit.metrics import Labels, Registry
from aenv.kit.refill import Refill
from aenv.proto.netpolicy import (
    EgressPolicy,
    render_slot_delete,
    render_slot_rules,
    render_table,
)
from aenv.proto.netstate import (
    PREFIX_RE,
    Diagnosis,
    Shape,
    SlotNames,
    diagnose,
    shape_of_listing,
    shape_of_script,
)
from aenv.proto.spares import Bursts

log = logging.getLogger("aenv.runtimes.netns")

NETNS_DIR: Final = Path("/run/netns")
GUEST_IFACE: Final = "eth0"
CLEANUP_TIMEOUT_S: Final = 15.0
_TABLE_RE: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
_IFNAMSIZ: Final = 15


class NetworkSetupError(RuntimeError):
    """An `ip`/`nft` command failed while building or changing the host network.

    `detail` is the tool's complaint (its first line); the message says which
    step failed, in words, when the step is known.
    """

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


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
        first = (err.splitlines() or [f"exit status {proc.returncode}"])[0][:200]
        raise NetworkSetupError(
            f"{' '.join(argv[:4])} failed ({proc.returncode}): {err}", detail=f"{argv[0]}: {first}"
        )
    return str(proc.stdout.decode(errors="replace"))


async def _step(what: str, argv: Sequence[str], *, stdin: str | None = None) -> str:
    """`_run`, its failure told as the step `what` of setting a slot up."""
    try:
        return await _run(argv, stdin=stdin)
    except NetworkSetupError as exc:
        raise NetworkSetupError(f"{what} failed ({exc.detail})", detail=exc.detail) from exc


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


# what `check` repairs, as counted in `HostNetwork.statistics()` (`repairs_<what>`)
REPAIRS: Final = ("table", "slot_rules", "netns")


def _netns_id(name: str) -> tuple[int, int] | None:
    """The identity (device, inode) of the namespace named `name`, if it exists (blocking)."""
    try:
        st = os.stat(NETNS_DIR / name)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pid_in_netns(ident: tuple[int, int]) -> int | None:
    """A process in the network namespace `ident`, if any is (blocking)."""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry.name}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                return int(entry.name)
    return None


class HostNetwork:
    """The node's network slots; get one with `open_host_network`."""

    def __init__(
        self,
        *,
        cidr: ipaddress.IPv4Network,
        prefix: str,
        table: str,
        max_slots: int,
        egress_cap: Sequence[str] = ("0.0.0.0/0",),
        proxy_port: int | None = None,
    ) -> None:
        self._cidr = cidr
        self._proxy_port = proxy_port
        self._prefix = prefix
        self._table = table
        self._max_slots = max_slots
        self._table_script = render_table(
            table=table, cidr=str(cidr), egress_cap=egress_cap, proxy_port=proxy_port
        )
        self._table_shape = shape_of_script(self._table_script, table=table)
        # Freed slots go to the back, so an address is reused as late as possible
        # (conntrack entries of the previous sandbox expire meanwhile).
        self._free: deque[int] = deque(range(max_slots))
        self._open: dict[int, NetSlot] = {}
        # slots an earlier node process made, kept for their sandboxes' adoption
        self._adoptable: dict[int, NetSlot] = {}
        # the policy of every slot whose rules are (or are being) installed
        self._policies: dict[int, EgressPolicy] = {}
        # open slots whose netns and veth exist (made, adopted, not lost or leaving)
        self._ready: set[int] = set()
        # the namespace each ready slot's name pointed at, to give it its name back
        self._netns_ids: dict[int, tuple[int, int]] = {}
        self._quarantined: set[int] = set()
        self._closed = False
        self._ipv6 = _ipv6_present()
        # one nft transaction on the table at a time: a rewrite of the whole
        # table must not undo a slot's rules applied meanwhile
        self._nft_lock = trio.Lock()
        # slots' rules written at once (a fork's children, say) go in one
        # transaction: an nft run costs about the same for one slot or twenty
        self._rules_commit = GroupCommit[tuple[NetSlot, EgressPolicy, bool]](
            self._nft_lock, self._write_rules
        )
        self._check_lock = trio.Lock()
        self._on_lost: Callable[[NetSlot, str], None] | None = None
        self._repairing = False
        self._repair_gen = 0
        self._repairs = dict.fromkeys(REPAIRS, 0)
        self._repair_failures = 0
        self._lost = 0
        self._opened_total = 0
        # made ahead (`keep_spares`), with the default policy, not handed out
        # yet: open (the watchdog checks them, closing removes them), unowned
        self._spares: deque[int] = deque()
        self._spares_taken = 0
        self._broken_spares: list[int] = []  # (lost while spare: removed by `keep_spares`)
        self._spare_refill = Refill(Bursts(most=0, gap_s=1.0))
        self._policy_updates = 0
        self._cleanup_failures = 0

    @property
    def cidr(self) -> str:
        return str(self._cidr)

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def repairing(self) -> bool:
        """The latest check found damage it could not repair (yet)."""
        return self._repairing

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
            proxy_port=self._proxy_port,
        )

    def policy_of(self, sandbox_ip: str) -> tuple[int, EgressPolicy] | None:
        """The slot index and policy of the open slot whose sandbox has address
        `sandbox_ip` (None: no such slot), for the egress proxy."""
        try:
            offset = int(ipaddress.IPv4Address(sandbox_ip)) - int(self._cidr.network_address)
        except ValueError:
            return None
        index, rest = divmod(offset, 4)
        if rest != 2 or index not in self._open:
            return None
        policy = self._policies.get(index)
        return None if policy is None else (index, policy)

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
            await self._made(slot)
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
        self._spare_refill.took()
        if self._spares:
            async with self._spare(policy) as slot:
                yield slot
            return
        if not self._free:
            raise NoFreeSlot(f"all {self._max_slots} network slots are in use")
        slot = self._slot(self._free.popleft())
        self._open[slot.index] = slot
        async with self._owned(slot):
            repairs = self._repair_gen
            try:
                await self._create(slot, policy)
            except NetworkSetupError as exc:
                # the host's network may have been damaged under the node: mend it, try again
                if not await self._repaired_since(repairs):
                    raise
                log.warning("slot %d: setting it up again after a repair (%s)", slot.index, exc)
                await self._destroy(slot)
                await self._create(slot, policy)
            await self._made(slot)
            self._opened_total += 1
            yield slot

    @asynccontextmanager
    async def _spare(self, policy: EgressPolicy) -> AsyncIterator[NetSlot]:
        """A spare slot (`keep_spares`) with `policy`, owned as `_open_slot`'s."""
        slot = self._open[self._spares.popleft()]
        self._spares_taken += 1
        async with self._owned(slot):
            # its rules written again in one transaction whatever the policy: the
            # host's network may have been damaged since the spare was made (the
            # table flushed, say), and a create mends what it finds
            await self._rewrite_rules(slot, policy)
            self._opened_total += 1
            yield slot

    async def keep_spares(self, count: int, *, quiet_s: float = 1.0, least: int = 1) -> None:
        """Keep slots made ahead with the default policy, until cancelled or
        closed: `open_slot` hands one out (its rules written again in one
        transaction, mending what was damaged meanwhile) instead of making a slot
        (a netns, a veth pair and their addresses: four processes, and an nft
        transaction at a time, which a fork of 20 children waits for in turn).
        As many as the largest burst of opens seen (opens less than `quiet_s`
        apart), at least `least`, at most `count` (`aenv.proto.spares`); made
        one at a time once no slot was opened for `quiet_s`. A spare that
        cannot be made is given up and tried again later."""
        self._spare_refill.demand = Bursts(most=count, gap_s=quiet_s, least=least)
        await self._spare_refill.keep(
            kept=lambda: len(self._spares),
            make=self._make_spare,
            failed=lambda exc: log.warning("making a spare network slot failed: %s", exc),
            retry_s=quiet_s,
            going=lambda: not self._closed and count > 0,
            tidy=self._discard_broken_spares,
        )

    async def _discard_broken_spares(self) -> None:
        """Remove the spares that lost their network (`_lose`)."""
        while self._broken_spares:
            await self._discard(self._open[self._broken_spares.pop()])

    async def _make_spare(self) -> bool:
        """One more spare slot (False: no slot is free); none is left behind if
        making it fails."""
        if not self._free:
            return False
        slot = self._slot(self._free.popleft())
        self._open[slot.index] = slot
        try:
            await self._create(slot, EgressPolicy())
            await self._made(slot)
        except BaseException:
            await self._discard(slot)
            raise
        self._spares.append(slot.index)
        return True

    async def _discard(self, slot: NetSlot) -> None:
        """Remove a slot (a spare, or one whose owner is done with it); its index is
        free again if that worked. The watchdog neither checks nor restores it."""
        self._ready.discard(slot.index)
        self._policies.pop(slot.index, None)
        self._netns_ids.pop(slot.index, None)
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

    async def _made(self, slot: NetSlot) -> None:
        """`slot`'s netns and veth exist from now on: the watchdog checks them."""
        ident = await trio.to_thread.run_sync(_netns_id, slot.netns_name)
        if ident is not None:
            self._netns_ids[slot.index] = ident
        self._ready.add(slot.index)

    @asynccontextmanager
    async def _owned(self, slot: NetSlot) -> AsyncIterator[None]:
        """Delete `slot` when the block is left; its index is free again if that worked."""
        try:
            yield
        finally:
            await self._discard(slot)

    async def _create(self, slot: NetSlot, policy: EgressPolicy) -> None:
        host_cidr = f"{slot.host_ip}/{slot.prefix_len}"
        guest_cidr = f"{slot.sandbox_ip}/{slot.prefix_len}"
        # Rules first: the interface is filtered from the moment it exists.
        await self._rules_commit.submit((slot, policy, True))
        await _step("creating its network namespace", ["ip", "netns", "add", slot.netns_name])
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
        await _step(
            "creating its virtual ethernet link",
            ["ip", "-batch", "-"],
            stdin="\n".join(host) + "\n",
        )
        await _step(
            "configuring the sandbox's interface",
            ["ip", "-n", slot.netns_name, "-batch", "-"],
            stdin="\n".join(guest) + "\n",
        )

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
                if argv[0] == "nft":
                    async with self._nft_lock:
                        await _run(argv, stdin=stdin)
                else:
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
        await self._rewrite_rules(slot, policy)
        self._policy_updates += 1

    async def _rewrite_rules(self, slot: NetSlot, policy: EgressPolicy) -> None:
        """Write the slot's rules for `policy` again; if that fails on a host
        network damaged under the node, mend it and write them once more."""
        repairs = self._repair_gen
        try:
            await self._rules_commit.submit((slot, policy, False))
        except NetworkSetupError:
            if not await self._repaired_since(repairs):
                raise
            await self._rules_commit.submit((slot, policy, False))

    async def _write_rules(self, batch: Sequence[tuple[NetSlot, EgressPolicy, bool]]) -> None:
        """Slots' rules in one transaction (`_rules_commit`, under the nft lock):
        a new slot's (`True`) noted as its policy first, a replaced one's once
        written."""
        for slot, policy, new in batch:
            if new:
                self._policies[slot.index] = policy
        what = "installing" if len(batch) == 1 and batch[0][2] else "replacing"
        script = "".join(self._rules(slot, policy) for slot, policy, _ in batch)
        await _step(f"{what} its firewall rules", ["nft", "-f", "-"], stdin=script)
        for slot, policy, new in batch:
            if not new:
                self._policies[slot.index] = policy

    # -- the watchdog -------------------------------------------------------------

    async def guard(self, *, every_s: float, on_lost: Callable[[NetSlot, str], None]) -> None:
        """Run `check` every `every_s` seconds until cancelled or closed.

        `on_lost(slot, why)` hears of each slot whose network is gone for good
        (the sandbox in it has no network any more: stop it). A check that
        fails is logged (once for each new error) and tried again.
        """
        self._on_lost = on_lost
        last_error = ""
        while not self._closed:
            await trio.sleep(every_s)
            try:
                await self.check()
                last_error = ""
            except Exception as exc:
                if repr(exc) != last_error:
                    log.exception("checking the host network failed")
                last_error = repr(exc)

    async def _repaired_since(self, generation: int) -> bool:
        """Check the host network now; whether it was repaired since `generation`
        (by this check or another) and is whole again."""
        try:
            await self.check()
        except Exception:
            log.exception("checking the host network failed")
            return False
        return self._repair_gen != generation and not self._repairing

    async def check(self) -> Diagnosis | None:
        """Compare the host with what the node's open slots need, and repair it.

        Returns what was found (None if the network is closed). A slot's
        namespace or veth is checked only once the slot is made, and not
        while it is being removed. Repairs are logged and counted; a slot
        lost for good is reported to `on_lost` once.
        """
        async with self._check_lock:
            if self._closed:
                return None
            before = set(self._ready)
            async with self._nft_lock:
                observed = await self._observe()
                rules = {
                    i: shape_of_script(self._rules(self._slot(i), p), table=self._table)
                    for i, p in self._policies.items()
                    if i in before
                }
            netns, links = set(await _list_netns()), set(await _list_links())
            ready = before & self._ready
            slots = {
                i: SlotNames(netns=f"{self._prefix}-{i}", veth=f"{self._prefix}h{i}", rules=r)
                for i, r in rules.items()
                if i in ready
            }
            found = diagnose(
                table=self._table_shape, slots=slots, observed=observed, netns=netns, links=links
            )
            if found.healthy:
                self._repairing = False
                return found
            self._repairing = True
            failed = False
            if found.table is not None:
                failed |= not await self._repair("table", found.table, self._rewrite_table())
            for index, why in found.rules.items():
                failed |= not await self._repair(
                    "slot_rules", f"slot {index}: {why}", self._readd_rules(index)
                )
            for index in found.veth_gone:
                self._lose(index, f"its veth {self._prefix}h{index} was deleted")
            for index in found.netns_gone:
                if index in found.veth_gone:
                    continue
                what = f"slot {index}: the name of its network namespace was deleted"
                if not await self._repair("netns", what, self._reattach(index)):
                    self._lose(index, f"its network namespace {self._prefix}-{index} is gone")
            self._repairing = failed
            if failed:
                self._repair_failures += 1
            else:
                self._repair_gen += 1
            return found

    async def _observe(self) -> Shape | None:
        """The node's table as the host has it (None: no such table)."""
        try:
            listing = await _run(["nft", "-j", "list", "table", "inet", self._table])
        except NetworkSetupError as exc:
            if _is_missing(exc):
                return None
            raise
        return shape_of_listing(listing, table=self._table)

    async def _repair(self, what: str, why: str, repair: Awaitable[bool]) -> bool:
        log.warning("host network: %s; repairing", why)
        try:
            done = await repair
        except Exception as exc:
            log.error("host network: repairing (%s) failed: %s", why, exc)
            return False
        if done is False:
            return False
        self._repairs[what] += 1
        log.warning("host network: repaired (%s)", what)
        return True

    async def _rewrite_table(self) -> bool:
        """Write the table again with every slot's rules, in one transaction."""
        async with self._nft_lock:
            script = self._table_script + "".join(
                "\n" + self._rules(self._slot(i), p) for i, p in sorted(self._policies.items())
            )
            await _nft(script)
        return True

    async def _readd_rules(self, index: int) -> bool:
        async with self._nft_lock:
            policy = self._policies.get(index)
            if policy is None or index not in self._ready:
                return True  # left meanwhile
            await _nft(self._rules(self._slot(index), policy))
        return True

    async def _reattach(self, index: int) -> bool:
        """Give slot `index`'s namespace its name back, from a process still in it."""
        ident = self._netns_ids.get(index)
        if ident is None:
            return False
        pid = await trio.to_thread.run_sync(_pid_in_netns, ident)
        if pid is None:
            return False
        await _run(["ip", "netns", "attach", f"{self._prefix}-{index}", str(pid)])
        return True

    def _lose(self, index: int, why: str) -> None:
        if index in self._spares:  # nobody's yet: made again
            self._spares.remove(index)
            self._ready.discard(index)
            self._broken_spares.append(index)
            self._spare_refill.wake()
            log.warning("host network: spare slot %d lost its network: %s", index, why)
            return
        slot = self._open.get(index)
        if slot is None or index not in self._ready or self._on_lost is None:
            return  # (before `guard` runs, its first check finds the slot again)
        self._ready.discard(index)
        self._lost += 1
        log.error("host network: slot %d lost its network: %s", index, why)
        self._on_lost(slot, why)

    def statistics(self) -> dict[str, int]:
        return {
            "slots_max": self._max_slots,
            "slots_open": len(self._open),
            "slots_free": len(self._free),
            "slots_quarantined": len(self._quarantined),
            "slots_opened_total": self._opened_total,
            "slots_spare": len(self._spares),
            "spares_taken_total": self._spares_taken,
            "policy_updates_total": self._policy_updates,
            "rules_transactions_total": self._rules_commit.batches,
            "cleanup_failures_total": self._cleanup_failures,
            **{f"repairs_{what}": n for what, n in self._repairs.items()},
            "repair_failures_total": self._repair_failures,
            "slots_lost_total": self._lost,
            "repairing": int(self._repairing),
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


def network_metrics(registry: Registry, network: HostNetwork) -> None:
    """Put the watchdog's counts of `network` in `registry` (read at scrape time)."""

    def read(*keys: str, label: str = "") -> Callable[[], list[tuple[Labels, float]]]:
        def values() -> list[tuple[Labels, float]]:
            s = network.statistics()
            if not label:
                return [((), float(s[keys[0]]))]
            return [(((label, k.split("_", 1)[1]),), float(s[k])) for k in keys]

        return values

    registry.counter(
        "aenv_host_network_repairs_total",
        "Repairs of the node's host network: its nftables table, a slot's rules, "
        "a network namespace's name",
        read(*(f"repairs_{what}" for what in REPAIRS), label="what"),
    )
    registry.counter(
        "aenv_host_network_repair_failures_total",
        "Checks of the host network that found damage they could not repair",
        read("repair_failures_total"),
    )
    registry.counter(
        "aenv_host_network_slots_lost_total",
        "Network slots whose veth or namespace vanished (their sandboxes were stopped)",
        read("slots_lost_total"),
    )
    registry.gauge(
        "aenv_host_network_repairing",
        "1 while the node's host network has damage it has not repaired yet",
        read("repairing"),
    )


@asynccontextmanager
async def open_host_network(
    *,
    cidr: str = "10.231.0.0/16",
    prefix: str = "aenv",
    table: str = "aenv",
    max_slots: int = 1024,
    egress_cap: Sequence[str] = ("0.0.0.0/0",),
    adopt: Mapping[int, EgressPolicy] | None = None,
    proxy_port: int | None = None,
) -> AsyncIterator[HostNetwork]:
    """Set the host up for sandbox slots; leaving the block removes all of it.

    `adopt` names slots an earlier node process made whose sandboxes this one
    takes over, with their policies: their netns and veths are kept (if they
    are still there), their rules rewritten in the same transaction that
    replaces the table, and `HostNetwork.adopt_slot` hands each out once.

    `proxy_port` is where the node's egress proxy listens (every address):
    slots whose policy names hosts have their TCP redirected there.

    Needs root, `ip` (iproute2) and `nft` (nftables). Leaves IPv4 forwarding on.
    """
    if not PREFIX_RE.match(prefix):
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
    network = HostNetwork(
        cidr=net,
        prefix=prefix,
        table=table,
        max_slots=max_slots,
        egress_cap=egress_cap,
        proxy_port=proxy_port,
    )
    present = set(await _list_netns()) if adopt else set()
    kept = [network._slot(i) for i in sorted(adopt)]
    kept = [slot for slot in kept if slot.netns_name in present]
    script = network._table_script
    script += "".join("\n" + network._rules(slot, adopt[slot.index]) for slot in kept)
    await _nft(script)
    for slot in kept:
        network._adoptable[slot.index] = slot
        network._policies[slot.index] = adopt[slot.index]
        network._free.remove(slot.index)
    try:
        yield network
    finally:
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            await network._close()
