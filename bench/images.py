"""aenv image benchmark: a never-seen OCI image to a first command, and FUSE read throughput.

One run starts Debian's docker-registry on loopback and builds, before any
timing, one distinct image per sample (`--n`): busybox plus `--total-mb` MiB
of random, incompressible files in 3 gzip layers, each image from another
seed so every sample meets layers the node has never seen (the busybox base
layer is shared, as a real base image is). It then starts a node
(`python -m aenv serve`) on a free loopback port, with a private home (the
envd bundle linked from `--home`), its own netns prefix and slot range, and
for each image times, on the same machine in the same run:

- aenv: `Sandbox.create("<registry>/<repo>:<tag>")` through the real e2b SDK
  until a first `commands.run("true")` returns (pull, layer conversion into
  the chunk cache, lazy FUSE tree, sandbox start), and the bytes the node
  downloaded from the registry and served through FUSE meanwhile (metrics);
- aenv again, with the same content in TOC-indexed layers (eStargz, and
  zstd:chunked: `--toc`, the test writers of `tests.toclayers`, 4 MiB chunks):
  the pull reads each big layer's footer and TOC by range instead of the blob,
  and the first command reads what it touches chunk by chunk;
- the full pull a Docker-like runtime does before it starts anything:
  `skopeo copy docker://REF oci:DIR` + `umoci unpack`, then `runsc run` of
  the unpacked root filesystem until its `true` exits, started as aenv's
  gVisor driver starts sandboxes (bench/run.py's floor, in a netns of its own).

The sides rotate which goes first per image. Afterwards it reads every
big file of every image through the node's FUSE mount (`HOME/run/images/<key>`,
from this process, not the node's) and from the umoci-unpacked root
filesystem, twice: cold (the chunk files and the unpacked files dropped from
the page cache with POSIX_FADV_DONTNEED after a sync) and warm (both in the
page cache; the FUSE file's own page cache is always dropped after reading,
so every FUSE read goes through the node). It prints a table and writes JSON
to bench/results/images-<timestamp>.json. Everything (node, registry, runsc
containers, netns, veth, cgroups, temp dirs) is removed also when a step
fails or the run is interrupted. Needs root, runsc, docker-registry, skopeo,
umoci and /bin/busybox.

    .venv/bin/python bench/images.py [--n 3] [--home DIR] [--total-mb 320]
        [--toc estargz,zstd:chunked]

`AENV_BENCH_IMAGES_NET_PREFIX` and `AENV_BENCH_IMAGES_SLOT_CIDR` move the
node's netns prefix and slot range (default aenvi, 10.238.0.0/16).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from aenv.config import Config  # noqa: E402
from aenv.runtimes.base import SandboxSpec  # noqa: E402
from aenv.runtimes.gvisor import oci_config  # noqa: E402
from bench.run import (  # noqa: E402
    MAIN_NET,
    Floor,
    FloorNet,
    Interrupted,
    Series,
    _describe,
    _sdk_env,
    bench_home,
    interrupt_on_sigterm,
    percentile,
    run,
    runsc_version,
)
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402
from tests.registry import (  # noqa: E402
    BUSYBOX,
    REGISTRY_BIN,
    LocalRegistry,
    PushedImage,
    busybox_layer,
    push_big_image,
    push_busybox,
)

NET_PREFIX = os.environ.get("AENV_BENCH_IMAGES_NET_PREFIX", "aenvi")
SLOT_CIDR = os.environ.get("AENV_BENCH_IMAGES_SLOT_CIDR", "10.238.0.0/16")
NODE_TAG = "bimg"
# The full-pull side's own netns, veth and cgroup parent (apart from bench/run.py's).
FLOOR_NETNS = "aenvifloor"
FLOOR_VETH = "aenvifh"
FLOOR_HOST_IP = "10.239.0.1"
FLOOR_GUEST_IP = "10.239.0.2"
FLOOR_CGROUP = "aenvbenchimages"
PULL_TIMEOUT_S = 900.0
MiB = 1 << 20
RESULTS = REPO / "bench" / "results"

LAZY_OPS = (
    ("create_to_first_command", 'Sandbox.create(ref) + commands.run("true")'),
    ("create_only", "  of which Sandbox.create"),
    ("again_to_first_command", "same image again (pulled): create + run"),
)
TOC_OPS = (
    ("create_to_first_command", 'Sandbox.create(ref) + commands.run("true")'),
    ("again_to_first_command", "same image again (pulled): create + run"),
)
FULL_OPS = (
    ("pull_unpack_start", "skopeo copy + umoci unpack + runsc run"),
    ("pull_unpack", "  skopeo copy + umoci unpack"),
    ("skopeo_copy", "    skopeo copy"),
    ("umoci_unpack", "    umoci unpack"),
    ("runsc_start", "  runsc run (true)"),
)


@dataclass
class Sample:
    """What one lazy start cost the node, from its /metrics and GET /images."""

    fs_read_bytes: float
    registry_bytes: float
    content_bytes: int
    new_blob_bytes: int  # the image's layers but its base (busybox, converted at warm-up)


@dataclass
class Throughput:
    """Per-file MB/s of one way of reading one set of files."""

    mbps: list[float] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def add(self, size: int, seconds: float) -> None:
        self.mbps.append(size / MiB / seconds)
        self.bytes += size
        self.seconds += seconds

    @property
    def aggregate(self) -> float:
        return self.bytes / MiB / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": len(self.mbps), "mib_per_s": self.mbps}
        if self.mbps:
            out |= {
                "p50": percentile(self.mbps, 50),
                "p5": percentile(self.mbps, 5),
                "p95": percentile(self.mbps, 95),
                "aggregate": self.aggregate,
            }
        if self.error:
            out["error"] = self.error
        return out


# -- the full pull: skopeo + umoci + runsc ------------------------------------------


class PullFloor(Floor):
    """bench/run.py's floor with this benchmark's own netns and cgroup parent."""

    def bundle(
        self, cid: str, argv: tuple[str, ...], rootfs: Path, net: FloorNet = MAIN_NET
    ) -> Path:
        """As the base's, always in this benchmark's own netns (`net` is not used)."""
        bundle_dir = self.workdir / "bundles" / cid
        bundle_dir.mkdir(parents=True)
        spec = SandboxSpec(
            sandbox_id=cid,
            rootfs=rootfs,
            bundle=self.home / "bundle",
            netns_path=Path("/run/netns") / FLOOR_NETNS,
            cpu_count=2,
            memory_mb=512,
            hostname="sandbox",
            workdir=bundle_dir,
            log_path=bundle_dir / "console.log",
            init_argv=argv,
        )
        config = oci_config(spec, cgroups_path=f"/{FLOOR_CGROUP}/{cid}")
        (bundle_dir / "config.json").write_text(json.dumps(config, indent=1))
        return bundle_dir

    @staticmethod
    def reset_guest_address(net: FloorNet = MAIN_NET) -> None:
        run(["ip", "-n", FLOOR_NETNS, "addr", "replace", f"{FLOOR_GUEST_IP}/30", "dev", "eth0"])
        run(["ip", "-n", FLOOR_NETNS, "route", "replace", "default", "via", FLOOR_HOST_IP])

    def cleanup(self) -> None:
        for cid in sorted(self.containers):
            with contextlib.suppress(Exception):
                self.delete(cid)
        for ctl in Path("/sys/fs/cgroup").iterdir():
            parent = ctl / FLOOR_CGROUP
            if parent.is_dir():
                for child in sorted(parent.rglob("*"), reverse=True):
                    if child.is_dir():
                        with contextlib.suppress(OSError):
                            child.rmdir()
                with contextlib.suppress(OSError):
                    parent.rmdir()


@contextlib.contextmanager
def floor_network() -> Iterator[None]:
    """A netns holding one end of a veth, as an aenv network slot has; removed afterwards."""
    remove_floor_network()
    try:
        run(["ip", "netns", "add", FLOOR_NETNS])
        run(["ip", "link", "add", FLOOR_VETH, "type", "veth", "peer", "name", "eth0",
             "netns", FLOOR_NETNS])  # fmt: skip
        run(["ip", "addr", "add", f"{FLOOR_HOST_IP}/30", "dev", FLOOR_VETH])
        run(["ip", "link", "set", FLOOR_VETH, "up"])
        run(["ip", "-n", FLOOR_NETNS, "link", "set", "lo", "up"])
        run(["ip", "-n", FLOOR_NETNS, "link", "set", "eth0", "up"])
        run(["ip", "-n", FLOOR_NETNS, "addr", "add", f"{FLOOR_GUEST_IP}/30", "dev", "eth0"])
        run(["ip", "-n", FLOOR_NETNS, "route", "add", "default", "via", FLOOR_HOST_IP])
        yield
    finally:
        remove_floor_network()


def remove_floor_network() -> None:
    run(["ip", "link", "del", FLOOR_VETH], check=False, timeout=15)
    run(["ip", "netns", "del", FLOOR_NETNS], check=False, timeout=15)


def full_pull(floor: PullFloor, img: PushedImage, dest: Path, cid: str) -> dict[str, float]:
    """skopeo copy + umoci unpack + runsc run of `img`; seconds of each step.

    The unpacked root filesystem stays at `dest/bundle/rootfs` (read later).
    """
    layout, bundle = dest / "oci", dest / "bundle"
    dest.mkdir(parents=True)
    copy = ["skopeo", "--insecure-policy", "copy", "--quiet", "--src-tls-verify=false",
            "--src-no-creds", f"docker://{img.ref}", f"oci:{layout}:img"]  # fmt: skip
    unpack = ["umoci", "unpack", "--image", f"{layout}:img", str(bundle)]
    floor.reset_guest_address()
    t0 = time.perf_counter()
    run(copy, timeout=PULL_TIMEOUT_S)
    t1 = time.perf_counter()
    run(unpack, timeout=PULL_TIMEOUT_S)
    t2 = time.perf_counter()
    rootfs = bundle / "rootfs"
    (rootfs / "opt" / "aenv").mkdir(parents=True, exist_ok=True)  # the envd bundle's mountpoint
    floor.run_once(cid, rootfs)
    t3 = time.perf_counter()
    floor.delete(cid)
    shutil.rmtree(layout, ignore_errors=True)  # the blobs; the tree stays for reading
    return {"skopeo_copy": t1 - t0, "umoci_unpack": t2 - t1, "runsc_start": t3 - t2}


# -- the lazy path: a node and the e2b SDK ------------------------------------------


def metrics(node: NodeProc) -> dict[str, float]:
    r = httpx.get(f"{node.url}/metrics", headers={"X-API-Key": node.api_key}, timeout=30)
    r.raise_for_status()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(aenv_image_\w+)(?:\{[^}]*\})? (\S+)$", r.text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def image_records(node: NodeProc) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{node.url}/images", headers={"X-API-Key": node.api_key}, timeout=30)
    r.raise_for_status()
    return {rec["image"]: rec for rec in r.json()}


def lazy_start(node: NodeProc, img: PushedImage) -> tuple[float, float, Sample]:
    """Seconds to Sandbox.create and to the first command's return, and what it cost."""
    from e2b import Sandbox

    before = metrics(node)
    sbx = None
    t0 = time.perf_counter()
    try:
        sbx = Sandbox.create(img.ref, timeout=300, request_timeout=PULL_TIMEOUT_S)
        created = time.perf_counter() - t0
        sbx.commands.run("true")
        first = time.perf_counter() - t0
    finally:
        if sbx is not None:
            with contextlib.suppress(Exception):
                sbx.kill()
    after = metrics(node)
    rec = image_records(node).get(img.ref, {})

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    sample = Sample(
        fs_read_bytes=delta("aenv_image_fs_read_bytes_total"),
        registry_bytes=delta("aenv_image_registry_bytes_total"),
        content_bytes=int(rec.get("contentBytes") or 0),
        new_blob_bytes=sum(layer.size for layer in img.layers[1:]),
    )
    return created, first, sample


