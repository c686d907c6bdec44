"""Creates: `Sandbox.create()` through the e2b SDK, sequential and in bursts, next to `runsc restore`.

Issue 15 goal 2: p50 <= 50 ms, and p99 <= 150 ms with 20 concurrent creates.
One node (`python -m aenv serve`, private home with the bundle and templates
linked, bench/run.py's netns prefix and slot range) with the default pool, or
what `--env KEY=VALUE` sets. After a warm-up (the template becomes a
snapshot, the pool learns it is hot) it times, through the real SDK:

- **sequential**: `Sandbox.create` back to back (each killed before the next),
- **burst**: `--bursts` times, `--burst` creates at once (p50/p99/max over
  every create of every burst, and over the bursts after the first: the
  pool has learnt the burst's size by then), `--settle` seconds apart, from
  SDK threads, SDK processes or bare POSTs (`--client`); for the later
  bursts, each create's time split between the client and the node (its
  `Server-Timing` header) and the node's CPU per create,
- **dry**: creates while the pool is empty: a node with `AENV_POOL_SIZE=0`
  (every create restores the template's snapshot, the path a create takes
  once the pool ran dry).

Each create's sandbox log says whether it was adopted from the pool; the
share is reported. In the same run, the floor (bench/run.py's `Floor`: runsc
as aenv's gVisor driver runs it, the template's rootfs under an overlay with
envd as init): `runsc restore --detach` of that sandbox's image into a fresh
container ID, one at a time, and 4 at once (each into a netns of its own).
Writes bench/results/creates-<timestamp>.json. Needs root and runsc.

    AENV_TEST_HOME=... .venv/bin/python bench/creates.py [--n 20] [--burst 20] [--bursts 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.config import Config  # noqa: E402
from aenv.runtimes.base import ENVD_PORT  # noqa: E402
from aenv.storage.bundle import envd_command  # noqa: E402
from bench.run import (  # noqa: E402
    FORK_NETS,
    MAIN_NET,
    NET_PREFIX,
    NODE_TAG,
    SLOT_CIDR,
    Floor,
    Init,
    Interrupted,
    Series,
    _describe,
    _sdk_env,
    _warm_up,
    bench_home,
    envd_rootfs,
    floor_network,
    interrupt_on_sigterm,
    loadavg,
    percentile,
    run,
    runsc_version,
)
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

RESULTS = REPO / "bench" / "results"
KEYS = ("sequential", "burst", "burst_later", "dry")
FLOOR_KEYS = ("restore", "restore_4")


# -- aenv ----------------------------------------------------------------------------


ADOPTED = re.compile(r"adopted from the pool in ([0-9.]+) ms(?: \((.*)\))?")
STARTED = re.compile(r"running: started in ([0-9.]+) ms \((.*)\)")
# server-side times of pool adoptions and of restores (ms), and their steps as
# the sandbox's log names them
ADOPTIONS: list[float] = []
ADOPT_STEPS: dict[str, list[float]] = {}
RESTORES: list[float] = []
RESTORE_STEPS: dict[str, list[float]] = {}


def _steps(into: dict[str, list[float]], text: str) -> None:
    for step in text.removesuffix(" ms").split(", "):
        name, _, ms = step.rpartition(" ")
        if name:
            into.setdefault(name, []).append(float(ms))


# -- where a create's time goes ------------------------------------------------------

# Per create of the bursts (ms): the client's wall time and its parts
# (`sdk_before`: from the call to the POST leaving httpx; `post`: the POST's
# round trip; `sdk_after`: from the response to the call's return), the node's
# Server-Timing (`handler`, `create`, `parse`) and `wire` = post - handler
# (connection, HTTP framing, the node's event loop before and after the handler).
SPLIT_KEYS = ("took", "sdk_before", "post", "sdk_after", "handler", "parse", "create", "wire")
SPLITS: dict[str, dict[str, list[float]]] = {}  # series key -> part -> samples
NODE_CPU: dict[str, list[float]] = {}  # series key -> node CPU ms per create, per burst
_TLS = threading.local()
# env vars every timed create asks for (`--envs`: envd's /init is then sent)
ENVS: dict[str, str] = {}
_TIMING = re.compile(r"(\w+);dur=([0-9.]+)")


def _patch_httpx() -> None:
    """Time the POST /sandboxes of this process's creates (the SDK's httpx client
    sends it) and keep the node's Server-Timing header, per thread."""
    if getattr(httpx.Client.send, "_bench", False):
        return
    send = httpx.Client.send

    def timed_send(self: httpx.Client, request: httpx.Request, **kw: Any) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith("/sandboxes"):
            return send(self, request, **kw)
        t = time.perf_counter()
        resp = send(self, request, **kw)
        _TLS.post = (t, time.perf_counter(), resp.headers.get("server-timing", ""))
        return resp

    timed_send._bench = True  # type: ignore[attr-defined]
    httpx.Client.send = timed_send  # type: ignore[method-assign]


