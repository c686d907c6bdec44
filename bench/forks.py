"""aenv fork and snapshot benchmark: fork(1), fork(4), fork(20) and how long
create_snapshot holds the source, next to one `runsc restore` in the same run.

Floor and aenv samples alternate in one run (both see the same load on a
shared machine). The floor (bench/run.py's, runsc set up as aenv's gVisor driver sets it up,
with nothing of aenv running) on the sandbox aenv runs (the template's root
filesystem under an overlay, envd as init): `runsc checkpoint
--leave-running`, then one `runsc restore` of that image into a fresh
container ID in a netns of its own (the issue's yardstick: one restore), and
checkpoint --leave-running + 4 and + 20 concurrent restores (bench/run.py's
fork floor: what runsc alone does for a fork of 4 or 20).

The aenv side: one node (`python -m aenv serve`, free loopback port, private
home with the bundle and templates linked, netns prefix and slot range as
bench/run.py's, `AENV_POOL_SIZE=0` so no pool refill competes with the
forks), through the unmodified e2b SDK. The source sandbox runs a ticker (a
Python loop that sleeps 2 ms and records the longest gap between its wake-ups):
a capture that stops the source shows as a gap. Timed:

- `fork(count=k)` for k in 1, 4, 20 (the call until the SDK has its
  children; each child then runs `true` and is killed, untimed);
- `create_snapshot()` (the call) and the ticker's longest gap while it ran
  (the hold the source's processes saw), next to the longest gap over as
  long a window without a snapshot (scheduling noise on a shared machine);
- from the sandboxes' logs, the node's own breakdown of each capture (close
  connections, runsc pause, checkpoint, file layer, resume) and of each child's
  start (root overlay, network slot, restore, envd, journal), as medians;
- a profile of each fork(20) next to its floor: when each child started and
  ended its restore (from its log line's time and phases), how many restores
  ran at once, the host's busy CPU time over the call and the CPU the
  children's sandboxes (their cgroups) and the node process used.

Prints a table with the issue's targets (fork(4) <= 1.3x one restore, fork(20)
<= 3x, the snapshot's hold <= 100 ms), the forks against their own floor (N
concurrent restores), and writes JSON to bench/results/forks-<timestamp>.json.
Needs root and runsc.

    .venv/bin/python bench/forks.py [--n 10] [--n20 3] [--home DIR] [--template base]

Environment as bench/run.py: AENV_BENCH_NET_PREFIX, AENV_BENCH_SLOT_CIDR,
AENV_BENCH_FLOOR_NET (two runs on one machine need their own).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.config import Config  # noqa: E402
from aenv.runtimes.base import ENVD_PORT  # noqa: E402
from aenv.storage.bundle import envd_command  # noqa: E402
from bench.run import (  # noqa: E402
    FLOOR_CGROUP,
    MAIN_NET,
    NET_PREFIX,
    NODE_TAG,
    SLOT_CIDR,
    Floor,
    Interrupted,
    Series,
    _describe,
    _sdk_env,
    _warm_up,
    bench_home,
    envd_rootfs,
    floor_network,
    fork_nets,
    interrupt_on_sigterm,
    loadavg,
    percentile,
    run,
    runsc_version,
)
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
# The source's ticker: the longest gap between wake-ups, reported and reset on
# request (a file appears: /tmp/gap.ask), in milliseconds.
TICKER = """
import os, time
last = time.monotonic(); worst = 0.0; i = 0
while True:
    time.sleep(0.002)
    now = time.monotonic(); worst = max(worst, now - last); last = now; i += 1
    if i % 16 == 0 and os.path.exists("/tmp/gap.ask"):
        os.unlink("/tmp/gap.ask")
        with open("/tmp/gap.new", "w") as f:
            f.write(f"{worst * 1000:.1f}")
        os.rename("/tmp/gap.new", "/tmp/gap")
        worst = 0.0