# -- reading files ----------------------------------------------------------------


def drop_cached(path: Path) -> None:
    """Drop `path`'s pages from the page cache (clean pages only: sync first)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            drop_cached(Path(dirpath) / name)


def timed_read(path: Path, buf: bytearray, *, drop_after: bool) -> tuple[int, float]:
    """Read all of `path` in len(buf) pieces; (bytes, seconds including open)."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        total = 0
        while n := os.readv(fd, [view]):
            total += n
        seconds = time.perf_counter() - t0
        if drop_after:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return total, seconds


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (its threads included) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_reads(
    node: NodeProc, pairs: list[tuple[Path, Path]], out: dict[str, Throughput]
) -> dict[str, dict[str, float]]:
    """Read (FUSE path, local path) pairs in two passes; what the node did in each.

    cold: chunk files and local files dropped from the page cache beforehand;
    warm: both in the page cache, the FUSE file's own pages dropped (after
    each read), so each read goes through the node; in this pass each FUSE
    file is read a second time, from the kernel's page cache the first read
    left (the node mounts with keep_cache), as a second read in a sandbox is.
    Per pass: MiB the node served, CPU seconds it spent, chunk cache hits and
    misses, MiB re-fetched from the registry, load average after.
    """
    buf = bytearray(MiB)
    served: dict[str, dict[str, float]] = {}
    os.sync()
    drop_tree(node.home / "cache")
    for _fuse, local in pairs:
        drop_cached(local)
    for phase in ("cold", "warm"):
        before = metrics(node)
        cpu = cpu_seconds(node.proc.pid)
        for fuse, local in pairs:
            size, secs = timed_read(fuse, buf, drop_after=phase == "cold")
            want = local.stat().st_size
            if size != want:
                raise AssertionError(f"{fuse}: read {size} bytes, the unpacked file has {want}")
            out[f"fuse_{phase}"].add(size, secs)
            if phase == "warm":
                out["fuse_pagecache"].add(*timed_read(fuse, buf, drop_after=True))
            out[f"local_{phase}"].add(*timed_read(local, buf, drop_after=False))
        cpu = cpu_seconds(node.proc.pid) - cpu
        after = metrics(node)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        served[phase] = {
            "node_served_mib": delta.get("aenv_image_fs_read_bytes_total", 0.0) / MiB,
            "node_cpu_s": cpu,
            "cache_hits": delta.get("aenv_image_cache_hits_total", 0.0),
            "cache_misses": delta.get("aenv_image_cache_misses_total", 0.0),
            "registry_mib": delta.get("aenv_image_registry_bytes_total", 0.0) / MiB,
            "loadavg_1m": os.getloadavg()[0],
        }
    return served


