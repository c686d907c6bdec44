"""The runtime-neutral sandbox interface every driver implements.

A driver turns a `SandboxSpec` (a prepared root filesystem, a network slot,
limits) into a running isolated sandbox whose init process is envd. The node
never talks to `runsc` or Firecracker directly; it holds a `RunningSandbox`
inside `async with runtime.open_sandbox(spec)`, and leaving that block stops the
sandbox and releases everything the driver created (processes, cgroups,
state directories), also on cancellation.

Memory snapshots go through the same interface: `RunningSandbox.checkpoint`
writes the sandbox's memory and kernel state into an image directory
(stopping it, or leaving it running), `freeze`/`thaw` stop and restart its
vCPUs without giving up its memory, `held` stops the guest while the
runtime still answers (a snapshot or fork checkpoints a held sandbox and
copies its changed files, then lets it go on), and `Runtime.open_restored` starts a new
sandbox from such an image with a spec of its own (sandbox id, netns, root
filesystem, working directory). Restoring one image several times is fork.
The root filesystem a restored sandbox is given must show the same files as
the checkpointed one did at checkpoint time (storage's frozen layer stack
plus a fresh upper): open files are reopened by path.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

ENVD_PORT = 49983


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    sandbox_id: str
    # Merged, writable root filesystem prepared by storage (host overlayfs).
    rootfs: Path
    # envd interpreter bundle, exposed read-only inside the sandbox at /opt/aenv.
    bundle: Path
    # Network namespace the sandbox takes over (its interfaces become the guest's).
    netns_path: Path
    cpu_count: int
    memory_mb: int
    hostname: str
    # Driver-private working directory (bundle config, runsc state, logs).
    workdir: Path
    # Where the sandbox's console (envd's stdout/stderr) is written.
    log_path: Path
    # The sandbox's init process: envd started from the bundle (argv, env).
    init_argv: tuple[str, ...]
    init_env: Mapping[str, str] = field(default_factory=dict)
    # Host directories bind-mounted read-write into the sandbox: (source, destination).
    binds: tuple[tuple[Path, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Usage:
    cpu_used_pct: float
    mem_used_bytes: int
    mem_total_bytes: int


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or an image could not be restored."""


class SandboxGone(RuntimeError):
    """The sandbox to adopt is not running any more (it exited while nobody watched)."""


class RunningSandbox(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    async def wait(self) -> int:
        """Return the sandbox's exit status once it has stopped by itself."""
        ...

    @property
    def host_oom_killed(self) -> bool:
        """Whether the host killed the sandbox for memory (known once `wait` returned)."""
        ...

    async def usage(self) -> Usage:
        """CPU and memory in use now (for `/sandboxes/{id}/metrics`)."""
        ...

    async def checkpoint(self, image_dir: Path, *, leave_running: bool) -> None:
        """Write the sandbox's memory and kernel state into `image_dir`.

        With `leave_running=False` the sandbox is gone when this returns (its
        processes have exited and no longer hold its root filesystem, so
        storage may unmount and freeze it); leaving the `open_*` block then
        only cleans up. With `leave_running=True` it carries on. Raises
        `CheckpointError` if no image was written.
        """
        ...

    async def compact_image(self, image_dir: Path) -> None:
        """Store `image_dir`, a memory image this sandbox wrote and will not
        run from again (it is no longer running), in less space where the
        runtime can (a hibernated image); it restores as before. Never raises
        for an image it leaves as it is."""
        ...

    async def freeze(self, *, may_checkpoint: bool = True) -> None:
        """Stop every process of the sandbox (no CPU used, memory kept).

        `may_checkpoint=False`: nothing checkpoints it before `thaw` (a pool
        member, thawed when adopted or killed), so the runtime may stop it in a
        way a checkpoint must not follow directly.
        """
        ...

    async def checkpoint_frozen(self, image_dir: Path) -> None:
        """Write a frozen sandbox's memory and kernel state into `image_dir`; it
        stays frozen (a write-behind copy of a paused sandbox, so that it
        survives a reboot of the host while resuming it stays a thaw)."""
        ...

    def held(self) -> AbstractAsyncContextManager[None]:
        """The sandbox's processes stopped for the block, its runtime still answering.

        For a consistent live capture: inside the block nothing in the guest
        writes to memory or files, `checkpoint(leave_running=True)` works and
        leaves the sandbox held, and leaving the block lets it run again
        (also on error or cancellation). Unlike `freeze`, which may stop the
        runtime itself, a held sandbox can still be checkpointed.
        """
        ...

    async def thaw(self) -> None:
        """Let a frozen sandbox run again."""
        ...


class Runtime(Protocol):
    name: str

    def open_sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[RunningSandbox]:
        """Start the sandbox; yields once envd's process has been started."""
        ...

    def open_restored(
        self, spec: SandboxSpec, image_dir: Path
    ) -> AbstractAsyncContextManager[RunningSandbox]:
        """Start a new sandbox from a checkpoint image, as `open_sandbox` does.

        `spec` may differ from the checkpointed sandbox's in id, netns (the
        guest's interfaces take that netns' addresses; listening sockets
        survive, established connections do not), root filesystem path,
        working directory and log path; the root filesystem must show the
        same files the checkpointed one showed. One image may be restored
        any number of times, also concurrently. Raises `CheckpointError` if
        the image cannot be restored.
        """
        ...

    def open_adopted(
        self, spec: SandboxSpec, *, frozen: bool = False
    ) -> AbstractAsyncContextManager[RunningSandbox]:
        """Own a sandbox that an earlier node process started with this `spec`
        and that ran on while no node watched it (its processes and memory
        untouched); leaving the block stops it as for `open_sandbox`. It is
        frozen in the block if `frozen`, else running (a process that died
        between freezing or holding it and recording that leaves it either
        way). Raises `SandboxGone` if it is not running any more."""
        ...

    async def remove(self, sandbox_id: str) -> None:
        """Stop and delete what is left of sandbox `sandbox_id`, if anything (one
        that could not be adopted)."""
        ...

    async def reap_stale(self, keep: Collection[str] = ()) -> list[str]:
        """Remove what sandboxes of an earlier node process left behind, but the
        sandboxes named in `keep` (being adopted); returns the ids removed."""
        ...
