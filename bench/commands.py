"""The command path of one running sandbox, next to its floors, measured in one run.

One node (`python -m aenv serve`, a private home linked to the built one),
one sandbox of the template through the unmodified e2b SDK, then, each
`--n` times, interleaved round-robin so the machine's noise falls on all
rows alike:

- `sdk_run_true`: `commands.run("true")` (the SDK runs `/bin/bash -l -c true`)
- `raw_start_true`: one Connect `process.Process/Start` of `/bin/true` over
  HTTP/1.1 through the node's proxy (httpx, kept-alive connection): the
  call without the SDK's own work
- `raw_start_bash`: the same with the SDK's argv (`/bin/bash -l -c true`)
- `files_write_small` / `files_read_small`: `files.write`/`files.read` of 64 bytes
- `first_byte`: how long after a process writes a line the SDK's
  `on_stdout` sees it (the line is the guest's clock when written; gVisor's
  clock is the host's)
- `floor_runsc_exec`: `runsc exec <the same sandbox> /bin/true`
- `floor_health`: GET envd `/health` through the proxy (one HTTP round trip)

Inside the sandbox, once: the time `sh` takes to spawn `/bin/true`, and
`bash -l -c true`, averaged over a loop (`spawn_sh_true`, `spawn_bash_login`),
read off the guest's clock.

    sudo .venv/bin/python bench/commands.py [--n 30] [--template base]
        [--home DIR [--home DIR ...]] [--rounds R]

With several `--home`s (homes whose bundles hold different envd builds,
templates linked from one), each gets its own node and sandbox, in turn,
`--rounds` times, and the table shows them side by side, each against the
`runsc exec` floor of its own sandbox.

Env: AENV_TEST_HOME (the built home), AENV_BENCH_NET_PREFIX and
AENV_BENCH_SLOT_CIDR (as bench/run.py). Writes bench/results/commands-*.json.
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
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import (  # noqa: E402
    NET_PREFIX,
    NODE_TAG,
    RESULTS,
    SLOT_CIDR,
    Interrupted,
    Series,
    _sdk_env,
    bench_home,
    interrupt_on_sigterm,
    loadavg,
    percentile,
)
from tests.conftest import leaks, link_home, start_node, stop_node  # noqa: E402

ENVD_PORT = 49983
ROWS = (
    ('commands.run("true") (SDK)', "sdk_run_true"),
    ("Connect Start /bin/true (raw, HTTP/1.1)", "raw_start_true"),
    ("Connect Start bash -l -c true (raw)", "raw_start_bash"),
    ("files.write 64 B (SDK)", "files_write_small"),
    ("files.read 64 B (SDK)", "files_read_small"),
    ("first byte of output after written (SDK)", "first_byte"),
    ("envd /health through the proxy", "floor_health"),
    ("floor: runsc exec true (same sandbox)", "floor_runsc_exec"),
    ("in-sandbox: sh spawns /bin/true (mean)", "spawn_sh_true"),
    ("in-sandbox: bash -l -c true from sh (mean)", "spawn_bash_login"),
)


def envelope(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", 0, len(data)) + data


def container_id(state_root: Path, sandbox_id: str) -> str:
    for p in state_root.glob("*_sandbox:*.state"):
        cid = p.name.split("_sandbox:", 1)[0]
        if sandbox_id.startswith(cid) or cid.startswith(sandbox_id.split("-")[0]):
            return cid
    raise RuntimeError(f"no runsc container for {sandbox_id} under {state_root}")


def in_guest_mean(sbx: Any, body: str, loops: int) -> float:
    """Mean ms of one iteration of `body` in a `sh` loop, by the guest's clock."""
    script = (
        f"s=$(date +%s%N); i=0; while [ $i -lt {loops} ]; do {body}; i=$((i+1)); done; "
        "e=$(date +%s%N); echo $((e-s))"
    )
    out = sbx.commands.run(f"sh -c '{script}'").stdout
    return int(out.strip()) / 1e6 / loops