# -- the run ----------------------------------------------------------------------


@dataclass
class Results:
    lazy: dict[str, Series] = field(default_factory=lambda: {k: Series() for k, _ in LAZY_OPS})
    full: dict[str, Series] = field(default_factory=lambda: {k: Series() for k, _ in FULL_OPS})
    samples: list[Sample] = field(default_factory=list)
    # TOC format -> its series (TOC_OPS), and what its lazy starts cost
    toc: dict[str, dict[str, Series]] = field(default_factory=dict)
    toc_samples: dict[str, list[Sample]] = field(default_factory=dict)
    reads: dict[str, Throughput] = field(
        default_factory=lambda: {
            key: Throughput()
            for key in ("fuse_cold", "local_cold", "fuse_warm", "local_warm", "fuse_pagecache")
        }
    )
    served: dict[str, dict[str, float]] = field(default_factory=dict)
    build_s: float = 0.0
    load: list[list[float]] = field(default_factory=list)

    def errors(self) -> list[str]:
        out = [f"aenv {k}: {s.error}" for k, s in self.lazy.items() if s.error]
        out += [f"full pull {k}: {s.error}" for k, s in self.full.items() if s.error]
        out += [
            f"aenv {fmt} {k}: {s.error}"
            for fmt, series in self.toc.items()
            for k, s in series.items()
            if s.error
        ]
        out += [f"reads {k}: {t.error}" for k, t in self.reads.items() if t.error]
        return out


