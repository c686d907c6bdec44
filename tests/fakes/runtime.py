"""A scripted runtime that behaves, as far as the node can observe, like runsc.

`FakeRuntime` implements `aenv.runtimes.base.Runtime` and `FakeSandbox`
`RunningSandbox`, on trio's clock (run them under a `MockClock`). What they
do, as `GVisorRuntime` does (tests/runtimes/test_runtime_conformance.py runs
the same checks against both):

- starting takes `Timings.start_s` (restoring `restore_s`) and makes the
  bundle's mount points in the root (/opt/aenv, /proc, ...); the sandbox is
  known to the runtime from the moment it is being started, and leaving the
  `open_*` block stops it (`stop_s`, shielded) and forgets it, also when the
  start is cancelled;
- `wait()` returns the exit status once the guest exits by itself
  (`FakeSandbox.guest_exit`, e.g. 137 for an OOM kill) or is checkpointed
  without `leave_running`;
- `checkpoint` writes `checkpoint.img` into an empty image directory
  (`checkpoint_s`); a non-empty directory, a stopped sandbox or one the
  cgroup freezer holds cannot be checkpointed (runsc would hang on it until
  its timeout; `checkpoint_frozen` is the way for those);
- `freeze` is the cgroup freezer (instant, idempotent), `checkpoint_frozen`
  hands the stop over to runsc pause and leaves it paused, `held()` is runsc
  pause for the block and works only on a running sandbox, `thaw` lets a
  frozen or paused one run;
- `open_restored` works only from a whole image directory (missing, empty
  or truncated: `CheckpointError`), and the restored sandbox holds the
  memory the image recorded;
- `open_adopted` takes over a sandbox an earlier node process left running
  (after `crash()`), frozen or not as asked, and raises `SandboxGone` for one
  that exited meanwhile or never existed;
- `usage()` reports the scripted memory (`FakeSandbox.memory_bytes`).

Failures are injected per call: `faults.fail_next("checkpoint")` makes the
next checkpoint raise (operations: start, restore, checkpoint,
checkpoint_frozen, freeze, thaw, hold, adopt). `calls` records every
operation with its time, for tests that count checkpoints.
"""

from __future__ import annotations

import enum
import json
import shutil
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from aenv.runtimes.base import CheckpointError, SandboxGone, SandboxSpec, Usage

IMAGE_FILE = "checkpoint.img"


class FakeRunscError(RuntimeError):
    """runsc refused (the fake's `GVisorError`)."""


class FakeCheckpointError(FakeRunscError, CheckpointError):
    """runsc checkpoint, restore, pause or resume failed (the fake's `GVisorCheckpointError`)."""


class Guest(enum.Enum):
    RUNNING = "running"
    FROZEN = "frozen"  # the cgroup freezer: everything stopped, runsc too
    PAUSED = "paused"  # runsc pause: the guest stopped, runsc answering
    EXITED = "exited"


@dataclass(frozen=True)
class Timings:
    """How long each runsc step takes, in seconds of trio's clock (binary
    fractions, so that sums of them compare exactly)."""

    start_s: float = 0.5
    restore_s: float = 0.25
    checkpoint_s: float = 0.25
    stop_s: float = 0.125


@dataclass(frozen=True)
class Call:
    at: float
    op: str
    sandbox_id: str


class Faults:
    """Failures for the next calls of an operation."""

    def __init__(self) -> None:
        self._queued: dict[str, deque[Exception | None]] = {}

    def fail_next(self, op: str, error: Exception | None = None, *, times: int = 1) -> None:
        """The next `times` calls of `op` raise `error` (None: the runtime's own error)."""
        self._queued.setdefault(op, deque()).extend([error] * times)

    def pending(self, op: str) -> int:
        return len(self._queued.get(op, ()))

    def check(self, op: str, sandbox_id: str) -> None:
        queued = self._queued.get(op)
        if queued:
            error = queued.popleft()
            raise error or FakeCheckpointError(f"runsc {op} {sandbox_id} failed (injected)")


