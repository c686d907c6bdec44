"""Cluster benchmarks: routing overhead, placement spread and failure detection at 3 nodes.

One run starts three real nodes on loopback (`python -m aenv serve`, each
with a private home whose bundle and templates are linked from the built
home, a shared `file://` store, netns prefixes `aenvq1`-`aenvq3` and slot
ranges in 10.240-10.242.0.0/16 (`--cidrs`), `AENV_POOL_SIZE=0`), joined
into one cluster through the first node, and measures with the real `e2b`
Python SDK:

1. **quiet**: a minute with nothing to do; every "is suspected" line the
   nodes log in it is a false suspicion (no node failed).
2. **routing**: a sandbox created on node 2 (the create carries the hop
   header, so node 2 keeps it) is driven through node 2 (its owner: the
   baseline) and through node 1 (which forwards every call to node 2):
   `commands.run("true")`, `files.read` of a 64-byte file, and envd's
   `GET /health` through the sandbox proxy (one plain HTTP/1.1 request: the
   hop alone, without a process start in the sandbox). The two paths
   alternate sample by sample, so drift in the machine's load hits both
   alike. Reported: p50/p95 of each, the difference of the p50s, the
   median of the paired differences (the issue's aim: <= 2 ms p50 added),
   and the CPU time node 1 spent per forwarded call (from /proc, less its
   idle rate measured just before).
3. **placement**: `--creates` creates through node 1 (the SDK, one after
   the other, as a user's loop would); the node each landed on (its
   `clientID`), against the mean +/- 20 %. Then they are killed.
4. **detection**: `--kills` times, node 3 is killed with SIGKILL; nodes 1
   and 2 are polled every 50 ms for the time until each first reports it
   `suspect` and `dead` in `GET /cluster/members`; then node 3 is started
   again (same home) and the cluster waits until every node sees every
   other alive. Next to it, memberlist's expected detection time at the same
   settings, from its formulas (`memberlist_expected`).

False suspicions are also counted while the routing and placement phases
load the machine, and suspicions of nodes 1 and 2 during the kills. Cross-node resume and drain are not built yet and not
measured (see bench/README.md). Results go to
bench/results/cluster-<UTC timestamp>.json. Nodes are stopped with SIGTERM
(sandboxes deleted first), checked for leftovers and their homes removed,
also when a step fails or the run is interrupted. Needs root and runsc.

    .venv/bin/python bench/cluster.py [--n 100] [--creates 30] [--kills 10] [--quiet 60]
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
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.proto.clusterroute import HOP_HEADER  # noqa: E402
from aenv.proto.swim import SwimConfig, suspicion_timeout  # noqa: E402
from bench.run import Interrupted, bench_home, interrupt_on_sigterm  # noqa: E402
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

NAMES = ("bench-1", "bench-2", "bench-3")  # the last character picks the prefix and range
NET_PREFIX = "aenvq"
# (the second is a /17: 10.241.0.0/17 is taken by a netns left on the machine this was written on)
SLOT_CIDRS = ("10.240.0.0/16", "10.241.128.0/17", "10.242.0.0/16")
ENVD_PORT = 49983
SMALL_FILE = "/tmp/aenv-bench-small.txt"
POLL_S = 0.05
RESULTS = REPO / "bench" / "results"
SUSPECTED = re.compile(r"node (\S+) is suspected")


def stats(samples: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    if len(samples) == 1:
        out["p50"] = out["p95"] = round(samples[0], 3)
    elif samples:
        qs = statistics.quantiles(samples, n=100, method="inclusive")
        out["p50"], out["p95"] = round(qs[49], 3), round(qs[94], 3)
    return out


class Cluster:
    """Three nodes sharing a store; started, restarted and stopped by name."""

    def __init__(self, built: Path, root: Path, cidrs: tuple[str, ...] = SLOT_CIDRS) -> None:
        self.built, self.root, self.cidrs = built, root, cidrs
        self.key = "aenv_bench_" + secrets.token_hex(8)
        self.secret = secrets.token_hex(16)
        self.nodes: dict[str, NodeProc] = {}
        (root / "store").mkdir()

    def start(self, name: str) -> NodeProc:
        home = self.root / name
        if not home.exists():
            home.mkdir()
            link_home(self.built, home)
        first = self.nodes.get(NAMES[0])
        peers = [first.url] if first is not None and name != NAMES[0] else []
        i = NAMES.index(name)
        n = start_node(
            home,
            api_key=self.key,
            log_path=home / "node.log",
            extra_env={
                "AENV_NODE_ID": name,
                "AENV_NODE_TAG": "",  # derived from the node id: one per node
                "AENV_NET_PREFIX": f"{NET_PREFIX}{i + 1}",
                "AENV_SLOT_CIDR": self.cidrs[i],
                "AENV_CLUSTER_SECRET": self.secret,
                "AENV_CLUSTER_PEERS": ",".join(peers),
                "AENV_STORE_URL": f"file://{self.root / 'store'}",
                "AENV_POOL_SIZE": "0",
            },
        )
        self.nodes[name] = n
        return n

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.key}

    def members(self, name: str, timeout: float = 5.0) -> dict[str, str]:
        r = httpx.get(f"{self.url(name)}/cluster/members", headers=self.headers(), timeout=timeout)
        r.raise_for_status()
        return {m["nodeID"]: m["state"] for m in r.json()}

    def wait_all_alive(self, within: float = 60.0) -> float:
        want = dict.fromkeys(NAMES, "alive")
        t0 = time.monotonic()
        seen: dict[str, dict[str, str]] = {}
        while time.monotonic() - t0 < within:
            with contextlib.suppress(httpx.HTTPError):
                seen = {n: self.members(n) for n in NAMES}
                if all(v == want for v in seen.values()):
                    return time.monotonic() - t0
            time.sleep(0.2)
        raise RuntimeError(f"the cluster never became all alive: {seen}")

    def suspicions(self, *, of: str | None = None) -> dict[str, int]:
        """ "node X is suspected" lines in each node's log so far (restarts
        append), of any node or only of those other than `of`."""
        out = {}
        for n in NAMES:
            text = (self.root / n / "node.log").read_text(errors="replace")
            out[n] = sum(1 for m in SUSPECTED.finditer(text) if of is None or m.group(1) != of)
        return out

    def owner(self, sandbox_id: str) -> str:
        r = httpx.get(
            f"{self.url(NAMES[0])}/sandboxes/{sandbox_id}", headers=self.headers(), timeout=30
        )
        r.raise_for_status()
        return str(r.json()["clientID"])

    def stop(self) -> list[str]:
        """Delete every sandbox, stop every node, report what was left behind."""
        problems: list[str] = []
        for name, n in self.nodes.items():
            if n.proc.poll() is None:
                try:
                    own = httpx.get(
                        f"{n.url}/cluster/v1/sandboxes", headers=self.headers(), timeout=10
                    ).json()
                    for sb in own:
                        httpx.delete(
                            f"{n.url}/sandboxes/{sb['sandbox_id']}",
                            headers={**self.headers(), HOP_HEADER: "bench"},
                            timeout=60,
                        )
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    problems.append(f"{name}: deleting its sandboxes failed: {e!r}")
                code = stop_node(n)
                if code != 0:
                    problems.append(f"{name} exited with {code}")
            problems += [f"{name}: {x}" for x in leaks(n.home, f"{NET_PREFIX}{name[-1]}")]
        return problems


@contextlib.contextmanager
def sdk_env(cluster: Cluster) -> Any:
    keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")
    old = {k: os.environ.get(k) for k in keys}
    for k in ("E2B_DOMAIN", "E2B_DEBUG"):
        os.environ.pop(k, None)
    os.environ["E2B_API_KEY"] = cluster.key
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def via(url: str) -> dict[str, str]:
    """SDK options that send both API and envd traffic to the node at `url`."""
    return {"api_url": url, "sandbox_url": url}


# -- 1. quiet ---------------------------------------------------------------------------------


def bench_quiet(cluster: Cluster, seconds: float) -> dict[str, Any]:
    before = cluster.suspicions()
    time.sleep(seconds)
    after = cluster.suspicions()
    states = {n: cluster.members(n) for n in NAMES}
    return {
        "seconds": seconds,
        "false_suspicions": {n: after[n] - before[n] for n in NAMES},
        "members_after": states,
    }


# -- 2. routing -------------------------------------------------------------------------------


def bench_routing(cluster: Cluster, template: str, n: int) -> dict[str, Any]:
    from e2b import Sandbox

    owner, other = NAMES[1], NAMES[0]
    sbx = Sandbox.create(
        template, timeout=600, api_headers={HOP_HEADER: "bench"}, **via(cluster.url(owner))
    )
    try:
        ran_on = cluster.owner(sbx.sandbox_id)
        if ran_on != owner:
            raise RuntimeError(f"the sandbox runs on {ran_on}, not {owner}")
        sbx.files.write(SMALL_FILE, "x" * 64)
        direct = Sandbox.connect(sbx.sandbox_id, **via(cluster.url(owner)))
        routed = Sandbox.connect(sbx.sandbox_id, **via(cluster.url(other)))
        route_headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        with (
            httpx.Client(base_url=cluster.url(owner), headers=route_headers) as h_direct,
            httpx.Client(base_url=cluster.url(other), headers=route_headers) as h_routed,
        ):

            def health(client: httpx.Client) -> Callable[[], object]:
                def op() -> object:
                    r = client.get("/health", timeout=30)
                    r.raise_for_status()
                    return r

                return op

            ops: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
                'commands.run("true")': (
                    lambda: direct.commands.run("true"),
                    lambda: routed.commands.run("true"),
                ),
                "files.read 64 B": (
                    lambda: direct.files.read(SMALL_FILE),
                    lambda: routed.files.read(SMALL_FILE),
                ),
                "envd GET /health (proxy)": (health(h_direct), health(h_routed)),
            }
            out: dict[str, Any] = {}
            pid = cluster.nodes[other].proc.pid
            c0, t0 = cpu_seconds(pid), time.monotonic()
            time.sleep(3.0)
            idle = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)  # gossip, timers
            for label, (d_op, r_op) in ops.items():
                for _ in range(5):  # warm: connections, caches
                    d_op()
                    r_op()
                d: list[float] = []
                r: list[float] = []
                c0, t0 = cpu_seconds(pid), time.monotonic()
                for i in range(n):
                    pair = ((d, d_op), (r, r_op)) if i % 2 == 0 else ((r, r_op), (d, d_op))
                    for samples, op in pair:
                        t0 = time.perf_counter()
                        op()
                        samples.append((time.perf_counter() - t0) * 1000)
                busy = cpu_seconds(pid) - c0 - idle * (time.monotonic() - t0)
                out[label] = {
                    "forwarder_cpu_ms_per_call": round(busy / n * 1000, 3),
                    "direct_ms": stats(d),
                    "routed_ms": stats(r),
                    "added_p50_ms": round(stats(r)["p50"] - stats(d)["p50"], 3),
                    "paired_diff_p50_ms": round(
                        statistics.median(b - a for a, b in zip(d, r, strict=True)), 3
                    ),
                    "samples_direct_ms": [round(x, 3) for x in d],
                    "samples_routed_ms": [round(x, 3) for x in r],
                }
            return out
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


# -- 3. placement -----------------------------------------------------------------------------


def bench_placement(cluster: Cluster, template: str, creates: int) -> dict[str, Any]:
    from e2b import Sandbox

    made: list[Any] = []
    landed: list[str] = []
    took: list[float] = []
    try:
        for _ in range(creates):
            t0 = time.perf_counter()
            sbx = Sandbox.create(template, timeout=600, **via(cluster.url(NAMES[0])))
            took.append((time.perf_counter() - t0) * 1000)
            made.append(sbx)
            landed.append(cluster.owner(sbx.sandbox_id))
    finally:
        for sbx in made:
            with contextlib.suppress(Exception):
                sbx.kill()
    counts = {n: landed.count(n) for n in NAMES}
    mean = creates / len(NAMES)
    return {
        "creates": creates,
        "counts": counts,
        "order": landed,
        "mean": round(mean, 2),
        "within_20pct": {n: abs(c - mean) <= 0.2 * mean for n, c in counts.items()},
        "create_ms": stats(took),
    }


# -- 4. failure detection ---------------------------------------------------------------------


def memberlist_expected(n: int, cfg: SwimConfig) -> dict[str, Any]:
    """Memberlist's detection time after a crash of one of `n` members, from its formulas.

    Each member probes the others round-robin (a shuffled list), one per
    probe interval, so a survivor first probes the dead member U(0, (n-1)
    intervals) after the crash; the first probe by any of the n-1 survivors
    is the minimum of n-1 such draws. That probe fails at the end of its
    interval (the probe timeout, then indirect probes until the interval
    ends) and the member is suspected for suspicion_mult * max(1, log10 n)
    * probe interval: memberlist's minimum suspicion timeout, which applies
    alone when n - 2 < suspicion_mult - 2 (too few members to expect
    independent confirmations; so at n = 3). The prober then declares it
    dead and gossips that (the others started their own timers when the
    suspicion reached them, a gossip interval later at most).

        T = min(U_1..U_{n-1}) + probe + suspicion_mult * max(1, log10 n) * probe,
        U_i ~ U(0, (n-1) * probe); P(min <= x) = 1 - (1 - x / L)^(n-1)
    """
    suspicion = suspicion_timeout(cfg.suspicion_mult, n, cfg.probe_interval)
    span = (n - 1) * cfg.probe_interval
    m = n - 1

    def quantile(q: float) -> float:
        return span * (1 - (1 - q) ** (1 / m))

    lo = cfg.probe_interval + suspicion
    return {
        "probe_interval_s": cfg.probe_interval,
        "probe_timeout_s": cfg.probe_timeout,
        "suspicion_mult": cfg.suspicion_mult,
        "suspicion_timeout_s": round(suspicion, 3),
        "suspect_p50_s": round(cfg.probe_interval + quantile(0.5), 3),
        "min_s": round(lo, 3),
        "p50_s": round(lo + quantile(0.5), 3),
        "mean_s": round(lo + span / (m + 1), 3),
        "p95_s": round(lo + quantile(0.95), 3),
        "max_s": round(lo + span, 3),
        "formula": "min over n-1 survivors of U(0, (n-1)*probe) + probe "
        "+ suspicion_mult*max(1, log10 n)*probe",
    }


def bench_detection(cluster: Cluster, kills: int, within: float = 60.0) -> dict[str, Any]:
    victim, watchers = NAMES[2], NAMES[:2]
    suspect: dict[str, list[float]] = {w: [] for w in watchers}
    dead: dict[str, list[float]] = {w: [] for w in watchers}
    rejoin: list[float] = []
    before = cluster.suspicions(of=victim)
    for _ in range(kills):
        cluster.wait_all_alive()
        time.sleep(2.0)  # the rejoin's gossip settles
        t0 = time.monotonic()
        stop_node(cluster.nodes[victim], signal.SIGKILL)
        pending = set(watchers)
        seen_suspect: set[str] = set()
        while pending and time.monotonic() - t0 < within:
            for w in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    state = cluster.members(w, timeout=2).get(victim)
                    now = time.monotonic() - t0
                    if state in ("suspect", "dead") and w not in seen_suspect:
                        seen_suspect.add(w)
                        suspect[w].append(now)
                    if state == "dead":
                        dead[w].append(now)
                        pending.discard(w)
            time.sleep(POLL_S)
        if pending:
            raise RuntimeError(f"{sorted(pending)} never reported {victim} dead in {within:g}s")
        t1 = time.monotonic()
        cluster.start(victim)
        cluster.wait_all_alive()
        rejoin.append(time.monotonic() - t1)
    after = cluster.suspicions(of=victim)
    both = [max(a, b) for a, b in zip(dead[watchers[0]], dead[watchers[1]], strict=True)]
    return {
        "kills": kills,
        "poll_s": POLL_S,
        "suspect_s": {
            w: stats(v) | {"samples": [round(x, 3) for x in v]} for w, v in suspect.items()
        },
        "dead_s": {w: stats(v) | {"samples": [round(x, 3) for x in v]} for w, v in dead.items()},
        "dead_at_both_s": stats(both) | {"samples": [round(x, 3) for x in both]},
        "all_alive_after_restart_s": stats(rejoin),
        "false_suspicions_of_survivors": {n: after[n] - before[n] for n in NAMES},
        "memberlist": memberlist_expected(len(NAMES), SwimConfig()),
    }


# -- the run ----------------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    q = r.get("quiet")
    if q:
        print(f"\nquiet {q['seconds']:g} s: false suspicions {q['false_suspicions']}")
    if "suspicions_under_load" in r:
        print(f"false suspicions during routing + placement: {r['suspicions_under_load']}")
    rt = r.get("routing")
    if rt:
        print("\nrouting (ms)          direct p50/p95     via non-owner p50/p95   added p50 "
              "(paired median)   non-owner CPU/call")  # fmt: skip
        for label, x in rt.items():
            d, v = x["direct_ms"], x["routed_ms"]
            print(f"  {label:26} {d['p50']:7.2f} / {d['p95']:7.2f}   {v['p50']:7.2f} / "
                  f"{v['p95']:7.2f}   {x['added_p50_ms']:+7.2f} ({x['paired_diff_p50_ms']:+.2f})"
                  f"   {x['forwarder_cpu_ms_per_call']:.2f}")  # fmt: skip
    pl = r.get("placement")
    if pl:
        ok = all(pl["within_20pct"].values())
        print(f"\nplacement: {pl['creates']} creates through {NAMES[0]}: {pl['counts']} "
              f"(mean {pl['mean']:g}; each within +/-20 %: {'yes' if ok else 'no'})")  # fmt: skip
    det = r.get("detection")
    if det:
        print(f"\nfailure detection, {det['kills']} kills of {NAMES[2]} (s, p50 / p95):")
        for w in det["dead_s"]:
            s, d = det["suspect_s"][w], det["dead_s"][w]
            print(f"  {w}: suspect {s['p50']:.2f} / {s['p95']:.2f}, dead {d['p50']:.2f} / "
                  f"{d['p95']:.2f}")  # fmt: skip
        b, m = det["dead_at_both_s"], det["memberlist"]
        print(f"  suspicions of the survivors meanwhile: {det['false_suspicions_of_survivors']}")
        print(f"  dead at both: {b['p50']:.2f} / {b['p95']:.2f}; memberlist expected "
              f"{m['p50_s']:.2f} / {m['p95_s']:.2f} (range {m['min_s']:.1f}-{m['max_s']:.1f}, "
              f"suspect p50 {m['suspect_p50_s']:.2f})")  # fmt: skip
    for e in r.get("errors", []):
        print(f"error: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100, help="routing samples per path (default 100)")
    p.add_argument("--creates", type=int, default=30, help="placement creates (default 30)")
    p.add_argument("--kills", type=int, default=10, help="kill -9 rounds (default 10)")
    p.add_argument("--quiet", type=float, default=60.0, help="quiet seconds (default 60)")
    p.add_argument("--template", default="busybox", help="template (default busybox)")
    p.add_argument("--home", type=Path, help="built home with bundle and templates "
                   "(default $AENV_TEST_HOME, else .state/test-home)")  # fmt: skip
    p.add_argument("--cidrs", default=",".join(SLOT_CIDRS),
                   help="the three nodes' slot ranges, comma-separated")  # fmt: skip
    p.add_argument("--skip", action="append", default=[],
                   choices=("quiet", "routing", "placement", "detection"))  # fmt: skip
    args = p.parse_args(argv)
    built = bench_home(p, args.home)
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    report: dict[str, Any] = {
        "started": started.isoformat(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "errors": [],
    }
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-cluster-"))
    cidrs = tuple(args.cidrs.split(","))
    if len(cidrs) != len(NAMES):
        p.error(f"--cidrs needs {len(NAMES)} ranges")
    cluster = Cluster(built, work, cidrs)
    try:
        with sdk_env(cluster):
            for name in NAMES:
                cluster.start(name)
            report["all_alive_s"] = round(cluster.wait_all_alive(), 3)
            print(f"3 nodes alive; load average {os.getloadavg()[0]:.2f}", flush=True)
            # the first create boots the template; warm each node once, untimed
            from e2b import Sandbox

            for name in NAMES:
                Sandbox.create(
                    args.template, api_headers={HOP_HEADER: "bench"}, **via(cluster.url(name))
                ).kill()
            steps: list[tuple[str, Callable[[], Any]]] = [
                ("quiet", lambda: bench_quiet(cluster, args.quiet)),
                ("routing", lambda: bench_routing(cluster, args.template, args.n)),
                ("placement", lambda: bench_placement(cluster, args.template, args.creates)),
                ("detection", lambda: bench_detection(cluster, args.kills)),
            ]
            before_load: dict[str, int] | None = None
            for name, step in steps:
                if name in args.skip:
                    continue
                if name == "routing":
                    before_load = cluster.suspicions()
                if name == "detection" and before_load is not None:
                    now = cluster.suspicions()
                    report["suspicions_under_load"] = {n: now[n] - before_load[n] for n in NAMES}
                print(f"{name} ...", flush=True)
                t0 = time.monotonic()
                try:
                    report[name] = step()
                except Exception as e:
                    report["errors"].append(f"{name}: {e!r}")
                    print(f"{name} failed: {e!r}", file=sys.stderr)
                report.setdefault("step_seconds", {})[name] = round(time.monotonic() - t0, 1)
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaning up", file=sys.stderr)
        report["errors"].append("interrupted")
    finally:
        problems = cluster.stop()
        if problems:
            report["errors"] += problems
            for name in NAMES:
                log = work / name / "node.log"
                if log.exists():
                    tail = log.read_text(errors="replace").splitlines()[-30:]
                    print(f"--- {name} log ---\n" + "\n".join(tail), file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    report["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["seconds"] = round((datetime.datetime.now(datetime.UTC) - started).total_seconds(), 1)
    print_report(report)
    print(f"\nload average {report['host']['loadavg_start']} at start, "
          f"{report['host']['loadavg_end']} at end; {report['seconds']:.0f} s")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cluster-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
