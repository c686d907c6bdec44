"""A quiet sandbox next to one under pressure: does the neighbour notice?

One node (`python -m aenv serve`, free loopback port, netns prefix from
`AENV_TEST_NET_PREFIX`, default `aenvq`, slot range from
`AENV_TEST_SLOT_CIDR`, default 10.224.0.0/16) runs two default sandboxes
(512 MiB, 2 vCPUs) of `--template`. The quiet one runs
`commands.run("true")` through the unmodified e2b SDK `--n` times, one
after the other:

1. **quiet**: the other sandbox idle (the baseline, same run);
2. **hogs**: the other sandbox runs, at once, a shell fork bomb
   (`b(){ b|b& }; b` as `user`, which meets the process limit), a memory
   hog (`python3 -c "x = bytearray(2*1024**3)"` in a loop as root, each one
   killed by the sandbox's OOM killer) and a disk writer (`dd` into
   /home/user as root until the sandbox's disk is full, then `rm`, in a
   loop), all under `timeout`. Each loop counts its rounds in a file; the
   counts and the bomb's live processes are read before and after the
   sampling, so the result shows that all three really ran at once.

It prints p50/p95 of both and their ratio (issue 17 aims at <= 1.5x), checks
that the hog sandbox is still usable after, records its host task count
(pids.current) every 5 s and the task valve's entries in its logs, and writes
bench/results/pressure-<timestamp>.json. Needs root and runsc.

    .venv/bin/python bench/pressure.py [--n 60] [--template base] [--home DIR]

The node's runsc platform is `AENV_RUNSC_PLATFORM` (default ptrace).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("AENV_TEST_NET_PREFIX", "aenvq")
os.environ.setdefault("AENV_TEST_SLOT_CIDR", "10.224.0.0/16")

import httpx  # noqa: E402
from e2b import Sandbox  # noqa: E402

from bench.run import Interrupted, bench_home, interrupt_on_sigterm  # noqa: E402
from tests.conftest import leaks, link_home, sdk_pointed_at, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
# How long the hogs run: the loaded sampling fits inside (they are still running after it).
HOGS_S = 150
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_PIDS = Path("/sys/fs/cgroup/pids")
# How often the hog sandbox's host task count is read.
TASKS_EVERY_S = 5.0
_COUNT = (
    "import os, sys\n"
    "bombs = 0\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        st = open(f'/proc/{p}/status').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if 'Name:\\tbash' in st and '\\nUid:\\t1000' in st:\n"
    "        bombs += 1\n"
    "def count(path):\n"
    "    try:\n"
    "        return int(open(path).read() or 0)\n"
    "    except (OSError, ValueError):\n"
    "        return 0\n"
    "print(bombs, count('/var/tmp/hog-mem'), count('/var/tmp/hog-disk'))\n"
)


def hogs() -> list[tuple[str, str]]:
    """(command, user) of the three hogs, each under `timeout`, counting its rounds."""
    memory = (
        "i=0; while true; do python3 -c 'x = bytearray(2*1024**3)'; "
        "i=$((i+1)); echo $i > /var/tmp/hog-mem; done"
    )
    disk = (
        "i=0; while true; do dd if=/dev/zero of=/home/user/fill bs=1M 2>/dev/null; "
        "rm -f /home/user/fill; i=$((i+1)); echo $i > /var/tmp/hog-disk; done"
    )
    return [
        (f"timeout {HOGS_S} bash -c 'b(){{ b|b& }}; b' >/dev/null 2>&1", "user"),
        (f"timeout {HOGS_S} sh -c {shlex.quote(memory)} >/dev/null 2>&1", "root"),
        (f"timeout {HOGS_S} sh -c {shlex.quote(disk)} >/dev/null 2>&1", "root"),
    ]


def activity(sbx: Sandbox) -> dict[str, Any]:
    """The bomb's live processes and the memory and disk hogs' rounds so far."""
    try:
        out = sbx.commands.run(f"python3 -c {shlex.quote(_COUNT)}", user="root", timeout=120)
    except Exception as exc:  # the sandbox died: say so in the result
        return {"error": str(exc)[:300]}
    bombs, memory, disk = (int(x) for x in out.stdout.split())
    return {"bomb_processes": bombs, "memory_hog_rounds": memory, "disk_writer_rounds": disk}


def together(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether all three hogs ran through the loaded sampling."""
    return (
        "error" not in before
        and "error" not in after
        and min(before["bomb_processes"], after["bomb_processes"]) > 16
        and after["memory_hog_rounds"] > before["memory_hog_rounds"]
        and after["disk_writer_rounds"] > before["disk_writer_rounds"]
    )


def host_memory(sandbox_id: str) -> dict[str, int]:
    """The hog sandbox's host memory cgroup (v1): peak and limit, in MiB, and its failures."""
    d = CGROUP_MEMORY / os.environ["AENV_TEST_NET_PREFIX"] / sandbox_id
    found: dict[str, int] = {}
    for name, key in (
        ("memory.max_usage_in_bytes", "peak_mib"),
        ("memory.limit_in_bytes", "limit_mib"),
        ("memory.failcnt", "failcnt"),
    ):
        with contextlib.suppress(OSError, ValueError):
            value = int((d / name).read_text())
            found[key] = value >> 20 if key.endswith("mib") else value
    return found


