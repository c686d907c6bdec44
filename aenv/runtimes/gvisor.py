"""The gVisor driver: one `runsc` sandbox per aenv sandbox.

`GVisorRuntime.open_sandbox` writes an OCI bundle (config.json) into the
spec's working directory -- root = the host overlay prepared by storage,
writable, so the gofer writes through to the overlay's upper directory; the
envd bundle bind-mounted read-only at /opt/aenv; the sandbox's netns taken
over by gVisor's netstack; CPU and memory limits as cgroup resources -- and
starts it with `runsc run --detach` inside a private mount namespace whose
/proc/sys/net is a tmpfs (Debian's runsc otherwise mistakes every netns for
the root one on 6.x kernels). Leaving the block stops the sandbox with a
ladder (runsc kill, wait with a deadline, runsc delete --force, SIGKILL to
whatever is left, cgroup removal), shielded from cancellation. The runsc
state lives under `state_root`, shared by all sandboxes of the node, so
`reap_stale` can find and remove everything a crashed node left behind.

Memory snapshots: `GVisorSandbox.checkpoint` runs `runsc checkpoint` (in the
same private mount namespace, but with `--leave-running`, which saves and
resumes the kernel in place on runsc 20240729), `freeze`/`thaw` are the cgroup v2 freezer (`runsc
pause`/`resume` on cgroup v1 hosts, whose freezer only pool members use), and
`GVisorRuntime.open_restored` starts a sandbox with `runsc restore --detach`
from a bundle written for the new spec: the restored kernel takes the new
netns' interfaces and reopens its files by path under the new root, which
may be a different overlay mount at a different path. Sandboxes are booted
with `--net-disconnect-ok` where runsc has it, so a checkpoint resets
established TCP connections instead of failing on them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from aenv.runtimes import memvalve, pagepack, taskvalve
from aenv.runtimes.base import (
    CheckpointError,
    RunningSandbox,
    Runtime,
    SandboxGone,
    SandboxSpec,
    Usage,
)
from aenv.runtimes.letgo import EarlyResume

__all__ = ["GVisorCheckpointError", "GVisorError", "GVisorRuntime", "GVisorSandbox"]

log = logging.getLogger("aenv.gvisor")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Host memory per guest task outside the guest's own memory, in MiB: with the
# ptrace platform each task is a host thread (kernel stack, page tables of its
# address space's stub) and sentry state. A fork bomb held at 256 processes
# took ~124 MiB of it here at first and ~300 MiB after a minute of churn
# (kernel memory and the sentry's own growing); 2 MiB each covers that.
MIB_PER_PROCESS = 2
# Host memory of one host task (thread) of a sandbox's runtime, in KiB: its
# kernel stack and task structures, charged to the sandbox's memory cgroup
# (~25 KiB measured: 55 MiB for 2,150 under a ptrace fork bomb). The task
# valve acts before the tasks would outgrow the runtime's share of the headroom.
KIB_PER_HOST_TASK = 32
# Where the guest sees SandboxSpec.bundle; equals aenv.storage.bundle.BUNDLE_MOUNT
# (runtimes may not import storage; a test keeps the two in step).
BUNDLE_MOUNT = "/opt/aenv"
# Keeps the guest's /tmp non-empty, so on its root file system (`_prepare_root`).
TMP_MARKER = ".aenv-tmp-on-disk"
_CPU_PERIOD_US = 100_000
_CPU_SHARES = 1024  # per vCPU
# Deadlines of the stop ladder (seconds).
_KILL_TIMEOUT = 5.0
_EXIT_TIMEOUT = 5.0
_DELETE_TIMEOUT = 10.0
_TEARDOWN_DEADLINE = 30.0
_START_TIMEOUT = 60.0
_CHECKPOINT_TIMEOUT = 120.0
_PAUSE_TIMEOUT = 10.0
# How long the sandbox and gofer may take to exit after a checkpoint.
_CHECKPOINT_EXIT_TIMEOUT = 10.0

# Docker's default capability set plus what agents commonly need (ptrace for
# debuggers, net admin for test networking). gVisor confines them anyway.
_CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
    "CAP_SYS_PTRACE",
    "CAP_NET_ADMIN",
]


class GVisorError(RuntimeError):
    """runsc refused to start the sandbox (the message carries its output)."""


class GVisorCheckpointError(GVisorError, CheckpointError):
    """runsc checkpoint, restore, pause or resume failed (the message carries its output)."""


@dataclass
class GVisorSandbox:
    """A running runsc sandbox; implements `RunningSandbox`."""

    spec: SandboxSpec
    sandbox_pid: int
    _cgroups: _Cgroups
    _runtime: GVisorRuntime = field(repr=False)
    _started_at: float = field(default_factory=time.monotonic)
    _cpu_sample: tuple[float, int] | None = None
    _exit_status: int | None = None
    # stopped by `runsc pause` (the freezer where there is no cgroup v2 one)
    _runsc_paused: bool = False
    _oom_killed: bool = False
    # the memory image it was restored from (None: booted), which a memory
    # image of it is packed against (`compact_image`)
    restored_from: Path | None = None
    # inside `held`, and the resume started once its checkpoint was written
    _holding: bool = False
    _early_resume: EarlyResume | None = None

    @property
    def host_oom_killed(self) -> bool:
        return self._oom_killed

    async def guard_memory(self, on_event: Callable[[str], None]) -> None:
        """Until cancelled: the relief valve on the host memory limit
        (`aenv.runtimes.memvalve`); returns at once on hosts without one (v2)."""
        if not self._cgroups.is_v2():
            cgroup = memvalve.Cgroup(CGROUP_ROOT / "memory" / self._cgroups.path)
            await memvalve.open_valve(cgroup, on_event)

    async def guard_tasks(self, on_event: Callable[[str], None]) -> None:
        """Until cancelled: end the guest's largest process group each time the
        sandbox's host tasks near its limit (`aenv.runtimes.taskvalve`)."""
        limit = self._runtime.valve_tasks(self.spec.memory_mb)
        await taskvalve.watch_tasks(self._cgroups.pids_current, limit, self._signal_envd, on_event)

    async def _signal_envd(self) -> None:
        """`runsc kill` envd (the guest's pid 1) with `taskvalve`'s signal for it."""
        cmd = self._runtime._command(
            "kill", "--pid", "1", self.sandbox_id, str(int(taskvalve.ENVD_SIGNAL))
        )
        with trio.fail_after(_KILL_TIMEOUT):
            proc = await trio.run_process(
                cmd, capture_stdout=True, capture_stderr=True, check=False
            )
        if proc.returncode != 0:
            raise GVisorError(f"runsc kill: {proc.stderr.decode(errors='replace')[-300:]}")

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id

    async def wait(self) -> int:
        """Wait for the sandbox process to exit; return its status.

        runsc's sandbox process exits with the root container's exit status,
        but it is not our child, so only its disappearance is observable
        (through a pidfd); the status reported is then that of the container
        when known (128+signal for a kill), else -1.
        """
        if self._exit_status is None:
            status = await _wait_pid_exit(self.sandbox_pid)
            self._exit_status = -1 if status is None else _decode_wait_status(status)
            # (read before teardown removes the cgroup)
            self._oom_killed = await trio.to_thread.run_sync(self._cgroups.oom_kills) > 0
        return self._exit_status

    async def usage(self) -> Usage:
        """CPU share (of the sandbox's vCPUs) since the previous call, memory from the cgroup."""
        return await trio.to_thread.run_sync(self._usage_sync)

    async def checkpoint(self, image_dir: Path, *, leave_running: bool) -> None:
        """`runsc checkpoint` into `image_dir`; see `RunningSandbox.checkpoint`.

        Without `leave_running`, returns once the sandbox and gofer processes
        have exited, so nothing holds the root filesystem any more.
        """
        rt = self._runtime
        sandbox_id = self.spec.sandbox_id
        await trio.to_thread.run_sync(_make_image_dir, image_dir)
        pidfds = (
            [] if leave_running else await trio.to_thread.run_sync(rt._state_pidfds, sandbox_id)
        )
        try:
            if rt.exclude_zero_pages is None:
                await rt._probe_zero_page_exclusion()
            args = ["checkpoint", "--image-path", str(image_dir)]
            args += ["--compression", rt.compression]
            if rt.exclude_zero_pages:
                # pages the guest touched that hold only zeros: a restore
                # would write each into the sandbox's memory file (≈ 10 % of
                # an idle envd's image, docs/performance.md, Density)
                args.append("--exclude-committed-zero-pages")
            if leave_running:
                args.append("--leave-running")
            # --leave-running saves the kernel and resumes it in place (runsc
            # 20240729: nothing is started, no network probed): without the
            # private namespace's three processes, inside a capture's hold
            await rt._runsc_logged(
                _CHECKPOINT_TIMEOUT, self.spec, *args, sandbox_id, private_netfs=not leave_running
            )
            if self._holding and self._early_resume is None:
                # its start-up runs while the caller copies the files (`aenv.runtimes.letgo`)
                try:
                    self._early_resume = await EarlyResume.start(
                        rt._lock_file(sandbox_id),
                        rt._command("resume", sandbox_id),
                        self.spec.workdir / "runsc-resume.out",
                    )
                except OSError as e:  # (resumed the usual way)
                    log.warning("sandbox %s: no early resume: %r", sandbox_id, e)
            if not leave_running and not await _wait_all_exit(pidfds, _CHECKPOINT_EXIT_TIMEOUT):
                raise GVisorCheckpointError(
                    f"sandbox {sandbox_id} still runs {_CHECKPOINT_EXIT_TIMEOUT:g}s after "
                    "its checkpoint"
                )
        finally:
            for fd in pidfds:
                os.close(fd)

    async def compact_image(self, image_dir: Path) -> None:
        """Store `image_dir` (a memory image of this sandbox, no longer running)
        as its difference from the image it was restored from (`aenv.runtimes.pagepack`).

        Only uncompressed images (compressed ones are not whole pages); a
        booted sandbox's image stays as it is. Never fails the caller: an
        image that cannot be packed stays whole.
        """
        if self.restored_from is None or self._runtime.compression != "none":
            return
        base = pagepack.base_of(self.restored_from)
        if base is None:
            return
        t0 = time.perf_counter()
        try:
            done = await trio.to_thread.run_sync(
                pagepack.pack, image_dir, base, limiter=self._runtime.packs
            )
        except Exception as e:  # (pages.img goes only once the pack is whole)
            log.warning("sandbox %s: its memory image stays whole: %r", self.sandbox_id, e)
            return
        if done is not None:
            log.info(
                "sandbox %s: memory image packed, %d of %d pages its own, %.1f MiB (%.0f ms)",
                self.sandbox_id, done.pages - done.shared, done.pages,
                done.written / (1 << 20), 1000 * (time.perf_counter() - t0),
            )  # fmt: skip

    async def freeze(self, *, may_checkpoint: bool = True) -> None:
        """Stop every process of the sandbox; memory stays.

        The cgroup v2 freezer (one write, no process to start) where the
        sandbox has its own cgroup, else `runsc pause`. With `may_checkpoint`
        False (it is thawed before anything else is done with it: a pool
        member) the cgroup v1 freezer too: a paused sandbox that is copied to
        disk while frozen stops with `runsc pause` on v1 hosts (see
        `_Cgroups.set_frozen`).
        """
        if self._runsc_paused:
            return
        v1_ok = not may_checkpoint or _Cgroups.is_v2()
        if not v1_ok or not await trio.to_thread.run_sync(self._cgroups.set_frozen, True):
            await self._runtime._runsc_logged(
                _PAUSE_TIMEOUT, self.spec, "pause", self.sandbox_id, private_netfs=False
            )
            self._runsc_paused = True

    async def thaw(self) -> None:
        # a thaw is one write the kernel answers at once: done on the event loop (a
        # worker thread per thaw costs a thread start in a burst, when the thread
        # cache has gone idle: the loop waits for the scheduler to run it)
        pending = self._cgroups.thaw_at_once()
        if pending is not None:  # (not reported thawed yet: waited for in a thread)
            await trio.to_thread.run_sync(_wait_reached, pending)
        if self._runsc_paused:
            await self._runtime._runsc_logged(
                _PAUSE_TIMEOUT, self.spec, "resume", self.sandbox_id, private_netfs=False
            )
            self._runsc_paused = False

    async def checkpoint_frozen(self, image_dir: Path) -> None:
        """`runsc checkpoint --leave-running` of a frozen sandbox, which stays frozen;
        see `RunningSandbox.checkpoint_frozen`."""
        if not self._runsc_paused:
            # the cgroup freezer stops the sentry too: hand the stop over to runsc
            await trio.to_thread.run_sync(self._cgroups.set_frozen, False)
            await self._runtime._runsc_logged(
                _PAUSE_TIMEOUT, self.spec, "pause", self.sandbox_id, private_netfs=False
            )
            self._runsc_paused = True
        await self.checkpoint(image_dir, leave_running=True)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """`runsc pause` for the block, `runsc resume` after; see `RunningSandbox.held`.

        The sentry stops the guest's tasks but keeps serving control calls, so
        `runsc checkpoint --leave-running` works and leaves it paused (the
        cgroup freezer would stop the sentry too).
        """
        rt = self._runtime
        await rt._runsc_logged(
            _PAUSE_TIMEOUT, self.spec, "pause", self.sandbox_id, private_netfs=False
        )
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            early, self._early_resume = self._early_resume, None
            with trio.CancelScope(shield=True):
                if early is None:
                    await rt._runsc_logged(
                        _PAUSE_TIMEOUT, self.spec, "resume", self.sandbox_id, private_netfs=False
                    )
                else:
                    await self._finish_resume(early)

    async def _finish_resume(self, early: EarlyResume) -> None:
        """Let a resume started early (`EarlyResume`) go on, as `_runsc_logged` would."""
        status = await early.finish(_PAUSE_TIMEOUT)
        out = self.spec.workdir / "runsc-resume.out"
        text = await trio.to_thread.run_sync(_tail, out)
        await trio.to_thread.run_sync(_append_log, self.spec.log_path, out)
        if status != 0:
            what = "timed out" if status is None else f"exited {status}"
            raise GVisorCheckpointError(f"runsc resume {self.sandbox_id} {what}: {text}")

    def _usage_sync(self) -> Usage:
        now = time.monotonic()
        cpu_ns = self._cgroups.cpu_usage_ns()
        mem = self._cgroups.memory_usage_bytes()
        prev_t, prev_ns = self._cpu_sample or (self._started_at, 0)
        self._cpu_sample = (now, cpu_ns)
        elapsed = max(now - prev_t, 1e-6)
        pct = 100.0 * (cpu_ns - prev_ns) / 1e9 / elapsed / max(self.spec.cpu_count, 1)
        return Usage(
            cpu_used_pct=round(max(0.0, min(pct, 100.0)), 2),
            mem_used_bytes=mem,
            mem_total_bytes=self.spec.memory_mb * 1024 * 1024,
        )