def _split(t0: float, t1: float, post: tuple[float, float, str] | None) -> dict[str, float]:
    out = {"took": (t1 - t0) * 1000}
    if post is not None:
        ps, pe, header = post
        out |= {"sdk_before": (ps - t0) * 1000, "post": (pe - ps) * 1000,
                "sdk_after": (t1 - pe) * 1000}  # fmt: skip
        out |= {k: float(v) for k, v in _TIMING.findall(header)}
        if "handler" in out:
            out["wire"] = out["post"] - out["handler"]
    return out


def _sdk_create(template: str) -> tuple[str, dict[str, float]]:
    """One `Sandbox.create` through the SDK: its ID and its time's parts."""
    from e2b import Sandbox

    _patch_httpx()
    _TLS.post = None
    t0 = time.perf_counter()
    sbx = Sandbox.create(template, timeout=300, envs=ENVS or None)
    t1 = time.perf_counter()
    return sbx.sandbox_id, _split(t0, t1, _TLS.post)


_LEAN: dict[str, httpx.Client] = {}


def _lean_create(template: str) -> tuple[str, dict[str, float]]:
    """The same create as a bare POST /sandboxes on one shared httpx client."""
    client = _LEAN.get("c")
    if client is None:
        client = _LEAN.setdefault("c", httpx.Client(
            base_url=os.environ["E2B_API_URL"], timeout=60,
            headers={"X-API-Key": os.environ["E2B_API_KEY"]},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)))  # fmt: skip
    t0 = time.perf_counter()
    body: dict[str, Any] = {"templateID": template, "timeout": 300}
    if ENVS:
        body["envVars"] = ENVS
    r = client.post("/sandboxes", json=body)
    t1 = time.perf_counter()
    r.raise_for_status()
    return r.json()["sandboxID"], _split(t0, t1, (t0, t1, r.headers.get("server-timing", "")))


def _proc_init() -> None:
    """A burst process: the SDK imported and its transport warm before any burst."""
    from e2b import Sandbox

    _patch_httpx()
    with contextlib.suppress(Exception):
        Sandbox.list()


def _proc_create(
    template: str, start_at: float, envs: dict[str, str]
) -> tuple[str, dict[str, float], float]:
    """One create in a process of its own, at wall-clock `start_at`; (id, parts, late ms)."""
    ENVS.update(envs)
    time.sleep(max(0.0, start_at - time.time()))
    late = (time.time() - start_at) * 1000
    sid, parts = _sdk_create(template)
    return sid, parts, late


