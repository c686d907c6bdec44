"""SWIM membership at 1,000 simulated members: failure detection, false positives, bytes.

Runs the sans-IO membership core (`aenv.proto.swim`, memberlist's LAN
defaults) in the in-process network of `tests/proto/swim_sim.py`: a virtual
clock, no sockets, every message lost independently with probability
`--loss` (default 1 %, 5 % and 10 %, one run each), latency uniform in
`--latency-ms` (default 0.5-3 ms). Members start out knowing each other (a
converged cluster); after `--warmup` seconds (default 10) of steady state,
`--kills` members (default 10) are killed one every `--spacing` seconds
(default 2), and the run goes on until every live member knows every killed
one is dead (or `--limit` seconds after the last kill). Measured, per loss:

- **knows dead**: for every (killed member, live member) pair, the time from
  the kill until that member reports it dead; p50/p95 over all pairs;
- **all know**: per kill, until the last live member knows; p50/p95 over kills;
- **first dead**: per kill, until the first member declares it dead;
- **false suspicions / deaths**: distinct (member, incarnation) suspicions and
  deaths of members that were not killed (a suspicion refuted by its member is
  one false suspicion however many members heard it); refutations;
- **bytes/member/s**: bytes sent per member per second as compact JSON, in the
  steady-state window (probes, acks, gossip) plus push-pull amortised over its
  scaled interval (the run is shorter than one push-pull round at 1,000
  members: 180 s); and over the failure window (warm-up end to run end).

Next to it, the **memberlist model** for the same size and loss, from
memberlist's own defaults and formulas (hashicorp/memberlist config.go
`DefaultLANConfig`, util.go `suspicionTimeout`, suspicion.go): a dead member is
first probed after about one probe interval and suspected after one more; it
is declared dead `suspicion_mult * log10(n) * probe_interval` = 12 s later at
best (two independent confirmations; 72 s without); the death then spreads as
the Serf convergence simulator computes (serf.io/docs/internals/simulator.html:
logistic spread with fanout 3 every 200 ms, to 99.99 %). Its bandwidth figure
is the simulator's "estimated max bandwidth": 1,400-byte UDP packets to 3
members 5 times a second, sent and received (an upper bound; memberlist sends
a gossip packet only when something is pending). memberlist publishes no false
positive rates for random loss; the Lifeguard paper (arXiv:1707.00788)
reports Lifeguard cutting SWIM's false positives by more than 50x under slow
message processing.

A second scenario checks Lifeguard where it matters, a slow member: in a
cluster of `--slow-members` (default 100) without loss, one member handles
every message 1.2 s late (starved of CPU) for 120 s, once with local health
and once without (`awareness_max_multiplier=1`); counted are the members it
falsely suspects, the suspicions of it, and deaths.

Results go to bench/results/swim-<UTC timestamp>.json. Pure Python, one
process; the default run takes 2-3 minutes on 2 cores (about 100 s of CPU).

    .venv/bin/python bench/swim.py [--members 1000] [--loss 0.01,0.05,0.10] [--kills 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.proto.swim import (  # noqa: E402
    Event,
    EventKind,
    SwimConfig,
    push_pull_interval,
    suspicion_timeout,
)
from tests.proto.swim_sim import SimNetwork  # noqa: E402

RESULTS = REPO / "bench" / "results"
# What the shell will gossip: capacity, load, cached templates, draining.
META = {
    "capacity": {"cpus": 16, "memory": 68719476736, "disk": 500107862016},
    "load": {"cpu": 0.31, "memory": 0.42, "sandboxes": 37, "free_disk": 312345678901},
    "templates": ["base", "busybox", "python-3.12", "node-22"],
    "draining": False,
}


def percentile(samples: Sequence[float], q: int) -> float | None:
    if not samples:
        return None
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


@dataclass
class Outcome:
    loss: float
    members: int
    kills: int
    knows_dead: list[float] = field(default_factory=list)  # per (kill, observer)
    all_know: list[float] = field(default_factory=list)  # per kill
    first_dead: list[float] = field(default_factory=list)  # per kill
    never_knew: int = 0
    false_suspicions: int = 0
    false_deaths: int = 0
    false_death_reports: int = 0
    refutations: int = 0
    steady_bps: float = 0.0  # probes, acks, gossip: bytes/member/s
    push_pull_bps: float = 0.0  # amortised
    failure_bps: float = 0.0
    msgs_per_s: float = 0.0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("knows_dead", "all_know", "first_dead"):
            samples = out.pop(key)
            out[key] = {"n": len(samples), "p50_s": percentile(samples, 50),
                        "p95_s": percentile(samples, 95),
                        "max_s": max(samples) if samples else None}  # fmt: skip
        return out


def run(n: int, loss: float, args: argparse.Namespace) -> Outcome:
    started = time.perf_counter()
    config = SwimConfig()
    lat = tuple(float(x) / 1000 for x in args.latency_ms.split(","))
    net = SimNetwork(loss=loss, latency=(lat[0], lat[1]), seed=args.seed, config=config,
                     wire="size", record=False)  # fmt: skip
    names = [f"node-{i:04d}" for i in range(n)]
    killed_at: dict[str, float] = {}
    dead_seen: dict[str, dict[str, float]] = {}
    first_dead: dict[str, float] = {}
    false_sus: set[tuple[str, int]] = set()
    false_dead: set[tuple[str, int]] = set()
    out = Outcome(loss, n, args.kills)

    def listen(at: float, observer: str, e: Event) -> None:
        mid = e.member.id
        victim = mid in killed_at and at >= killed_at[mid]
        if e.kind is EventKind.DEAD:
            if victim:
                dead_seen[mid].setdefault(observer, at)
                first_dead.setdefault(mid, at)
            else:
                false_dead.add((mid, e.member.incarnation))
                out.false_death_reports += 1
        elif e.kind is EventKind.SUSPECT and not victim:
            false_sus.add((mid, e.member.incarnation))

    net.listeners.append(listen)
    net.bootstrap(names, meta=META)
    warm = args.warmup
    net.run_until(warm / 2)
    b0, m0, k0 = _sent(net), _msgs(net), dict(net.bytes_by_kind)
    net.run_until(warm)
    b1, m1 = _sent(net), _msgs(net)
    window = warm / 2
    sync_bytes = net.bytes_by_kind["sync"] - k0.get("sync", 0)
    reply_bytes = net.bytes_by_kind["sync-reply"] - k0.get("sync-reply", 0)
    out.steady_bps = (b1 - b0 - sync_bytes - reply_bytes) / n / window
    # push-pull: one sync and one reply per member per scaled interval
    sync_size = _average_size(net, ("sync", "sync-reply"))
    out.push_pull_bps = 2 * sync_size / push_pull_interval(config.push_pull_interval, n)
    out.msgs_per_s = (m1 - m0) / n / window

    step = max(1, n // (args.kills + 1))
    victims = [names[(i + 1) * step] for i in range(args.kills)]
    for i, v in enumerate(victims):
        net.run_until(warm + i * args.spacing)
        net.kill(v)
        killed_at[v] = net.now
        dead_seen[v] = {}
    live = [x for x in names if x not in killed_at]

    def everyone_knows() -> bool:
        return all(len(dead_seen[v]) >= len(live) for v in victims)

    end = warm + (args.kills - 1) * args.spacing + args.limit
    net.run_until(end, stop=everyone_knows)
    out.failure_bps = (_sent(net) - b1) / n / max(1e-9, net.now - warm)
    for v in victims:
        seen = {o: t for o, t in dead_seen[v].items() if o in live}
        out.knows_dead += [t - killed_at[v] for t in seen.values()]
        out.never_knew += len(live) - len(seen)
        if len(seen) == len(live):
            out.all_know.append(max(seen.values()) - killed_at[v])
        if v in first_dead:
            out.first_dead.append(first_dead[v] - killed_at[v])
    out.false_suspicions = len(false_sus)
    out.false_deaths = len(false_dead)
    out.refutations = sum(node.swim.statistics().refutations for node in net.nodes.values())
    out.bytes_by_kind = dict(net.bytes_by_kind)
    out.sim_seconds = net.now
    out.wall_seconds = time.perf_counter() - started
    return out


def run_slow(n: int, lifeguard: bool, args: argparse.Namespace) -> dict[str, Any]:
    config = SwimConfig(awareness_max_multiplier=8 if lifeguard else 1)
    net = SimNetwork(seed=args.seed, config=config, wire="off", record=False)
    names = [f"node-{i:04d}" for i in range(n)]
    slow = names[n // 2]
    accused: set[tuple[str, int]] = set()
    suspected: set[int] = set()
    deaths = 0

    def listen(at: float, observer: str, e: Event) -> None:
        nonlocal deaths
        if e.kind is EventKind.SUSPECT:
            if e.member.id == slow:
                suspected.add(e.member.incarnation)
            else:
                accused.add((e.member.id, e.member.incarnation))
        elif e.kind is EventKind.DEAD:
            deaths += 1

    net.listeners.append(listen)
    net.bootstrap(names, meta=META)
    net.run_until(5.0)
    net.set_slow(slow, 1.2)
    net.run_until(125.0)
    swim = net.nodes[slow].swim
    return {"members": n, "lifeguard": lifeguard, "others_falsely_suspected": len(accused),
            "slow_one_suspected": len(suspected), "deaths": deaths,
            "slow_health_score": swim.health_score,
            "slow_probes": swim.statistics().probes}  # fmt: skip


def slow_table(rows: list[dict[str, Any]]) -> str:
    head = ("slow member (1.2 s late), 120 s", "members", "others falsely suspected",
            "slow one suspected", "deaths", "its probes", "its health score")  # fmt: skip
    body = [
        (f"Lifeguard {'on' if r['lifeguard'] else 'off'}", str(r["members"]),
         str(r["others_falsely_suspected"]), str(r["slow_one_suspected"]), str(r["deaths"]),
         str(r["slow_probes"]), str(r["slow_health_score"]))
        for r in rows
    ]  # fmt: skip
    return "\n".join(_grid([head, *body]))


def _sent(net: SimNetwork) -> int:
    return sum(node.bytes_sent for node in net.nodes.values())


def _msgs(net: SimNetwork) -> int:
    return sum(node.messages_sent for node in net.nodes.values())


def _average_size(net: SimNetwork, kinds: tuple[str, ...]) -> float:
    count = sum(net.sent_by_kind[k] for k in kinds)
    return sum(net.bytes_by_kind[k] for k in kinds) / count if count else 0.0


@dataclass(frozen=True)
class Model:
    """memberlist's expected behaviour for n members at a loss rate (see the docstring)."""

    n: int
    loss: float

    @property
    def suspicion_min(self) -> float:
        return suspicion_timeout(4, self.n, 1.0)

    @property
    def suspicion_max(self) -> float:
        return 6 * self.suspicion_min

    @property
    def spread(self) -> float:
        """Serf simulator: seconds until 99.99 % of members have a gossiped update."""
        n, fanout, interval, p = self.n, 3, 0.2, 0.9999
        contact = fanout / n * (1 - self.loss)
        rounds = math.log((n + 1) * p / (1 - p)) / (contact * n)
        return rounds * interval

    @property
    def all_know(self) -> float:
        # first probe of the dead member ~1 s, that probe fails after 1 s more
        return 2.0 + self.suspicion_min + self.spread

    @property
    def max_bandwidth(self) -> float:
        return 1400 * 3 * (1 / 0.2) * 2  # bytes/s, sent + received


