"""Node restarts with many sandboxes: how long until the API and every sandbox answer.

One node (`python -m aenv serve`, free loopback port, netns prefix `aenvb`,
slot range 10.228.0.0/16, `AENV_ON_STOP=keep`) gets `--running` sandboxes
that run and `--paused` that are paused (frozen in memory) through the REST
API, then is restarted twice, each time timing from the new process's start
until `/health` answers (**api**) and until every running sandbox has run a
command through the envd proxy (**all answer**, with `--workers` clients in
parallel), and counting the sandboxes the restarted node no longer lists
(**lost**, must be 0):

1. **kill -9**: SIGKILL, then start;
2. **graceful**: SIGTERM (the stop writes the paused ones to disk), then start.

The baselines, in the same run: the start of the same node with nothing to
take back (a fresh home), and the same round of commands on the running
sandboxes before any restart. Each restart is also measured for the paused ones:
a sample of `--resume-sample` of them is resumed and runs a command. The
pause latency (the `POST /pause` answer, frozen in memory) is printed as
p50/p95 from the setup. Results go to bench/results/restart-<timestamp>.json.
Everything is deleted at the end (sandboxes through the API, then the node
stopped with `AENV_ON_STOP=stop` and its home removed). Needs root and runsc.

    .venv/bin/python bench/restart.py [--running 100] [--paused 100] [--template busybox]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

NET_PREFIX = "aenvb"
SLOT_CIDR = "10.228.0.0/16"
RESULTS = REPO / "bench" / "results"


def stats(samples: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    if samples:
        qs = (
            statistics.quantiles(samples, n=100, method="inclusive")
            if len(samples) > 1
            else [samples[0]] * 99
        )
        out["p50"], out["p95"], out["max"] = round(qs[49], 4), round(qs[94], 4), max(samples)
    return out


class Node:
    def __init__(self, home: Path, key: str, env: dict[str, str]) -> None:
        self.home, self.key, self.env = home, key, env
        self.proc: NodeProc | None = None

    def start(self) -> float:
        t0 = time.perf_counter()
        self.proc = start_node(
            self.home, api_key=self.key, log_path=self.home / "node.log", extra_env=self.env
        )
        took = time.perf_counter() - t0  # start_node returns once /health answers
        os.environ.update({"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url})
        return took

    @property
    def url(self) -> str:
        assert self.proc is not None
        return self.proc.url

    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.key}

    def create(self, template: str) -> dict[str, Any]:
        r = httpx.post(
            self.url + "/v2/sandboxes",
            json={"templateID": template, "timeout": 3600},
            headers=self.headers(),
            timeout=300,
        )
        r.raise_for_status()
        return dict(r.json())

    def pause(self, sid: str) -> float:
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/sandboxes/{sid}/pause", headers=self.headers(), timeout=120)
        r.raise_for_status()
        return time.perf_counter() - t0

    def listed(self) -> dict[str, str]:
        r = httpx.get(
            self.url + "/v2/sandboxes?state=running,paused&limit=1000",
            headers=self.headers(),
            timeout=60,
        )
        r.raise_for_status()
        return {d["sandboxID"]: d["state"] for d in r.json()}

    def command(self, sb: dict[str, Any]) -> None:
        """Connect to the sandbox and run `true` in it (the SDK, through the envd proxy)."""
        from e2b import Sandbox

        s = Sandbox.connect(sb["sandboxID"], timeout=3600)
        s.commands.run("true")


def _answer_all(node: Node, sandboxes: list[dict[str, Any]], workers: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(node.command, sb) for sb in sandboxes]:
            f.result()


def _restart(
    node: Node, how: int, running: list[dict[str, Any]], paused: list[dict[str, Any]], args: Any
) -> dict[str, Any]:
    assert node.proc is not None
    t0 = time.perf_counter()
    code = stop_node(node.proc, how, timeout=600)
    stop_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    api_s = node.start()
    listed = node.listed()
    ids = [sb["sandboxID"] for sb in running + paused]
    lost = [i for i in ids if i not in listed]
    alive = [sb for sb in running if sb["sandboxID"] in listed]
    _answer_all(node, alive, args.workers)
    all_s = time.perf_counter() - t1
    sample = [sb for sb in paused if sb["sandboxID"] in listed][: args.resume_sample]
    resumes = []
    for sb in sample:
        r0 = time.perf_counter()
        node.command(sb)
        resumes.append(time.perf_counter() - r0)
        node.pause(sb["sandboxID"])
    return {
        "stop_exit": code,
        "stop_s": round(stop_s, 3),
        "api_s": round(api_s, 3),
        "all_answer_s": round(all_s, 3),
        "lost": len(lost),
        "resume_after_restart_s": stats(resumes),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=100)
    ap.add_argument("--paused", type=int, default=100)
    ap.add_argument("--template", default="busybox")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--resume-sample", type=int, default=10)
    ap.add_argument("--home", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root", file=sys.stderr)
        return 2
    built = args.home or Path(os.environ.get("AENV_TEST_HOME", REPO / ".state" / "test-home"))
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-restart-"))
    env = {
        "AENV_NET_PREFIX": NET_PREFIX,
        "AENV_SLOT_CIDR": SLOT_CIDR,
        "AENV_ON_STOP": "keep",
        "AENV_POOL_SIZE": "0",
        "AENV_HIBERNATE_AFTER": "3600",
        "AENV_HIBERNATE_MEMORY_LOW": "0",
    }
    key = "k" + secrets.token_hex(8)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    base_home, home = work / "empty", work / "node"
    for h in (base_home, home):
        h.mkdir()
        link_home(built, h)
    baseline = Node(base_home, key, env)
    node = Node(home, key, env)
    os.environ.update({"E2B_API_KEY": key})
    try:
        result["baseline_api_s"] = round(baseline.start(), 3)
        assert baseline.proc is not None
        stop_node(baseline.proc)
        node.start()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(
                pool.map(lambda _: node.create(args.template), range(args.running + args.paused))
            )
        result["setup_create_s"] = round(time.perf_counter() - t0, 1)
        running, paused = made[: args.running], made[args.running :]
        result["pause_s"] = stats([node.pause(sb["sandboxID"]) for sb in paused])
        # the same round of commands with no restart: what "all answer" costs anyway
        t0 = time.perf_counter()
        _answer_all(node, running, args.workers)
        result["baseline_all_answer_s"] = round(time.perf_counter() - t0, 3)
        for name, how in (("kill-9", signal.SIGKILL), ("graceful", signal.SIGTERM)):
            result[name] = _restart(node, how, running, paused, args)
    finally:
        if node.proc is not None:
            try:
                for sid in node.listed():
                    httpx.delete(f"{node.url}/sandboxes/{sid}", headers=node.headers(), timeout=60)
            except Exception as exc:  # the node died: it is stopped below all the same
                print(f"cleanup through the API failed: {exc!r}", file=sys.stderr)
            stop_node(node.proc)
        node.env = {**env, "AENV_ON_STOP": "stop"}
        node.start()
        assert node.proc is not None
        stop_node(node.proc)
        left = leaks(home, NET_PREFIX)
        if left:
            print(f"left behind: {left}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    _print(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"restart-{stamp}.json").write_text(json.dumps(result, indent=1))
    return 0


def _print(r: dict[str, Any]) -> None:
    a = r["args"]
    print(f"\nrestart with {a['running']} running and {a['paused']} paused ({a['template']})")
    print(f"  baseline: empty node to /health         {r['baseline_api_s']:.2f} s")
    print(
        f"  baseline: every running sandbox answers, no restart  {r['baseline_all_answer_s']:.2f} s"
    )
    p = r["pause_s"]
    print(
        f"  pause (frozen), p50 / p95               {p['p50'] * 1000:.0f} / {p['p95'] * 1000:.0f} ms"
    )
    for name in ("kill-9", "graceful"):
        x = r[name]
        rs = x["resume_after_restart_s"]
        print(
            f"  {name:9} stop {x['stop_s']:.2f} s, to /health {x['api_s']:.2f} s, "
            f"every running sandbox answered {x['all_answer_s']:.2f} s, lost {x['lost']}, "
            f"resume of a paused one p50 {rs.get('p50', 0) * 1000:.0f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
