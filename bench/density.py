"""Density: what an idle running sandbox and a paused one cost the host.

Issue 15 goal 6: >= 600 idle running and >= 5,000 paused sandboxes on one
24 GiB node. One node (`python -m aenv serve`, private home with the bundle
and templates linked, netns prefix `aenvdn`, slots in 10.214.0.0/16, pool
off so only the bench's sandboxes count) creates `--n` idle sandboxes of
`--template` through the e2b SDK in batches of `--batch`. After each batch:

- the host's `MemAvailable` drop since before the first create,
- the sum over the sandboxes' host cgroups (`/sys/fs/cgroup/<prefix>/<id>`)
  of `memory.current` and of `memory.stat`'s anon, file, kernel, sock, shmem,
- the node process's RSS, and the host's task count (`/proc/loadavg`).

Then, for `--sample` sandboxes, every host process whose command line names
the sandbox (runsc's sandbox = the sentry, its gofer, the runsc parents) with
its PSS and RSS (`smaps_rollup`), and inside the guest every process's RSS
(envd is the sandbox's init). The idle CPU over `--idle` s: the sandboxes'
host processes, and the node's own (also read before the first create);
`--trace-reads` counts the task valve's reads. Then (unless `--running-only`)
every sandbox is paused (frozen in memory) and, after
`AENV_HIBERNATE_AFTER=--hibernate-after` seconds, written to disk: memory and
local disk per paused sandbox, by file. Everything is killed and the node
stopped; leaks are checked. Writes bench/results/density-<ts>.json. Needs
root and runsc.

    AENV_TEST_HOME=... .venv/bin/python bench/density.py [--n 50] [--batch 25]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import (  # noqa: E402
    Interrupted,
    _sdk_env,
    _warm_up,
    bench_home,
    interrupt_on_sigterm,
    loadavg,
    runsc_version,
)
from tests.conftest import leaks, link_home, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
NET_PREFIX = os.environ.get("AENV_BENCH_NET_PREFIX", "aenvdn")
SLOT_CIDR = os.environ.get("AENV_BENCH_SLOT_CIDR", "10.214.0.0/16")
STAT_KEYS = ("anon", "file", "shmem", "kernel", "kernel_stack", "pagetables", "sock", "slab")
PARTS = ("anon", "file", "shmem", "mapped_file", "kernel", "sock")
MIB = 1 << 20


# -- host readings -------------------------------------------------------------------


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def host_tasks() -> int:
    """Every task (thread) on the host, from /proc/loadavg's `running/total`."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _int(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def cgroups(prefix: str) -> dict[str, dict[str, int]]:
    """Each sandbox cgroup under the node's parent (v2, or v1's memory controller):
    its memory charge, and the charge's parts."""
    out: dict[str, dict[str, int]] = {}
    v2 = Path("/sys/fs/cgroup", prefix)
    v1 = Path("/sys/fs/cgroup/memory", prefix)
    parent = v2 if (Path("/sys/fs/cgroup/cgroup.controllers")).exists() else v1
    if not parent.is_dir():
        return out
    for d in parent.iterdir():
        if not d.is_dir():
            continue
        with contextlib.suppress(OSError, ValueError):
            stat = {
                k: int(v)
                for k, v in (line.split() for line in (d / "memory.stat").read_text().splitlines())
            }
            if parent is v2:
                row = {k: stat.get(k, 0) for k in STAT_KEYS}
                row["current"] = _int(d / "memory.current")
                row["tasks"] = len((d / "cgroup.threads").read_text().split())
            else:  # v1: rss is anon, cache is file (shmem included), kmem apart
                row = {
                    "anon": stat.get("rss", 0),
                    "file": stat.get("cache", 0),
                    "shmem": stat.get("shmem", 0),
                    "mapped_file": stat.get("mapped_file", 0),
                    "kernel": _int(d / "memory.kmem.usage_in_bytes"),
                    "sock": _int(d / "memory.kmem.tcp.usage_in_bytes"),
                    "current": _int(d / "memory.usage_in_bytes"),
                    "tasks": len((d / "tasks").read_text().split()),
                }
            out[d.name] = row
    return out