"""
ASK_GAP = (
    "touch /tmp/gap.ask; end=$(($(date +%s) + 20)); "
    "while [ ! -e /tmp/gap ] && [ $(date +%s) -lt $end ]; do sleep 0.05; done; "
    "cat /tmp/gap; rm -f /tmp/gap"
)
# (label, aenv key, floor key, target: a ratio to the floor's p50, or ms)
ROWS: tuple[tuple[str, str | None, str | None, float | str | None], ...] = (
    ("fork(count=1)", "fork_1", "restore", None),
    ("fork(count=4)", "fork_4", "restore", "1.3x"),
    ("fork(count=20)", "fork_20", "restore", "3x"),
    ("  fork(count=4) against checkpoint + 4 restores", "fork_4", "fork_4", None),
    ("  fork(count=20) against checkpoint + 20 restores", "fork_20", "fork_20", None),
    ("create_snapshot (call)", "snapshot", "checkpoint_leave_running", None),
    ("create_snapshot: source held (ticker gap)", "snapshot_gap", None, 100.0),
    ("  ticker gap without a snapshot (noise)", "idle_gap", None, None),
    ("floor: runsc restore (one)", None, "restore", None),
    ("floor: checkpoint --leave-running", None, "checkpoint_leave_running", None),
    ("floor: checkpoint --leave-running + 4 restores", None, "fork_4", None),
    ("floor: checkpoint --leave-running + 20 restores", None, "fork_20", None),
)
# the floor's children: one netns each, as many as the largest fork
FORK_NETS = fork_nets(20)
PHASE_LINE = re.compile(r"(captured for a fork of \d+|captured for a snapshot|running: started)"
                        r" in (\d+) ms \(([^)]*)\)")  # fmt: skip


# -- CPU ----------------------------------------------------------------------------

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
TICK = os.sysconf("SC_CLK_TCK")


def host_busy_s() -> float:
    """CPU seconds the host has been busy (all CPUs, neither idle nor waiting for I/O)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its reaped children (utime, stime, cutime, cstime)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICK


def reaped_cpu_s() -> float:
    """CPU seconds of this process's reaped children (the floor's runsc CLIs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cgroup_cpu_s(path: str) -> float:
    """CPU seconds a cgroup (v1 cpuacct; v2 cpu.stat) has used; 0 where there is none."""
    for f, scale in ((CPUACCT / path / "cpuacct.usage", 1e9),
                     (Path("/sys/fs/cgroup") / path / "cpu.stat", 1e6)):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text()
            if f.name == "cpu.stat":
                text = text.split()[1]  # usage_usec
            return int(text) / scale
    return 0.0


def sandbox_cpu_s(sandbox_id: str) -> float:
    """CPU seconds of a node's sandbox, found by its ID under any cgroup parent."""
    sid = sandbox_id.split("-", 1)[0]
    for root in (CPUACCT, Path("/sys/fs/cgroup")):
        for d in root.glob(f"*/{sid}*"):
            return cgroup_cpu_s(str(d.relative_to(root)))
    return 0.0


def _overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


# -- the floor --------------------------------------------------------------------


