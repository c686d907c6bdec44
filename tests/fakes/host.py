"""Scripted host facilities for an in-process node: network slots, roots, envd, memory.

`FakeHost` bundles them with a `FakeRuntime` into an `aenv.node.host.Host`.
Like the real ones, they keep host state (slots, mounted roots, runtime
sandboxes) that outlives a node process: `crash()` makes every block open now
leave its resource in place when it is left (the node process died, the
kernel keeps its namespaces, mounts and sandboxes), and the next node takes
them back (`FakeNetwork.restart` with the slots to keep, as
`open_host_network(adopt=...)` does; `reap` for roots and runtime sandboxes).

- `FakeNetwork` (`NetworkSlots`): slots with the addresses the real
  allocator gives, their egress policies kept per slot.
- `FakeRoots` (`WritableRoots`): a root is a plain `upper` directory in its
  workdir (the runtime writes there, as gVisor's gofer writes through to the
  overlay's upper), "mounted" until unmounted or its block is left; `read`
  looks through the upper, then the lower layers, as an overlay shows them.
- `FakeEnvd` (`EnvdControl`): ready once the sandbox at that address runs;
  records every `/init`; failures and a slow close are scripted.
- `FakeMemory`: what `/proc/meminfo` says: free memory set by the test,
  less what the runtime's sandboxes hold.
"""

from __future__ import annotations

import ipaddress
import shutil
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from aenv.node.host import EnvdUnavailable, Host
from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.netns import NetSlot, NoFreeSlot
from aenv.storage.overlay import OverlayError
from tests.fakes.runtime import FakeRuntime, Faults, Guest

GIB = 1 << 30


class FakeNetwork:
    """Network slots on one host; see the module docstring."""

    def __init__(self, *, cidr: str = "10.250.0.0/16", max_slots: int = 64) -> None:
        self._cidr = ipaddress.IPv4Network(cidr)
        self.max_slots = max_slots
        # slots that exist on the host (netns, veth, rules), with their policies
        self.slots: dict[int, NetSlot] = {}
        self.policies: dict[int, EgressPolicy] = {}
        self._owner: dict[int, int] = {}
        self._adoptable: set[int] = set()
        self.generation = 0
        self.opened_total = 0
        # the real one is repairing its host state (a failed setup answers 503)
        self.repairing = False

    def slot(self, index: int) -> NetSlot:
        base = self._cidr.network_address + 4 * index
        return NetSlot(
            index=index,
            netns_name=f"fake-{index}",
            netns_path=Path(f"/run/netns/fake-{index}"),
            host_veth=f"fakeh{index}",
            host_ip=str(base + 1),
            sandbox_ip=str(base + 2),
            prefix_len=30,
        )

    def by_address(self, address: str) -> NetSlot | None:
        return next((s for s in self.slots.values() if s.sandbox_ip == address), None)

    def crash(self) -> None:
        self.generation += 1

    def restart(self, adopt: Mapping[int, EgressPolicy]) -> None:
        """A new node process opens the host network: the slots in `adopt` that
        still exist are kept for adoption (with those policies), the rest reaped."""
        for index in list(self.slots):
            if index in adopt:
                self.policies[index] = adopt[index]
                self._adoptable.add(index)
            else:
                self._delete(index)

    # -- NetworkSlots ----------------------------------------------------------

    @asynccontextmanager
    async def open_slot(self, policy: EgressPolicy) -> AsyncIterator[NetSlot]:
        await trio.lowlevel.checkpoint()
        free = [i for i in range(self.max_slots) if i not in self.slots]
        if not free:
            raise NoFreeSlot(f"all {self.max_slots} network slots are in use")
        slot = self.slot(free[0])
        self.slots[slot.index] = slot
        self.policies[slot.index] = policy
        self._owner[slot.index] = self.generation
        self.opened_total += 1
        async with self._owned(slot):
            yield slot

    @asynccontextmanager
    async def adopt_slot(self, index: int) -> AsyncIterator[NetSlot]:
        await trio.lowlevel.checkpoint()
        if index not in self._adoptable:
            raise RuntimeError(f"network slot {index} was not kept for adoption")
        self._adoptable.discard(index)
        self._owner[index] = self.generation
        async with self._owned(self.slots[index]):
            yield self.slots[index]

    async def set_policy(self, slot: NetSlot, policy: EgressPolicy) -> None:
        await trio.lowlevel.checkpoint()
        if self.slots.get(slot.index) != slot or self._owner.get(slot.index) != self.generation:
            raise RuntimeError(f"network slot {slot.index} is not open")
        self.policies[slot.index] = policy

    async def release_unadopted(self) -> None:
        await trio.lowlevel.checkpoint()
        for index in sorted(self._adoptable):
            self._delete(index)
        self._adoptable.clear()

    @asynccontextmanager
    async def _owned(self, slot: NetSlot) -> AsyncIterator[None]:
        owner = self.generation
        try:
            yield
        finally:
            if owner == self.generation:
                self._delete(slot.index)

    def _delete(self, index: int) -> None:
        self.slots.pop(index, None)
        self.policies.pop(index, None)
        self._owner.pop(index, None)
        self._adoptable.discard(index)


