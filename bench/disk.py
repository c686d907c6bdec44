"""Write throughput inside a sandbox with a disk size (its own ext4 disk) vs without.

Two nodes run one after the other (`python -m aenv serve`, free loopback
port, netns prefix `aenvd`, a free slot range picked by the node, node tag
`bnch`): **unbounded** (`AENV_SANDBOX_DISK_MB=0`: the upper directory on
the host's file system, as before disk sizes) and **sized**
(`AENV_SANDBOX_DISK_MB=--disk-mb`). On each, one sandbox of `--template`
runs, `--n` times each:

1. **seq**: `dd` of `--mib` MiB from /dev/zero into /home/user with
   `conv=fsync` (the bytes reach the disk, not just the page cache): MB/s
   from dd's own time, the file removed after each round;
2. **files**: Python writing `--files` files of 4 KiB each under /home/user
   and fsyncing the directory: files/s;
3. **tmp**: the same `dd` into /tmp (a memory tmpfs before disk sizes; on the
   disk now).

Each line prints p50/p95 for both sides and sized/unbounded of the p50 (the
aim is >= 0.9). Results go to bench/results/disk-<timestamp>.json. Needs
root and runsc; the home (default `$AENV_TEST_HOME`) must hold the envd
bundle and templates, and is only read.

    .venv/bin/python bench/disk.py [--n 5] [--mib 256] [--files 2000] [--disk-mb 4096]
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import link_home, sdk_pointed_at, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
_DD_RATE = re.compile(r"copied, ([0-9.]+) s")
_FILES = """
import os, sys, time
d = "/home/user/many"; os.makedirs(d, exist_ok=True)
n = int(sys.argv[1]); data = b"x" * 4096; t = time.perf_counter()
for i in range(n):
    with open(f"{d}/{i}", "wb") as f:
        f.write(data)
fd = os.open(d, os.O_RDONLY); os.fsync(fd); os.close(fd); os.sync()
print(time.perf_counter() - t)
"""


def stats(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples
    return {"p50": statistics.median(samples), "p95": qs[94] if len(qs) > 94 else max(samples)}


def measure(home_src: Path, disk_mb: int, args: argparse.Namespace) -> dict[str, list[float]]:
    from e2b import Sandbox

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-disk-"))
    link_home(home_src, home)
    env = {
        "AENV_SANDBOX_DISK_MB": str(disk_mb),
        "AENV_NET_PREFIX": "aenvd",
        "AENV_SLOT_CIDR": "",
        "AENV_NODE_TAG": "bnch",
        "AENV_POOL_SIZE": "0",
    }
    key = "bench-" + secrets.token_hex(8)
    node = start_node(home, api_key=key, log_path=home / "node.log", extra_env=env)
    out: dict[str, list[float]] = {"seq": [], "files": [], "tmp": []}
    try:
        with sdk_pointed_at(node.url, key):
            s = Sandbox.create(args.template, timeout=900)
            try:
                s.files.write("/home/user/files.py", _FILES)
                for _ in range(args.n):
                    for name, path in (("seq", "/home/user/big"), ("tmp", "/tmp/big")):
                        r = s.commands.run(
                            f"dd if=/dev/zero of={path} bs=1M count={args.mib} conv=fsync "
                            f"2>&1; rm -f {path}",
                            timeout=600,
                        )
                        m = _DD_RATE.search(r.stdout)
                        assert m, r.stdout
                        out[name].append(args.mib * (1 << 20) / 1e6 / float(m.group(1)))
                    r = s.commands.run(
                        f"python3 /home/user/files.py {args.files}; rm -rf /home/user/many",
                        timeout=600,
                    )
                    out["files"].append(args.files / float(r.stdout.strip()))
            finally:
                Sandbox.kill(s.sandbox_id)
    finally:
        stop_node(node)
        shutil.rmtree(home, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--disk-mb", type=int, default=4096)
    p.add_argument("--template", default="base")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("AENV_TEST_HOME", "")))
    args = p.parse_args()
    started = time.time()
    unbounded = measure(args.home, 0, args)
    sized = measure(args.home, args.disk_mb, args)
    rows: dict[str, Any] = {}
    units = {"seq": "MB/s", "files": "files/s", "tmp": "MB/s"}
    print(f"{'':6} {'unbounded p50/p95':>22} {'sized p50/p95':>22} {'ratio':>6}")
    for name in ("seq", "files", "tmp"):
        a, b = stats(unbounded[name]), stats(sized[name])
        ratio = b["p50"] / a["p50"]
        rows[name] = {"unbounded": a, "sized": b, "ratio": ratio, "unit": units[name]}
        print(
            f"{name:6} {a['p50']:10.1f}/{a['p95']:<10.1f} {b['p50']:10.1f}/{b['p95']:<10.1f}"
            f" {ratio:6.2f}  {units[name]}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": time.time() - started}
    doc["rows"] = rows
    doc["samples"] = {"unbounded": unbounded, "sized": sized}
    (RESULTS / f"disk-{stamp}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