class FloorRig:
    """bench/run.py's floor on the sandbox aenv runs, kept up for the whole run
    so its samples interleave with aenv's (both see the same load)."""

    def __init__(self, home: Path, workdir: Path, config: Config, template: str) -> None:
        flags = run([config.runsc_binary, "flags"], check=False, timeout=30)
        self.floor = Floor(
            home=home,
            workdir=workdir,
            runsc=config.runsc_binary,
            platform=config.runsc_platform,
            net_disconnect_ok=b"-net-disconnect-ok" in flags.stdout + flags.stderr,
            compression=config.checkpoint_compression,
        )
        self.home, self.workdir, self.template = home, workdir, template
        self.tag = secrets.token_hex(3)
        argv, env = envd_command(ENVD_PORT)
        self.init = (argv, dict(env))
        self.samples = 0
        self.rootfs = Path()
        self.source = f"aenvbench-src-{self.tag}"

    @contextlib.contextmanager
    def running(self) -> Iterator[FloorRig]:
        try:
            with (
                floor_network((MAIN_NET, *FORK_NETS)),
                envd_rootfs(self.home, self.template, self.workdir / "envd-root") as rootfs,
            ):
                self.rootfs = rootfs
                self.floor.reset_guest_address()
                self.floor.start_detached(self.source, rootfs, self.init)
                self.floor.exec(self.source, "/bin/true")
                yield self
        finally:
            self.floor.cleanup()

    def _image(self) -> Path:
        self.samples += 1
        image = self.workdir / "images" / str(self.samples)
        image.mkdir(parents=True)
        return image

    def restore_one(self, results: dict[str, Series]) -> None:
        """checkpoint --leave-running (timed), then one restore of it (timed)."""
        image = self._image()
        t0 = time.perf_counter()
        self.floor.checkpoint(self.source, image, leave_running=True)
        results["checkpoint_leave_running"].samples.append((time.perf_counter() - t0) * 1000)
        child = f"aenvbench-one-{self.tag}-{self.samples}"
        prepared = self.floor.prepare_restore(child, self.rootfs, image, FORK_NETS[0], self.init)
        t0 = time.perf_counter()
        self.floor.restore_all([(child, *prepared)])
        results["restore"].samples.append((time.perf_counter() - t0) * 1000)
        self.floor.exec(child, "/bin/true")
        self.floor.delete(child)
        shutil.rmtree(image)

    def fork(
        self,
        count: int,
        results: dict[str, Series],
        profiles: list[dict[str, Any]] | None = None,
        limit: int | None = None,
    ) -> None:
        """checkpoint --leave-running + `count` concurrent restores (bench/run.py's
        fork floor), at most `limit` at once; with `profiles`, one more profile
        of it (`profile`)."""
        image = self._image()
        children = [(f"aenvbench-f{count}-{self.tag}-{self.samples}-{j:02d}", net) for j, net in
                    enumerate(FORK_NETS[:count])]  # fmt: skip
        prepared = [
            (c, *self.floor.prepare_restore(c, self.rootfs, image, net, self.init))
            for c, net in children
        ]
        cpu0, clis0 = host_busy_s(), reaped_cpu_s()
        t0 = time.perf_counter()
        self.floor.checkpoint(self.source, image, leave_running=True)
        t1 = time.perf_counter()
        ended = self.floor.restore_all(prepared, limit)
        t2 = time.perf_counter()
        key = f"fork_{count}" if limit is None else f"fork_{count}_at_{limit}"
        results.setdefault(key, Series()).samples.append((t2 - t0) * 1000)
        if profiles is not None:
            sandbox_cpu = [cgroup_cpu_s(f"{FLOOR_CGROUP}/{c}") for c, _ in children]
            profiles.append({
                "ms": (t2 - t0) * 1000,
                "capture_ms": (t1 - t0) * 1000,
                "restores": [((t1 - t0) * 1000, (e - t0) * 1000) for e in ended],
                "host_busy_s": host_busy_s() - cpu0,
                "children_cpu_s": sum(sandbox_cpu),
                "clis_cpu_s": reaped_cpu_s() - clis0,
            })  # fmt: skip
        for c, _ in children:
            self.floor.exec(c, "/bin/true")
            self.floor.delete(c)
        shutil.rmtree(image)


# -- aenv ---------------------------------------------------------------------------


def _entries(node: NodeProc, sandbox_id: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{node.url}/sandboxes/{sandbox_id}/logs",
        headers={"X-API-Key": node.api_key},
        timeout=10,
    )
    return list(r.json().get("logs", [])) if r.status_code == 200 else []


def _logs(node: NodeProc, sandbox_id: str) -> list[str]:
    return [e["line"] for e in _entries(node, sandbox_id)]


def _child_span(entries: list[dict[str, Any]], t0_wall: float) -> dict[str, float] | None:
    """A fork child's start from its log line: when it began and ended (ms after
    the fork call, by the line's time) and its phases."""
    for e in entries:
        m = PHASE_LINE.search(e["line"])
        if m is None or not m.group(1).startswith("running"):
            continue
        end = datetime.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00"))
        end_ms = (end.timestamp() - t0_wall) * 1000
        span = {"begin": end_ms - float(m.group(2)), "end": end_ms}
        for part in m.group(3).split(", "):
            name, _, ms = part.rpartition(" ")
            with contextlib.suppress(ValueError):
                span[name] = float(ms)
        return span
    return None