def _node_cpu_ms(node: NodeProc) -> float:
    """CPU time the node process (all its threads, not its children) has used."""
    fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def _settle_created(
    node: NodeProc, sid: str, hits: list[bool], lock: threading.Lock, kill: bool = True
) -> None:
    """Whether `sid` came from the pool (and its adoption's server-side time,
    from its log), then kill it."""
    headers = {"X-API-Key": node.api_key}
    try:
        lines = httpx.get(f"{node.url}/sandboxes/{sid}/logs", headers=headers,
                          timeout=30).json()["logs"]  # fmt: skip
        found = [m for e in lines if (m := ADOPTED.search(e["line"]))]
        started = [m for e in lines if (m := STARTED.search(e["line"]))]
        with lock:
            hits.append(bool(found))
            for m in found:
                ADOPTIONS.append(float(m.group(1)))
                _steps(ADOPT_STEPS, m.group(2) or "")
            for m in started if not found else []:
                RESTORES.append(float(m.group(1)))
                _steps(RESTORE_STEPS, m.group(2))
    finally:
        if kill:
            with contextlib.suppress(Exception):
                httpx.delete(f"{node.url}/sandboxes/{sid}", headers=headers, timeout=60)


def _one_create(template: str, node: NodeProc, hits: list[bool], lock: threading.Lock) -> float:
    """One `Sandbox.create` (timed), whether it came from the pool (and its
    adoption's server-side time), then kill."""
    sid, parts = _sdk_create(template)
    _settle_created(node, sid, hits, lock)
    return parts["took"]


def _sequential(node: NodeProc, template: str, n: int, series: Series) -> None:
    hits: list[bool] = []
    lock = threading.Lock()
    for _ in range(n):
        series.samples.append(_one_create(template, node, hits, lock))
    series.note = f"{sum(hits)}/{len(hits)} from the pool, back to back"


def _bursts(
    node: NodeProc,
    template: str,
    args: argparse.Namespace,
    series: Series,
    later: Series,
) -> None:
    """`args.bursts` bursts into `series`; those after the first (the pool sized by
    then) also into `later`. Each create is made by `args.client`: SDK threads in
    this process, SDK processes (one per create), or bare POSTs from threads.
    Sandboxes are killed once the whole burst returned (`--kill-in-burst`: each
    by its own thread right after its create, as before)."""
    size, count, settle_s = args.burst, args.bursts, args.settle
    hits: list[bool] = []
    lock = threading.Lock()
    per_burst: list[str] = []
    splits = SPLITS.setdefault("burst_later", {})
    cpu = NODE_CPU.setdefault("burst_later", [])
    procs = None
    if args.client == "procs":
        import multiprocessing

        procs = concurrent.futures.ProcessPoolExecutor(
            size, mp_context=multiprocessing.get_context("spawn"), initializer=_proc_init
        )
        # every process started, its SDK imported, before the first burst
        list(procs.map(time.sleep, [0.5] * size * 2))
    create_one = _lean_create if args.client == "lean" else _sdk_create
    try:
        for b in range(count):
            time.sleep(settle_s)
            cpu0 = _node_cpu_ms(node)
            start_at = time.time() + 0.5
            lateness: list[float] = []
            results: list[tuple[str, dict[str, float]]] = []
            with concurrent.futures.ThreadPoolExecutor(size) as ex:

                def create(start_at: float = start_at) -> tuple[str, dict[str, float]]:
                    time.sleep(max(0.0, start_at - time.time()))
                    sid, parts = create_one(template)
                    if args.kill_in_burst:
                        _settle_created(node, sid, hits, lock)
                    return sid, parts

                if procs is not None:
                    futs = [
                        procs.submit(_proc_create, template, start_at, ENVS) for _ in range(size)
                    ]
                    for f in futs:
                        sid, parts, late = f.result(timeout=600)
                        results.append((sid, parts))
                        lateness.append(late)
                else:
                    futures = [ex.submit(create) for _ in range(size)]
                    results = [f.result(timeout=600) for f in futures]
            node_cpu = (_node_cpu_ms(node) - cpu0) / size
            if not args.kill_in_burst:
                with concurrent.futures.ThreadPoolExecutor(size) as ex:
                    list(ex.map(lambda r: _settle_created(node, r[0], hits, lock), results))
            took = [p["took"] for _, p in results]
            series.samples += took
            if b:
                later.samples += took
                cpu.append(node_cpu)
                for _, parts in results:
                    for k, v in parts.items():
                        splits.setdefault(k, []).append(v)
            late = f", start spread {max(lateness):.0f} ms" if lateness else ""
            per_burst.append(
                f"burst {b + 1}: max {max(took):.0f} ms, {sum(hits[-size:])}/{size} from the pool"
                f", node CPU {node_cpu:.1f} ms per create{late}"
            )
    finally:
        if procs is not None:
            procs.shutdown(cancel_futures=True)
    how = {"threads": "SDK, one thread each", "procs": "SDK, one process each",
           "lean": "bare POST, one thread each"}[args.client]  # fmt: skip
    kill = "each killed in the burst" if args.kill_in_burst else "killed after the burst"
    envs = "; with envs (/init)" if ENVS else ""
    series.note = "; ".join(per_burst) + f"; {settle_s:g} s apart; {how}; {kill}{envs}"


