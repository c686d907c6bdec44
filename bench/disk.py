"""Write throughput inside a sandbox with a disk size (its own ext4 disk) vs without.

One node (`python -m aenv serve`, free loopback port, netns prefix derived from its home,
a free slot range picked by the node, node tag `bnch`) with
`AENV_SANDBOX_DISK_MB=0` runs two sandboxes side by side: **unbounded**, of
`--template` (its upper directory on the host's file system, as before disk
sizes), and **sized**, of a copy of that template whose `sandboxDiskMB` is
`--disk-mb` (its upper on a disk of its own). Rounds alternate between the
two, so both see the same machine (other jobs on it included). Each round,
`--n` times each:

1. **seq**: `dd` of `--mib` MiB from /dev/zero into /home/user with
   `conv=fsync` (the bytes reach the disk, not just the page cache): MB/s
   from dd's own time, the file removed after each round;
2. **files**: Python writing `--files` files of 4 KiB each under /home/user,
   then fsyncing the directory and calling sync(): files/s (and apart:
   **files_create**, the files/s of creating and writing them, and
   **files_sync**, the seconds the fsync and sync took);
3. **tmp**: the same `dd` into /tmp (a memory tmpfs before disk sizes; on the
   root file system now, with or without a disk).

Then, unless `--pause-rounds 0`, pause and resume: each round writes
`--pause-mib` MiB (`dd`, fsynced) into /home/user, times
`pause(mode="filesystem")` through the SDK (**pause_written**: the writable
layer is frozen into a layer at once: a rename on the host's file system, a
copy off a sandbox's disk), resumes (`Sandbox.connect`), times a second
pause with nothing new written (**pause_empty**, the baseline) and resumes
again, in seconds. (A default pause freezes the sandbox in memory and
returns in tens of milliseconds on both sides; its files are copied later,
by the write-behind or hibernation.)

Each line prints p50/p95 for both sides and sized/unbounded of the p50 (the
aim is >= 0.9). Results go to bench/results/disk-<timestamp>.json. Needs
root and runsc; the home (default `$AENV_TEST_HOME`) must hold the envd
bundle and templates, and is only read.

    .venv/bin/python bench/disk.py [--n 10] [--mib 256] [--files 2000] [--disk-mb 4096]
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import link_home, sdk_pointed_at, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
UNITS = {
    "seq": "MB/s",
    "files": "files/s",
    "files_create": "files/s",
    "files_sync": "s",
    "tmp": "MB/s",
    "pause_written": "s",
    "pause_empty": "s",
}
_DD_RATE = re.compile(r"copied, ([0-9.]+) s")
_FILES = """
import os, sys, time
d = "/home/user/many"; os.makedirs(d, exist_ok=True)
n = int(sys.argv[1]); data = b"x" * 4096; t = time.perf_counter()
for i in range(n):
    with open(f"{d}/{i}", "wb") as f:
        f.write(data)
