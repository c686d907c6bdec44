"""aenv durable-snapshot benchmark: store throughput and resuming from a cold cache.

One run starts moto's S3 server on loopback (tests/s3.py) and measures:

- throughput of `aenv.storage.snapstore` against it, in this process: a
  synthetic snapshot (one frozen layer of `--mb` MiB of random,
  incompressible files, and a memory image file of `--mb` MiB) uploaded to
  an empty prefix (`upload_snapshot`: hashing, HEADs, PUTs of 1 MiB
  blobs, manifest), then fetched back (`materialise_layer` +
  `download_image`, every blob verified); MB/s of content, `--n` rounds;
- what a second snapshot of the same sandbox, 1 MiB of file data later,
  uploads (memory pages already stored are referenced, not sent again);
- time to resume from a snapshot through the real e2b SDK, `Sandbox.create(id)`
  until a first `commands.run("true")` returns: warm (the node has the
  snapshot locally) and cold (a node with a fresh home, same store, never
  saw it: layers and image come from S3 first). The snapshot is taken on a
  first node (a busybox sandbox with a running process and `--data-mb` MiB
  of random file data), waited for until durable, then that node stops;
  each cold sample starts a node with a fresh private home (not timed), so
  it is also that node's first create; cold_serving is a cold restore (of a
  snapshot of another sandbox like it) on that node after it served the
  cold and warm samples: the store's part alone; cold_next restores the
  second snapshot of the first sandbox there, most of whose memory pages
  the node has in the first one's image (copied, not fetched).
  Cold is measured twice: with the snapshot's layers served on demand (the
  default) and downloaded whole first (`AENV_LAZY_RESTORE=0`, cold_eager).
  Each sample's parts come from the node's own log too: its restore from the
  store (manifest, restore.*) and its create's phases (node.root, .network,
  .restore: runsc's, .envd, .journal); a cold node's start (until /health
  answers) is timed as well. --keep-logs DIR keeps every node's log.

It prints p50/p95 and writes JSON to bench/results/storage-<timestamp>.json.
Nodes use their own netns prefix and slot range (AENV_BENCH_NET_PREFIX,
AENV_BENCH_SLOT_CIDR to run beside another benchmark), are stopped with SIGTERM,
and temp homes are removed, also when a step fails or SIGTERM stops it. The
node part needs root, runsc and a built home (--home, else AENV_TEST_HOME,
else .state/test-home; `make test-artefacts`); --skip-nodes measures only
the store's throughput.

    .venv/bin/python bench/storage.py [--n 3] [--mb 64] [--data-mb 16] [--home DIR]
        [--skip-throughput] [--skip-eager] [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
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

import httpx
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.storage.objstore import open_object_store  # noqa: E402
from aenv.storage.snapstore import (  # noqa: E402
    LocalLayer,
    download_image,
    fetch_manifest,
    materialise_layer,
    upload_snapshot,
)
from bench.run import Interrupted, bench_home, interrupt_on_sigterm  # noqa: E402
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402
from tests.s3 import MotoS3  # noqa: E402

NET_PREFIX = os.environ.get("AENV_BENCH_NET_PREFIX", "aenvq")
SLOT_CIDR = os.environ.get("AENV_BENCH_SLOT_CIDR", "10.229.0.0/16")
RESULTS = REPO / "bench" / "results"
MiB = 1 << 20


def stats(samples: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples), "samples": [round(s, 4) for s in samples]}
    if samples:
        qs = (
            statistics.quantiles(samples, n=100, method="inclusive")
            if len(samples) > 1
            else [samples[0]] * 99
        )
        out["p50"], out["p95"] = round(qs[49], 4), round(qs[94], 4)
    return out


# -- throughput, in process -----------------------------------------------------------


def _make_snapshot(root: Path, mb: int) -> tuple[Path, Path, dict[str, str]]:
    tree = root / "layer" / "tree"
    tree.mkdir(parents=True)
    per = 4
    for i in range(max(1, mb // per)):
        (tree / f"f{i}.bin").write_bytes(os.urandom(per * MiB))
    image = root / "image"
    image.mkdir()
    (image / "checkpoint.img").write_bytes(os.urandom(mb * MiB))
    sums = {"checkpoint.img": hashlib.sha256((image / "checkpoint.img").read_bytes()).hexdigest()}
    return tree, image, sums


async def throughput(s3: MotoS3, work: Path, mb: int, n: int) -> dict[str, Any]:
    up: list[float] = []
    down: list[float] = []
    for i in range(n):
        root = work / f"t{i}"
        tree, image, sums = await trio.to_thread.run_sync(_make_snapshot, root, mb)
        store = open_object_store(
            s3.url(f"bench/{secrets.token_hex(4)}"),
            config=s3.config(),
            client_options={"allow_http": True},
        )
        t0 = time.perf_counter()
        report = await upload_snapshot(
            store,
            snapshot_id=f"snap-bench{i}",
            record={"createdAt": time.time()},
            layers=[LocalLayer(id=f"bench{i}", below=(), tree=tree)],
            image=image,
            checksums=sums,
        )
        up.append(report.bytes_uploaded / MiB / (time.perf_counter() - t0))
        m = await fetch_manifest(store, f"snap-bench{i}", by_id=True)
        assert m is not None
        t0 = time.perf_counter()
        content = await materialise_layer(store, m.snapshot_id, m.layers[0], root / "back")
        await download_image(store, m, root / "image-back")
        content += sum(f.size for f in m.image or ())
        down.append(content / MiB / (time.perf_counter() - t0))
        await trio.to_thread.run_sync(shutil.rmtree, root)
    return {"size_mib": 2 * mb, "upload_mib_s": stats(up), "download_mib_s": stats(down)}


# -- resume: cold vs warm --------------------------------------------------------------


class Env:
    def __init__(self, node: NodeProc) -> None:
        self.saved = {
            k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
        }
        os.environ.update(
            {"E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url, "E2B_API_KEY": node.api_key}
        )

    def restore(self) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _node(
    built: Path, work: Path, name: str, s3: MotoS3, prefix: str, key: str, **extra: str
) -> NodeProc:
    home = work / name
    home.mkdir()
    link_home(built, home)
    env = {
        "AENV_NET_PREFIX": NET_PREFIX,
        "AENV_SLOT_CIDR": SLOT_CIDR,
        "AENV_STORE_URL": s3.url(prefix),
        # not the default templates' share at start: seconds of hashing `base`'s
        # root on the node's CPUs while the cold sample runs, a one-off of a new
        # node that a resume on a node already up never meets
        "AENV_SHARE_DEFAULT_TEMPLATES": "off",
        **s3.env(),
        **extra,
    }
    return start_node(home, api_key=key, log_path=home / "node.log", extra_env=env)


KEEP_LOGS: Path | None = None  # --keep-logs: each node's log is copied there


def _stop(node: NodeProc) -> None:
    code = stop_node(node)
    left = leaks(node.home, NET_PREFIX)
    if code != 0 or left:
        print(f"node exit {code}, left {left}\n{node.log_tail(30)}", file=sys.stderr)
    if KEEP_LOGS is not None:
        KEEP_LOGS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(node.log_path, KEEP_LOGS / f"{node.home.name}.log")
    shutil.rmtree(node.home, ignore_errors=True)


def _resume_once(
    snapshot_id: str, parts: dict[str, list[float]] | None = None, node: NodeProc | None = None
) -> float:
    from e2b import Sandbox

    t0 = time.perf_counter()
    s = Sandbox.create(snapshot_id, timeout=120)
    t1 = time.perf_counter()
    try:
        s.commands.run("true")
        t2 = time.perf_counter()
    finally:
        s.kill()
    if parts is not None:
        parts.setdefault("create", []).append(t1 - t0)
        parts.setdefault("first_command", []).append(t2 - t1)
        if node is not None:
            _create_phases(node, s.sandbox_id, parts)
    return t2 - t0


_STARTED = re.compile(r"running: started in ([0-9]+) ms \(([^)]*)\)")


def _create_phases(node: NodeProc, sandbox_id: str, parts: dict[str, list[float]]) -> None:
    """Add the node's own phases of the sandbox's create (its `running: started
    in` line: root, network, restore, envd, journal) to `parts`, as `node.*`."""
    for line in node.log_path.read_text(errors="replace").splitlines():
        hit = _STARTED.search(line) if f"{sandbox_id}:" in line else None
        if hit is None:
            continue
        parts.setdefault("node", []).append(int(hit.group(1)) / 1000)
        for word in hit.group(2).split(", "):
            name, _, ms = word.rpartition(" ")
            parts.setdefault(f"node.{name}", []).append(int(ms) / 1000)


_PHASE = re.compile(r"in ([0-9.]+)s(?: \(([^)]*)\))?")


def _store_phases(node: NodeProc, snapshot_id: str, parts: dict[str, list[float]]) -> None:
    """Add the node's own account of a cold restore (its log) to `parts`: the
    manifest lookup, then the restore from the store and its phases."""
    for line in node.log_path.read_text(errors="replace").splitlines():
        for marker, name in (("found snapshot", "manifest"), ("restored snapshot", "restore")):
            if f"{marker} {snapshot_id}" not in line or "object store" not in line:
                continue
            hit = _PHASE.search(line)
            if hit is None:
                continue
            parts.setdefault(name, []).append(float(hit.group(1)))
            words = (hit.group(2) or "").split()
            for k, v in zip(words[::2], words[1::2], strict=False):
                parts.setdefault(f"{name}.{k}", []).append(float(v))


def _durable_snapshot(node: NodeProc, key: str, sandbox_id: str) -> tuple[float, dict[str, Any]]:
    """Seconds until a snapshot of the sandbox is durable, and its detail."""
    t0 = time.perf_counter()
    r = httpx.post(
        f"{node.url}/sandboxes/{sandbox_id}/snapshots",
        json={"durable": True},
        headers={"X-API-Key": key},
        timeout=600,
    )
    took = time.perf_counter() - t0
    r.raise_for_status()
    sid = r.json()["snapshotID"]
    return took, httpx.get(f"{node.url}/snapshots/{sid}", headers={"X-API-Key": key}).json()


def resume(
    built: Path, s3: MotoS3, work: Path, n: int, data_mb: int, *, skip_eager: bool = False
) -> dict[str, Any]:
    from e2b import Sandbox

    prefix = f"resume/{secrets.token_hex(4)}"
    key = "aenv_bench_" + secrets.token_hex(8)
    node = _node(built, work, "origin", s3, prefix, key)
    env = Env(node)
    try:
        s = Sandbox.create("busybox", timeout=300)
        s.commands.run(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done", background=True
        )
        s.commands.run(f"head -c {data_mb * MiB} /dev/urandom > $HOME/data.bin")
        snapshot_wait, detail = _durable_snapshot(node, key, s.sandbox_id)
        sid = detail["snapshotID"]
        # a later snapshot of the same sandbox: only what changed goes up (pages, files)
        s.commands.run(f"head -c {MiB} /dev/urandom > $HOME/more.bin")
        second_wait, detail2 = _durable_snapshot(node, key, s.sandbox_id)
        sid2 = detail2["snapshotID"]
        s.kill()
        # another sandbox like it, for cold restores on a node that is already serving
        s = Sandbox.create("busybox", timeout=300)
        s.commands.run(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done", background=True
        )
        s.commands.run(f"head -c {data_mb * MiB} /dev/urandom > $HOME/data.bin")
        other = _durable_snapshot(node, key, s.sandbox_id)[1]["snapshotID"]
        s.kill()
    finally:
        env.restore()
        _stop(node)
    cold: list[float] = []
    eager: list[float] = []
    warm: list[float] = []
    serving: list[float] = []
    following: list[float] = []
    next_parts: dict[str, list[float]] = {}
    cold_parts: dict[str, list[float]] = {}
    warm_parts: dict[str, list[float]] = {}
    serving_parts: dict[str, list[float]] = {}
    starts: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        node = _node(built, work, f"cold{i}", s3, prefix, key)
        starts.append(time.perf_counter() - t0)  # until /health answers
        env = Env(node)
        try:
            cold.append(_resume_once(sid, cold_parts, node))
            warm.append(_resume_once(sid, warm_parts, node))
            serving.append(_resume_once(other, serving_parts, node))
            # the later snapshot of the first sandbox: most of its pages are local now
            following.append(_resume_once(sid2, next_parts, node))
            _store_phases(node, sid, cold_parts)
            _store_phases(node, other, serving_parts)
            _store_phases(node, sid2, next_parts)
        finally:
            env.restore()
            _stop(node)
        if skip_eager:
            continue
        node = _node(built, work, f"eager{i}", s3, prefix, key, AENV_LAZY_RESTORE="0")
        env = Env(node)
        try:
            eager.append(_resume_once(sid))
        finally:
            env.restore()
            _stop(node)
    return {
        "snapshot_durable_s": round(snapshot_wait, 3),
        "snapshot_upload": detail.get("storageUpload"),
        "second_snapshot_durable_s": round(second_wait, 3),
        "second_snapshot_upload": detail2.get("storageUpload"),
        "node_start_s": stats(starts),
        "cold_s": stats(cold),
        "cold_eager_s": stats(eager),
        "warm_s": stats(warm),
        "cold_serving_s": stats(serving),
        "cold_next_s": stats(following),
        "cold_parts_s": {k: stats(v) for k, v in cold_parts.items()},
        "warm_parts_s": {k: stats(v) for k, v in warm_parts.items()},
        "cold_serving_parts_s": {k: stats(v) for k, v in serving_parts.items()},
        "cold_next_parts_s": {k: stats(v) for k, v in next_parts.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--mb", type=int, default=64, help="MiB of layer files and of image each")
    ap.add_argument("--data-mb", type=int, default=16, help="MiB of file data in the sandbox")
    ap.add_argument("--home", type=Path, help="built home (default $AENV_TEST_HOME)")
    ap.add_argument("--skip-nodes", action="store_true", help="throughput only")
    ap.add_argument("--skip-throughput", action="store_true", help="resume only")
    ap.add_argument("--skip-eager", action="store_true", help="no cold_eager samples")
    ap.add_argument("--keep-logs", type=Path, help="copy each node's log into this directory")
    args = ap.parse_args()
    global KEEP_LOGS
    KEEP_LOGS = args.keep_logs
    home = None if args.skip_nodes else bench_home(ap, args.home)
    interrupt_on_sigterm()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    s3 = MotoS3(bucket="aenv-bench")
    s3.start()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-storage-"))
    out: dict[str, Any] = {"when": datetime.datetime.now(datetime.UTC).isoformat()}
    try:
        if not args.skip_throughput:
            out["throughput"] = trio.run(throughput, s3, work, args.mb, args.n)
            tp = out["throughput"]
            print(
                f"store throughput ({tp['size_mib']} MiB snapshot, moto on loopback): "
                f"upload p50 {tp['upload_mib_s']['p50']:.1f} MiB/s, "
                f"download p50 {tp['download_mib_s']['p50']:.1f} MiB/s"
            )
        if home is not None:
            out["resume"] = resume(home, s3, work, args.n, args.data_mb, skip_eager=args.skip_eager)
            rs = out["resume"]
            print(
                f"snapshot with {args.data_mb} MiB of data durable in {rs['snapshot_durable_s']}s "
                f"(uploaded {rs['snapshot_upload']})"
            )
            up2 = rs["second_snapshot_upload"] or {}
            print(
                f"the next snapshot, 1 MiB of file data later, durable in "
                f"{rs['second_snapshot_durable_s']}s: {up2.get('bytes')} bytes uploaded "
                f"({up2.get('imageBytes')} of memory: {up2.get('reusedPages')} of "
                f"{up2.get('imagePages')} pages already stored)"
            )
            st = rs["node_start_s"]
            print(f"a cold sample's node up (/health) in p50 {st['p50']:.3f}s p95 {st['p95']:.3f}s")
            for kind in ("cold", "cold_eager", "cold_serving", "cold_next", "warm"):
                st = rs[f"{kind}_s"]
                if st["n"]:
                    print(f"resume {kind}: p50 {st['p50']:.3f}s p95 {st['p95']:.3f}s (n={st['n']})")
            for kind in ("cold", "cold_serving", "cold_next", "warm"):
                parts = ", ".join(
                    f"{k} {st['p50']:.0f}" if "pages" in k else f"{k} {st['p50']:.3f}"
                    for k, st in rs[f"{kind}_parts_s"].items()
                )
                print(f"  {kind} p50 by part (s): {parts}")
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"storage-{stamp}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