def private_home(built: Path, dest: Path) -> Path:
    """A node home of its own whose bundle (and templates, if built) link to `built`."""
    dest.mkdir(parents=True)
    if (built / "templates").is_dir():
        link_home(built, dest)
    else:
        (dest / "bundle").symlink_to(built / "bundle")
        (dest / "templates").mkdir()
    return dest


def build_images(reg: LocalRegistry, args: argparse.Namespace) -> list[PushedImage]:
    tag = "r" + secrets.token_hex(3)
    images = []
    for i in range(args.n):
        t0 = time.perf_counter()
        images.append(
            push_big_image(
                reg,
                f"bench/big{i}",
                tag,
                total_mb=args.total_mb,
                files=args.files,
                layers=3,
                compression=args.compression,
                seed=1000 + i,
                base=[busybox_layer(compression=args.compression)],
            )
        )
        print(f"  image {i + 1}/{args.n} built and pushed in {time.perf_counter() - t0:.1f}s",
              flush=True)  # fmt: skip
    return images


def build_toc_images(reg: LocalRegistry, args: argparse.Namespace) -> dict[str, list[PushedImage]]:
    """The same content as `build_images` (same seeds) in each `--toc` format."""
    out: dict[str, list[PushedImage]] = {}
    for fmt in args.toc:
        tag = "r" + secrets.token_hex(3)
        out[fmt] = []
        for i in range(args.n):
            t0 = time.perf_counter()
            out[fmt].append(
                push_big_image(
                    reg,
                    f"bench/big{i}-{fmt.replace(':', '-')}",
                    tag,
                    total_mb=args.total_mb,
                    files=args.files,
                    layers=3,
                    seed=1000 + i,
                    base=[busybox_layer(compression=args.compression)],
                    toc=fmt,
                )
            )
            print(f"  {fmt} image {i + 1}/{args.n} built and pushed in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)  # fmt: skip
    return out


def bench(args: argparse.Namespace, built: Path, config: Config, workdir: Path) -> Results:
    res = Results()
    for fmt in args.toc:
        res.toc[fmt] = {k: Series() for k, _ in TOC_OPS}
        res.toc_samples[fmt] = []
    res.load.append(list(os.getloadavg()))
    reg = LocalRegistry(workdir / "registry")
    node: NodeProc | None = None
    floor = PullFloor(
        home=built, workdir=workdir / "floor", runsc=config.runsc_binary,
        platform=config.runsc_platform,
    )  # fmt: skip
    try:
        reg.start()
        print(f"building {args.n} images of {args.total_mb} MiB ({args.compression}) ...",
              flush=True)  # fmt: skip
        t0 = time.perf_counter()
        warm = push_busybox(reg, "bench/warmup", "v1", compression=args.compression)
        images = build_images(reg, args)
        toc_images = build_toc_images(reg, args)
        res.build_s = time.perf_counter() - t0

        home = private_home(built, workdir / "home")
        node = start_node(
            home,
            api_key="aenv_bench_" + secrets.token_hex(8),
            log_path=workdir / "node.log",
            extra_env={
                "AENV_NET_PREFIX": NET_PREFIX,
                "AENV_SLOT_CIDR": SLOT_CIDR,
                "AENV_NODE_TAG": NODE_TAG,
                "AENV_REGISTRY_TIMEOUT": "60",
            },
        )
        tag = secrets.token_hex(3)
        with _sdk_env(node), floor_network():
            print("warm-up (busybox image, not counted) ...", flush=True)
            lazy_start(node, warm)
            full_pull(floor, warm, workdir / "pulls" / "warmup", f"aenvbi-{tag}-w")
            rootfs: list[Path | None] = []
            for i, img in enumerate(images):
                print(f"sample {i + 1}/{len(images)}: {img.ref}", flush=True)
                rootfs.append(None)
                sides = ["lazy", "full", *args.toc]
                for side in sides[i % len(sides) :] + sides[: i % len(sides)]:
                    if side == "lazy":
                        _sample_lazy(node, img, res)
                    elif side in toc_images:
                        _sample_toc(node, toc_images[side][i], side, res)
                    else:
                        dest = workdir / "pulls" / str(i)
                        if _sample_full(floor, img, dest, f"aenvbi-{tag}-{i}", res):
                            rootfs[i] = dest / "bundle" / "rootfs"
            print("reading files through FUSE and from the unpacked trees ...", flush=True)
            try:
                pairs = _read_pairs(node, images, rootfs)
                res.served = bench_reads(node, pairs, res.reads)
            except Exception as e:
                for t in res.reads.values():
                    t.error = t.error or _describe(e)
    finally:
        floor.cleanup()
        if node is not None:
            _stop(node, res)
        reg.cleanup()
        res.load.append(list(os.getloadavg()))
    return res


def _sample_lazy(node: NodeProc, img: PushedImage, res: Results) -> None:
    series = res.lazy["create_to_first_command"]
    if series.error:
        return
    try:
        created, first, sample = lazy_start(node, img)
    except Exception as e:
        series.error = _describe(e)
        return
    series.samples.append(first * 1000)
    res.lazy["create_only"].samples.append(created * 1000)
    res.samples.append(sample)
    print(f"  aenv lazy   {first:6.2f}s (create {created:.2f}s); registry "
          f"{sample.registry_bytes / MiB:.0f} MiB, FUSE read {sample.fs_read_bytes / MiB:.2f} MiB",
          flush=True)  # fmt: skip
    # the same image once more: what a sandbox of an image already pulled costs
    again = res.lazy["again_to_first_command"]
    if again.error:
        return
    try:
        _created, first, _sample = lazy_start(node, img)
    except Exception as e:
        again.error = _describe(e)
        return
    again.samples.append(first * 1000)
    print(f"  aenv again  {first:6.2f}s (image already pulled)", flush=True)


def _sample_toc(node: NodeProc, img: PushedImage, fmt: str, res: Results) -> None:
    series = res.toc[fmt]
    first_s, again_s = series["create_to_first_command"], series["again_to_first_command"]
    if first_s.error:
        return
    try:
        created, first, sample = lazy_start(node, img)
    except Exception as e:
        first_s.error = _describe(e)
        return
    first_s.samples.append(first * 1000)
    res.toc_samples[fmt].append(sample)
    print(f"  aenv {fmt:<12} {first:6.2f}s (create {created:.2f}s); registry "
          f"{sample.registry_bytes / MiB:.1f} MiB, FUSE read {sample.fs_read_bytes / MiB:.2f} MiB",
          flush=True)  # fmt: skip
    if again_s.error:
        return
    try:
        _created, first, _sample = lazy_start(node, img)
    except Exception as e:
        again_s.error = _describe(e)
        return
    again_s.samples.append(first * 1000)


def _sample_full(floor: PullFloor, img: PushedImage, dest: Path, cid: str, res: Results) -> bool:
    total = res.full["pull_unpack_start"]
    if total.error:
        return False
    try:
        steps = full_pull(floor, img, dest, cid)
    except Exception as e:
        total.error = _describe(e)
        return False
    for key, secs in steps.items():
        res.full[key].samples.append(secs * 1000)
    pull = steps["skopeo_copy"] + steps["umoci_unpack"]
    res.full["pull_unpack"].samples.append(pull * 1000)
    total.samples.append((pull + steps["runsc_start"]) * 1000)
    print(f"  full pull   {pull + steps['runsc_start']:6.2f}s (copy {steps['skopeo_copy']:.2f}s, "
          f"unpack {steps['umoci_unpack']:.2f}s, runsc {steps['runsc_start']:.2f}s)",
          flush=True)  # fmt: skip
    return True


def _read_pairs(
    node: NodeProc, images: list[PushedImage], rootfs: list[Path | None]
) -> list[tuple[Path, Path]]:
    records = image_records(node)
    pairs = []
    for img, local in zip(images, rootfs, strict=True):
        rec = records.get(img.ref)
        if rec is None or local is None:
            continue  # that sample failed on one side
        tree = node.home / "run" / "images" / rec["digest"].removeprefix("sha256:")
        pairs += [(tree / rel, local / rel) for rel in sorted(img.contents)]
    if not pairs:
        raise RuntimeError("no image was both pulled by the node and unpacked by umoci")
    return pairs


def _stop(node: NodeProc, res: Results) -> None:
    code = stop_node(node)
    left = leaks(node.home, prefix=NET_PREFIX)
    if code != 0 or left or res.errors():
        print(f"--- node log (exit {code}) ---\n{node.log_tail(40)}", file=sys.stderr)
    if left:
        print(f"node left behind: {left}", file=sys.stderr)
        for line in left:
            if line.startswith("mount "):
                mountpoint = line.split()[2]
                run(["umount", "-l", mountpoint], check=False, timeout=30)


# -- report -----------------------------------------------------------------------


def _secs(series: Series, q: int) -> str:
    if not series.samples:
        return "error" if series.error else "-"
    return f"{percentile(series.samples, q) / 1000:.2f}"


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def ratios(res: Results) -> dict[str, float]:
    """Full pull over lazy start: of the p50s, and the median of per-image ratios."""
    lazy = res.lazy["create_to_first_command"].samples
    out: dict[str, float] = {}
    for key in ("pull_unpack_start", "pull_unpack"):
        full = res.full[key].samples
        if lazy and full:
            out[f"{key}_p50"] = percentile(full, 50) / percentile(lazy, 50)
            paired = [f / a for f, a in zip(full, lazy, strict=False)]
            out[f"{key}_paired_median"] = statistics.median(paired)
    full = res.full["pull_unpack_start"].samples
    for fmt, series in res.toc.items():
        toc = series["create_to_first_command"].samples
        if toc and full:
            out[f"{fmt}_full_p50"] = percentile(full, 50) / percentile(toc, 50)
            out[f"{fmt}_full_p95"] = percentile(full, 95) / percentile(toc, 95)
            paired = [f / a for f, a in zip(full, toc, strict=False)]
            out[f"{fmt}_full_paired_median"] = statistics.median(paired)
        if toc and lazy:
            out[f"{fmt}_gzip_p50"] = percentile(lazy, 50) / percentile(toc, 50)
    return out


def _bytes_lines(samples: list[Sample]) -> list[str]:
    """Medians of what the lazy starts read through FUSE and downloaded."""
    read = statistics.median(s.fs_read_bytes for s in samples)
    content = statistics.median(s.content_bytes for s in samples)
    got = statistics.median(s.registry_bytes for s in samples)
    new = statistics.median(s.new_blob_bytes for s in samples)
    lines = [f"lazy (medians): read through FUSE {read / MiB:.2f} MiB"]
    if content:
        lines[0] += (
            f" = {100 * read / content:.2f} % of the image content ({content / MiB:.0f} MiB)"
        )
    line = f"  downloaded from the registry {got / MiB:.0f} MiB"
    if new:
        line += f" = {100 * got / new:.0f} % of the blobs new to the node ({new / MiB:.0f} MiB)"
    return [*lines, line]


def report(res: Results, args: argparse.Namespace) -> str:
    lines = [
        f"time to first command, never-seen image: busybox + {args.total_mb} MiB in "
        f"{args.files} files over 3 {args.compression} layers (seconds)",
        "",
    ]
    rows: list[tuple[str, ...]] = [("", "n", "p50", "p95")]
    rows.append(("aenv (lazy)", "", "", ""))
    for key, label in LAZY_OPS:
        s = res.lazy[key]
        rows.append((label, str(len(s.samples)), _secs(s, 50), _secs(s, 95)))
    for fmt, series in res.toc.items():
        rows.append((f"aenv, the same content as {fmt} layers", "", "", ""))
        for key, label in TOC_OPS:
            s = series[key]
            rows.append((label, str(len(s.samples)), _secs(s, 50), _secs(s, 95)))
    rows.append(("full pull (skopeo + umoci + runsc)", "", "", ""))
    for key, label in FULL_OPS:
        s = res.full[key]
        rows.append((label, str(len(s.samples)), _secs(s, 50), _secs(s, 95)))
    lines += _grid(rows)
    r = ratios(res)
    if r:
        lines += [
            "",
            f"full pull + start / lazy: {r['pull_unpack_start_p50']:.1f}x of p50s "
            f"(per-image median {r['pull_unpack_start_paired_median']:.1f}x); goal >= 5x",
            f"full pull alone / lazy:   {r['pull_unpack_p50']:.1f}x of p50s "
            f"(per-image median {r['pull_unpack_paired_median']:.1f}x)",
        ]
    for fmt in res.toc:
        if f"{fmt}_full_p50" in r:
            lines.append(
                f"full pull + start / aenv {fmt}: {r[f'{fmt}_full_p50']:.1f}x of p50s, "
                f"{r[f'{fmt}_full_p95']:.1f}x of p95s (per-image median "
                f"{r[f'{fmt}_full_paired_median']:.1f}x); goal >= 5x"
            )
        if f"{fmt}_gzip_p50" in r:
            lines.append(f"aenv gzip / aenv {fmt}: {r[f'{fmt}_gzip_p50']:.1f}x of p50s")
    if res.samples:
        lines += ["", *_bytes_lines(res.samples)]
    for fmt, samples in res.toc_samples.items():
        if samples:
            lines += [f"{fmt}:", *_bytes_lines(samples)]
    lines += ["", "read throughput, per file (MiB/s; p5 is the slow tail)", ""]
    rows = [("", "files", "p50", "p5", "p95", "aggregate")]
    for key, label in (
        ("fuse_cold", "FUSE, chunk files not in page cache"),
        ("local_cold", "unpacked dir, not in page cache"),
        ("fuse_warm", "FUSE, chunk files in page cache"),
        ("local_warm", "unpacked dir, in page cache"),
        ("fuse_pagecache", "FUSE re-read, kernel page cache (keep_cache)"),
    ):
        t = res.reads[key]
        if t.mbps:
            cells = [f"{percentile(t.mbps, q):.0f}" for q in (50, 5, 95)]
            rows.append((label, str(len(t.mbps)), *cells, f"{t.aggregate:.0f}"))
        else:
            rows.append((label, "0", "error" if t.error else "-", "", "", ""))
    lines += _grid(rows)
    for phase in ("cold", "warm"):
        f, loc = res.reads[f"fuse_{phase}"], res.reads[f"local_{phase}"]
        if f.mbps and loc.mbps:
            lines.append(
                f"{phase}: FUSE / local = {100 * f.aggregate / loc.aggregate:.0f} % aggregate, "
                f"{100 * percentile(f.mbps, 50) / percentile(loc.mbps, 50):.0f} % of p50s"
                + ("  (goal >= 50 %)" if phase == "warm" else "")
            )
    for phase, v in res.served.items():
        lines.append(
            f"{phase}: the node served {v['node_served_mib']:.0f} MiB through FUSE using "
            f"{v['node_cpu_s']:.1f} CPU s ({v['cache_hits']:.0f} chunk hits, "
            f"{v['cache_misses']:.0f} misses, {v['registry_mib']:.0f} MiB re-fetched); "
            f"load average after {v['loadavg_1m']:.2f}"
        )
    lines.append(
        f"load average at start {res.load[0][0]:.2f}, at end {res.load[-1][0]:.2f} "
        f"({os.cpu_count()} CPUs)"
    )
    return "\n".join(lines + res.errors())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3, help="images, one sample each (default 3)")
    p.add_argument("--home", type=Path, help="home with the envd bundle "
                   "(default $AENV_TEST_HOME, else .state/test-home)")  # fmt: skip
    p.add_argument("--total-mb", type=int, default=320, help="MiB per image (default 320)")
    p.add_argument("--files", type=int, default=30, help="big files per image (default 30)")
    p.add_argument("--compression", choices=("gzip", "zstd", "none"), default="gzip",
                   help="layer compression (default gzip; umoci 0.4 cannot unpack zstd)")  # fmt: skip
    p.add_argument("--toc", default="estargz,zstd:chunked",
                   help="TOC-indexed formats to time too, comma-separated ('' for none)")  # fmt: skip
    args = p.parse_args(argv)
    args.toc = [f for f in args.toc.split(",") if f]
    if any(f not in ("estargz", "zstd:chunked") for f in args.toc):
        p.error("--toc takes estargz and zstd:chunked")
    if not 1 <= args.n <= 50:
        p.error("--n must be in 1..50")
    if not 1 <= args.total_mb <= 8192 or args.files < 3:
        p.error("--total-mb must be in 1..8192 and --files at least 3")
    home = bench_home(p, args.home, needs=("bundle",), why="runsc, network namespaces, FUSE")
    config = Config.from_env()
    for tool in (config.runsc_binary, "skopeo", "umoci", REGISTRY_BIN, str(BUSYBOX)):
        if shutil.which(tool) is None:
            p.error(f"{tool} not found")
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-images-"))
    try:
        res = bench(args, home, config, workdir)
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(report(res, args))
    doc = {
        "started": started.isoformat(),
        "n": args.n,
        "image": {
            "total_mib": args.total_mb,
            "files": args.files,
            "layers": 3,
            "compression": args.compression,
            "base": "busybox",
        },
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "loadavg_start": res.load[0],
            "loadavg_end": res.load[-1],
            "runsc": runsc_version(config.runsc_binary),
            "runsc_platform": config.runsc_platform,
        },
        "build_s": res.build_s,
        "lazy": {k: s.to_json() for k, s in res.lazy.items()},
        "lazy_bytes": [vars(s) for s in res.samples],
        "full": {k: s.to_json() for k, s in res.full.items()},
        "toc": {
            fmt: {k: s.to_json() for k, s in series.items()} for fmt, series in res.toc.items()
        },
        "toc_bytes": {fmt: [vars(s) for s in v] for fmt, v in res.toc_samples.items()},
        "ratios": ratios(res),
        "reads": {k: t.to_json() for k, t in res.reads.items()},
        "read_passes": res.served,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"images-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")
    return 1 if res.errors() else 0


if __name__ == "__main__":
    sys.exit(main())