def _model_json(m: Model) -> dict[str, float]:
    return {"loss": m.loss, "suspicion_min_s": m.suspicion_min,
            "suspicion_max_s": m.suspicion_max, "spread_s": m.spread,
            "all_know_s": m.all_know, "max_bandwidth_bps": m.max_bandwidth}  # fmt: skip


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{unit}"


def _grid(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def table(outcomes: list[Outcome]) -> str:
    head = ("", "loss", "knows dead p50/p95 s", "all know p50/p95 s", "first dead p50 s",
            "false susp.", "false deaths", "refutations", "B/member/s steady+pp",
            "B/member/s failure", "msgs/member/s")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for o in outcomes:
        m = Model(o.members, o.loss)
        rows.append((
            f"aenv swim, {o.members} members", f"{o.loss:.0%}",
            f"{_fmt(percentile(o.knows_dead, 50))} / {_fmt(percentile(o.knows_dead, 95))}",
            f"{_fmt(percentile(o.all_know, 50))} / {_fmt(percentile(o.all_know, 95))}",
            _fmt(percentile(o.first_dead, 50)),
            str(o.false_suspicions), str(o.false_deaths), str(o.refutations),
            f"{o.steady_bps + o.push_pull_bps:.0f} ({o.steady_bps:.0f}+{o.push_pull_bps:.0f})",
            f"{o.failure_bps:.0f}", f"{o.msgs_per_s:.1f}",
        ))  # fmt: skip
        rows.append((
            "  memberlist model", f"{o.loss:.0%}", "-",
            f"{m.all_know:.1f} ({m.suspicion_min:.0f} + {m.spread:.1f} + 2)",
            f"{m.all_know - m.spread:.1f} (max {m.suspicion_max + 2:.0f})",
            "-", "-", "-", f"<= {m.max_bandwidth:.0f}", "-", "-",
        ))  # fmt: skip
    lines = _grid(rows)
    lines.append(
        "(seconds from the kill; 'knows dead' over every (killed, live member) pair, 'all "
        "know' and 'first dead' over kills; bytes are compact JSON sent per member; "
        "pp = push-pull amortised over its scaled interval; memberlist model: best-case "
        "suspicion timeout + Serf simulator spread + ~2 s to a first failed probe, and the "
        "simulator's max bandwidth)"
    )
    for o in outcomes:
        if o.never_knew:
            lines.append(f"loss {o.loss:.0%}: {o.never_knew} (killed, member) pairs never knew")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--loss", default="0.01,0.05,0.10", help="comma-separated loss rates")
    p.add_argument("--kills", type=int, default=10, help="members killed per loss rate")
    p.add_argument("--spacing", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--warmup", type=float, default=10.0, help="steady state before the kills")
    p.add_argument("--limit", type=float, default=120.0, help="give up this long after a kill")
    p.add_argument("--latency-ms", default="0.5,3", help="min,max one-way latency")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slow-members", type=int, default=100, help="0 skips the slow member")
    args = p.parse_args(argv)
    losses = [float(x) for x in args.loss.split(",")]
    if args.members < args.kills + 3 or args.kills < 1:
        p.error("need --kills >= 1 and --members >= kills + 3")
    started = datetime.datetime.now(datetime.UTC)
    load_start = [round(x, 2) for x in os.getloadavg()]
    outcomes = []
    for loss in losses:
        print(f"{args.members} members, loss {loss:.0%}, {args.kills} kills ...", flush=True)
        o = run(args.members, loss, args)
        print(f"  {o.sim_seconds:.0f} s simulated in {o.wall_seconds:.0f} s", flush=True)
        outcomes.append(o)
    slow_rows = []
    if args.slow_members:
        print(f"{args.slow_members} members, one slow ...", flush=True)
        slow_rows = [run_slow(args.slow_members, lg, args) for lg in (True, False)]
    load_end = [round(x, 2) for x in os.getloadavg()]
    elapsed = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
    print()
    print(table(outcomes))
    if slow_rows:
        print()
        print(slow_table(slow_rows))
    print(f"\nload average {load_start} at start, {load_end} at end; "
          f"{os.cpu_count()} CPUs; {elapsed:.0f} s")  # fmt: skip
    report = {
        "started": started.isoformat(),
        "seconds": round(elapsed, 1),
        "args": vars(args),
        "config": SwimConfig().__dict__,
        "host": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": load_end},
        "runs": [o.to_json() for o in outcomes],
        "memberlist_model": [_model_json(Model(o.members, o.loss)) for o in outcomes],
        "slow_member": slow_rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"swim-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")
    never = sum(o.never_knew for o in outcomes)
    return 1 if never else 0


if __name__ == "__main__":
    sys.exit(main())
