"""The runtime-neutral sandbox interface every driver implements.

A driver turns a `SandboxSpec` (a prepared root filesystem, a network slot,
limits) into a running isolated sandbox whose init process is envd. The node
never talks to `runsc` or Firecracker directly; it holds a `RunningSandbox`
inside `async with runtime.open_sandbox(spec)`, and leaving that block stops the
sandbox and releases everything the driver created (processes, cgroups,
state directories), also on cancellation.
"""

from __future__ import annotations

from collections.abc import Mapping
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


@dataclass(frozen=True, kw_only=True)
class Usage:
    cpu_used_pct: float
    mem_used_bytes: int
    mem_total_bytes: int


class RunningSandbox(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    async def wait(self) -> int:
        """Return the sandbox's exit status once it has stopped by itself."""
        ...

    async def usage(self) -> Usage:
        """CPU and memory in use now (for `/sandboxes/{id}/metrics`)."""
        ...


class Runtime(Protocol):
    name: str

    def open_sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[RunningSandbox]:
        """Start the sandbox; yields once envd's process has been started."""
        ...

    async def reap_stale(self) -> None:
        """Remove leftovers of sandboxes from an earlier crashed node process."""
        ...