def _phases(
    lines: list[str], phases: dict[str, dict[str, list[float]]], *, child_of: str = ""
) -> None:
    """Add every breakdown line of a sandbox's log to `phases` (what -> phase ->
    ms); a fork child's start goes under `child_of`."""
    for line in lines:
        m = PHASE_LINE.search(line)
        if m is None:
            continue
        what = m.group(1)
        if what.startswith("running") and child_of:
            what = f"{child_of}: a child started"
        bucket = phases.setdefault(what, {})
        bucket.setdefault("total", []).append(float(m.group(2)))
        for part in m.group(3).removesuffix(" ms").split(", "):
            name, _, ms = part.rpartition(" ")
            with contextlib.suppress(ValueError):
                value = float(ms)
                bucket.setdefault(name, []).append(value)


def _gap(sbx: Any) -> float:
    out = sbx.commands.run(ASK_GAP, timeout=60).stdout.strip()
    if not out:
        why = sbx.commands.run("cat /tmp/ticker.out; ps aux", timeout=30).stdout
        raise RuntimeError(f"the ticker did not answer: {why}")
    return float(out)


def _fork(
    node: NodeProc,
    sbx: Any,
    count: int,
    results: dict[str, Series],
    phases: dict[str, dict[str, list[float]]],
    profiles: list[dict[str, Any]] | None = None,
) -> None:
    cpu0, node0, t0_wall = host_busy_s(), process_cpu_s(node.proc.pid), time.time()
    t0 = time.perf_counter()
    children = sbx.fork(count=count, timeout=300)
    results[f"fork_{count}"].samples.append((time.perf_counter() - t0) * 1000)
    busy, node_cpu = host_busy_s() - cpu0, process_cpu_s(node.proc.pid) - node0
    try:
        for c in children:
            if isinstance(c, Exception):
                raise c
        if profiles is not None:
            spans = [_child_span(_entries(node, c.sandbox_id), t0_wall) for c in children]
            profiles.append({
                "ms": results[f"fork_{count}"].samples[-1],
                "children": [s for s in spans if s is not None],
                "host_busy_s": busy,
                "node_cpu_s": node_cpu,
                "children_cpu_s": sum(sandbox_cpu_s(c.sandbox_id) for c in children),
            })  # fmt: skip
        for c in children:
            if c.commands.run("cat /tmp/state").stdout.strip() != "1":
                raise AssertionError(f"fork {c.sandbox_id} lost the source's file")
            _phases(_logs(node, c.sandbox_id), phases, child_of=f"fork({count})")
    finally:
        for c in children:
            if not isinstance(c, Exception):
                with contextlib.suppress(Exception):
                    c.kill()


def measure(
    node: NodeProc,
    rig: FloorRig | None,
    template: str,
    n: int,
    n20: int,
    aenv: dict[str, Series],
    floor: dict[str, Series],
    phases: dict[str, dict[str, list[float]]],
    profiles: dict[str, list[dict[str, Any]]],
    floor_limit: int | None = None,
) -> None:
    """Rounds of floor and aenv samples, one after the other."""
    from e2b import Sandbox

    _warm_up(node, template)
    sbx = Sandbox.create(template, timeout=900)
    try:
        sbx.commands.run("echo 1 > /tmp/state")
        for _ in range(n):
            if rig is not None:
                rig.restore_one(floor)
            _fork(node, sbx, 1, aenv, phases)
            _fork(node, sbx, 4, aenv, phases)
            if rig is not None:
                rig.fork(4, floor)
        for _ in range(n20):
            if rig is not None:
                rig.restore_one(floor)
                rig.fork(20, floor, profiles["floor"])
                if floor_limit:
                    rig.fork(20, floor, limit=floor_limit)
            _fork(node, sbx, 20, aenv, phases, profiles["aenv"])
        # the ticker only now: the forks' children would each run one
        sbx.files.write("/tmp/ticker.py", TICKER)
        sbx.commands.run("python3 /tmp/ticker.py > /tmp/ticker.out 2>&1", background=True)
        _gap(sbx)
        for _ in range(n):
            if rig is not None:
                rig.restore_one(floor)
            _gap(sbx)  # reset
            t0 = time.perf_counter()
            info = sbx.create_snapshot()
            aenv["snapshot"].samples.append((time.perf_counter() - t0) * 1000)
            aenv["snapshot_gap"].samples.append(_gap(sbx))
            Sandbox.delete_snapshot(info.snapshot_id)
            _gap(sbx)  # reset
            time.sleep(aenv["snapshot"].samples[-1] / 1000)
            aenv["idle_gap"].samples.append(_gap(sbx))
    finally:
        with contextlib.suppress(Exception):
            _phases(_logs(node, sbx.sandbox_id), phases)
        with contextlib.suppress(Exception):
            sbx.kill()