class FakeRoots:
    """Writable roots as plain directories; see the module docstring."""

    def __init__(self) -> None:
        # "mounted" roots: workdir -> the lowers it stands on (topmost first)
        self.mounted: dict[Path, tuple[Path, ...]] = {}
        # the disk each root was opened with: workdir -> (disk_bytes, carried_bytes)
        self.disks: dict[Path, tuple[int, int]] = {}
        self.generation = 0

    def crash(self) -> None:
        self.generation += 1

    def read(self, root: Path, path: str) -> str | None:
        """What the guest reads at `path` in `root`: the upper's file, else the
        topmost lower's (None: no such file)."""
        workdir = root.parent
        for layer in (root, *self.mounted.get(workdir, ())):
            if (layer / path).is_file():
                return (layer / path).read_text()
        return None

    # -- WritableRoots -----------------------------------------------------------

    @asynccontextmanager
    async def open_root(
        self, lowers: Sequence[Path], workdir: Path, *, disk_bytes: int = 0, carried_bytes: int = 0
    ) -> AsyncIterator[Path]:
        await trio.lowlevel.checkpoint()
        _prepare(lowers, workdir)
        self.disks[workdir] = (disk_bytes, carried_bytes)
        self.mounted[workdir] = tuple(Path(p) for p in lowers)
        async with self._owned(workdir):
            yield workdir / "upper"

    @asynccontextmanager
    async def adopt_root(self, workdir: Path) -> AsyncIterator[Path]:
        await trio.lowlevel.checkpoint()
        if workdir not in self.mounted:
            raise OverlayError(f"{workdir / 'merged'} is not mounted any more")
        async with self._owned(workdir):
            yield workdir / "upper"

    async def unmount(self, workdir: Path) -> Path:
        await trio.lowlevel.checkpoint()
        self.mounted.pop(workdir, None)
        return workdir / "upper"

    async def reap(self, root: Path, keep: Collection[Path] = ()) -> list[Path]:
        await trio.lowlevel.checkpoint()
        stale = [
            w for w in self.mounted if w.is_relative_to(root) and w / "merged" not in set(keep)
        ]
        for workdir in stale:
            del self.mounted[workdir]
        return [w / "merged" for w in stale]

    @asynccontextmanager
    async def _owned(self, workdir: Path) -> AsyncIterator[None]:
        owner = self.generation
        try:
            yield
        finally:
            if owner == self.generation:
                self.mounted.pop(workdir, None)
                shutil.rmtree(workdir, ignore_errors=True)


def _prepare(lowers: Sequence[Path], workdir: Path) -> None:
    """What mounting an overlay checks and makes."""
    if not lowers:
        raise OverlayError("an overlay needs at least one lower layer")
    for lower in lowers:
        if not Path(lower).is_dir():
            raise OverlayError(f"lower layer {lower} is not a directory")
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise OverlayError(f"{workdir} is not empty")
    (workdir / "upper").mkdir()
    (workdir / "work").mkdir()


