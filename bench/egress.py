"""What the egress proxy adds to a sandbox's allowed HTTPS traffic, next to no proxy.

Builds the real path without runsc, so the numbers are the proxy's and the
network's, not gVisor's netstack: a small internet (`tests.egressnet`,
namespace `aenvcib`, its resolver, HTTP and HTTPS servers), a `HostNetwork`
(`aenv.runtimes.netns`, prefix `aenvcb`, slots in 10.232.200.0/24, the
node's real nftables table with the proxy's port) and the node's
`EgressProxy` in this process, asking the internet's resolver. Two slots:

- **direct**: policy `allowOut: [<server address>], denyOut: [0.0.0.0/0]`
  (an address rule: nftables only, no proxy);
- **proxied**: policy `allowOut: [allowed.test], denyOut: [0.0.0.0/0]`
  (a name rule: every TCP connection goes through the proxy, which reads the
  SNI, checks the address against the resolver, cached, and splices);
- **intercepted**: the same plus `network.rules` for `allowed.test` with a
  header holding a secret placeholder: the proxy terminates TLS with the
  node's egress CA (`aenv.node.egresstls`, in a temporary directory),
  verifies the server, resolves the placeholder and injects the header.

A client process runs in each slot's namespace (the sandbox's place) and,
`--n` times, opens a new TCP+TLS connection to `allowed.test:443`, sends
`GET /` and reads the answer; the time of each is one sample (p50/p95; the
difference is the proxy's added latency). Then it downloads `--mib` MiB
(`GET /bytes/N`, over TLS) `--repeat` times and reports the best MiB/s.
The slots alternate in the same run. `AENV_TEST_EGRESS_PREFIX`/`_SUBNET`
(see `tests.egressnet`) and `AENV_BENCH_EGRESS_SLOTS` move it off the
default names and ranges.

    sudo .venv/bin/python bench/egress.py [--n 300] [--mib 100] [--repeat 3]

Needs root, `ip` and `nft`. Leaves nothing behind (netns, veths, table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv.node.egresstls import NodeCA, interceptor, upstream_context  # noqa: E402
from aenv.proto.egressrules import Placeholder, parse_rules  # noqa: E402
from aenv.proto.netpolicy import EgressPolicy  # noqa: E402
from tests.egressnet import NAMES, PREFIX, open_internet, open_proxied_network  # noqa: E402

NS_PREFIX = PREFIX.removesuffix("i") + "b"
SLOTS = os.environ.get("AENV_BENCH_EGRESS_SLOTS", "10.232.200.0/24")

SERVER_IP = NAMES["allowed.test"][0]

CLIENT = r"""
import json, socket, ssl, sys, time
ip, ca, n, mib, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ctx = ssl.create_default_context(cafile=ca)
def one(path):
    s = socket.create_connection((ip, 443))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = ctx.wrap_socket(s, server_hostname="allowed.test")
    t.sendall(f"GET {path} HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n".encode())
    got = 0
    buf = bytearray(1 << 20)
    while True:
        k = t.recv_into(buf)
        if not k:
            break
        got += k
    t.close()
    return got
for _ in range(5):
    one("/")
lat = []
for _ in range(n):
    t0 = time.perf_counter()
    assert one("/") > 0
    lat.append((time.perf_counter() - t0) * 1000)
best = 0.0
for _ in range(repeat):
    t0 = time.perf_counter()
    got = one(f"/bytes/{mib << 20}")
    dt = time.perf_counter() - t0
    assert got >= mib << 20, got
    best = max(best, mib / dt)