def measure(sbx: Any, node: Any, runsc_cmd: list[str], n: int) -> dict[str, Series]:
    res = {key: Series() for _, key in ROWS}
    headers = {
        "e2b-sandbox-id": sbx.sandbox_id,
        "e2b-sandbox-port": str(ENVD_PORT),
        "content-type": "application/connect+json",
        "connect-protocol-version": "1",
    }
    token = getattr(sbx, "_envd_access_token", None)
    if token:
        headers["x-access-token"] = token
    client = httpx.Client(base_url=node.url, http1=True, timeout=30)

    def raw_start(cmd: str, args: list[str]) -> Callable[[], object]:
        body = envelope({"process": {"cmd": cmd, "args": args}})

        def op() -> object:
            r = client.post("/process.Process/Start", content=body, headers=headers)
            if r.status_code != 200 or b'"end"' not in r.content or b'"error"' in r.content:
                raise RuntimeError(f"Start: {r.status_code} {r.content[-300:]!r}")
            return r

        return op

    def health() -> object:
        return client.get(
            "/health", headers={k: v for k, v in headers.items() if k != "content-type"}
        )

    seen: list[float] = []

    def first_byte() -> float:
        seen.clear()

        def on_out(line: str) -> None:
            if not seen:
                seen.append(time.time_ns() / 1e6 - int(line.strip()) / 1e6)

        sbx.commands.run("sleep 0.02; date +%s%N; sleep 0.05", on_stdout=on_out)
        return seen[0] if seen else float("nan")

    payload = b"x" * 64
    ops: list[tuple[str, Callable[[], object]]] = [
        ("sdk_run_true", lambda: sbx.commands.run("true")),
        ("raw_start_true", raw_start("/bin/true", [])),
        ("raw_start_bash", raw_start("/bin/bash", ["-l", "-c", "true"])),
        ("files_write_small", lambda: sbx.files.write("/tmp/aenv-bench-small", payload)),
        ("files_read_small", lambda: sbx.files.read("/tmp/aenv-bench-small")),
        ("floor_health", health),
        ("floor_runsc_exec", lambda: subprocess.run(runsc_cmd, check=True, capture_output=True)),
    ]
    for _, op in ops:  # warm every path once (connections, page cache)
        op()
        op()
    for _ in range(n):
        for key, op in ops:
            t0 = time.perf_counter()
            op()
            res[key].samples.append((time.perf_counter() - t0) * 1000)
        res["first_byte"].samples.append(first_byte())
    res["spawn_sh_true"].samples.append(in_guest_mean(sbx, "/bin/true", 30))
    res["spawn_bash_login"].samples.append(in_guest_mean(sbx, "/bin/bash -l -c true", 10))
    client.close()
    return res


def table(runs: dict[str, dict[str, Series]]) -> str:
    """One block of columns per home: p50, p95 and p50 ÷ that home's runsc exec p50."""
    head = f"{'operation':<46}"
    for label in runs:
        head += f" | {label[:24]:<24}"
    sub = f"{'':<46}" + " | {:>7} {:>7} {:>8}".format("p50 ms", "p95 ms", "÷ floor") * len(runs)
    lines = [head, sub]
    for row_label, key in ROWS:
        line = f"{row_label:<46}"
        for res in runs.values():
            s, floor = res[key], res["floor_runsc_exec"]
            if not s.samples:
                line += f" | {'-':>7} {'-':>7} {'':>8}"
                continue
            p50, p95 = percentile(s.samples, 50), percentile(s.samples, 95)
            f50 = percentile(floor.samples, 50) if floor.samples else None
            ratio = f"{p50 / f50:.2f}x" if f50 else ""
            line += f" | {p50:7.1f} {p95:7.1f} {ratio:>8}"
        lines.append(line)
    return "\n".join(lines)


def measure_home(home: Path, template: str, n: int) -> dict[str, Series]:
    """One node on `home`, one sandbox, `n` rounds of every operation."""
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-cmd-"))
    private = workdir / "home"
    private.mkdir()
    link_home(home, private)
    node = start_node(
        private,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=workdir / "node.log",
        extra_env={"AENV_NET_PREFIX": NET_PREFIX, "AENV_SLOT_CIDR": SLOT_CIDR,
                   "AENV_NODE_TAG": NODE_TAG},
    )  # fmt: skip
    try:
        from e2b import Sandbox

        with _sdk_env(node):
            sbx = Sandbox.create(template, timeout=600)
            try:
                state_root = private / "run" / "runsc"
                cid = container_id(state_root, sbx.sandbox_id)
                runsc = os.environ.get("AENV_RUNSC", "runsc")
                runsc_cmd = [runsc, "--root", str(state_root), "exec", cid, "/bin/true"]
                return measure(sbx, node, runsc_cmd, n)
            finally:
                with contextlib.suppress(Exception):
                    sbx.kill()
    finally:
        code = stop_node(node)
        left = leaks(private, prefix=NET_PREFIX)
        if code != 0 or left:
            print(f"--- node log (exit {code}) ---\n{node.log_tail(40)}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=30, help="samples per operation and round")
    p.add_argument("--template", default="base")
    p.add_argument(
        "--home",
        type=Path,
        action="append",
        help="a built home (repeat to compare envd bundles; default $AENV_TEST_HOME)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the homes in turn this many times (samples pooled)",
    )
    args = p.parse_args(argv)
    homes = [bench_home(p, h) for h in args.home or [None]]
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    runs: dict[str, dict[str, Series]] = {}
    try:
        for _ in range(args.rounds):
            for home in homes:
                label = str(home)
                print(f"{label}: n={args.n} ...", flush=True)
                got = measure_home(home, args.template, args.n)
                if label not in runs:
                    runs[label] = got
                else:
                    for key, series in got.items():
                        runs[label][key].samples += series.samples
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    print(table(runs))
    load_end = loadavg()
    print(f"\nload average {load_start} at start, {load_end} at end; {os.cpu_count()} CPUs")
    report = {
        "started": started.isoformat(),
        "n": args.n,
        "rounds": args.rounds,
        "template": args.template,
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                 "loadavg_start": load_start, "loadavg_end": load_end},
        "homes": {label: {k: s.to_json() for k, s in res.items()} for label, res in runs.items()},
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"commands-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