t1 = time.perf_counter()
fd = os.open(d, os.O_RDONLY); os.fsync(fd); os.close(fd); os.sync()
print(time.perf_counter() - t, t1 - t)
"""


def stats(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples
    return {"p50": statistics.median(samples), "p95": qs[94] if len(qs) > 94 else max(samples)}


def sized_copy(home: Path, template: str, disk_mb: int) -> str:
    """A copy of `template` in `home` (files hard-linked, its record new) whose
    sandboxes get `disk_mb`-MiB disks; returns its name."""
    name = f"{template}-sized"
    src, dst = home / "templates" / template, home / "templates" / name
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    doc = json.loads((src / "template.json").read_text())
    doc.update(templateID=name, aliases=[name], sandboxDiskMB=disk_mb)
    (dst / "template.json").unlink()  # a hard link to the original's: never write through it
    (dst / "template.json").write_text(json.dumps(doc, indent=2))
    return name


def one_round(s: Any, args: argparse.Namespace, out: dict[str, list[float]]) -> None:
    for name, path in (("seq", "/home/user/big"), ("tmp", "/tmp/big")):
        r = s.commands.run(
            f"dd if=/dev/zero of={path} bs=1M count={args.mib} conv=fsync 2>&1; rm -f {path}",
            timeout=600,
        )
        m = _DD_RATE.search(r.stdout)
        assert m, r.stdout
        out[name].append(args.mib * (1 << 20) / 1e6 / float(m.group(1)))
    r = s.commands.run(
        f"python3 /home/user/files.py {args.files}; rm -rf /home/user/many", timeout=600
    )
    total, create = (float(x) for x in r.stdout.split())
    out["files"].append(args.files / total)
    out["files_create"].append(args.files / create)
    out["files_sync"].append(total - create)


def pause_round(s: Any, args: argparse.Namespace, out: dict[str, list[float]]) -> Any:
    """Time a pause after writing `--pause-mib` MiB and one after writing nothing;
    returns the resumed sandbox."""
    from e2b import Sandbox

    s.commands.run(
        f"dd if=/dev/zero of=/home/user/pause-$RANDOM bs=1M count={args.pause_mib} conv=fsync",
        timeout=600,
    )
    for name in ("pause_written", "pause_empty"):
        t0 = time.perf_counter()
        s.pause(mode="filesystem")
        out[name].append(time.perf_counter() - t0)
        s = Sandbox.connect(s.sandbox_id, timeout=1800)
        assert s.commands.run("echo back").stdout.strip() == "back"
    return s


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    from e2b import Sandbox

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-disk-"))
    link_home(args.home, home)
    sized_template = sized_copy(home, args.template, args.disk_mb)
    env = {
        "AENV_SANDBOX_DISK_MB": "0",
        "AENV_NET_PREFIX": "",  # derived from the private home: its own
        "AENV_SLOT_CIDR": "",
        "AENV_NODE_TAG": "bnch",
        "AENV_POOL_SIZE": "0",
    }
    key = "bench-" + secrets.token_hex(8)
    node = start_node(home, api_key=key, log_path=home / "node.log", extra_env=env)
    out: dict[str, dict[str, list[float]]] = {
        side: {name: [] for name in UNITS} for side in ("unbounded", "sized")
    }
    boxes: dict[str, Any] = {}
    try:
        with sdk_pointed_at(node.url, key):
            boxes["unbounded"] = Sandbox.create(args.template, timeout=1800)
            boxes["sized"] = Sandbox.create(sized_template, timeout=1800)
            size = boxes["sized"].commands.run("df -m / | tail -1").stdout.split()[1]
            print(f"sized sandbox: df / says {size} MiB", file=sys.stderr)
            for s in boxes.values():
                s.files.write("/home/user/files.py", _FILES)
            for i in range(args.n):
                sides = ("unbounded", "sized") if i % 2 == 0 else ("sized", "unbounded")
                for side in sides:
                    one_round(boxes[side], args, out[side])
            for i in range(args.pause_rounds):
                sides = ("unbounded", "sized") if i % 2 == 0 else ("sized", "unbounded")
                for side in sides:
                    boxes[side] = pause_round(boxes[side], args, out[side])
    finally:
        with sdk_pointed_at(node.url, key):
            for s in boxes.values():
                Sandbox.kill(s.sandbox_id)
        stop_node(node)
        shutil.rmtree(home, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--disk-mb", type=int, default=4096)
    p.add_argument("--pause-rounds", type=int, default=3)
    p.add_argument("--pause-mib", type=int, default=500)
    p.add_argument("--template", default="base")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("AENV_TEST_HOME", "")))
    args = p.parse_args()
    started = time.time()
    samples = measure(args)
    unbounded, sized = samples["unbounded"], samples["sized"]
    rows: dict[str, Any] = {}
    print(f"{'':13} {'unbounded p50/p95':>22} {'sized p50/p95':>22} {'ratio':>6}")
    for name, unit in UNITS.items():
        if not unbounded[name] or not sized[name]:
            continue
        a, b = stats(unbounded[name]), stats(sized[name])
        ratio = b["p50"] / a["p50"]
        rows[name] = {"unbounded": a, "sized": b, "ratio": ratio, "unit": unit}
        print(
            f"{name:13} {a['p50']:10.2f}/{a['p95']:<10.2f} {b['p50']:10.2f}/{b['p95']:<10.2f}"
            f" {ratio:6.2f}  {unit}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": time.time() - started}
    doc["rows"] = rows
    doc["samples"] = {"unbounded": unbounded, "sized": sized}
    (RESULTS / f"disk-{stamp}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
