"""Catalog scale: lookups of images, templates and snapshots with a million records.

Two homes are built side by side in one run: **baseline** (`--baseline`,
1,000 records of each kind) and **large** (`--images` image records,
1,000,000 by default, `--templates` templates and `--snapshots` snapshots,
100,000 each). Records are generated directly (SQL into the image catalog
and the metadata store, `template.json` files written as the template store
writes them), never through pulls. Every image has its own two layers over
one of 100 shared base layers (10,000 images per base in the large home);
every template is an image's own (`img-` and its key, as a create from an
image reference makes it) with an alias, and has its warm snapshot
(`~template/ID@BUILD`); the user snapshots have names.

Measured with the real stores (`ImageStore`, `TemplateStore`, `Snapshots`
over `Metadata`), p50/p95 of `--samples` random lookups each, large next to
baseline (the ratio is ~1 when a lookup is O(1) or O(log n)):

- image by reference, by digest, by key, and a shared base layer's source;
- template by alias and by ID;
- snapshot by ID and by name (through the node's serial SQLite thread);
- the create path from an image reference, as `Node.resolve_template` and
  the warm-snapshot lookup run it: the name is not a template, the image is
  found (`pull(missing_only=True)`), its `img-` template resolved, its warm
  snapshot looked up; and the same from a template name.

Then the stores' open time and the start-time work of a node over each home
(alias index build on the first open, layer GC's and upload resume's reads of
the snapshots), with peak RSS, each in a fresh process; and, for contrast, the
lookup as it was before the catalog (read every JSON record) at 1,000 and
10,000 records, with the one-time import of those files. With `--node`
(root, runsc and a built `$AENV_TEST_HOME`), a real `aenv serve` on each home:
time to /health, RSS, and `GET /templates/aliases/<alias>` p50/p95.

    .venv/bin/python bench/catalog.py [--images 1000000] [--templates 100000]
        [--snapshots 100000] [--baseline 1000] [--samples 2000] [--node] [--keep]

Results go to bench/results/catalog-<timestamp>.json. The homes (about 2 GB
for the defaults) are removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.images.cache import ChunkCache  # noqa: E402
from aenv.images.catalog import ImageCatalog  # noqa: E402
from aenv.images.registry import RegistryConfig, open_registry_client  # noqa: E402
from aenv.images.store import CATALOG_FILE, ImageConfigView, ImageRecord, ImageStore  # noqa: E402
from aenv.node.snapshots import Snapshots, snapshot_name  # noqa: E402
from aenv.proto.ids import InvalidName  # noqa: E402
from aenv.storage.metadata import Metadata, MetadataStore  # noqa: E402
from aenv.storage.templates import Template, TemplateNotFound, TemplateStore  # noqa: E402

RESULTS = REPO / "bench" / "results"
NET_PREFIX = "aenvg"
SLOT_CIDR = "10.236.0.0/16"
BASES = 100  # shared base layers
T0 = 1.7e9
BATCH = 50_000


# -- generated records ---------------------------------------------------------------


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def image_key(n: int) -> str:
    return _sha(f"image {n}")


def image_ref(n: int) -> str:
    return f"registry.example/team{n % 1000}/app{n}:v1"


def base_layer(n: int) -> str:
    return "sha256:" + _sha(f"base {n % BASES}")


def image_record(n: int) -> ImageRecord:
    key = image_key(n)
    ref = image_ref(n)
    return ImageRecord(
        key=key,
        reference=ref,
        registry="registry.example",
        repository=f"team{n % 1000}/app{n}",
        manifest_digest="sha256:" + key,
        platform="linux/amd64",
        config=ImageConfigView(
            env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", f"APP={n}"),
            workdir="/app",
            entrypoint=("/usr/bin/app",),
            cmd=("--serve",),
        ),
        layers=(base_layer(n), "sha256:" + _sha(f"layer {n} a"), "sha256:" + _sha(f"layer {n} b")),
        compressed_bytes=50_000_000 + n,
        content_bytes=150_000_000 + n,
        pulled_at=T0 + n,
    )


def template_of(n: int, templates_root: Path) -> Template:
    key = image_key(n)
    return Template(
        template_id=f"img-{key[:20]}",
        build_id=_sha(f"build {n}")[:32],
        aliases=(f"app-{n}",),
        rootfs=templates_root / "unused",
        cpu_count=2,
        memory_mb=512,
        disk_size_mb=150,
        created_at=T0 + n,
        updated_at=T0 + n,
        image_key=key,
        image_ref=image_ref(n),
        env=("APP=1",),
        workdir="/app",
    )


def snapshot_id(n: int) -> str:
    return "snap-" + _sha(f"snapshot {n}")[:16]


def _bulk(path: Path) -> sqlite3.Connection:
    """A connection for building a database in one go: no journal, no syncs, a page
    cache that holds it all (the stores reopen it in WAL mode afterwards)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("PRAGMA journal_mode=OFF")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-3000000")  # KiB
    return db