@dataclass(frozen=True)
class Init:
    """One `/init` call envd received."""

    at: float
    address: str
    body: dict[str, Any]
    token: str | None  # the X-Access-Token it came with (a re-init)


class FakeEnvd:
    """envd's control calls; see the module docstring."""

    def __init__(self, runtime: FakeRuntime, network: FakeNetwork) -> None:
        self._runtime = runtime
        self._network = network
        self.inits: list[Init] = []
        self.faults = Faults()  # "init": envd refuses the next /init
        # False: envd never answers (a guest whose envd does not start)
        self.answering = True
        # envd holds the node's connections open this long after they are closed
        self.close_delay_s = 0.0

    def running(self, address: str) -> bool:
        slot = self._network.by_address(address)
        return slot is not None and any(
            s.spec.netns_path == slot.netns_path and s.state is Guest.RUNNING
            for s in self._runtime.sandboxes.values()
        )

    async def wait_ready(self, client: httpx.AsyncClient, address: str) -> None:
        while not (self.answering and self.running(address)):  # noqa: ASYNC110 - envd is polled, as the real one is
            await trio.sleep(0.5)

    async def init(
        self,
        client: httpx.AsyncClient,
        address: str,
        body: Mapping[str, Any],
        *,
        token: str | None,
    ) -> None:
        await trio.lowlevel.checkpoint()
        try:
            self.faults.check("init", address)
        except Exception as exc:
            raise EnvdUnavailable(f"envd /init answered 500: {exc}") from None
        self.inits.append(Init(trio.current_time(), address, dict(body), token))

    async def wait_closed(self, address: str, *, within_s: float) -> bool:
        if self.close_delay_s > within_s:
            await trio.sleep(within_s)
            return False
        await trio.sleep(self.close_delay_s)
        return True


@dataclass
class FakeMemory:
    """The host's memory as `/proc/meminfo` says it: what is free without any
    sandbox (`free`, set by the test) less what the runtime's sandboxes hold."""

    runtime: FakeRuntime
    total: int = 32 * GIB
    free: int = 16 * GIB
    # the next `failures` reads raise this (a kernel without MemAvailable, say)
    error: Exception = field(default_factory=lambda: KeyError("MemAvailable"))
    failures: int = 0
    reads: list[float] = field(default_factory=list)  # when it was read

    def read(self) -> tuple[int, int]:
        self.reads.append(trio.current_time())
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        held = sum(
            s.memory_bytes for s in self.runtime.sandboxes.values() if s.state is not Guest.EXITED
        )
        return self.free - held, self.total


@dataclass
class FakeHost:
    runtime: FakeRuntime = field(default_factory=FakeRuntime)
    network: FakeNetwork = field(default_factory=FakeNetwork)
    roots: FakeRoots = field(default_factory=FakeRoots)
    envd: FakeEnvd = field(init=False)
    memory: FakeMemory = field(init=False)

    def __post_init__(self) -> None:
        self.envd = FakeEnvd(self.runtime, self.network)
        self.memory = FakeMemory(self.runtime)

    def host(self) -> Host:
        return Host(
            runtime=self.runtime,
            network=self.network,
            roots=self.roots,
            envd=self.envd,
            meminfo=self.memory.read,
        )

    def crash(self) -> None:
        """The node process dies: whatever it holds stays on the host."""
        self.runtime.crash()
        self.network.crash()
        self.roots.crash()

    def leftovers(self) -> list[str]:
        """Runtime sandboxes, slots and roots that exist on the host now."""
        return (
            [f"sandbox {i}" for i in self.runtime.sandboxes]
            + [f"slot {i}" for i in self.network.slots]
            + [f"root {w}" for w in self.roots.mounted]
        )


class NoImages:
    """The node's image service where no test uses images (template sandboxes only)."""

    def attach_store(self, objects: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"this test node has no image service (asked for {name})")
