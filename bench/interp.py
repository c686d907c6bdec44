"""aenv code-interpreter benchmark: `code-interpreter-v1` to a first `run_code` result.

One run starts a node (`python -m aenv serve`, free loopback port, private
home with the bundle and templates linked from `--home`, netns prefix
`aenvc`, slot range 10.241.0.0/16, node tag `bint`) with its defaults (warm
template snapshots, a pool of restored sandboxes) and times, through the
unmodified SDKs, in the same run and alternating which goes first:

- interp: `e2b_code_interpreter.Sandbox.create()` (the SDK's default
  template, `code-interpreter-v1`) until a first `run_code("1+1")` returns
  its result ("2"), and the create alone;
- baseline: `e2b.Sandbox.create("base")` until a first
  `commands.run("true")` returns, and the create alone.

Warm-up (untimed): one create of each template (the first
`code-interpreter-v1` create waits while the node boots it, starts the
code interpreter and captures it; `base` is captured in the background,
waited for in the node log), then one more of each. Samples are
`--spacing` seconds apart so the pool refills between them (as in
bench/run.py). Also timed once per sample on the interp sandbox: a second
`run_code` (a round trip to a warm kernel) and a matplotlib figure with its
chart data. Prints a table with the issue's target (interp p50 <= 2x the
baseline p50) and writes JSON to bench/results/interp-<timestamp>.json.
Needs root, runsc and a home with `code-interpreter-v1`
(`make test-artefacts`).

    .venv/bin/python bench/interp.py [--n 10] [--home DIR] [--spacing 1.5]
                                     [--net-prefix aenvc] [--slot-cidr 10.241.0.0/16]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
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
    Series,
    _describe,
    _sdk_env,
    interrupt_on_sigterm,
    loadavg,
    percentile,
    runsc_version,
)
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

NET_PREFIX = "aenvc"
SLOT_CIDR = "10.241.0.0/16"
NODE_TAG = "bint"
WARM_WAIT_S = 300.0
RESULTS = REPO / "bench" / "results"
CHART_CODE = (
    "import matplotlib.pyplot as plt\n"
    "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
    "plt.title('squares'); plt.show()"
)
ROWS = (
    ("interp_first_result", "interp: create + run_code('1+1')"),
    ("interp_create", "  of which Sandbox.create"),
    ("base_first_command", "baseline: create('base') + commands.run('true')"),
    ("base_create", "  of which Sandbox.create"),
    ("run_code_roundtrip", "run_code('1+1') on a warm kernel"),
    ("run_code_chart", "run_code(matplotlib figure): png + chart"),
)


def _wait_for_log(node: NodeProc, needle: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while needle not in node.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{needle!r} not in the node log after {limit_s:g}s")
        time.sleep(0.2)


def _interp_sample(results: dict[str, Series]) -> None:
    from e2b_code_interpreter import Sandbox as InterpSandbox

    t0 = time.perf_counter()
    sbx = InterpSandbox.create(timeout=120, request_timeout=300)
    t1 = time.perf_counter()
    try:
        got = sbx.run_code("1+1").text
        t2 = time.perf_counter()
        if got != "2":
            raise AssertionError(f"run_code('1+1') gave {got!r}")
        results["interp_create"].samples.append((t1 - t0) * 1000)
        results["interp_first_result"].samples.append((t2 - t0) * 1000)
        t3 = time.perf_counter()
        sbx.run_code("1+1")
        results["run_code_roundtrip"].samples.append((time.perf_counter() - t3) * 1000)
        t4 = time.perf_counter()
        chart = sbx.run_code(CHART_CODE)
        if not chart.results or chart.results[0].png is None or chart.results[0].chart is None:
            raise AssertionError(f"the figure came back without png or chart: {chart}")
        results["run_code_chart"].samples.append((time.perf_counter() - t4) * 1000)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def _base_sample(results: dict[str, Series]) -> None:
    from e2b import Sandbox

    t0 = time.perf_counter()
    sbx = Sandbox.create("base", timeout=120)
    t1 = time.perf_counter()
    try:
        sbx.commands.run("true")
        t2 = time.perf_counter()
        results["base_create"].samples.append((t1 - t0) * 1000)
        results["base_first_command"].samples.append((t2 - t0) * 1000)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def measure(node: NodeProc, n: int, spacing_s: float, results: dict[str, Series]) -> None:
    from e2b import Sandbox
    from e2b_code_interpreter import Sandbox as InterpSandbox

    started = time.perf_counter()
    InterpSandbox.create(timeout=120, request_timeout=600).kill()
    print(f"  first code-interpreter-v1 create (capture): {time.perf_counter() - started:.1f} s")
    Sandbox.create("base", timeout=120).kill()
    _wait_for_log(node, "template base is now a snapshot", WARM_WAIT_S)
    InterpSandbox.create(timeout=120).kill()
    Sandbox.create("base", timeout=120).kill()
    time.sleep(3 * spacing_s)  # let the pools fill
    for i in range(n):
        order = (_interp_sample, _base_sample) if i % 2 == 0 else (_base_sample, _interp_sample)
        for sample in order:
            time.sleep(spacing_s)
            sample(results)


def _fmt(series: Series, q: int) -> str:
    return f"{percentile(series.samples, q):.0f}" if series.samples else "-"


def table(results: dict[str, Series]) -> str:
    lines = [f"{'operation':52} {'p50 ms':>8} {'p95 ms':>8} {'n':>4}"]
    for key, label in ROWS:
        s = results[key]
        lines.append(f"{label:52} {_fmt(s, 50):>8} {_fmt(s, 95):>8} {len(s.samples):>4}")
    a, b = results["interp_first_result"], results["base_first_command"]
    if a.samples and b.samples:
        ratio = percentile(a.samples, 50) / percentile(b.samples, 50)
        met = "yes" if ratio <= 2.0 else "no"
        lines.append(f"interp / baseline (p50): {ratio:.2f}x  (target <= 2x: {met})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--spacing", type=float, default=1.5)
    parser.add_argument("--net-prefix", default=NET_PREFIX, help="the node's AENV_NET_PREFIX")
    parser.add_argument("--slot-cidr", default=SLOT_CIDR, help="the node's AENV_SLOT_CIDR")
    parser.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("AENV_TEST_HOME") or REPO / ".state" / "test-home"),
    )
    args = parser.parse_args(argv)
    if not (args.home / "templates" / "code-interpreter-v1").is_dir():
        print(f"{args.home} has no code-interpreter-v1: make test-artefacts", file=sys.stderr)
        return 2

    interrupt_on_sigterm()
    results = {key: Series() for key, _ in ROWS}
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-interp-"))
    private = work / "home"
    private.mkdir()
    link_home(args.home, private)
    node = start_node(
        private,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=work / "node.log",
        extra_env={"AENV_NET_PREFIX": args.net_prefix, "AENV_SLOT_CIDR": args.slot_cidr,
                   "AENV_NODE_TAG": NODE_TAG},
    )  # fmt: skip
    error: str | None = None
    try:
        with _sdk_env(node):
            measure(node, args.n, args.spacing, results)
    except Exception as e:
        error = _describe(e)
        print(f"failed: {error}\n{node.log_tail(40)}", file=sys.stderr)
    finally:
        code = stop_node(node)
        left = leaks(private, prefix=args.net_prefix)
        if code != 0 or left:
            print(f"node exit {code}, left behind: {left}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out: dict[str, Any] = {
        "when": stamp,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "load": loadavg()},
        "runsc": runsc_version(os.environ.get("AENV_RUNSC", "runsc")),
        "n": args.n,
        "spacing_s": args.spacing,
        "error": error,
        "results": {key: results[key].to_json() for key, _ in ROWS},
    }
    (RESULTS / f"interp-{stamp}.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