def _done(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.close()


def build_home(home: Path, *, images: int, templates: int, snapshots: int) -> dict[str, float]:
    """A home with these many records, written directly; returns seconds per part."""
    took: dict[str, float] = {}
    t = time.perf_counter()
    catalog_path = home / "images" / CATALOG_FILE
    ImageCatalog(catalog_path).close()  # its schema
    db = _bulk(catalog_path)
    db.execute("BEGIN")
    for start in range(0, images, BATCH):
        rows, refs, layers = [], [], []
        for n in range(start, min(images, start + BATCH)):
            r = image_record(n)
            doc = {k: v for k, v in r.to_json().items() if k != "references"}
            rows.append((r.key, r.manifest_digest, r.pulled_at, json.dumps(doc, sort_keys=True)))
            refs.append((r.reference, r.key))
            if n % 10 == 0:
                refs.append((f"registry.example/team{n % 1000}/app{n}:stable", r.key))
            layers += [(layer, r.pulled_at, r.key) for layer in r.layers]
        db.executemany("INSERT INTO images VALUES (?, ?, ?, ?)", rows)
        db.executemany("INSERT INTO image_refs VALUES (?, ?)", refs)
        db.executemany("INSERT INTO image_layers VALUES (?, ?, ?)", layers)
    db.execute("COMMIT")
    _done(db)
    took["images_s"] = time.perf_counter() - t

    t = time.perf_counter()
    root = home / "templates"
    root.mkdir(parents=True, exist_ok=True)
    for n in range(templates):
        tpl = template_of(n, root)
        d = root / tpl.template_id
        d.mkdir()
        (d / "template.json").write_text(json.dumps(tpl.to_json(), indent=2, sort_keys=True))
    took["templates_s"] = time.perf_counter() - t

    t = time.perf_counter()
    MetadataStore(home / "aenv.db").close()  # its schema
    db = _bulk(home / "aenv.db")
    db.execute("BEGIN")
    sql = (
        "INSERT INTO snapshots(id, name, created_at, doc, template_id, source) "
        "VALUES (?, ?, ?, ?, ?, ?)"
    )
    total = templates + snapshots
    for start in range(0, total, BATCH):
        rows = []
        for n in range(start, min(total, start + BATCH)):
            own = n < templates  # a template's warm snapshot, then the users'
            tpl = template_of(n if own else n % max(templates, 1), root)
            name = snapshot_name(tpl) if own else f"snap-name-{n - templates}"
            doc = {
                "snapshotID": snapshot_id(n),
                "name": name,
                "names": [name],
                "sourceSandboxID": f"sb{n:08d}",
                "templateID": tpl.template_id,
                "layers": [f"l{n:08d}"],
                "memory": True,
                "cpuCount": 2,
                "memoryMB": 512,
                "createdAt": T0 + n,
                "image": None,
                "checksums": {"pages.img": _sha(f"pages {n}")},
                "storage": "local",
            }
            rows.append(
                (
                    doc["snapshotID"],
                    name,
                    T0 + n,
                    json.dumps(doc, sort_keys=True),
                    tpl.template_id,
                    doc["sourceSandboxID"],
                )
            )
        db.executemany(sql, rows)
    db.execute("COMMIT")
    _done(db)
    took["snapshots_s"] = time.perf_counter() - t
    return {k: round(v, 1) for k, v in took.items()}


# -- measuring -----------------------------------------------------------------------


def stats(ns: list[int]) -> dict[str, float]:
    us = sorted(x / 1000 for x in ns)
    qs = statistics.quantiles(us, n=100, method="inclusive")
    return {"n": len(us), "p50_us": round(qs[49], 1), "p95_us": round(qs[94], 1)}


@dataclass
class Home:
    path: Path
    images: int
    templates: int
    snapshots: int


async def _open_stores(
    home: Path, nursery: trio.Nursery
) -> tuple[ImageStore, TemplateStore, Snapshots]:
    registry = await nursery.start(_registry)

    async def fetch(chunk: object, layer: str) -> bytes:
        raise AssertionError("no chunk is read")

    cache = ChunkCache(root=home / "cache" / "chunks", max_bytes=1 << 30, fetch=fetch)
    images = ImageStore(root=home / "images", cache=cache, registry=registry)
    templates = TemplateStore(home / "templates", image_root=home / "run" / "images")
    snapshots = Snapshots(home / "snapshots", Metadata(MetadataStore(home / "aenv.db")))
    return images, templates, snapshots


async def _registry(*, task_status: trio.TaskStatus[Any]) -> None:
    async with open_registry_client(config=RegistryConfig()) as registry:
        task_status.started(registry)
        await trio.sleep_forever()


async def measure_lookups(homes: dict[str, Home], samples: int, seed: int) -> dict[str, Any]:
    """p50/p95 of each lookup over `samples` random records of each home; the
    homes' samples alternate, so both see the same load of the machine."""
    times: dict[str, dict[str, list[int]]] = {label: {} for label in homes}
    async with trio.open_nursery() as nursery:
        opened = {label: await _open_stores(h.path, nursery) for label, h in homes.items()}
        rng = random.Random(seed)

        async def run(
            name: str, size: Callable[[Home], int], fn: Any, *, samples: int = samples
        ) -> None:
            for _ in range(samples):
                for label, home in homes.items():
                    images, templates, snapshots = opened[label]
                    n = rng.randrange(size(home))
                    t = time.perf_counter_ns()
                    found = fn(images, templates, snapshots, n)
                    if isinstance(found, Awaitable):
                        found = await found
                    times[label].setdefault(name, []).append(time.perf_counter_ns() - t)
                    assert found is not None, (name, label, n)

        async def create_from_image(
            images: ImageStore, templates: TemplateStore, snapshots: Snapshots, n: int
        ) -> object:
            # Node.resolve_template for an image reference, then Warmer.snapshot
            ref = image_ref(n)
            try:
                await trio.to_thread.run_sync(templates.resolve, ref)
                raise AssertionError("an image reference is not a template name")
            except (TemplateNotFound, InvalidName):
                pass
            record = await images.pull(ref, missing_only=True)
            template = await trio.to_thread.run_sync(templates.resolve, f"img-{record.key[:20]}")
            return await snapshots.resolve(snapshot_name(template))

        async def create_from_name(
            images: ImageStore, templates: TemplateStore, snapshots: Snapshots, n: int
        ) -> object:
            template = await trio.to_thread.run_sync(templates.resolve, f"app-{n}")
            return await snapshots.resolve(snapshot_name(template))

        def n_images(h: Home) -> int:
            return h.images

        def n_templates(h: Home) -> int:
            return h.templates

        await run("image: find by reference", n_images, lambda i, t, s, n: i.find(image_ref(n)))
        await run(
            "image: find by digest",
            n_images,
            lambda i, t, s, n: i.find(f"registry.example/any@sha256:{image_key(n)}"),
        )
        await run("image: record by key", n_images, lambda i, t, s, n: i.record(image_key(n)))
        await run(
            "image: source of a shared base layer",
            lambda h: BASES,
            lambda i, t, s, n: i._source(base_layer(n)),
        )
        await run(
            "template: resolve by alias", n_templates, lambda i, t, s, n: t.resolve(f"app-{n}")
        )
        await run(
            "template: resolve by ID",
            n_templates,
            lambda i, t, s, n: t.resolve(f"img-{image_key(n)[:20]}"),
        )
        await run(
            "snapshot: get by ID",
            lambda h: h.templates + h.snapshots,
            lambda i, t, s, n: s.resolve(snapshot_id(n)),
        )
        await run(
            "snapshot: latest by name",
            lambda h: h.snapshots,
            lambda i, t, s, n: s.resolve(f"snap-name-{n}"),
        )
        await run(
            "create path: image reference -> template -> warm snapshot",
            n_templates,
            create_from_image,
        )
        await run("create path: template name -> warm snapshot", n_templates, create_from_name)

        async def load_names(
            images: ImageStore, templates: TemplateStore, snapshots: Snapshots, n: int
        ) -> object:
            # what a cluster node measures every 3 s for gossip (aenv.cluster.measure_load)
            names = await trio.to_thread.run_sync(templates.names, 100)
            return names + await snapshots.names(100)

        await run(
            "cluster load: first 100 template and snapshot names (every 3 s, nothing changed)",
            lambda h: 1,
            load_names,
            samples=max(1, samples // 100),
        )
        nursery.cancel_scope.cancel()
    return {label: {name: stats(ns) for name, ns in t.items()} for label, t in times.items()}


STARTUP_CODE = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
t0 = time.perf_counter()
from aenv.images.catalog import ImageCatalog
from aenv.storage.metadata import MetadataStore
from aenv.storage.templates import TemplateStore
home = Path(sys.argv[1])
imported = time.perf_counter()
def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return {l.split(":")[0]: round(int(l.split()[1]) / 1024, 1) for l in status if l.startswith(("VmRSS", "VmHWM"))}
rss0 = rss()["VmRSS"]
t = time.perf_counter(); catalog = ImageCatalog(home / "images" / "catalog.db"); catalog.import_legacy(home / "images" / "records")
out = {"open image catalog": time.perf_counter() - t}
t = time.perf_counter(); templates = TemplateStore(home / "templates", image_root=home / "run" / "images")
out["open template store (alias index)"] = time.perf_counter() - t
t = time.perf_counter(); meta = MetadataStore(home / "aenv.db")
out["open metadata store"] = time.perf_counter() - t
t = time.perf_counter(); layers = meta.snapshot_layer_ids()
out["layer GC: every snapshot's layers (in SQLite)"] = time.perf_counter() - t
t = time.perf_counter(); pending = meta.snapshots_uploading()
out["upload resume: unfinished uploads (partial index)"] = time.perf_counter() - t
t = time.perf_counter(); shares = templates.share_pending()
out["template share resume (unfinished shares only)"] = time.perf_counter() - t
del layers, pending, shares
now = rss()
t = time.perf_counter(); every = meta.list_snapshots()
out["for contrast: every snapshot record parsed"] = time.perf_counter() - t
out = {k: round(v, 3) for k, v in out.items()}
out["RSS MiB after imports"] = rss0
out["RSS MiB with the stores open"] = now["VmRSS"]
out["peak RSS MiB before the contrast"] = now["VmHWM"]
out["peak RSS MiB with every snapshot parsed"] = rss()["VmHWM"]
print(json.dumps(out))
"""


def measure_startup(home: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", STARTUP_CODE, str(home), str(REPO)],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def old_find(records_dir: Path, ref: str) -> ImageRecord | None:
    """`ImageStore.find` as it was before the catalog: every record read and sorted."""
    found = [ImageRecord.from_json(json.loads(p.read_bytes())) for p in records_dir.glob("*.json")]
    for record in sorted(found, key=lambda rec: rec.pulled_at, reverse=True):
        if ref in (record.references or (record.reference,)):
            return record
    return None


def legacy_contrast(work: Path, counts: tuple[int, ...], samples: int) -> dict[str, Any]:
    """The lookup before the catalog (every JSON record read, sorted, searched)
    and the one-time import of those files into the catalog."""
    out: dict[str, Any] = {}
    for count in counts:
        home = work / f"legacy-{count}"
        records_dir = home / "images" / "records"
        records_dir.mkdir(parents=True)
        for n in range(count):
            r = image_record(n)
            (records_dir / f"{r.key}.json").write_text(json.dumps(r.to_json(), indent=1))

        times = []
        for n in random.Random(count).sample(range(count), samples):
            t = time.perf_counter_ns()
            assert old_find(records_dir, image_ref(n)) is not None
            times.append(time.perf_counter_ns() - t)
        out[f"before the catalog: find by reference, {count} JSON records"] = stats(times)
        t = time.perf_counter()
        catalog = ImageCatalog(home / "images" / CATALOG_FILE)
        catalog.import_legacy(records_dir)
        catalog.close()
        out[f"one-time import of {count} JSON records (s)"] = round(time.perf_counter() - t, 2)
        shutil.rmtree(home)
    return out


def measure_nodes(homes: dict[str, Home], built: Path, samples: int) -> dict[str, Any]:
    """A real `aenv serve` on each home: time to /health (first start, which builds the
    alias index, and a second), RSS, and alias lookups through the API."""
    import httpx

    from tests.conftest import start_node, stop_node

    out: dict[str, Any] = {}
    key = "k" + secrets.token_hex(8)
    env = {
        "AENV_NET_PREFIX": NET_PREFIX,
        "AENV_SLOT_CIDR": SLOT_CIDR,
        "AENV_POOL_SIZE": "0",
        "AENV_WARM_TEMPLATES": "0",
        "AENV_HIBERNATE_MEMORY_LOW": "0",
    }
    for label, home in homes.items():
        for name in ("bundle",):
            if not (home.path / name).exists():
                (home.path / name).symlink_to(built / name)
        for tpl in (built / "templates").iterdir():  # the default templates, hard-linked
            if not tpl.name.startswith(".") and not (home.path / "templates" / tpl.name).exists():
                subprocess.run(
                    ["cp", "-al", str(tpl), str(home.path / "templates" / tpl.name)], check=True
                )
        (home.path / "templates" / ".aliases" / ".complete").unlink(missing_ok=True)
        row: dict[str, Any] = {}
        for start in ("first start", "second start"):
            t = time.perf_counter()
            node = start_node(
                home.path, api_key=key, log_path=home.path / "node.log", extra_env=env
            )
            row[f"{start}: to /health (s)"] = round(time.perf_counter() - t, 2)
            try:
                status = Path(f"/proc/{node.proc.pid}/status").read_text()
                rss = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
                row[f"{start}: RSS MiB"] = round(int(rss.split()[1]) / 1024, 1)
                if start == "second start":
                    rng = random.Random(7)
                    times = []
                    with httpx.Client(base_url=node.url, headers={"X-API-Key": key}) as c:
                        for n in [rng.randrange(home.templates) for _ in range(samples)]:
                            t = time.perf_counter_ns()
                            r = c.get(f"/templates/aliases/app-{n}")
                            times.append(time.perf_counter_ns() - t)
                            r.raise_for_status()
                    row["GET /templates/aliases/<alias>"] = stats(times)
            finally:
                stop_node(node)
        out[label] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1_000_000)
    ap.add_argument("--templates", type=int, default=100_000)
    ap.add_argument("--snapshots", type=int, default=100_000)
    ap.add_argument("--baseline", type=int, default=1_000)
    ap.add_argument("--samples", type=int, default=2_000)
    ap.add_argument("--node", action="store_true", help="also start real nodes (root, runsc)")
    ap.add_argument("--keep", action="store_true", help="keep the generated homes")
    ap.add_argument("--work", type=Path, default=None, help="where to build the homes")
    args = ap.parse_args()
    if args.templates > args.images or args.baseline < 1:
        ap.error("every template is an image's own: --templates must not exceed --images")
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-catalog-", dir=args.work))
    homes = {
        "baseline": Home(work / "baseline", args.baseline, args.baseline, args.baseline),
        "large": Home(work / "large", args.images, args.templates, args.snapshots),
    }
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        for label, home in homes.items():
            home.path.mkdir()
            result.setdefault("build", {})[label] = build_home(
                home.path, images=home.images, templates=home.templates, snapshots=home.snapshots
            )
            print(f"built {label}: {result['build'][label]}", flush=True)
        for label, home in homes.items():
            result.setdefault("startup", {})[label] = measure_startup(home.path)  # alias index
            result.setdefault("startup again", {})[label] = measure_startup(home.path)
            print(f"startup {label}: {result['startup'][label]}", flush=True)
        result["lookups"] = trio.run(measure_lookups, homes, args.samples, 1)
        result["legacy"] = legacy_contrast(work, (1_000, 10_000), samples=20)
        built = Path(os.environ.get("AENV_TEST_HOME", REPO / ".state" / "test-home"))
        if args.node:
            result["node"] = measure_nodes(homes, built, samples=500)
        result["database MiB"] = {
            label: {
                name: round(
                    sum(f.stat().st_size for f in h.path.glob(pattern) if f.is_file()) / (1 << 20),
                    1,
                )
                for name, pattern in (("images", "images/catalog.db*"), ("aenv.db", "aenv.db*"))
            }
            for label, h in homes.items()
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"homes kept in {work}")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"catalog-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    _print(result)
    print(f"\nwritten to {out.relative_to(REPO)}")
    return 0


def _print(r: dict[str, Any]) -> None:
    base, large = r["lookups"]["baseline"], r["lookups"]["large"]
    a = r["args"]
    print(
        f"\nlookups: large = {a['images']} images, {a['templates']} templates, "
        f"{int(a['templates']) + int(a['snapshots'])} snapshots; baseline = {a['baseline']} each"
    )
    print(f"{'lookup':60} {'baseline p50/p95 us':>22} {'large p50/p95 us':>20} {'ratio p50':>9}")
    for name, b in base.items():
        x = large[name]
        print(
            f"{name:60} {b['p50_us']:>10} / {b['p95_us']:<9} {x['p50_us']:>9} / {x['p95_us']:<9}"
            f" {x['p50_us'] / b['p50_us']:>8.2f}"
        )
    for name, v in r["legacy"].items():
        print(f"{name:60} {v}")
    for which in ("startup", "startup again"):
        for label, v in r[which].items():
            print(f"{which} {label}: {v}")
    for label, v in (r.get("node") or {}).items():
        print(f"node {label}: {v}")
    print(f"databases: {r['database MiB']}")


if __name__ == "__main__":
    sys.exit(main())
