"""How much scheduling one Connect `Start` costs envd: trio rounds and socket writes.

Under gVisor every round of trio's scheduler is a round trip through the
sandbox's kernel (an `epoll_wait`, wake-ups, context switches) and every
socket write a system call and a segment the node's proxy wakes up for;
these are what envd adds to a command besides the spawn itself. This runs
envd's app in this process, on the host (loopback, port 0; a resident
spawner as in a sandbox), and a client process that sends `--n` raw
`process.Process/Start`s of `/bin/true` (HTTP/1.1, kept-alive connection)
one after another; a trio instrument counts the rounds (I/O waits) and the
writes envd makes while they run. The counts do not depend on the
machine's load, unlike the latencies, which it prints too. `--trace` prints
the tasks that ran in each round of one call.

    .venv/bin/python bench/envd_rounds.py [--n 100] [--trace]

A/B: run it with `PYTHONPATH` pointing at another tree's `aenv`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio
from hypercorn.trio import serve

if "aenv" not in sys.modules and not any(Path(p, "aenv").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd import server
from aenv.envd.app import EnvdApp
from aenv.envd.spawner import SpawnerClient, fork_spawner
from aenv.envd.state import EnvdState

CLIENT = r"""
import httpx, json, struct, sys, time
url, n = sys.argv[1], int(sys.argv[2])
body = json.dumps({"process": {"cmd": "/bin/true", "args": []}}).encode()
envelope = struct.pack(">BI", 0, len(body)) + body
headers = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
with httpx.Client(base_url=url, timeout=10) as c:
    for _ in range(3):
        c.post("/process.Process/Start", content=envelope, headers=headers)
    print("ready", flush=True)
    sys.stdin.readline()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        r = c.post("/process.Process/Start", content=envelope, headers=headers)
        took.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200 and b'"end"' in r.content, r.content
    took.sort()
    print(json.dumps({"p50_ms": took[len(took) // 2], "min_ms": took[0]}), flush=True)
"""


class Rounds(trio.abc.Instrument):
    """Counts I/O waits (one per round of the scheduler), optionally with the tasks of each."""

    def __init__(self, trace: bool) -> None:
        self.on = False
        self.rounds = 0
        self.trace = trace
        self.log: list[list[str]] = [[]]

    def before_io_wait(self, timeout: float) -> None:
        if self.on:
            self.rounds += 1
            if self.trace:
                self.log.append([])

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on and self.trace:
            self.log[-1].append(task.name.rsplit(".", 1)[-1])


async def measure(n: int, trace: bool) -> dict[str, Any]:
    rounds = Rounds(trace)
    trio.lowlevel.add_instrument(rounds)
    writes = [0]
    send_all = trio.SocketStream.send_all

    async def counted(self: trio.SocketStream, data: bytes | bytearray | memoryview) -> None:
        if rounds.on:
            writes[0] += 1
        await send_all(self, data)

    trio.SocketStream.send_all = counted  # type: ignore[method-assign]
    server.guard_hypercorn_h2()
    server.guard_hypercorn_idle_close()
    coalesce = getattr(server, "coalesce_hypercorn_h11_writes", None)
    if coalesce is not None:  # (absent in older trees)
        coalesce()
    spawner = SpawnerClient(*fork_spawner(1024))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spawner.run)
        state = EnvdState()
        state.process_limit = 1024
        app = EnvdApp(nursery, state=state, spawner=spawner)
        config = server.hypercorn_config("127.0.0.1", 0)
        binds = await nursery.start(serve, app, config)  # type: ignore[arg-type]
        client = await trio.lowlevel.open_process(
            [sys.executable, "-c", CLIENT, binds[0], str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert client.stdin is not None and client.stdout is not None
        out = b""
        while b"ready" not in out:
            out += await client.stdout.receive_some(1024)
        rounds.on = True
        await client.stdin.send_all(b"\n")
        out = b""
        while b"}" not in out:
            out += await client.stdout.receive_some(1024)
        rounds.on = False
        await client.wait()
        nursery.cancel_scope.cancel()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result.update(rounds_per_start=rounds.rounds / n, writes_per_start=writes[0] / n)
    if trace:
        result["rounds"] = [" ".join(tasks) for tasks in rounds.log]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100, help="Starts to count over")
    p.add_argument("--trace", action="store_true", help="one call, its rounds' tasks")
    args = p.parse_args(argv)
    result = trio.run(measure, 1 if args.trace else args.n, args.trace)
    for line in result.pop("rounds", []):
        print(line)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