print(json.dumps({"lat_ms": lat, "mib_s": best}))
"""


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


async def run_client(netns: str, ca: Path, n: int, mib: int, repeat: int) -> dict[str, object]:
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", CLIENT]
    argv += [SERVER_IP, str(ca), str(n), str(mib), str(repeat)]
    proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.decode()[-2000:])
    result: dict[str, object] = json.loads(proc.stdout)
    return result


async def reveal(_slot: int, _policy: EgressPolicy, _p: Placeholder) -> str:
    return "bench-secret-value"


async def bench(
    args: argparse.Namespace, ca: Path, node_ca: NodeCA, trusted: Path
) -> dict[str, dict[str, float]]:
    direct = EgressPolicy.from_request(
        allow_internet_access=None,
        network={"allowOut": [SERVER_IP], "denyOut": ["0.0.0.0/0"]},
    )
    named = EgressPolicy.from_request(
        allow_internet_access=None,
        network={"allowOut": ["allowed.test"], "denyOut": ["0.0.0.0/0"]},
    )
    rules = parse_rules(
        {"allowed.test": [{"transform": {"headers": {"X-Api-Key": "${e2b.secrets.k}"}}}]}
    )
    intercepted = dataclasses.replace(named, rules=rules.rules)
    results: dict[str, dict[str, list[float]]] = {
        k: {"lat": [], "mib_s": []} for k in ("direct", "proxied", "intercepted")
    }
    async with open_proxied_network(
        prefix=NS_PREFIX, slots=SLOTS, intercept=interceptor(node_ca, upstream_context(ca), reveal)
    ) as proxied:
        network, proxy = proxied.network, proxied.proxy
        cpu = cpu_tls = 0.0
        async with (
            network.open_slot(direct) as d,
            network.open_slot(named) as p,
            network.open_slot(intercepted) as i,
        ):
            for _ in range(args.rounds):
                for key, slot in (("direct", d), ("proxied", p), ("intercepted", i)):
                    t0 = time.process_time()
                    r = await run_client(
                        slot.netns_name, trusted, args.n // args.rounds, args.mib, args.repeat
                    )
                    if key == "proxied":
                        cpu += time.process_time() - t0
                    elif key == "intercepted":
                        cpu_tls += time.process_time() - t0
                    results[key]["lat"] += r["lat_ms"]  # type: ignore[arg-type]
                    results[key]["mib_s"].append(float(r["mib_s"]))  # type: ignore[arg-type]
        stats = proxy.statistics()
        print("proxy:", stats, file=sys.stderr)
        relayed = int(stats["bytes_in"]) + int(stats["bytes_out"])  # type: ignore[call-overload]
    out = {
        k: {
            "p50_ms": statistics.median(v["lat"]),
            "p95_ms": pct(v["lat"], 95),
            "mib_s": max(v["mib_s"]),
            "n": len(v["lat"]),
        }
        for k, v in results.items()
    }
    # the proxy runs in this process: its CPU time while the proxied client ran
    out["proxied"]["cpu_ms_per_100mib"] = cpu * 1000 / (relayed / (100 << 20))
    # the intercepted slot's downloads (its small latency requests aside)
    downloaded_mib = args.rounds * args.repeat * args.mib
    out["intercepted"]["cpu_ms_per_100mib"] = cpu_tls * 1000 / (downloaded_mib / 100)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--n", type=int, default=300, help="latency samples per path")
    parser.add_argument("--rounds", type=int, default=10, help="alternations of the two paths")
    parser.add_argument("--mib", type=int, default=100, help="download size (MiB)")
    parser.add_argument("--repeat", type=int, default=1, help="downloads per round (best kept)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces, nftables)")
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-egress-") as tmp,
        open_internet(Path(tmp), prefix="aenvcib") as net,
    ):
        node_ca = NodeCA(Path(tmp) / "egress-ca")
        trusted = Path(tmp) / "trusted.pem"  # the client trusts the server's CA and the node's
        trusted.write_text(net.ca_pem.read_text() + node_ca.cert_pem)
        out = trio.run(bench, args, net.ca_pem, node_ca, trusted)
    d, p, i = out["direct"], out["proxied"], out["intercepted"]
    print(f"{'path':10} {'p50 ms':>8} {'p95 ms':>8} {'MiB/s':>8}")
    for k, v in out.items():
        print(f"{k:10} {v['p50_ms']:8.2f} {v['p95_ms']:8.2f} {v['mib_s']:8.0f}")
    print(
        f"added by the proxy: p50 {p['p50_ms'] - d['p50_ms']:+.2f} ms, "
        f"p95 {p['p95_ms'] - d['p95_ms']:+.2f} ms; throughput {p['mib_s'] / d['mib_s']:.2f}x direct; "
        f"proxy CPU {p['cpu_ms_per_100mib']:.0f} ms per 100 MiB relayed"
    )
    print(
        f"added by interception: p50 {i['p50_ms'] - d['p50_ms']:+.2f} ms, "
        f"p95 {i['p95_ms'] - d['p95_ms']:+.2f} ms; throughput {i['mib_s'] / d['mib_s']:.2f}x direct; "
        f"proxy CPU {i['cpu_ms_per_100mib']:.0f} ms per 100 MiB downloaded"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