def bench(
    home: Path,
    template: str,
    n: int,
    n20: int,
    workdir: Path,
    config: Config,
    with_floor: bool,
    spares: int | None = None,
    floor_limit: int | None = None,
) -> tuple[
    dict[str, Series],
    dict[str, Series],
    dict[str, dict[str, list[float]]],
    dict[str, list[dict[str, Any]]],
]:
    keys = ("fork_1", "fork_4", "fork_20", "snapshot", "snapshot_gap", "idle_gap")
    aenv = {k: Series() for k in keys}
    floor = {k: Series() for k in ("restore", "checkpoint_leave_running", "fork_4", "fork_20")}
    phases: dict[str, dict[str, list[float]]] = {}
    profiles: dict[str, list[dict[str, Any]]] = {"aenv": [], "floor": []}
    private = workdir / "home"
    private.mkdir(parents=True)
    link_home(home, private)
    rig = FloorRig(home, workdir / "floor", config, template) if with_floor else None
    try:
        with contextlib.ExitStack() as stack:
            if rig is not None:
                stack.enter_context(rig.running())
            node = start_node(
                private,
                api_key="aenv_bench_" + secrets.token_hex(8),
                log_path=workdir / "node.log",
                extra_env={
                    "AENV_NET_PREFIX": NET_PREFIX,
                    "AENV_SLOT_CIDR": SLOT_CIDR,
                    "AENV_NODE_TAG": NODE_TAG,
                    "AENV_POOL_SIZE": "0",
                    **({} if spares is None else {"AENV_START_SPARES": str(spares)}),
                },
            )
            try:
                with _sdk_env(node):
                    measure(node, rig, template, n, n20, aenv, floor, phases, profiles, floor_limit)
            except Exception as e:
                print(f"--- node log ---\n{node.log_tail(40)}", file=sys.stderr)
                print(f"aenv side failed: {_describe(e)}", file=sys.stderr)
                raise
            finally:
                code = stop_node(node)
                left = leaks(private, prefix=NET_PREFIX)
                if code != 0 or left:
                    print(f"node exit {code}, left behind: {left}", file=sys.stderr)
    except Exception as e:
        for s in (*aenv.values(), *floor.values()):
            if s.error is None and not s.samples:
                s.error = _describe(e)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return aenv, floor, phases, profiles


# -- report -------------------------------------------------------------------------


def _p(s: Series | None, q: int) -> str:
    if s is None:
        return "-"
    if not s.samples:
        return "error" if s.error else "-"
    return f"{percentile(s.samples, q):.1f}"


