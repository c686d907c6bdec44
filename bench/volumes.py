"""Volume throughput: file IO inside a sandbox on a volume vs its root fs, and the content API.

One node (`python -m aenv serve`, free loopback port, netns prefix
`$AENV_BENCH_PREFIX` (default `aenvq`), slot range `$AENV_BENCH_CIDR`
(default 10.226.0.0/16)) gets a volume of `--size-mb` and a sandbox of
`--template` that mounts it at /mnt/vol. Each round, inside the sandbox
(`dd`, its own timing of the copy):

- **write**: `--mb` MiB from /dev/zero with `conv=fsync` (on disk when it
  returns), to a new file on the volume and to one under $HOME (the
  sandbox's root file system: the host overlay, also through the gofer);
- **read**: the file just written back to /dev/null (both cached).

The two alternate which goes first each round. The node's copies of volumes
to the object store are off (`AENV_VOLUME_PERSIST_S=0`): they would hash the
very files being written.

Outside, through the e2b SDK: `Volume.write_file` / `Volume.read_file` of
`--api-mb` MiB (the content API, streamed), next to `files.write` /
`files.read` of the same bytes into the sandbox (envd, the baseline a user
has without volumes). Rates are MB/s (10^6 bytes); the table prints
p50/p95 over `--n` rounds and the volume/root ratio (target: >= 0.8).
Results go to bench/results/volumes-<timestamp>.json; the sandbox, the
volume and the node's home are removed at the end. Needs root and runsc.

    .venv/bin/python bench/volumes.py [--n 5] [--mb 256] [--api-mb 64] [--template base]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import leaks, link_home, start_node, stop_node  # noqa: E402

NET_PREFIX = os.environ.get("AENV_BENCH_PREFIX", "aenvq")
SLOT_CIDR = os.environ.get("AENV_BENCH_CIDR", "10.226.0.0/16")
RESULTS = REPO / "bench" / "results"
_DD = re.compile(r"^(\d+) bytes .* copied, ([0-9.]+) s", re.M)


def pcts(samples: list[float]) -> dict[str, float]:
    if len(samples) == 1:
        return {"p50": samples[0], "p95": samples[0]}
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": round(qs[49], 1), "p95": round(qs[4], 1)}  # p95: the slow end of a rate


def dd_rate(out: str) -> float:
    m = _DD.search(out)
    if m is None:
        raise RuntimeError(f"no dd summary in: {out!r}")
    return int(m.group(1)) / float(m.group(2)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--api-mb", type=int, default=64)
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--template", default="base")
    ap.add_argument("--home", default=os.environ.get("AENV_TEST_HOME", ".state/test-home"))
    args = ap.parse_args()

    from e2b import Sandbox, Volume

    private = Path(tempfile.mkdtemp(prefix="aenv-bench-vol-"))
    link_home(Path(args.home), private)
    key = "bench_" + secrets.token_hex(8)
    env = {
        "AENV_NET_PREFIX": NET_PREFIX,
        "AENV_SLOT_CIDR": SLOT_CIDR,
        "AENV_ON_STOP": "stop",
        # the copies to the object store would hash the files being measured
        "AENV_VOLUME_PERSIST_S": "0",
    }
    node = start_node(private, api_key=key, log_path=private / "node.log", extra_env=env)
    os.environ.update(
        {
            "E2B_API_URL": node.url,
            "E2B_SANDBOX_URL": node.url,
            "E2B_VOLUME_API_URL": node.url,
            "E2B_API_KEY": key,
        }
    )
    os.environ.pop("E2B_DOMAIN", None)
    rows: dict[str, list[float]] = {}
    try:
        r = httpx.post(
            f"{node.url}/volumes",
            json={"name": "bench", "sizeMB": args.size_mb},
            headers={"X-API-Key": key},
        )
        r.raise_for_status()
        vol = Volume.connect(r.json()["volumeID"])
        sbx = Sandbox.create(args.template, timeout=3600, volume_mounts={"/mnt/vol": vol})
        try:
            places = {"volume": "/mnt/vol/bench.bin", "root fs": "/home/user/bench.bin"}
            for i in range(args.n):
                # each round the other one first: a busy disk's slow spells hit both
                order = list(places.items())[:: 1 if i % 2 == 0 else -1]
                for where, path in order:
                    w = sbx.commands.run(
                        f"rm -f {path}; dd if=/dev/zero of={path} bs=1M count={args.mb} "
                        "conv=fsync 2>&1",
                        timeout=600,
                    ).stdout
                    rd = sbx.commands.run(
                        f"dd if={path} of=/dev/null bs=1M 2>&1", timeout=600
                    ).stdout
                    rows.setdefault(f"write {args.mb} MiB, fsync ({where})", []).append(dd_rate(w))
                    rows.setdefault(f"read {args.mb} MiB ({where})", []).append(dd_rate(rd))
                    sbx.commands.run(f"rm -f {path}")
                data = os.urandom(args.api_mb * 2**20)
                mb = len(data) / 1e6
                t0 = time.perf_counter()
                vol.write_file("/api.bin", data)
                rows.setdefault(f"content API write {args.api_mb} MiB", []).append(
                    mb / (time.perf_counter() - t0)
                )
                t0 = time.perf_counter()
                back = vol.read_file("/api.bin", format="bytes")
                rows.setdefault(f"content API read {args.api_mb} MiB", []).append(
                    mb / (time.perf_counter() - t0)
                )
                assert back == data
                vol.remove("/api.bin")
                t0 = time.perf_counter()
                sbx.files.write("/home/user/api.bin", data)
                rows.setdefault(f"envd files.write {args.api_mb} MiB (baseline)", []).append(
                    mb / (time.perf_counter() - t0)
                )
                t0 = time.perf_counter()
                back = sbx.files.read("/home/user/api.bin", format="bytes")
                rows.setdefault(f"envd files.read {args.api_mb} MiB (baseline)", []).append(
                    mb / (time.perf_counter() - t0)
                )
                assert back == data
                sbx.files.remove("/home/user/api.bin")
                print(f"round {i + 1}/{args.n} done", file=sys.stderr)
        finally:
            sbx.kill()
            Volume.destroy(vol.volume_id)
    finally:
        stop_node(node)
        left = leaks(private, NET_PREFIX)
        shutil.rmtree(private, ignore_errors=True)
        if left:
            print(f"LEAKED: {left}", file=sys.stderr)

    table = {k: pcts(v) for k, v in rows.items()}
    print(f"| row (MB/s, n={args.n}) | p50 | p95 (slow end) |")
    print("|---|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v['p50']:.0f} | {v['p95']:.0f} |")
    for op in ("write", "read"):
        vk = next(k for k in table if k.startswith(op) and "(volume)" in k)
        rk = next(k for k in table if k.startswith(op) and "(root fs)" in k)
        print(f"{op}: volume / root fs = {table[vk]['p50'] / table[rk]['p50']:.2f}x (p50)")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = {"args": vars(args), "samples": rows, "table": table}
    (RESULTS / f"volumes-{stamp}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