def runsc_alive(ids: list[str]) -> int:
    """Host processes whose command line names one of `ids` (runsc, its sentry, gofer)."""
    wanted = [i.encode() for i in ids]
    alive = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (p / "cmdline").read_bytes()
                alive += any(w in argv for w in wanted)
    return alive


def _sum(rows: dict[str, dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for row in rows.values():
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    return total


def processes_of(sandbox_id: str) -> list[dict[str, Any]]:
    """Host processes whose command line names the sandbox, with PSS/RSS and threads."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if not any(sandbox_id.encode() in a for a in argv):
                continue
            roll = {}
            for line in (p / "smaps_rollup").read_text().splitlines()[1:]:
                k, v = line.split(":", 1)
                roll[k] = int(v.split()[0]) * 1024
            words = [a.decode(errors="replace") for a in argv if a]
            role = (
                "gofer" if "gofer" in words else
                "sentry" if "boot" in words else
                "runsc " + next((w for w in words[1:] if not w.startswith("-")), "?")
            )  # fmt: skip
            found.append({
                "pid": int(p.name), "role": role, "pss": roll.get("Pss", 0),
                "rss": roll.get("Rss", 0), "anon": roll.get("Pss_Anon", 0),
                "threads": len(list((p / "task").iterdir())),
            })  # fmt: skip
    return found


def disk_of(path: Path, depth: int = 2, seen: set[tuple[int, int]] | None = None) -> dict[str, int]:
    """Allocated bytes under `path` by entry, `depth` levels down (`image1/pages.img`).

    Mounts are not entered; a file whose inode is in `seen` (hard links:
    a packed image's `pages.base`, the template's own memory image) is not
    counted again, and `seen` gets every inode counted.
    """
    out: dict[str, int] = {}
    if not path.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(path, onerror=lambda e: None):
        dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
        for name in filenames:
            f = Path(dirpath) / name
            with contextlib.suppress(OSError):
                st = f.lstat()
                if seen is not None:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                rel = f.relative_to(path).parts
                key = "/".join(rel[:depth])
                out[key] = out.get(key, 0) + st.st_blocks * 512
    return out


def on_disk(node: Any, ids: list[str]) -> int:
    """How many of `ids` the node reports paused and written to disk."""
    import httpx

    done = 0
    for sandbox_id in ids:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            d = httpx.get(f"{node.url}/sandboxes/{sandbox_id}",
                          headers={"X-API-Key": node.api_key}, timeout=10).json()  # fmt: skip
            done += d["state"] == "paused" and not d["pausedInMemory"]
    return done


def valve_reads(node_pid: int, seconds: float) -> float:
    """How many times a minute the node opens a `pids.current` (the task valve's
    read: `aenv.runtimes.taskvalve`), counted with strace over `seconds`."""
    import subprocess

    out = Path(tempfile.mkdtemp(prefix="aenv-bench-strace-")) / "trace"
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(out), "-p", str(node_pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(seconds)
    proc.terminate()
    proc.wait(10)
    opens = sum("pids.current" in line for line in out.read_text().splitlines())
    shutil.rmtree(out.parent, ignore_errors=True)
    return opens * 60 / seconds


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime (clock ticks) of `pids` and their threads."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total


# -- the run -------------------------------------------------------------------------


def snapshot(
    label: str, node_pid: int, base_avail: int, base_tasks: int, count: int
) -> dict[str, Any]:
    rows = cgroups(NET_PREFIX)
    total = _sum(rows)
    snap = {
        "label": label,
        "sandboxes": count,
        "mem_available_drop": base_avail - meminfo("MemAvailable"),
        "cgroups": len(rows),
        "cgroup_sum": total,
        "node_rss": rss(node_pid),
        "host_tasks_added": host_tasks() - base_tasks,
    }
    per = max(count, 1)
    print(
        f"  {label}: {count} sandboxes, MemAvailable -{snap['mem_available_drop'] / MIB:.0f} MiB"
        f" ({snap['mem_available_drop'] / per / MIB:.1f}/sbx), cgroups {len(rows)} "
        f"current {total.get('current', 0) / MIB:.0f} MiB ({total.get('current', 0) / per / MIB:.1f}/sbx:"
        f" anon {total.get('anon', 0) / per / MIB:.1f} file {total.get('file', 0) / per / MIB:.1f}"
        f" kernel {total.get('kernel', 0) / per / MIB:.1f}), node RSS {snap['node_rss'] / MIB:.0f} MiB,"
        f" tasks +{snap['host_tasks_added']}",
        flush=True,
    )
    return snap


GUEST_PS = (
    "for p in /proc/[0-9]*; do n=$(cat $p/comm 2>/dev/null);"
    " r=$(awk '/^VmRSS/ {print $2}' $p/status 2>/dev/null);"
    ' echo "${p#/proc/} $n $r"; done'
)


def guest_processes(sbx: Any) -> list[dict[str, Any]]:
    out = sbx.commands.run(GUEST_PS, timeout=60).stdout
    if not out.strip():
        return [{"raw": "(no output)"}]
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            rows.append({"pid": int(parts[0]), "comm": parts[1], "rss": int(parts[2]) * 1024})
    return rows


def measure(node: Any, args: argparse.Namespace, report: dict[str, Any]) -> None:
    from e2b import Sandbox

    _warm_up(node, args.template)
    time.sleep(2)
    node_pid = node.proc.pid
    base_avail, base_tasks = meminfo("MemAvailable"), host_tasks()
    # the node's own CPU with no sandbox, over the same window as the idle reading
    t_node, t_s = cpu_ticks([node_pid]), time.perf_counter()
    time.sleep(args.idle)
    hz = os.sysconf("SC_CLK_TCK")
    report["node_cpu_empty"] = (cpu_ticks([node_pid]) - t_node) / hz / (time.perf_counter() - t_s)
    report["baseline"] = {"mem_available": base_avail, "host_tasks": base_tasks,
                          "node_rss": rss(node_pid)}  # fmt: skip
    sandboxes: list[Any] = []
    report["sandbox_ids"] = ids = []
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
            while len(sandboxes) < args.n:
                k = min(args.batch, args.n - len(sandboxes))
                t0 = time.perf_counter()
                made = list(ex.map(lambda _: Sandbox.create(args.template, timeout=3600), range(k)))
                sandboxes += made
                ids += [s.sandbox_id for s in made]
                time.sleep(args.settle)
                snap = snapshot(f"running {len(sandboxes)}", node_pid, base_avail, base_tasks,
                                len(sandboxes))  # fmt: skip
                snap["batch_s"] = time.perf_counter() - t0
                report["running"].append(snap)
            # per-sandbox breakdown for a sample
            rows = cgroups(NET_PREFIX)
            for sbx in sandboxes[: args.sample]:
                report["sample"].append({
                    "sandbox_id": sbx.sandbox_id,
                    "cgroup": rows.get(sbx.sandbox_id, {}),
                    "host": processes_of(sbx.sandbox_id),
                    "guest": guest_processes(sbx),
                })  # fmt: skip
            # idle CPU of every sandbox's host processes over `--idle` seconds
            all_pids = [p["pid"] for i in ids for p in processes_of(i)]
            t_all, t_node, t_s = cpu_ticks(all_pids), cpu_ticks([node_pid]), time.perf_counter()
            time.sleep(args.idle)
            took = time.perf_counter() - t_s
            hz = os.sysconf("SC_CLK_TCK")
            report["idle_cpu_per_sandbox"] = (cpu_ticks(all_pids) - t_all) / hz / took / len(ids)
            node_cpu = (cpu_ticks([node_pid]) - t_node) / hz / took
            report["idle_node_cpu"] = node_cpu
            report["load_idle"] = loadavg()
            print(f"  idle CPU {report['idle_cpu_per_sandbox'] * 100:.2f} % of a core per sandbox,"
                  f" node {node_cpu * 100:.2f} % ({report['node_cpu_empty'] * 100:.2f} % empty),"
                  f" load {report['load_idle']}", flush=True)  # fmt: skip
            if args.trace_reads:
                report["valve_reads_per_min"] = valve_reads(node_pid, args.trace_reads) / len(ids)
                print(f"  task valve reads {report['valve_reads_per_min']:.1f} per sandbox"
                      " per minute", flush=True)  # fmt: skip
            if args.running_only:
                return
            # pause: frozen in memory, then hibernated to disk
            t0 = time.perf_counter()
            list(ex.map(lambda s: s.pause(), sandboxes))
            report["pause_s"] = time.perf_counter() - t0
            time.sleep(args.settle)
            report["paused_frozen"] = snapshot("paused (frozen)", node_pid, base_avail,
                                               base_tasks, len(sandboxes))  # fmt: skip
            deadline = time.monotonic() + args.hibernate_after + args.hibernate_wait
            while (runsc_alive(ids) or on_disk(node, ids) < len(ids)) and (
                time.monotonic() < deadline
            ):
                time.sleep(2)
            time.sleep(args.settle)
            report["hibernated_after_s"] = time.perf_counter() - t0
            report["paused_hibernated"] = snapshot("paused (hibernated)", node_pid, base_avail,
                                                   base_tasks, len(sandboxes))  # fmt: skip
            # the memory images of snapshots (the template's) are shared, not a sandbox's
            shared: set[tuple[int, int]] = set()
            report["snapshots_disk"] = sum(disk_of(node.home / "snapshots", 3, shared).values())
            disks = {i: disk_of(node.home / "sandboxes" / i, seen=shared) for i in ids}
            report["paused_disk"] = disks
            parts: dict[str, int] = {}
            for d in disks.values():
                for name, b in d.items():
                    parts[name] = parts.get(name, 0) + b
            total = sum(parts.values())
            per = max(len(ids), 1)
            report["paused_disk_per_sandbox"] = total / per
            print(f"  disk per paused sandbox {total / per / MIB:.1f} MiB: " + ", ".join(
                f"{n} {b / per / MIB:.2f}" for n, b in sorted(parts.items(), key=lambda x: -x[1])
            ), flush=True)  # fmt: skip
            tmpl = node.home / "templates" / args.template
            report["template_disk_parts"] = disk_of(tmpl, depth=3)
            report["template_disk"] = sum(report["template_disk_parts"].values())
    finally:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
            list(ex.map(_kill, ids))


def _kill(sandbox_id: str) -> None:
    from e2b import Sandbox

    with contextlib.suppress(Exception):
        Sandbox.kill(sandbox_id)


def table(report: dict[str, Any]) -> str:
    lines = []
    last = report["running"][-1] if report["running"] else None
    if last:
        n = last["sandboxes"]
        c = last["cgroup_sum"]
        lines.append(f"idle running sandboxes: {n}, per sandbox (MiB):")
        lines.append(f"  host MemAvailable drop  {last['mem_available_drop'] / n / MIB:6.1f}")
        lines.append(f"  cgroup memory.current   {c.get('current', 0) / n / MIB:6.1f}")
        for k in PARTS:
            lines.append(f"    {k:<20}  {c.get(k, 0) / n / MIB:6.1f}")
        lines.append(f"  host tasks per sandbox  {last['host_tasks_added'] / n:6.1f}")
        lines.append(f"  node RSS (total)        {last['node_rss'] / MIB:6.1f}")
    roles: dict[str, list[dict[str, Any]]] = {}
    for s in report["sample"]:
        for p in s["host"]:
            roles.setdefault(p["role"], []).append(p)
    if report["sample"]:
        k = len(report["sample"])
        lines.append(
            f"host processes per sandbox (mean of {k}): role, count, PSS, RSS MiB, threads"
        )
        for role, ps in sorted(roles.items()):
            lines.append(
                f"  {role:<16} {len(ps) / k:4.1f}  {sum(p['pss'] for p in ps) / k / MIB:6.1f}"
                f"  {sum(p['rss'] for p in ps) / k / MIB:6.1f}  {sum(p['threads'] for p in ps) / k:5.1f}"
            )
        guest: dict[str, list[int]] = {}
        for s in report["sample"]:
            for p in s["guest"]:
                guest.setdefault(p["comm"], []).append(p["rss"])
        lines.append("guest processes (RSS MiB, mean over the sample): " + ", ".join(
            f"{c} {sum(v) / k / MIB:.1f}" for c, v in sorted(guest.items(), key=lambda x: -sum(x[1]))
        ))  # fmt: skip
    for key in ("paused_frozen", "paused_hibernated"):
        if snap := report.get(key):
            n = max(snap["sandboxes"], 1)
            lines.append(
                f"{key}: MemAvailable drop {snap['mem_available_drop'] / n / MIB:.1f} MiB/sbx,"
                f" cgroups left {snap['cgroups']}, current"
                f" {snap['cgroup_sum'].get('current', 0) / n / MIB:.1f} MiB/sbx,"
                f" tasks +{snap['host_tasks_added']}"
            )
    if "paused_disk_per_sandbox" in report:
        lines.append(
            f"disk per paused sandbox {report['paused_disk_per_sandbox'] / MIB:.1f} MiB"
            f" (template on disk {report['template_disk'] / MIB:.0f} MiB and its memory image"
            f" {report.get('snapshots_disk', 0) / MIB:.0f} MiB, shared)"
        )
    if "idle_cpu_per_sandbox" in report:
        lines.append(f"idle CPU per sandbox {report['idle_cpu_per_sandbox'] * 100:.2f} % of a core")
    if "idle_node_cpu" in report:
        n = max(len(report["sandbox_ids"]), 1)
        per = (report["idle_node_cpu"] - report["node_cpu_empty"]) / n
        lines.append(
            f"node CPU idle {report['idle_node_cpu'] * 100:.2f} % of a core"
            f" ({report['node_cpu_empty'] * 100:.2f} % with no sandbox: {per * 100:.3f} % per"
            f" sandbox), load {report['load_idle']}"
        )
    if "valve_reads_per_min" in report:
        lines.append(f"task valve reads per sandbox per minute {report['valve_reads_per_min']:.1f}")
    if report.get("error"):
        lines.append(f"ERROR: {report['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50, help="idle sandboxes (default 50)")
    p.add_argument("--batch", type=int, default=25, help="creates between two readings")
    p.add_argument("--concurrency", type=int, default=4, help="creates at once")
    p.add_argument("--sample", type=int, default=5, help="sandboxes broken down by process")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before each reading")
    p.add_argument("--hibernate-after", type=int, default=20, help="AENV_HIBERNATE_AFTER")
    p.add_argument("--hibernate-wait", type=float, default=600, help="most seconds to wait for it")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU reading")
    p.add_argument(
        "--trace-reads",
        type=float,
        default=0.0,
        help="seconds of counting the task valve's reads (strace; 0: not)",
    )
    p.add_argument(
        "--running-only",
        action="store_true",
        help="stop after the idle reading (no pause, no hibernation)",
    )
    p.add_argument("--template", default="base")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the node")
    p.add_argument("--home", type=Path)
    args = p.parse_args(argv)
    home = bench_home(p, args.home)
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    report: dict[str, Any] = {
        "started": started.isoformat(),
        "args": {k: str(v) for k, v in vars(args).items() if k != "home"},
        "host": {"cpus": os.cpu_count(), "mem_total": meminfo("MemTotal"),
                 "loadavg_start": loadavg()},
        "running": [], "sample": [],
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-density-"))
    private = work / "home"
    private.mkdir()
    link_home(home, private)
    env = {
        "AENV_NET_PREFIX": NET_PREFIX, "AENV_SLOT_CIDR": SLOT_CIDR,
        "AENV_NODE_TAG": "dn" + secrets.token_hex(2), "AENV_POOL_SIZE": "0",
        "AENV_HIBERNATE_AFTER": str(args.hibernate_after), "AENV_WRITE_BEHIND_AFTER": "0",
        "AENV_HIBERNATE_MEMORY_LOW": "0", "AENV_SANDBOX_DISK_MB": "1024",
        **dict(kv.split("=", 1) for kv in args.env),
    }  # fmt: skip
    node = start_node(private, api_key="aenv_bench_" + secrets.token_hex(8),
                      log_path=work / "node.log", extra_env=env)  # fmt: skip
    report["host"]["runsc"] = runsc_version(os.environ.get("AENV_RUNSC", "runsc"))
    try:
        with _sdk_env(node):
            measure(node, args, report)
    except (KeyboardInterrupt, Interrupted):
        report["error"] = "interrupted"
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"--- node log ---\n{node.log_tail(40)}", file=sys.stderr)
    finally:
        code = stop_node(node)
        left = leaks(private, prefix=NET_PREFIX)
        report["node_exit"], report["leaks"] = code, [str(x) for x in left]
        if code != 0 or left:
            print(f"node exit {code}, left behind: {left}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    report["host"]["loadavg_end"] = loadavg()
    print()
    print(table(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"density-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return 1 if report.get("error") or report["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