@dataclass(eq=False)
class FakeSandbox:
    """One sandbox as the runtime holds it; implements `RunningSandbox`."""

    spec: SandboxSpec
    runtime: FakeRuntime = field(repr=False)
    memory_bytes: int
    # the node process that owns it (`FakeRuntime.generation` when it was opened)
    owner: int
    restored_from: Path | None = None
    state: Guest = Guest.RUNNING
    # frozen with `may_checkpoint=False`: a checkpoint or hold before the thaw is a bug
    until_thaw: bool = False
    exit_status: int | None = None
    _exited: trio.Event = field(default_factory=trio.Event, repr=False)
    # the node's memory relief valve, while it watches (`guard_memory`)
    _valve: Callable[[str], None] | None = field(default=None, repr=False)

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id

    # -- what the guest does (tests drive it) -----------------------------------

    def guest_exit(self, status: int) -> None:
        """The guest's init exits with `status` (137: killed, as by the OOM killer)."""
        if self.state is not Guest.EXITED:
            self._exit(status)
            self.runtime._console(self.spec, f"init exited with status {status}")

    def memory_limit_reached(self) -> None:
        """The sandbox reaches its host memory limit: the valve opens (as on v1 hosts)."""
        assert self._valve is not None, "nobody guards this sandbox's memory"
        self._valve("host memory limit reached (1024 MiB): 128 MiB more (fake)")

    def write(self, path: str, data: str) -> None:
        """The guest writes a file (into its root; a frozen or paused guest cannot)."""
        if self.state is not Guest.RUNNING:
            raise RuntimeError(f"sandbox {self.sandbox_id} is {self.state.value}")
        target = self.spec.rootfs / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data)

    # -- RunningSandbox -----------------------------------------------------------

    @property
    def host_oom_killed(self) -> bool:
        return False

    async def guard_memory(self, on_event: Callable[[str], None]) -> None:
        self._valve = on_event
        try:
            await trio.sleep_forever()
        finally:
            self._valve = None

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.exit_status is not None
        return self.exit_status

    async def usage(self) -> Usage:
        await trio.lowlevel.checkpoint()
        alive = self.state is not Guest.EXITED
        return Usage(
            cpu_used_pct=5.0 if self.state is Guest.RUNNING else 0.0,
            mem_used_bytes=self.memory_bytes if alive else 0,
            mem_total_bytes=self.spec.memory_mb << 20,
        )

    async def checkpoint(self, image_dir: Path, *, leave_running: bool) -> None:
        self.runtime._record("checkpoint", self)
        await self._checkpoint("checkpoint", image_dir, leave_running=leave_running)

    async def compact_image(self, image_dir: Path) -> None:
        await trio.lowlevel.checkpoint()  # (the fake's images are not page files)

    async def freeze(self, *, may_checkpoint: bool = True) -> None:
        self.runtime._record("freeze" if may_checkpoint else "freeze-until-thaw", self)
        self.runtime.faults.check("freeze", self.sandbox_id)
        await trio.lowlevel.checkpoint()
        self._require(Guest.RUNNING, Guest.FROZEN, Guest.PAUSED, op="freeze")
        if self.state is Guest.RUNNING:
            self.state = Guest.FROZEN
            self.until_thaw = not may_checkpoint

    async def thaw(self) -> None:
        self.runtime._record("thaw", self)
        self.runtime.faults.check("thaw", self.sandbox_id)
        await trio.lowlevel.checkpoint()
        if self.state in (Guest.FROZEN, Guest.PAUSED):
            self.state = Guest.RUNNING
            self.until_thaw = False

    async def checkpoint_frozen(self, image_dir: Path) -> None:
        self.runtime._record("checkpoint_frozen", self)
        self._refuse_until_thaw("checkpoint_frozen")
        self._require(Guest.FROZEN, Guest.PAUSED, op="checkpoint_frozen")
        self.state = Guest.PAUSED  # the cgroup freezer hands over to runsc pause
        await self._checkpoint("checkpoint_frozen", image_dir, leave_running=True)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        self.runtime._record("hold", self)
        self._refuse_until_thaw("hold")
        self.runtime.faults.check("hold", self.sandbox_id)
        await trio.lowlevel.checkpoint()
        self._require(Guest.RUNNING, op="hold")
        self.state = Guest.PAUSED
        try:
            yield
        finally:
            if self.state is Guest.PAUSED:
                self.state = Guest.RUNNING

    # -- helpers ------------------------------------------------------------------

    async def _checkpoint(self, op: str, image_dir: Path, *, leave_running: bool) -> None:
        """runsc checkpoint: it fails on a frozen sandbox only at its timeout."""
        rt = self.runtime
        self._refuse_until_thaw(op)
        if self.state is not Guest.FROZEN:
            self._require(Guest.RUNNING, Guest.PAUSED, op=op)
            _make_image_dir(image_dir)
        await trio.sleep(rt.timings.checkpoint_s)
        rt.faults.check(op, self.sandbox_id)
        self._require(Guest.RUNNING, Guest.PAUSED, op=op)
        image = {"sandbox": self.sandbox_id, "memory_bytes": self.memory_bytes, "whole": True}
        (image_dir / IMAGE_FILE).write_text(json.dumps(image))
        if not leave_running:
            self._exit(0)

    def _refuse_until_thaw(self, op: str) -> None:
        """The contract of `freeze(may_checkpoint=False)`: thawed before anything else."""
        if self.until_thaw:
            raise AssertionError(
                f"{op} of {self.sandbox_id}, frozen with may_checkpoint=False and not thawed"
            )

    def _require(self, *states: Guest, op: str) -> None:
        if self.state not in states:
            raise FakeCheckpointError(
                f"runsc {op} {self.sandbox_id}: sandbox is {self.state.value}"
            )

    def _exit(self, status: int) -> None:
        self.state = Guest.EXITED
        self.exit_status = status
        self._exited.set()