def host_tasks(sandbox_id: str) -> int | None:
    """The hog sandbox's host tasks now (its pids cgroup, v1), None once it is gone."""
    try:
        path = CGROUP_PIDS / os.environ["AENV_TEST_NET_PREFIX"] / sandbox_id / "pids.current"
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def follow_tasks(
    sandbox_id: str, series: list[tuple[float, int | None]], stop: threading.Event
) -> None:
    """Append (seconds since the hogs started, host tasks) until `stop`."""
    t0 = time.monotonic()
    while not stop.is_set():
        series.append((round(time.monotonic() - t0, 1), host_tasks(sandbox_id)))
        stop.wait(TASKS_EVERY_S)


def stats(samples: list[float]) -> dict[str, Any]:
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    return {
        "n": len(samples),
        "p50_ms": round(1000 * statistics.median(samples), 1),
        "p95_ms": round(1000 * qs[94], 1),
        "max_ms": round(1000 * max(samples), 1),
    }


def sample(sbx: Sandbox, n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        sbx.commands.run("true", timeout=120)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--template", default="base")
    ap.add_argument("--home", type=Path, help="built home (default $AENV_TEST_HOME)")
    args = ap.parse_args()
    if args.n < 2:
        ap.error("--n must be at least 2 (its percentiles need two samples)")
    home = bench_home(ap, args.home)
    interrupt_on_sigterm()
    private = Path(tempfile.mkdtemp(prefix="aenv-bench-pressure-"))
    link_home(home, private)
    node = start_node(
        private,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=private / "node.log",
        extra_env={"AENV_ON_STOP": "stop"},
    )
    result: dict[str, Any] = {}
    try:
        with sdk_pointed_at(node.url, node.api_key):
            quiet = Sandbox.create(args.template, timeout=1800)
            hog = Sandbox.create(args.template, timeout=1800)
            try:
                sample(quiet, 5)  # warm the connection and the sandbox
                base = sample(quiet, args.n)
                tasks_idle = host_tasks(hog.sandbox_id)
                stop = threading.Event()
                series: list[tuple[float, int | None]] = []
                follower = threading.Thread(
                    target=follow_tasks, args=(hog.sandbox_id, series, stop), daemon=True
                )
                follower.start()
                for command, user in hogs():
                    hog.commands.run(command, background=True, user=user)
                time.sleep(5)  # let all three reach their limits
                started = time.monotonic()
                started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
                before = activity(hog)
                loaded = sample(quiet, args.n)
                after = activity(hog)
                host = host_memory(hog.sandbox_id)
                # the hogs end (timeout) and the bomb's orphans are reaped
                time.sleep(max(0.0, started + HOGS_S + 5 - time.monotonic()))
                try:
                    alive = hog.commands.run("echo alive", user="root", timeout=120).stdout.strip()
                except Exception as exc:  # the host killed it: the answer says why
                    alive = str(exc)[:300]
                stop.set()
                follower.join()
                logs = (
                    httpx.get(
                        f"{node.url}/v2/sandboxes/{hog.sandbox_id}/logs",
                        headers={"X-API-Key": node.api_key},
                    )
                    .json()
                    .get("logs", [])
                )  # (none for a sandbox that died)
                kills = sum("out of memory" in str(e["message"]) for e in logs)
                task_valve = [str(e["message"]) for e in logs if "host tasks" in str(e["message"])]
                detail = httpx.get(
                    f"{node.url}/sandboxes/{hog.sandbox_id}",
                    headers={"X-API-Key": node.api_key},
                )
                died = "" if detail.status_code == 200 else str(detail.json().get("message"))
            finally:
                for s in (quiet, hog):
                    with contextlib.suppress(Exception):
                        s.kill()
        result = {
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "template": args.template,
            "platform": os.environ.get("AENV_RUNSC_PLATFORM", "ptrace"),
            "quiet": stats(base),
            "hogs": stats(loaded),
            "hog_sandbox_alive_after": alive == "alive",
            "hog_sandbox_answer": alive,
            "hog_sandbox_died": died,  # when and why, if it did
            "hogs_started": started_at,
            "oom_kills_logged": kills,
            "hogs_before_sampling": before,
            "hogs_after_sampling": after,
            "all_hogs_ran_together": together(before, after),
            "host_cgroup": host,
            # the hog sandbox's host tasks (threads of its runtime): idle, then
            # (seconds since the hogs started, count) every TASKS_EVERY_S
            "host_tasks_idle": tasks_idle,
            "host_tasks": series,
            "task_valve": task_valve,
        }
        result["ratio_p50"] = round(result["hogs"]["p50_ms"] / result["quiet"]["p50_ms"], 2)
        result["ratio_p95"] = round(result["hogs"]["p95_ms"] / result["quiet"]["p95_ms"], 2)
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        stop_node(node)
        left = leaks(private)
        shutil.rmtree(private, ignore_errors=True)
        if left:
            print("left behind:", left, file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"pressure-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
