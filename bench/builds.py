"""aenv template build benchmark: rebuilding an unchanged ten-step template vs its first build.

One run starts a node (`python -m aenv serve`) on a free loopback port with a
private home (bundle and default templates linked from `--home`), its own
netns prefix and slot range, and through the unmodified e2b SDK
(`Template.build`, timed from the call until it returns, as a user waits)
builds, per round (`--n`), a ten-step template from the `base` template: a
COPY of a local directory, ENV, WORKDIR, and RUN steps that write, compile
and archive files (a round-specific nonce in the first step, so every first
build meets steps the node has never run). Rows, in the same run:

- **first build**: every step runs (the baseline);
- **rebuild, unchanged**: the same template again, `--rebuilds` times per
  round (every step and the final snapshot come from the build cache);
- **rebuild, last step changed**: the same template with a different last
  RUN step (nine steps cached, one run, a new final snapshot).

Prints p50/p95 per row and the unchanged rebuild as a share of the first
build, and writes JSON to bench/results/builds-<timestamp>.json. The node
and its sandboxes are removed also when a step fails. Needs root, runsc and
a built test home.

    .venv/bin/python bench/builds.py [--n 3] [--rebuilds 3] [--home DIR]
"""

from __future__ import annotations

import argparse
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

from e2b import Sandbox, Template  # noqa: E402

from bench.run import _sdk_env, percentile  # noqa: E402
from tests.conftest import leaks, link_home, start_node, stop_node  # noqa: E402

NET_PREFIX = "aenvbb"
SLOT_CIDR = "10.241.0.0/16"


def template(context: Path, nonce: str, last: str) -> Any:
    return (
        Template(file_context_path=context)
        .from_template("base")
        .run_cmd(f"echo {nonce} > /home/user/nonce.txt", user="root")
        .copy("app", "/opt/app")
        .set_envs({"APP_HOME": "/opt/app", "MODE": "bench"})
        .set_workdir("/opt/app")
        .run_cmd("seq 1 20000 > numbers.txt", user="root")
        .run_cmd("sha256sum numbers.txt > numbers.sum", user="root")
        .run_cmd("tar -cf /tmp/app.tar -C /opt/app app.py lib", user="root")
        .run_cmd("mkdir -p /opt/data && head -c 4194304 /dev/urandom > /opt/data/blob", user="root")
        .run_cmd("python3 -m compileall -q /opt/app || true", user="root")
        .run_cmd(last, user="root")
    )


def build_s(t: Any, name: str, logs: list[str]) -> float:
    t0 = time.perf_counter()
    Template.build(t, name, on_build_logs=lambda e: logs.append(e.message))
    return time.perf_counter() - t0


def stats(samples: list[float]) -> dict[str, float]:
    return {"p50": percentile(samples, 50), "p95": percentile(samples, 95), "n": len(samples)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="rounds (a fresh template each)")
    p.add_argument("--rebuilds", type=int, default=3, help="unchanged rebuilds per round")
    p.add_argument("--home", type=Path, help="built test home (default $AENV_TEST_HOME)")
    args = p.parse_args()
    built = args.home or Path(os.environ.get("AENV_TEST_HOME") or REPO / ".state/test-home")
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-builds-"))
    home = workdir / "home"
    home.mkdir()
    link_home(built, home)
    context = workdir / "context"
    (context / "app" / "lib").mkdir(parents=True)
    (context / "app" / "app.py").write_text("print('hello from the bench')\n")
    for i in range(20):
        (context / "app" / "lib" / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 50)
    node = start_node(
        home,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=workdir / "node.log",
        extra_env={"AENV_NET_PREFIX": NET_PREFIX, "AENV_SLOT_CIDR": SLOT_CIDR},
    )
    first: list[float] = []
    rebuild: list[float] = []
    changed: list[float] = []
    cached_steps: list[int] = []
    try:
        with _sdk_env(node):
            for r in range(args.n):
                name = f"bench-build-{r}"
                nonce = secrets.token_hex(8)
                logs: list[str] = []
                first.append(build_s(template(context, nonce, "echo one > /opt/last"), name, logs))
                assert not any("CACHED" in m for m in logs), "a first build hit the cache"
                for _ in range(args.rebuilds):
                    logs = []
                    rebuild.append(
                        build_s(template(context, nonce, "echo one > /opt/last"), name, logs)
                    )
                    cached_steps.append(sum(" CACHED" in m for m in logs))
                logs = []
                changed.append(
                    build_s(template(context, nonce, "echo two > /opt/last"), name, logs)
                )
                s = Sandbox.create(name, timeout=60)
                try:
                    assert s.files.read("/opt/last") == "two\n"
                    assert s.files.read("/home/user/nonce.txt").strip() == nonce
                finally:
                    s.kill()
                print(
                    f"round {r + 1}/{args.n}: first {first[-1]:.2f} s, "
                    f"rebuilds {', '.join(f'{x:.2f}' for x in rebuild[-args.rebuilds :])} s, "
                    f"last step changed {changed[-1]:.2f} s",
                    flush=True,
                )
    finally:
        code = stop_node(node)
        left = leaks(home, prefix=NET_PREFIX)
        if code != 0 or left:
            print(f"node exit {code}, left behind: {left}\n{node.log_tail(40)}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = {
        "first build": stats(first),
        "rebuild, unchanged": stats(rebuild),
        "rebuild, last step changed": stats(changed),
    }
    share = rows["rebuild, unchanged"]["p50"] / rows["first build"]["p50"]
    print("\n| build (10 steps, from base) | n | p50 s | p95 s |\n|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v['n']:.0f} | {v['p50']:.2f} | {v['p95']:.2f} |")
    print(f"\nunchanged rebuild / first build (p50): {share:.1%}")
    print(f"cached steps per unchanged rebuild (incl. finalize): {sorted(set(cached_steps))}")
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "rows": rows,
        "samples": {"first": first, "rebuild": rebuild, "changed": changed},
        "share_p50": share,
        "load": os.getloadavg(),
    }
    (out / f"builds-{stamp}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