def table(
    aenv: dict[str, Series], floor: dict[str, Series], phases: dict[str, dict[str, list[float]]]
) -> tuple[str, dict[str, Any]]:
    head = ("operation", "n", "aenv p50", "aenv p95", "floor p50", "floor p95", "x floor",
            "target", "met")  # fmt: skip
    rows = [head]
    verdicts: dict[str, Any] = {}
    extra = [(f"floor: checkpoint --leave-running + 20 restores, {k.rsplit('_', 1)[1]} at once",
              None, k, None) for k in floor if k.startswith("fork_20_at_")]  # fmt: skip
    for label, akey, fkey, target in (*ROWS, *extra):
        a = aenv.get(akey) if akey else None
        f = floor.get(fkey) if fkey else None
        mine = percentile(a.samples, 50) if a and a.samples else None
        base = percentile(f.samples, 50) if f and f.samples else None
        ratio = mine / base if mine is not None and base else None
        want, met = "", ""
        if isinstance(target, str):
            bound = float(target.rstrip("x"))
            want = f"<= {target} floor"
            met = "-" if ratio is None else ("yes" if ratio <= bound else "no")
        elif target is not None:
            want = f"<= {target:g} ms"
            met = "-" if mine is None else ("yes" if mine <= target else "no")
        if target is not None:
            verdicts[akey or label] = {"target": want, "met": met, "ratio": ratio}
        count = len(a.samples) if a else len(f.samples) if f else 0
        rows.append((label, str(count), _p(a, 50), _p(a, 95), _p(f, 50), _p(f, 95),
                     "-" if ratio is None else f"{ratio:.2f}", want, met))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())  # fmt: skip
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(milliseconds; floor = runsc alone on the sandbox aenv runs; x floor = "
                 "aenv p50 / floor p50; fork rows against one runsc restore)")  # fmt: skip
    lines.append("")
    lines.append("node's breakdown (median ms per phase, from the sandboxes' logs):")
    for what, parts in sorted(phases.items()):
        text = ", ".join(f"{name} {statistics.median(v):.0f}" for name, v in parts.items() if v)
        lines.append(f"  {what} (n={len(parts.get('total', []))}): {text}")
    for side, res in (("aenv", aenv), ("floor", floor)):
        for key, s in res.items():
            if s.error:
                lines.append(f"{side} {key}: {s.error}")
    return "\n".join(lines), verdicts


def _restore_span(child: dict[str, float]) -> tuple[float, float]:
    """When a child's restore ran (ms after the fork call): the phases after it
    (envd, journal) are taken off its end."""
    end = child["end"] - child.get("envd", 0.0) - child.get("journal", 0.0)
    return end - child.get("restore", 0.0), end


def _cpu_line(profiles: list[dict[str, Any]], own: str, own_key: str) -> str:
    """The CPU seconds of fork(20) calls (median): the host's, the children's
    sandboxes' and what the caller ran itself (`own`, under `own_key`)."""
    med = statistics.median
    cpus = os.cpu_count() or 1
    return (
        "  CPU s: host busy {:.2f} ({:.0f}% of {} CPUs over the call), children's "
        "sandboxes {:.2f}, {} {:.2f}".format(
            med(p["host_busy_s"] for p in profiles),
            100 * med(p["host_busy_s"] / (p["ms"] / 1000) for p in profiles) / cpus,
            cpus,
            med(p["children_cpu_s"] for p in profiles),
            own,
            med(p.get(own_key, 0.0) for p in profiles),
        )
    )


