"""Moving sandboxes between nodes: cross-node resume against same-node resume, and drain.

Runs the cluster lab (tests/cluster/lab.py: three real nodes in network
namespaces, moto's S3 as the store, `AENV_HIBERNATE_AFTER=1`,
`AENV_POOL_SIZE=0`; set AENV_TEST_LAB_* to give it names of its own) and the
e2b Python SDK. A sandbox of `--template` runs a counter (a shell loop
writing an increasing number to a file every 100 ms); every resume is checked
to continue the same process.

1. **same-node resume** (the baseline), `--n` times: on node 0, pause,
   wait until the sandbox is on disk and durable in the store (its claim says
   `paused-durable`), then `Sandbox.connect` through node 0 until it returns
   and until a first command answers.
2. **cross-node resume after kill -9**, `--n` times: the same sandbox paused
   on node 0; node 0 is killed; once node 1 reports it dead, `Sandbox.connect`
   through node 1 until it returns and a first command answers. This includes
   fencing node 0 (the lease window, 10 s by default: nothing may take a
   sandbox sooner). The adopter logs how long the restore from the store took
   (`adopted paused sandbox ... in X s`): reported as **restore on another
   node** (fetch of memory image and layer indexes from the store, journal,
   restore). Node 0 is started again after each sample.
3. **drain**, `--rounds` times: `--per-drain` running sandboxes (counters)
   on node 1, `POST /cluster/nodes/node1/drain` through node 0: the drain's
   own time per sandbox (pause to disk with memory, upload, hand over,
   restore and resume on the target) and the whole drain; then every moved
   sandbox is connected and checked, and node 1 started again.

Results (p50/p95 in ms) are printed as a table and written to
bench/results/cluster-moves-<UTC timestamp>.json. Needs root, runsc and
AENV_TEST_HOME built by `make test`.

    .venv/bin/python bench/cluster_moves.py [--n 5] [--rounds 3] [--per-drain 2] [--template base]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from e2b import Sandbox  # noqa: E402

from tests.cluster.lab import Lab, LabNode, open_lab  # noqa: E402

RESULTS = REPO / "bench" / "results"
COUNTER = (
    "sh -c 'echo $$ > /tmp/pid; i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; "
    "mv /tmp/count.new /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &"
)
ADOPTED = re.compile(r"adopted paused sandbox (\S+) from node \S+ in ([0-9.]+)s")


def stats(samples: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    if samples:
        ordered = sorted(samples)
        out["p50"] = statistics.median(ordered)
        out["p95"] = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return out


def wait_for(what: str, check: Callable[[], Any], within: float = 120.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if got := check():
                return got
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def members(node: LabNode) -> dict[str, str]:
    with node.client() as api:
        return {m["nodeID"]: m["state"] for m in api.get("/cluster/members").json()}


def counting(sbx: Sandbox) -> tuple[int, int]:
    out = sbx.commands.run("cat /tmp/pid /tmp/count", timeout=30).stdout.split()
    return int(out[0]), int(out[1])


def create_on(lab: Lab, index: int, template: str) -> Sandbox:
    node = lab.node(index)
    for _ in range(20):
        sbx = Sandbox.create(template, timeout=900, **node.sdk())
        if sbx.sandbox_id.endswith(node.env["AENV_NODE_TAG"]):
            sbx.commands.run(COUNTER, timeout=30)
            wait_for("the counter", lambda s=sbx: counting(s)[1] > 2)
            return sbx
        sbx.kill()
    raise RuntimeError(f"no create through node {index} stayed there")


def park(lab: Lab, sbx: Sandbox) -> int:
    """Pause `sbx` and wait until it is on disk and durable; its counter's PID."""
    pid = counting(sbx)[0]
    sbx.pause()
    wait_for(
        "paused-durable",
        lambda: (c := lab.claim(sbx.sandbox_id)) is not None and c["state"] == "paused-durable",
    )
    return pid


def resume_via(lab: Lab, index: int, sid: str, pid: int) -> tuple[float, float]:
    """Connect through node `index`: (ms until connect returns, ms until a command ran)."""
    t0 = time.perf_counter()
    sbx = Sandbox.connect(sid, timeout=900, **lab.node(index).sdk())
    t1 = time.perf_counter()
    got, _ = counting(sbx)
    t2 = time.perf_counter()
    if got != pid:
        raise RuntimeError(f"{sid}: the counter is a new process ({got} != {pid})")
    return 1000 * (t1 - t0), 1000 * (t2 - t0)