class FakeRuntime:
    """Sandboxes as runsc keeps them on one host; see the module docstring."""

    name = "fake"

    def __init__(self, *, timings: Timings | None = None, memory_bytes: int = 64 << 20) -> None:
        self.timings = timings or Timings()
        self.memory_bytes = memory_bytes
        self.faults = Faults()
        self.calls: list[Call] = []
        # what runsc's state directory holds: started and not yet deleted
        self.sandboxes: dict[str, FakeSandbox] = {}
        # bumped by `crash`: blocks opened before it stop nothing when left
        self.generation = 0

    def get(self, sandbox_id: str) -> FakeSandbox:
        return self.sandboxes[sandbox_id]

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def crash(self) -> None:
        """The node process died: its sandboxes run on, nobody stops them."""
        self.generation += 1

    # -- Runtime -------------------------------------------------------------------

    @asynccontextmanager
    async def open_sandbox(self, spec: SandboxSpec) -> AsyncIterator[FakeSandbox]:
        async with self._open(spec, None) as sandbox:
            yield sandbox

    @asynccontextmanager
    async def open_restored(self, spec: SandboxSpec, image_dir: Path) -> AsyncIterator[FakeSandbox]:
        async with self._open(spec, Path(image_dir)) as sandbox:
            yield sandbox

    @asynccontextmanager
    async def open_adopted(
        self, spec: SandboxSpec, *, frozen: bool = False
    ) -> AsyncIterator[FakeSandbox]:
        sandbox = self.sandboxes.get(spec.sandbox_id)
        self.calls.append(Call(trio.current_time(), "adopt", spec.sandbox_id))
        await trio.lowlevel.checkpoint()
        if sandbox is None or sandbox.state is Guest.EXITED:
            raise SandboxGone(f"runsc has no running sandbox {spec.sandbox_id}")
        self.faults.check("adopt", spec.sandbox_id)
        sandbox.owner = self.generation
        sandbox.spec = spec
        try:
            if frozen and sandbox.state is Guest.RUNNING:
                sandbox.state = Guest.FROZEN
            elif not frozen and sandbox.state is not Guest.RUNNING:
                sandbox.state = Guest.RUNNING
            yield sandbox
        finally:
            await self._release(sandbox)

    async def remove(self, sandbox_id: str) -> None:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            sandbox.owner = self.generation
            await self._release(sandbox)

    async def reap_stale(self, keep: Collection[str] = ()) -> list[str]:
        stale = sorted(i for i, s in self.sandboxes.items() if i not in keep)
        for sandbox_id in stale:
            await self.remove(sandbox_id)
        return stale

    # -- helpers -------------------------------------------------------------------

    @asynccontextmanager
    async def _open(self, spec: SandboxSpec, image: Path | None) -> AsyncIterator[FakeSandbox]:
        if spec.sandbox_id in self.sandboxes:
            raise FakeRunscError(f"runsc: container {spec.sandbox_id} already exists")
        op = "start" if image is None else "restore"
        sandbox = FakeSandbox(
            spec=spec,
            runtime=self,
            memory_bytes=self.memory_bytes,
            owner=self.generation,
            restored_from=image,
        )
        self._record(op, sandbox)
        _write_bundle(spec)
        self.sandboxes[spec.sandbox_id] = sandbox
        try:
            await trio.sleep(self.timings.start_s if image is None else self.timings.restore_s)
            self.faults.check(op, spec.sandbox_id)
            if image is not None:
                sandbox.memory_bytes = _read_image(image)
            self._console(spec, f"envd started ({op})")
            yield sandbox
        finally:
            await self._release(sandbox)

    async def _release(self, sandbox: FakeSandbox) -> None:
        """Leaving an `open_*` block: the stop ladder, unless the owner is gone."""
        if sandbox.owner != self.generation:
            return
        with trio.CancelScope(shield=True):
            self._record("stop", sandbox)
            await trio.sleep(self.timings.stop_s)
        if sandbox.state is not Guest.EXITED:
            sandbox._exit(128 + 9)
        if self.sandboxes.get(sandbox.sandbox_id) is sandbox:
            del self.sandboxes[sandbox.sandbox_id]
        (sandbox.spec.workdir / "config.json").unlink(missing_ok=True)
        if sandbox.spec.workdir.is_dir() and not any(sandbox.spec.workdir.iterdir()):
            sandbox.spec.workdir.rmdir()

    def _record(self, op: str, sandbox: FakeSandbox) -> None:
        self.calls.append(Call(trio.current_time(), op, sandbox.sandbox_id))

    def _console(self, spec: SandboxSpec, line: str) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("a") as f:
            f.write(line + "\n")


def _write_bundle(spec: SandboxSpec) -> None:
    """What runsc's bundle needs: its config, and mount points in the root."""
    spec.workdir.mkdir(parents=True, exist_ok=True)
    (spec.workdir / "config.json").write_text(json.dumps({"id": spec.sandbox_id}))
    for mountpoint in ("opt/aenv", "proc", "dev", "sys", "tmp"):
        (spec.rootfs / mountpoint).mkdir(parents=True, exist_ok=True)


def _make_image_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FakeCheckpointError(f"checkpoint image directory {path} is not empty")


def _read_image(image: Path) -> int:
    """The memory a whole image recorded; CheckpointError for anything else."""
    try:
        doc = json.loads((image / IMAGE_FILE).read_text())
        if doc.get("whole") is not True:
            raise ValueError("incomplete")
        return int(doc["memory_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FakeCheckpointError(f"runsc restore from {image}: {exc!r}") from None


def corrupt_image(image: Path) -> None:
    """Truncate an image as a crash in the middle of writing it would."""
    data = (image / IMAGE_FILE).read_bytes()
    (image / IMAGE_FILE).write_bytes(data[: len(data) // 2])


def drop_image(image: Path) -> None:
    shutil.rmtree(image)