def profile(profiles: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The fork(20) profile's lines: aenv's children against the floor's restores
    (medians over the samples; ms after the call began, CPU in seconds)."""
    lines = []
    med = statistics.median
    aenv, floor = profiles.get("aenv", []), profiles.get("floor", [])
    if aenv:
        lines.append("fork(20) profile, aenv (median over the calls; ms after the call):")
        kids = [c for p in aenv for c in p["children"]]
        spans = [[_restore_span(c) for c in p["children"]] for p in aenv]
        if kids:
            parts = ", ".join(f"{k} {med(c.get(k, 0.0) for c in kids):.0f}"
                              for k in ("root", "network", "restore", "envd", "journal"))  # fmt: skip
            lines.append(f"  child phases: {parts}")
            lines.append(
                "  first child began {:.0f}, last began {:.0f}; first restore began {:.0f}, "
                "first ended {:.0f}, last ended {:.0f}; last child running {:.0f}; "
                "call {:.0f}".format(
                    med(min(c["begin"] for c in p["children"]) for p in aenv),
                    med(max(c["begin"] for c in p["children"]) for p in aenv),
                    med(min(a for a, _ in sp) for sp in spans),
                    med(min(b for _, b in sp) for sp in spans),
                    med(max(b for _, b in sp) for sp in spans),
                    med(max(c["end"] for c in p["children"]) for p in aenv),
                    med(p["ms"] for p in aenv),
                )
            )
            lines.append(f"  restores at once, at most: {med(_overlap(sp) for sp in spans):.0f}")
        lines.append(_cpu_line(aenv, "node process (with its reaped children)", "node_cpu_s"))
    if floor:
        lines.append("fork(20) profile, floor (checkpoint + 20 restores):")
        lines.append(
            "  checkpoint {:.0f}; restores ended: first {:.0f}, median {:.0f}, last {:.0f}".format(
                med(p["capture_ms"] for p in floor),
                med(min(b for _, b in p["restores"]) for p in floor),
                med(med(b for _, b in p["restores"]) for p in floor),
                med(max(b for _, b in p["restores"]) for p in floor),
            )
        )
        lines.append(_cpu_line(floor, "runsc's CLIs (checkpoint, restores)", "clis_cpu_s"))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10, help="samples per operation (default 10)")
    p.add_argument("--n20", type=int, default=3, help="samples of fork(count=20) (default 3)")
    p.add_argument("--home", type=Path, help="built home (default $AENV_TEST_HOME)")
    p.add_argument("--template", default="base")
    p.add_argument("--skip-floor", action="store_true", help="measure only aenv")
    p.add_argument(
        "--spares", type=int, help="the node's AENV_START_SPARES (default: the node's default)"
    )
    p.add_argument(
        "--floor-limit",
        type=int,
        help="also time the floor's fork(20) with at most this many restores at once",
    )
    args = p.parse_args(argv)
    if not 1 <= args.n <= 1000 or not 0 <= args.n20 <= 100:
        p.error("--n must be in 1..1000 and --n20 in 0..100")
    home = bench_home(p, args.home)
    config = Config.from_env()
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    floor_res: dict[str, Series] = {}
    aenv_res: dict[str, Series] = {}
    phases: dict[str, dict[str, list[float]]] = {}
    profiles: dict[str, list[dict[str, Any]]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-forks-"))
    try:
        print(f"aenv (a node + e2b SDK) and runsc ({config.runsc_platform}) in turns, "
              f"n={args.n}, fork(20) n={args.n20} ...", flush=True)  # fmt: skip
        aenv_res, floor_res, phases, profiles = bench(
            home, args.template, args.n, args.n20, workdir, config, not args.skip_floor,
            args.spares, args.floor_limit,
        )  # fmt: skip
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text, verdicts = table(aenv_res, floor_res, phases)
    load_end = loadavg()
    elapsed = datetime.datetime.now(datetime.UTC) - started
    print()
    print(text)
    if profiles:
        print("\n".join(["", *profile(profiles)]))
    print(f"\nload average {load_start} at start, {load_end} at end; "
          f"{os.cpu_count()} CPUs; {elapsed.total_seconds():.0f} s")  # fmt: skip
    report = {
        "started": started.isoformat(),
        "seconds": round(elapsed.total_seconds(), 1),
        "n": args.n,
        "n20": args.n20,
        "template": args.template,
        "spares": args.spares,
        "floor_limit": args.floor_limit,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "runsc": runsc_version(config.runsc_binary),
            "runsc_platform": config.runsc_platform,
            "loadavg_start": load_start,
            "loadavg_end": load_end,
        },
        "targets": verdicts,
        "aenv": {k: s.to_json() for k, s in aenv_res.items() if s.samples or s.error},
        "floor": {k: s.to_json() for k, s in floor_res.items() if s.samples or s.error},
        "phases": {
            what: {name: statistics.median(v) for name, v in parts.items() if v}
            for what, parts in phases.items()
        },
        "fork_20_profiles": profiles,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"forks-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")
    failed = any(s.error for res in (aenv_res, floor_res) for s in res.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