def adopted_s(lab: Lab, sid: str) -> float | None:
    for node in lab.nodes:
        try:
            text = node.log_path.read_text(errors="replace")
        except OSError:
            continue
        for m in ADOPTED.finditer(text):
            if m.group(1) == sid:
                return float(m.group(2))
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-drain", type=int, default=2)
    ap.add_argument("--template", default="base")
    args = ap.parse_args()
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "same_connect",
            "same_first_cmd",
            "cross_connect",
            "cross_first_cmd",
            "cross_restore",
            "drain_per_sandbox",
            "drain_total",
            "drain_total_per_sandbox",
        )
    }
    started = time.time()
    load0 = os.getloadavg()[0]
    env = {"AENV_HIBERNATE_AFTER": "1", "AENV_POOL_SIZE": "0"}
    with open_lab(nodes=3, store="s3", env=env) as lab:
        for i in range(args.n):
            sbx = create_on(lab, 0, args.template)
            try:
                pid = park(lab, sbx)
                connect_ms, cmd_ms = resume_via(lab, 0, sbx.sandbox_id, pid)
                samples["same_connect"].append(connect_ms)
                samples["same_first_cmd"].append(cmd_ms)
                pid = park(lab, sbx)
                lab.kill_node(0)
                wait_for("node0 dead", lambda: members(lab.node(1)).get("node0") == "dead")
                connect_ms, cmd_ms = resume_via(lab, 1, sbx.sandbox_id, pid)
                samples["cross_connect"].append(connect_ms)
                samples["cross_first_cmd"].append(cmd_ms)
                restore = adopted_s(lab, sbx.sandbox_id)
                if restore is not None:
                    samples["cross_restore"].append(1000 * restore)
                print(f"resume sample {i + 1}/{args.n}: cross {cmd_ms:.0f} ms", flush=True)
            finally:
                lab.reset()
                Sandbox.kill(sbx.sandbox_id, **lab.node(1).sdk())
        for r in range(args.rounds):
            boxes = [create_on(lab, 1, args.template) for _ in range(args.per_drain)]
            pids = {b.sandbox_id: counting(b)[0] for b in boxes}
            try:
                t0 = time.perf_counter()
                with lab.node(0).client(timeout=900) as api:
                    resp = api.post("/cluster/nodes/node1/drain")
                total = time.perf_counter() - t0
                report = resp.json()
                if resp.status_code != 200 or report.get("failed"):
                    raise RuntimeError(f"drain failed: {resp.text[:500]}")
                samples["drain_total"].append(1000 * total)
                samples["drain_total_per_sandbox"].append(1000 * total / len(boxes))
                for m in report["sandboxes"]:
                    samples["drain_per_sandbox"].append(1000 * float(m["seconds"]))
                for sid, pid in pids.items():
                    resume_via(lab, 2, sid, pid)  # the same process, on its new node
                print(f"drain round {r + 1}/{args.rounds}: {total:.1f} s", flush=True)
            finally:
                lab.restart_node(1, sig=15)
                wait_for("node1 back", lambda: members(lab.node(0)).get("node1") == "alive")
                for b in boxes:
                    Sandbox.kill(b.sandbox_id, **lab.node(0).sdk())
    rows = [
        ("resume on its own node (from disk): connect", "same_connect"),
        ("resume on its own node -> first command", "same_first_cmd"),
        ("resume through another node after kill -9: connect", "cross_connect"),
        ("resume through another node -> first command", "cross_first_cmd"),
        ("of which restore on another node (adopter's log)", "cross_restore"),
        (f"drain: per sandbox ({args.per_drain} running, 2 at once)", "drain_per_sandbox"),
        ("drain: whole drain", "drain_total"),
        ("drain: whole drain / sandboxes", "drain_total_per_sandbox"),
    ]
    print("\n| operation | n | p50 ms | p95 ms |\n|---|---|---|---|")
    out: dict[str, Any] = {}
    for label, key in rows:
        s = stats(samples[key])
        out[key] = {**s, "samples": samples[key]}
        p50 = f"{s['p50']:.0f}" if "p50" in s else "-"
        p95 = f"{s['p95']:.0f}" if "p95" in s else "-"
        print(f"| {label} | {s['n']} | {p50} | {p95} |")
    print(f"\nload average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"cluster-moves-{stamp}.json"
    meta = {"args": vars(args), "seconds": time.time() - started, "cpus": os.cpu_count()}
    path.write_text(json.dumps({**meta, "results": out}, indent=2))
    print(f"raw samples: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
