"""Private network namespaces for runtime tests that need several per test.

`netns_maker()` yields a factory of netns, each with a veth pair
10.214.N.1 (host) / .2 (guest, `eth0`), all deleted when the block is left;
the `make_netns` fixture (conftest) wraps it. Needs root and `ip`.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Net:
    name: str
    path: Path
    host_ip: str
    guest_ip: str


@contextmanager
def netns_maker() -> Iterator[Callable[[], Net]]:
    made: list[tuple[str, str]] = []
    subnets: set[int] = set()

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def make() -> Net:
        tag = secrets.token_hex(2)
        name, host_if = f"aenvck-{tag}", f"aenvch{tag}"
        n = int(tag, 16) % 250 + 1
        while n in subnets:  # one test's slots never share a subnet
            n = n % 250 + 1
        subnets.add(n)
        host_ip, guest_ip = f"10.214.{n}.1", f"10.214.{n}.2"
        ip("netns", "add", name)
        made.append((name, host_if))
        ip("link", "add", host_if, "type", "veth", "peer", "name", f"aenvcg{tag}")
        ip("link", "set", f"aenvcg{tag}", "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "set", f"aenvcg{tag}", "name", "eth0")
        ip("-n", name, "addr", "add", f"{guest_ip}/30", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        return Net(name, Path("/var/run/netns") / name, host_ip, guest_ip)

    try:
        yield make
    finally:
        for name, host_if in made:
            subprocess.run(["ip", "link", "del", host_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
