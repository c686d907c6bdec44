"""Fixtures for runtime tests: the envd bundle, a busybox-only root layer, a netns.

The bundle is built once per session into pytest's base temp directory (the
storage tests share it by path; `build_bundle` is idempotent). The lower
layer holds nothing but a static busybox -- no libc, no Python -- so a
sandbox that runs Python proves the bundle is self-contained. Each `netns`
is `aenvtest-XXXX` with a veth whose host end is 10.213.N.1/30 and guest end
10.213.N.2/30 (traffic stays on that private pair); it is deleted afterwards.
`make_netns` makes as many as a test asks for (`tests.runtimes.nets`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runtimes.nets import Net, netns_maker


def _need_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    for tool in tools:
        if shutil.which(tool) is None and not Path(tool).exists():
            pytest.skip(f"needs {tool}")


@dataclass(frozen=True)
class Netns:
    name: str
    path: Path
    host_ip: str
    guest_ip: str


@pytest.fixture
def netns() -> Iterator[Netns]:
    _need_root_and("ip")
    tag = secrets.token_hex(2)
    name = f"aenvtest-{tag}"
    host_if, guest_if = f"aenvth{tag}", f"aenvtg{tag}"
    n = int(tag, 16) % 250 + 1
    host_ip, guest_ip = f"10.213.{n}.1", f"10.213.{n}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", guest_if)
        ip("link", "set", guest_if, "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "set", guest_if, "name", "eth0")
        ip("-n", name, "addr", "add", f"{guest_ip}/30", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        yield Netns(name, Path("/var/run/netns") / name, host_ip, guest_ip)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def make_netns() -> Iterator[Callable[[], Net]]:
    """Factory of private netns with a veth pair 10.214.N.1 (host) / .2 (guest)."""
    _need_root_and("ip")
    with netns_maker() as make:
        yield make