class GVisorRuntime:
    """Starts sandboxes with runsc; see the module docstring."""

    name = "gvisor"

    def __init__(
        self,
        *,
        runsc: str = "runsc",
        platform: str = "ptrace",
        state_root: Path,
        cgroup_parent: str = "aenv",
        net_disconnect_ok: bool | None = None,
        compression: str = "none",
        memory_headroom_mb: int = 256,
        process_limit: Callable[[int], int] | None = None,
        io_weight: int = 100,
        tasks_limit: int | None = None,
    ) -> None:
        self.runsc = runsc
        # host tasks (threads) of a sandbox: None for `host_tasks_limit`'s default
        self.tasks_limit = tasks_limit
        # The host's memory limit of a sandbox is its size plus this margin
        # (at least an eighth of the size): the sentry's own memory, and room
        # for envd's OOM killer to act before the host's kills the sandbox ...
        self.memory_headroom_mb = memory_headroom_mb
        # ... plus MIB_PER_PROCESS for each process the guest may run
        # (`process_limit(memory_mb)`): what the runtime holds per guest task
        # on the host, outside the guest's memory.
        self.process_limit = process_limit
        # blkio/io weight of every sandbox (where the host's I/O scheduler has one)
        self.io_weight = io_weight
        # of memory images: "none" checkpoints and restores 2-3x faster here
        # than runsc's default "flate-best-speed", for images about 4x larger
        self.compression = compression
        self.platform = platform
        self.state_root = Path(state_root)
        self.cgroup_parent = cgroup_parent.strip("/")
        # None: use the flag if this runsc knows it (probed once: `probe`, or
        # else on the first start).
        self.net_disconnect_ok = net_disconnect_ok
        # None: leave zero pages out of memory images if this runsc can
        # (probed once: `probe`, or else on the first checkpoint)
        self.exclude_zero_pages: bool | None = None
        # one hibernated image packed at a time: CPU-bound, and a burst of
        # hibernations must not take a worker thread (and its heap) each
        self.packs = trio.CapacityLimiter(1)

    # -- starting -------------------------------------------------------

    @asynccontextmanager
    async def open_sandbox(self, spec: SandboxSpec) -> AsyncIterator[GVisorSandbox]:
        async with self._open(spec, None) as sandbox:
            yield sandbox

    @asynccontextmanager
    async def open_restored(
        self, spec: SandboxSpec, image_dir: Path
    ) -> AsyncIterator[GVisorSandbox]:
        async with self._open(spec, Path(image_dir)) as sandbox:
            yield sandbox

    @asynccontextmanager
    async def open_adopted(
        self, spec: SandboxSpec, *, frozen: bool = False
    ) -> AsyncIterator[GVisorSandbox]:
        """Own a sandbox an earlier node process started with this `spec`, as
        `open_sandbox` owns a new one; see `Runtime.open_adopted`."""
        async with self._open(spec, None, adopt=True) as sandbox:
            # that process may have died between a freeze (or a hold) and its record
            frozen_now = sandbox._runsc_paused or await trio.to_thread.run_sync(
                sandbox._cgroups.is_frozen
            )
            if frozen and not frozen_now:
                await sandbox.freeze()
            elif not frozen and frozen_now:
                await sandbox.thaw()
            yield sandbox

    @asynccontextmanager
    async def _open(
        self, spec: SandboxSpec, image_dir: Path | None, *, adopt: bool = False
    ) -> AsyncIterator[GVisorSandbox]:
        cgroups = _Cgroups(f"/{self.cgroup_parent}/{spec.sandbox_id}")
        try:
            if adopt:
                sandbox = await trio.to_thread.run_sync(self._running, spec, cgroups)
            else:
                sandbox = await self._start(spec, cgroups, image_dir)
            await trio.to_thread.run_sync(self._set_host_limits, spec, cgroups)
            yield sandbox
        finally:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _TEARDOWN_DEADLINE):
                await self._stop(spec.sandbox_id, cgroups)
                await trio.to_thread.run_sync(_remove_bundle, spec.workdir)

    async def probe(self) -> None:
        """Ask runsc now which optional flags it knows (`runsc flags`, `runsc
        checkpoint --help`: 20-30 ms each), rather than on the first start and
        the first checkpoint; the node calls this as it starts. A runsc that
        cannot be run leaves them unknown: the first start fails as before."""

        async def one(probe: Callable[[], Awaitable[None]]) -> None:
            try:
                await probe()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("cannot ask runsc for its flags: %s", exc)

        async with trio.open_nursery() as nursery:
            if self.net_disconnect_ok is None:
                nursery.start_soon(one, self._probe_net_disconnect_ok)
            if self.exclude_zero_pages is None:
                nursery.start_soon(one, self._probe_zero_page_exclusion)

    async def _probe_net_disconnect_ok(self) -> None:
        known = await trio.to_thread.run_sync(self._knows_net_disconnect_ok)
        if self.net_disconnect_ok is None:  # (unless set meanwhile)
            self.net_disconnect_ok = known

    async def _probe_zero_page_exclusion(self) -> None:
        known = await trio.to_thread.run_sync(self._knows_zero_page_exclusion)
        if self.exclude_zero_pages is None:
            self.exclude_zero_pages = known

    async def _start(
        self, spec: SandboxSpec, cgroups: _Cgroups, image_dir: Path | None
    ) -> GVisorSandbox:
        if self.net_disconnect_ok is None:
            await self._probe_net_disconnect_ok()
        await trio.to_thread.run_sync(self._write_bundle, spec)
        # a hibernated image stored as its difference from its base: whole
        # again, in a directory of this restore's own (removed once restored)
        unpacked: Path | None = None
        try:
            if image_dir is not None and await trio.to_thread.run_sync(
                pagepack.is_packed, image_dir
            ):
                unpacked = spec.workdir / "unpacked-image"
                try:
                    await trio.to_thread.run_sync(pagepack.unpack, image_dir, unpacked)
                except (pagepack.PackError, OSError) as e:
                    raise GVisorCheckpointError(f"unpacking {image_dir}: {e}") from e
            pid = await self._runsc_start(spec, unpacked or image_dir)
        finally:
            if unpacked is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(shutil.rmtree, unpacked, True)
        return GVisorSandbox(
            spec=spec, sandbox_pid=pid, _cgroups=cgroups, _runtime=self, restored_from=image_dir
        )

    async def _runsc_start(self, spec: SandboxSpec, image_dir: Path | None) -> int:
        """`runsc run` (or `restore` of `image_dir`), detached; the sandbox's pid."""
        pid_file = spec.workdir / "sandbox.pid"
        verb = ["run"] if image_dir is None else ["restore", "--image-path", str(image_dir)]
        cmd = self._command(
            *verb, "--detach", "--bundle", str(spec.workdir), "--pid-file", str(pid_file),
            spec.sandbox_id,
        )  # fmt: skip
        # The sandbox keeps the stdio it is started with: hand it the log
        # file, never a pipe.
        log = await trio.to_thread.run_sync(_open_append, spec.log_path)
        try:
            with trio.fail_after(_START_TIMEOUT):
                proc = await trio.run_process(
                    _in_private_netfs(cmd), stdin=None, stdout=log, stderr=log, check=False
                )
        finally:
            os.close(log)
        if proc.returncode != 0:
            error = GVisorError if image_dir is None else GVisorCheckpointError
            raise error(
                f"runsc {verb[0]} {spec.sandbox_id} exited {proc.returncode}: "
                f"{_tail(spec.log_path)}"
            )
        return int(pid_file.read_text().strip())

    def host_memory_bytes(self, memory_mb: int) -> int:
        """The host's memory limit of a sandbox of `memory_mb`: its size plus the
        headroom plus the runtime's own memory for as many processes as it may run."""
        processes = self.process_limit(memory_mb) if self.process_limit is not None else 0
        headroom = max(self.memory_headroom_mb, memory_mb // 8) + processes * MIB_PER_PROCESS
        return (memory_mb + headroom) * 1024 * 1024

    def _set_host_limits(self, spec: SandboxSpec, cgroups: _Cgroups) -> None:
        """Raise the host's memory limit above the sandbox's size (blocking).

        runsc tells the guest its memory from the cgroup's limit when the
        sandbox starts (the spec's: its size); raised afterwards, the guest
        keeps seeing its size while the host kills only past the headroom.
        The I/O weight is set where the host has one (best effort).
        """
        cgroups.set_memory_limit(self.host_memory_bytes(spec.memory_mb))
        cgroups.set_io_weight(self.io_weight)
        cgroups.set_pids_limit(self.host_tasks_limit(spec.memory_mb))

    def host_tasks_limit(self, memory_mb: int) -> int:
        """The most host tasks (threads) a sandbox of `memory_mb` may hold: a
        quarter of the host's `kernel.pid_max` (which every sandbox shares),
        and never less than 8 per process of its process limit (systrap needs
        about one per guest thread). ptrace keeps a host thread per sentry
        thread and guest address space, never freed, so a fork bomb grows a
        sandbox to thousands; past this the sandbox dies instead of leaving
        the host unable to fork (the task valve ends the bomb before that:
        `valve_tasks`). `tasks_limit` (AENV_SANDBOX_HOST_TASKS) overrides it."""
        if self.tasks_limit is not None:
            return self.tasks_limit
        processes = self.process_limit(memory_mb) if self.process_limit is not None else 1024
        return max(_pid_max() // 4, 8 * processes)

    def valve_tasks(self, memory_mb: int) -> int:
        """The host tasks the task valve measures a sandbox of `memory_mb` against
        (`aenv.runtimes.taskvalve`): its host limit, or fewer where the limit
        is more than the runtime's share of its memory headroom can hold
        (`MIB_PER_PROCESS` per process, `KIB_PER_HOST_TASK` per task)."""
        limit = self.host_tasks_limit(memory_mb)
        if self.process_limit is None:
            return limit
        budget = self.process_limit(memory_mb) * MIB_PER_PROCESS * 1024 // KIB_PER_HOST_TASK
        return min(limit, budget)

    def _running(self, spec: SandboxSpec, cgroups: _Cgroups) -> GVisorSandbox:
        """The sandbox runsc runs as `spec.sandbox_id`, if it is alive (blocking)."""
        try:
            state = json.loads(self._state_file(spec.sandbox_id).read_text())
            pid = int(state["sandbox"]["pid"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SandboxGone(f"runsc has no sandbox {spec.sandbox_id}: {exc}") from None
        if not _alive(pid):
            raise SandboxGone(f"the runsc sandbox {spec.sandbox_id} (pid {pid}) has exited")
        sandbox = GVisorSandbox(spec=spec, sandbox_pid=pid, _cgroups=cgroups, _runtime=self)
        # runsc's own record (no `runsc state`: a process per sandbox slows a restart)
        sandbox._runsc_paused = state.get("status") == "paused"
        return sandbox

    def _command(self, *args: str) -> list[str]:
        return [
            self.runsc,
            "--root", str(self.state_root),
            "--platform", self.platform,
            "--network", "sandbox",
            # Writes must reach the host overlay, never gVisor's memory.
            "--overlay2", "none",
            # A checkpoint resets established connections instead of failing.
            *(["--net-disconnect-ok"] if self.net_disconnect_ok else []),
            *args,
        ]  # fmt: skip

    def _knows_zero_page_exclusion(self) -> bool:
        proc = subprocess.run(
            [self.runsc, "checkpoint", "--help"],
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        return "-exclude-committed-zero-pages" in proc.stdout + proc.stderr

    def _knows_net_disconnect_ok(self) -> bool:
        proc = subprocess.run(
            [self.runsc, "flags"], capture_output=True, text=True, check=False, timeout=30
        )
        return "-net-disconnect-ok" in proc.stdout + proc.stderr

    async def _runsc_logged(
        self, seconds: float, spec: SandboxSpec, *args: str, private_netfs: bool = True
    ) -> None:
        """Run a runsc command with its output appended to the sandbox's log.

        Without `private_netfs` it runs as it is (`runsc pause` and `resume`:
        calls to the running sandbox, which start nothing and probe no network;
        the namespace costs three more processes on a capture's hold).
        Raises GVisorCheckpointError (with the output) if it fails or times out.
        """
        out = spec.workdir / "runsc.out"
        fd = await trio.to_thread.run_sync(_open_truncated, out)
        try:
            with trio.move_on_after(seconds) as scope:
                cmd = self._command(*args)
                proc = await trio.run_process(
                    _in_private_netfs(cmd) if private_netfs else cmd,
                    stdin=None,
                    stdout=fd,
                    stderr=fd,
                    check=False,
                )
        finally:
            os.close(fd)
        text = await trio.to_thread.run_sync(_tail, out)
        await trio.to_thread.run_sync(_append_log, spec.log_path, out)
        if scope.cancelled_caught:
            raise GVisorCheckpointError(f"runsc {args[0]} {spec.sandbox_id} timed out: {text}")
        if proc.returncode != 0:
            raise GVisorCheckpointError(
                f"runsc {args[0]} {spec.sandbox_id} exited {proc.returncode}: {text}"
            )

    def _write_bundle(self, spec: SandboxSpec) -> None:
        self.state_root.mkdir(parents=True, exist_ok=True)
        spec.workdir.mkdir(parents=True, exist_ok=True)
        _prepare_root(spec.rootfs)
        config = oci_config(spec, cgroups_path=f"/{self.cgroup_parent}/{spec.sandbox_id}")
        target = spec.workdir / "config.json"
        target.write_text(json.dumps(config, indent=1))

    # -- stopping -------------------------------------------------------

    async def _stop(self, sandbox_id: str, cgroups: _Cgroups) -> None:
        """The stop ladder: runsc kill, wait; SIGKILL, wait; runsc delete; clean up."""
        pidfds = await trio.to_thread.run_sync(self._state_pidfds, sandbox_id)
        try:
            # frozen: thaw first (runsc kill asks the frozen sentry; under the v1
            # freezer a SIGKILL of a frozen process waits for the thaw)
            if await trio.to_thread.run_sync(cgroups.is_frozen):
                await trio.to_thread.run_sync(cgroups.set_frozen, False)
            await self._runsc_quiet(_KILL_TIMEOUT, "kill", sandbox_id, "SIGKILL")
            if not await _wait_all_exit(pidfds, _EXIT_TIMEOUT):
                for fd in pidfds:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                await _wait_all_exit(pidfds, _EXIT_TIMEOUT)
            if not pidfds or not await _wait_all_exit(pidfds, 0):
                # Unknown or unkillable processes: let runsc try its own way.
                await self._runsc_quiet(_DELETE_TIMEOUT, "delete", "--force", sandbox_id)
        finally:
            for fd in pidfds:
                os.close(fd)
        await trio.to_thread.run_sync(self._remove_leftovers, sandbox_id, cgroups)

    async def _runsc_quiet(self, seconds: float, *args: str) -> None:
        with trio.move_on_after(seconds):
            await trio.run_process(
                self._command(*args),
                stdin=None,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )

    def _state_file(self, sandbox_id: str) -> Path:
        return self.state_root / f"{sandbox_id}_sandbox:{sandbox_id}.state"

    def _lock_file(self, sandbox_id: str) -> Path:
        """runsc's lock of the container, which each of its commands holds."""
        return self.state_root / f"{sandbox_id}_sandbox:{sandbox_id}.lock"

    def _state_pidfds(self, sandbox_id: str) -> list[int]:
        """pidfds of the sandbox and gofer processes named in runsc's state file."""
        try:
            state = json.loads(self._state_file(sandbox_id).read_text())
        except (OSError, ValueError):
            return []
        fds: list[int] = []
        for pid in (state.get("sandbox", {}).get("pid"), state.get("goferPid")):
            if isinstance(pid, int) and pid > 0:
                with contextlib.suppress(ProcessLookupError):
                    fds.append(os.pidfd_open(pid))
        return fds

    def _remove_leftovers(self, sandbox_id: str, cgroups: _Cgroups) -> None:
        """SIGKILL whatever is still in the sandbox's cgroups, remove them and runsc's state."""
        deadline = time.monotonic() + _EXIT_TIMEOUT
        while (leftovers := [p for p in cgroups.pids() if _alive(p)]) and (
            time.monotonic() < deadline
        ):
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        try:
            cgroups.remove()
        finally:
            for path in self._state_files(sandbox_id):
                with contextlib.suppress(OSError):
                    path.unlink()

    def _state_files(self, sandbox_id: str) -> list[Path]:
        # State and lock files; newer runsc also keeps its control socket here.
        return [
            *self.state_root.glob(f"{sandbox_id}_sandbox:*"),
            *self.state_root.glob(f"runsc-{sandbox_id}.sock"),
        ]

    # -- crash recovery -------------------------------------------------

    async def reap_stale(self, keep: Collection[str] = ()) -> list[str]:
        """Kill and delete every container runsc knows under `state_root`, and its
        cgroups, but those named in `keep`; returns the ids reaped."""
        if not self.state_root.is_dir():
            return []
        ids = [i for i in await trio.to_thread.run_sync(self._stale_ids) if i not in keep]
        for sandbox_id in ids:
            await self.remove(sandbox_id)
        return ids

    async def remove(self, sandbox_id: str) -> None:
        """Stop and delete sandbox `sandbox_id` and its cgroups, if anything of it is left.

        Nothing of it is kept, so its processes get SIGKILL at once (a paused
        sandbox would not act on `runsc kill`), then the stop ladder cleans up.
        """
        with trio.CancelScope(shield=True, deadline=trio.current_time() + _TEARDOWN_DEADLINE):
            pidfds = await trio.to_thread.run_sync(self._state_pidfds, sandbox_id)
            cgroups = _Cgroups(f"/{self.cgroup_parent}/{sandbox_id}")
            try:
                # a frozen task acts on SIGKILL only once thawed
                if await trio.to_thread.run_sync(cgroups.is_frozen):
                    await trio.to_thread.run_sync(cgroups.set_frozen, False)
                for fd in pidfds:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                await _wait_all_exit(pidfds, _EXIT_TIMEOUT)
            finally:
                for fd in pidfds:
                    os.close(fd)
            await self._stop(sandbox_id, cgroups)

    def release_parent(self) -> bool:
        """Remove the node's cgroup parent (`/<cgroup_parent>` in each hierarchy)
        if no sandbox cgroup is left in it; True if it is gone.

        Called when the node stops, when nothing starts a sandbox any more (a
        runsc mkdir of the parent racing this rmdir would fail a start);
        sandboxes kept running across a restart keep it.
        """
        gone = True
        for d in _Cgroups(self.cgroup_parent).dirs():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
        return gone

    def _stale_ids(self) -> list[str]:
        ids = {p.name.split("_sandbox:", 1)[0] for p in self.state_root.glob("*_sandbox:*")}
        ids.update(
            p.name[len("runsc-") : -len(".sock")] for p in self.state_root.glob("runsc-*.sock")
        )
        ids.update(_Cgroups.children(f"/{self.cgroup_parent}"))
        return sorted(ids)


def oci_config(spec: SandboxSpec, *, cgroups_path: str) -> dict[str, Any]:
    """The OCI runtime spec (config.json) for one sandbox."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM": "xterm"}
    env.update(spec.init_env)
    memory = spec.memory_mb * 1024 * 1024
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.init_argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {
                key: _CAPABILITIES
                for key in ("bounding", "effective", "inheritable", "permitted", "ambient")
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
            "noNewPrivileges": False,
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            {
                "destination": BUNDLE_MOUNT,
                "type": "bind",
                "source": str(spec.bundle),
                "options": ["rbind", "ro"],
            },
            # volumes: through the gofer, shared with the host and other sandboxes
            *(
                {
                    "destination": dest,
                    "type": "bind",
                    "source": str(src),
                    "options": ["rbind", "rw"],
                }
                for src, dest in spec.binds
            ),
        ],
        "linux": {
            "cgroupsPath": cgroups_path,
            "resources": {
                "cpu": {
                    "quota": max(spec.cpu_count, 1) * _CPU_PERIOD_US,
                    "period": _CPU_PERIOD_US,
                    # busy sandboxes share the host's CPUs by their size
                    "shares": _CPU_SHARES * max(spec.cpu_count, 1),
                },
                "memory": {"limit": memory},
            },
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "network", "path": str(spec.netns_path)},
            ],
        },
    }


def _wait_reached(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait (blocking) until the freezer reports its new state, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.001)


class _Cgroups:
    """The sandbox's cgroup on the host: v1 (one dir per controller) or v2 (unified)."""

    _V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "devices", "freezer",
                       "blkio", "net_cls", "net_prio", "perf_event", "hugetlb", "systemd")  # fmt: skip

    def __init__(self, path: str) -> None:
        self.path = path.strip("/")

    @staticmethod
    def is_v2() -> bool:
        return (CGROUP_ROOT / "cgroup.controllers").exists()

    def dirs(self) -> list[Path]:
        if self.is_v2():
            return [CGROUP_ROOT / self.path]
        return [CGROUP_ROOT / c / self.path for c in self._V1_CONTROLLERS]

    @classmethod
    def children(cls, parent: str) -> set[str]:
        parent = parent.strip("/")
        roots = [CGROUP_ROOT] if cls.is_v2() else [CGROUP_ROOT / "memory", CGROUP_ROOT / "cpu"]
        names: set[str] = set()
        for root in roots:
            with contextlib.suppress(OSError):
                names.update(p.name for p in (root / parent).iterdir() if p.is_dir())
        return names

    def set_frozen(self, frozen: bool) -> bool:
        """Freeze or thaw the cgroup; False if that is not possible here.

        The v2 freezer (`cgroup.freeze`) or the v1 one (`freezer.state`): one
        write, no process to start (`runsc pause`/`resume` cost a Go process
        each, 100+ ms on a busy host). Waits for the kernel to report the new
        state, so the processes really are stopped on return.

        The v1 freezer is used only for sandboxes thawed before anything else
        is done with them (pool members, `GVisorSandbox.freeze`): once, in CI
        under load, a sandbox paused by it under the ptrace platform, copied to
        disk (thawed, `runsc pause`, checkpoint) and hibernated did not answer
        after its restore; not reproduced since (docs/performance.md).
        """
        done = self._freezer_write(frozen)
        if done is None:
            return False
        _wait_reached(done)
        return True

    def thaw_at_once(self) -> Callable[[], bool] | None:
        """Thaw with one write and one read, for the event loop (no waiting): None
        if the kernel reports the cgroup thawed at once (as it does for a thaw,
        which wakes the tasks and returns) or the write failed (best effort, as
        `set_frozen`); else the check to wait on (`_wait_reached`)."""
        done = self._freezer_write(False)
        return None if done is None or done() else done

    def _freezer_write(self, frozen: bool) -> Callable[[], bool] | None:
        """Write the freezer's new state; whether the kernel reports it reached (a
        check to call), None if the write failed."""
        if self.is_v2():
            d = CGROUP_ROOT / self.path
            control, value, events = "cgroup.freeze", "1" if frozen else "0", "cgroup.events"
            want = f"frozen {1 if frozen else 0}"
        else:
            d = CGROUP_ROOT / "freezer" / self.path
            control, value = "freezer.state", "FROZEN" if frozen else "THAWED"
            events, want = "freezer.state", value
        try:
            (d / control).write_text(value)
        except OSError:
            return None

        def reached() -> bool:
            with contextlib.suppress(OSError):
                return want in (d / events).read_text().splitlines()
            return False

        return reached

    def is_frozen(self) -> bool:
        """Whether the cgroup freezer holds the sandbox (False where there is none)."""
        with contextlib.suppress(OSError):
            if self.is_v2():
                return "frozen 1" in (CGROUP_ROOT / self.path / "cgroup.events").read_text()
            state = (CGROUP_ROOT / "freezer" / self.path / "freezer.state").read_text()
            return state.strip() in ("FROZEN", "FREEZING")
        return False

    def pids(self) -> list[int]:
        found: list[int] = []
        for d in self.dirs():
            for dirpath, _dirs, files in os.walk(d):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError, ValueError):
                        found.extend(
                            int(x) for x in Path(dirpath, "cgroup.procs").read_text().split()
                        )
        return found

    def remove(self) -> None:
        for d in self.dirs():
            # Children first (runsc may create per-container subgroups).
            for dirpath, _dirs, _files in sorted(os.walk(d), key=lambda t: len(t[0]), reverse=True):
                with contextlib.suppress(FileNotFoundError):
                    _rmdir_retry(Path(dirpath))

    def set_memory_limit(self, limit: int) -> None:
        """Set the memory limit (memory.max, or memory.limit_in_bytes on v1)."""
        if self.is_v2():
            (CGROUP_ROOT / self.path / "memory.max").write_text(str(limit))
        else:
            (CGROUP_ROOT / "memory" / self.path / "memory.limit_in_bytes").write_text(str(limit))

    def oom_kills(self) -> int:
        """How many processes the host's OOM killer killed in this cgroup."""
        if self.is_v2():
            path, key = CGROUP_ROOT / self.path / "memory.events", "oom_kill"
        else:
            path, key = CGROUP_ROOT / "memory" / self.path / "memory.oom_control", "oom_kill"
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        return 0

    def _pids_dir(self) -> Path:
        """The cgroup's directory in the pids controller."""
        return CGROUP_ROOT / self.path if self.is_v2() else CGROUP_ROOT / "pids" / self.path

    def pids_current(self) -> int | None:
        """The cgroup's host tasks now (None: no cgroup, or no pids controller)."""
        try:
            return int((self._pids_dir() / "pids.current").read_text())
        except (OSError, ValueError):
            return None

    def set_pids_limit(self, limit: int) -> None:
        """Set the host's task limit (pids.max; best effort: a host may not have the controller)."""
        with contextlib.suppress(OSError):
            (self._pids_dir() / "pids.max").write_text(str(limit))

    def set_io_weight(self, weight: int) -> bool:
        """Set the I/O weight (1..1000 on v1's scale) where the host has one; False if not."""
        if self.is_v2():
            d = CGROUP_ROOT / self.path
            files = [(d / "io.bfq.weight", weight), (d / "io.weight", f"default {weight}")]
        else:
            d = CGROUP_ROOT / "blkio" / self.path
            files = [(d / "blkio.bfq.weight", weight), (d / "blkio.weight", weight)]
        for path, value in files:
            with contextlib.suppress(OSError):
                path.write_text(str(value))
                return True
        return False

    def memory_usage_bytes(self) -> int:
        if self.is_v2():
            return _read_int(CGROUP_ROOT / self.path / "memory.current")
        mem = CGROUP_ROOT / "memory" / self.path
        usage = _read_int(mem / "memory.usage_in_bytes")
        # Report what the sandbox uses, not reclaimable page cache.
        with contextlib.suppress(OSError):
            for line in (mem / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "total_inactive_file":
                    usage -= int(value)
        return max(usage, 0)

    def cpu_usage_ns(self) -> int:
        if self.is_v2():
            for line in (CGROUP_ROOT / self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) * 1000
            return 0
        return _read_int(CGROUP_ROOT / "cpuacct" / self.path / "cpuacct.usage")


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _rmdir_retry(path: Path) -> None:
    deadline = time.monotonic() + 2.0
    while True:
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as gone: only its parent can reap it.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return False


async def _wait_all_exit(pidfds: Sequence[int], seconds: float) -> bool:
    """Wait up to `seconds` for every pidfd's process to exit; True if all did."""
    with trio.move_on_after(seconds):
        for fd in pidfds:
            if seconds <= 0:
                if not _pidfd_exited(fd):
                    return False
                continue
            await trio.lowlevel.wait_readable(fd)
        return True
    return False


def _pidfd_exited(fd: int) -> bool:
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


async def _wait_pid_exit(pid: int) -> int | None:
    """Wait until process `pid` (not necessarily our child) has exited.

    Returns its wait status if it could still be read (the process is a
    zombie not yet reaped by its parent), else None.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    return _zombie_status(pid)


def _zombie_status(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state); field 52 is the exit code in waitpid form.
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return int(fields[49])


def _decode_wait_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _in_private_netfs(cmd: Sequence[str]) -> list[str]:
    """Run `cmd` in a private mount namespace with a tmpfs over /proc/sys/net.

    Propagation is slave so that unmounts on the host (a sandbox's overlay
    being torn down) reach the namespace instead of pinning the mount.
    """
    script = "mount -t tmpfs -o size=4k aenv-netfs /proc/sys/net && exec " + shlex.join(cmd)
    return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script]


def _prepare_root(rootfs: Path) -> None:
    """Make the guest's mount points and its /tmp in `rootfs` (blocking).

    The root holds what the sandbox wrote (a restore's, a resume's), so
    nothing here follows a symbolic link out of it: a component that is one
    (or not a directory) is left as it is. /tmp gets a marker file, because
    runsc mounts a tmpfs, memory the sandbox's disk size does not bound, over
    an empty /tmp at boot; a non-empty one stays on the root file system.
    """
    for mountpoint in ("opt/aenv", "proc", "dev", "sys"):
        fd = _guest_dir(rootfs, mountpoint)
        if fd is not None:
            os.close(fd)
    tmp = _guest_dir(rootfs, "tmp")
    if tmp is None:
        return
    try:
        os.fchmod(tmp, 0o1777)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with contextlib.suppress(OSError):
            os.close(os.open(TMP_MARKER, flags, 0o444, dir_fd=tmp))
    finally:
        os.close(tmp)


def _guest_dir(rootfs: Path, path: str) -> int | None:
    """An fd of directory `path` of `rootfs`, made if missing; None if a
    component is a symbolic link or not a directory."""
    fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in path.split("/"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            try:
                child = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError:
                return None
            os.close(fd)
            fd = child
        fd, out = -1, fd
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def _remove_bundle(workdir: Path) -> None:
    """Remove the files the driver wrote into the spec's workdir (and it, if now empty)."""
    for name in ("config.json", "sandbox.pid", "runsc.out"):
        with contextlib.suppress(FileNotFoundError):
            (workdir / name).unlink()
    with contextlib.suppress(OSError):
        workdir.rmdir()


def _make_image_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise GVisorCheckpointError(f"checkpoint image directory {path} is not empty")


def _open_truncated(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)


def _append_log(log_path: Path, out: Path) -> None:
    """Copy a runsc command's output (its panics are long) into the console log, capped."""
    with contextlib.suppress(OSError):
        data = out.read_bytes()[-16384:]
        if data:
            with open(log_path, "ab") as f:
                f.write(data)


def _open_append(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)


def _tail(path: Path, limit: int = 2000) -> str:
    with contextlib.suppress(OSError):
        data = path.read_bytes()[-limit:]
        return data.decode(errors="replace").strip()
    return ""


if TYPE_CHECKING:

    def _conforms(rt: GVisorRuntime, sandbox: GVisorSandbox) -> tuple[Runtime, RunningSandbox]:
        return rt, sandbox