def _with_node(
    home: Path, work: Path, env: dict[str, str], measure: Callable[[NodeProc], None]
) -> None:
    private = work / "home"
    private.mkdir(parents=True)
    link_home(home, private)
    node = start_node(
        private,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=work / "node.log",
        extra_env={"AENV_NET_PREFIX": NET_PREFIX, "AENV_SLOT_CIDR": SLOT_CIDR,
                   "AENV_NODE_TAG": NODE_TAG, **env},
    )  # fmt: skip
    try:
        with _sdk_env(node):
            measure(node)
    except Exception:
        print(f"--- node log ---\n{node.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        code = stop_node(node)
        left = leaks(private, prefix=NET_PREFIX)
        if code != 0 or left:
            print(f"node exit {code}, left behind: {left}", file=sys.stderr)
        shutil.rmtree(private, ignore_errors=True)


def bench_aenv(home: Path, work: Path, args: argparse.Namespace) -> dict[str, Series]:
    results = {key: Series() for key in KEYS}
    extra = dict(kv.split("=", 1) for kv in args.env)

    def pooled(node: NodeProc) -> None:
        _warm_up(node, args.template)
        time.sleep(args.settle)  # the pool fills
        try:
            _sequential(node, args.template, args.n, results["sequential"])
        except Exception as e:
            results["sequential"].error = _describe(e)
        try:
            _bursts(node, args.template, args, results["burst"], results["burst_later"])
        except Exception as e:
            results["burst"].error = _describe(e)

    def dry(node: NodeProc) -> None:
        _warm_up(node, args.template)
        hits: list[bool] = []
        lock = threading.Lock()
        for _ in range(args.n):
            results["dry"].samples.append(_one_create(args.template, node, hits, lock))
        results["dry"].note = "AENV_POOL_SIZE=0: every create restores the snapshot"

    for name, env, measure in (
        ("pool", extra, pooled),
        ("dry", {**extra, "AENV_POOL_SIZE": "0"}, dry),
    ):
        if name in args.skip:
            continue
        print(f"  node {name} ...", flush=True)
        try:
            _with_node(home, work / name, env, measure)
        except Exception as e:
            for s in results.values():
                if not s.samples and s.error is None:
                    s.error = _describe(e)
    return results


# -- floor ---------------------------------------------------------------------------


def bench_floor(home: Path, work: Path, n: int, template: str) -> dict[str, Series]:
    """`runsc restore` of the sandbox aenv runs: alone (n times), and 4 at once."""
    results = {key: Series() for key in FLOOR_KEYS}
    config = Config.from_env()
    flags = run([config.runsc_binary, "flags"], check=False, timeout=30)
    floor = Floor(
        home=home,
        workdir=work,
        runsc=config.runsc_binary,
        platform=config.runsc_platform,
        net_disconnect_ok=b"-net-disconnect-ok" in flags.stdout + flags.stderr,
        compression=config.checkpoint_compression,
    )
    tag = secrets.token_hex(3)
    argv, env = envd_command(ENVD_PORT)
    init: Init = (tuple(argv), dict(env))
    try:
        with (
            floor_network((MAIN_NET, *FORK_NETS)),
            envd_rootfs(home, template, work / "envd-root") as rootfs,
        ):
            src = f"aenvbench-cr-{tag}"
            floor.reset_guest_address()
            floor.start_detached(src, rootfs, init)
            floor.exec(src, "/bin/true")
            image = work / "image"
            image.mkdir()
            floor.checkpoint(src, image)
            floor.delete(src)
            for i in range(n):
                cid = f"aenvbench-cr-{tag}-{i}"
                cmd, bundle = floor.prepare_restore(cid, rootfs, image, MAIN_NET, init)
                t0 = time.perf_counter()
                floor.restore_all([(cid, cmd, bundle)])
                results["restore"].samples.append((time.perf_counter() - t0) * 1000)
                floor.delete(cid)
            for i in range(max(1, n // 4)):
                prepared = []
                for j, net in enumerate(FORK_NETS):
                    cid = f"aenvbench-cr4-{tag}-{i}-{j}"
                    prepared.append((cid, *floor.prepare_restore(cid, rootfs, image, net, init)))
                t0 = time.perf_counter()
                floor.restore_all(prepared)
                results["restore_4"].samples.append((time.perf_counter() - t0) * 1000)
                for cid, _, _ in prepared:
                    floor.delete(cid)
    except Exception as e:
        for s in results.values():
            if s.error is None:
                s.error = _describe(e)
    finally:
        floor.cleanup()
    results["restore_4"].note = "4 concurrent restores of one image, until all returned"
    return results


# -- report --------------------------------------------------------------------------


def _q(s: Series, q: float) -> float | None:
    if not s.samples:
        return None
    if q == 100:
        return max(s.samples)
    return percentile(s.samples, int(q))


def table(aenv: dict[str, Series], floor: dict[str, Series]) -> str:
    restore = _q(floor["restore"], 50)
    rows = [("operation", "n", "p50", "p95", "p99", "max", "p50/restore", "p99/restore")]
    labels = (
        ("aenv create, sequential (pool)", aenv["sequential"]),
        ("aenv create, burst of concurrent", aenv["burst"]),
        ("  bursts after the first", aenv["burst_later"]),
        ("aenv create, pool dry (restore)", aenv["dry"]),
        ("floor runsc restore", floor["restore"]),
        ("floor 4 concurrent runsc restore", floor["restore_4"]),
    )
    for label, s in labels:
        qs = [_q(s, q) for q in (50, 95, 99, 100)]
        cells = ["-" if v is None else f"{v:.0f}" for v in qs]
        ratios = ["-" if v is None or not restore else f"{v / restore:.2f}" for v in (qs[0], qs[2])]
        rows.append((label, str(len(s.samples)), *cells, *ratios))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    burst, seq = _q(aenv["burst_later"], 99), _q(aenv["sequential"], 50)
    lines.append(
        "(ms) targets: sequential p50 <= 50: "
        + ("-" if seq is None else "yes" if seq <= 50 else "no")
        + "; burst p99 (after the first) <= 150: "
        + ("-" if burst is None else "yes" if burst <= 150 else "no")
    )
    for what, total, parts in (
        ("pool adoptions", ADOPTIONS, ADOPT_STEPS),
        ("restores (pool missed or dry)", RESTORES, RESTORE_STEPS),
    ):
        if total:
            steps = ", ".join(
                f"{name} {percentile(v, 50):.1f}/{percentile(v, 95):.1f}"
                for name, v in parts.items()
            )
            lines.append(
                f"{what}, server side (n={len(total)}): p50 {percentile(total, 50):.1f}"
                f" p95 {percentile(total, 95):.1f} ms; steps p50/p95: {steps}"
            )
    for key, parts in SPLITS.items():
        if parts.get("took"):
            lines.append(f"{key}: where a create's time went, p50/p95/p99 ms:")
            for part in SPLIT_KEYS:
                if v := parts.get(part):
                    qs = "/".join(f"{percentile(v, q):.1f}" for q in (50, 95, 99))
                    lines.append(f"  {part:<10} {qs}")
    for key, cpu in NODE_CPU.items():
        if cpu:
            per = ", ".join(f"{c:.1f}" for c in cpu)
            lines.append(f"{key}: node process CPU per create, per burst: {per} ms")
    for name, res in (("aenv", aenv), ("floor", floor)):
        for key, s in res.items():
            if s.note:
                lines.append(f"{name} {key}: {s.note}")
            if s.error:
                lines.append(f"{name} {key} ERROR: {s.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20, help="sequential samples (default 20)")
    p.add_argument("--burst", type=int, default=20, help="concurrent creates per burst")
    p.add_argument("--bursts", type=int, default=3, help="bursts (default 3)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds before each burst")
    p.add_argument("--template", default="base")
    p.add_argument("--client", default="threads", choices=("threads", "procs", "lean"),
                   help="who makes a burst's creates: SDK threads in this process (default),"
                        " one SDK process per create, or bare POSTs from threads")  # fmt: skip
    p.add_argument(
        "--envs",
        action="store_true",
        help="every timed create asks for an env var of its own (envd's /init)",
    )
    p.add_argument("--kill-in-burst", action="store_true",
                   help="kill each sandbox of a burst right after its create (before:"
                        " the kills ran beside the burst's later creates)")  # fmt: skip
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the nodes")
    p.add_argument("--skip-floor", action="store_true")
    p.add_argument("--skip-aenv", action="store_true")
    p.add_argument("--skip", action="append", default=[], choices=("pool", "dry"),
                   help="leave out that node")  # fmt: skip
    p.add_argument("--home", type=Path)
    args = p.parse_args(argv)
    home = bench_home(p, args.home)
    if args.envs:
        ENVS["AENV_BENCH_ENV"] = "1"
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-creates-"))
    aenv = {key: Series() for key in KEYS}
    floor = {key: Series() for key in FLOOR_KEYS}
    try:
        if not args.skip_floor:
            print("floor: runsc restore ...", flush=True)
            floor = bench_floor(home, work / "floor", args.n, args.template)
        if not args.skip_aenv:
            print("aenv: creates through the e2b SDK ...", flush=True)
            aenv = bench_aenv(home, work / "aenv", args)
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(aenv, floor))
    load_end = loadavg()
    print(f"load average {load_start} at start, {load_end} at end; {os.cpu_count()} CPUs")
    report: dict[str, Any] = {
        "started": started.isoformat(),
        "args": {k: v for k, v in vars(args).items() if k != "home"},
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                 "runsc": runsc_version(Config.from_env().runsc_binary),
                 "loadavg_start": load_start, "loadavg_end": load_end},
        "aenv": {k: s.to_json() | {"p99_ms": _q(s, 99), "max_ms": _q(s, 100)}
                 for k, s in aenv.items() if s.samples or s.error},
        "floor": {k: s.to_json() for k, s in floor.items() if s.samples or s.error},
        "adoptions_ms": ADOPTIONS,
        "adopt_steps_ms": ADOPT_STEPS,
        "restores_ms": RESTORES,
        "restore_steps_ms": RESTORE_STEPS,
        "burst_splits_ms": SPLITS,
        "node_cpu_per_create_ms": NODE_CPU,
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"creates-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    failed = any(s.error for res in (aenv, floor) for s in res.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
