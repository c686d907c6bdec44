"""A quiet sandbox next to one under pressure: does the neighbour notice?

One node (`python -m aenv serve`, free loopback port, netns prefix from
`AENV_TEST_NET_PREFIX`, default `aenvq`, slot range from
`AENV_TEST_SLOT_CIDR`, default 10.224.0.0/16) runs two default sandboxes
(512 MiB, 2 vCPUs) of `--template`. The quiet one runs
`commands.run("true")` through the unmodified e2b SDK `--n` times, one
after the other:

1. **quiet**: the other sandbox idle (the baseline, same run);
2. **hogs**: the other sandbox runs, at once, a shell fork bomb
   (`b(){ b|b& }; b` as `user`, which meets the process limit) and a memory
   hog (`python3 -c "x = bytearray(2*1024**3)"` in a loop as root, each one
   killed by the sandbox's OOM killer), both under `timeout`.

It prints p50/p95 of both and their ratio (issue 17 aims at <= 1.5x), checks
that the hog sandbox is still usable after, and writes
bench/results/pressure-<timestamp>.json. Needs root and runsc.

    .venv/bin/python bench/pressure.py [--n 60] [--template base]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("AENV_TEST_NET_PREFIX", "aenvq")
os.environ.setdefault("AENV_TEST_SLOT_CIDR", "10.224.0.0/16")

import httpx  # noqa: E402
from e2b import Sandbox  # noqa: E402

from tests.conftest import leaks, link_home, sdk_pointed_at, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
HOGS_S = 240


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
    ap.add_argument("--home", default=os.environ.get("AENV_TEST_HOME", ".state/test-home"))
    args = ap.parse_args()
    private = Path(tempfile.mkdtemp(prefix="aenv-bench-pressure-"))
    link_home(Path(args.home), private)
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
                hog.commands.run(
                    f"timeout {HOGS_S} bash -c 'b(){{ b|b& }}; b' >/dev/null 2>&1",
                    background=True,
                    user="user",
                )
                hog.commands.run(
                    f"timeout {HOGS_S} sh -c 'while true; do "
                    'python3 -c "x = bytearray(2*1024**3)"; done\' >/dev/null 2>&1',
                    background=True,
                    user="user",
                )
                time.sleep(5)  # let both reach their limits
                loaded = sample(quiet, args.n)
                alive = hog.commands.run("echo alive", user="root", timeout=120).stdout.strip()
                logs = httpx.get(
                    f"{node.url}/v2/sandboxes/{hog.sandbox_id}/logs",
                    headers={"X-API-Key": node.api_key},
                ).json()["logs"]
                kills = sum("out of memory" in str(e["message"]) for e in logs)
            finally:
                for s in (quiet, hog):
                    with contextlib.suppress(Exception):
                        s.kill()
        result = {
            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "template": args.template,
            "quiet": stats(base),
            "hogs": stats(loaded),
            "hog_sandbox_alive_after": alive == "alive",
            "oom_kills_logged": kills,
        }
        result["ratio_p50"] = round(result["hogs"]["p50_ms"] / result["quiet"]["p50_ms"], 2)
        result["ratio_p95"] = round(result["hogs"]["p95_ms"] / result["quiet"]["p95_ms"], 2)
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
