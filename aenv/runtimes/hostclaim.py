"""This node's names, home and address range on its host, held while it runs.

Before a node touches the host (reaping what an earlier process left, making
slots) it claims what it will own: its names prefix (network namespaces,
veths, the nftables table and the cgroup parent all carry it), its home and
its slot range. `claim_host` writes `{claims_dir}/{prefix}.json` (by default
`/run/aenv`) and holds an flock on it for the node's life; the kernel drops
the lock however the process ends, so a claim file nobody holds is stale.
Another live claim with the same prefix, the same home or an overlapping
range, or addresses and routes of other programs inside the range, make the
claim fail with `HostConflict`, whose message says what to change. With no
range configured the claim picks a free one (`aenv.proto.netstate.pick_range`):
the range its own slots are in, else the one it used last, else the first
free of `AUTO_SLOT_CIDRS`. A registry lock (`{claims_dir}/.lock`, held for
milliseconds) makes checking and claiming one step for nodes starting at once.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from aenv.proto.netstate import (
    AUTO_SLOT_CIDRS,
    PREFIX_RE,
    Claim,
    claim_conflicts,
    pick_range,
    range_users,
)

log = logging.getLogger("aenv.runtimes.hostclaim")

CLAIMS_DIR: Final = Path("/run/aenv")


class HostConflict(RuntimeError):
    """Another node or program on this host holds what this node needs (the message
    says what, and which setting to change)."""


@dataclass
class HeldClaim:
    claim: Claim
    path: Path
    fd: int

    def release(self) -> None:
        """Drop the claim (blocking, quick): the file goes, then the lock."""
        with _registry(self.path.parent):
            self.path.unlink(missing_ok=True)
            os.close(self.fd)


@contextmanager
def _registry(claims_dir: Path) -> Iterator[None]:
    fd = os.open(claims_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(fd: int) -> Claim | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return Claim.from_json(data.decode(errors="replace"))


def _live_claims(claims_dir: Path, own: Path) -> list[Claim]:
    """The claims of the nodes running now (other than `own`); stale files go."""
    live: list[Claim] = []
    for path in sorted(claims_dir.glob("*.json")):
        if path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                claim = _read(fd)
                if claim is not None:
                    live.append(claim)
                continue
            path.unlink(missing_ok=True)  # its node is gone
        finally:
            os.close(fd)
    return live


def _some(items: Sequence[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def hold_claim(
    *,
    prefix: str,
    home: Path,
    cidr: str | None,
    claims_dir: Path,
    addresses: Sequence[tuple[str, str]],
    routes: Sequence[tuple[str, str]],
) -> HeldClaim:
    """`claim_host`'s work (blocking): `addresses` and `routes` are the host's,
    as (interface, address/prefixlen) and (interface, destination)."""
    claims_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    where = str(home.resolve())
    own_path = claims_dir / f"{prefix}.json"
    with _registry(claims_dir):
        others = _live_claims(claims_dir, own_path)
        fd = os.open(own_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd) or Claim(prefix=prefix, home="?", cidr="?")
                others.append(holder)
                previous = None
            else:
                last = _read(fd)
                previous = last.cidr if last is not None else None
            conflicts = claim_conflicts(prefix=prefix, home=where, cidr=cidr, others=others)
            if conflicts:
                # (each conflict says what to change)
                raise HostConflict("this node cannot start: " + "; ".join(conflicts))
            own = re.compile(rf"^{re.escape(prefix)}h\d+$")

            def users(c: str) -> list[str]:
                return range_users(c, addresses=addresses, routes=routes, own=own)

            def taken(c: str) -> bool:
                busy = claim_conflicts(prefix=prefix, home=where, cidr=c, others=others)
                return bool(busy or users(c))

            if cidr is None:
                chosen = pick_range(
                    candidates=AUTO_SLOT_CIDRS,
                    own_addresses=[a for dev, a in addresses if own.match(dev)],
                    previous=previous,
                    taken=taken,
                )
                if chosen is None:
                    raise HostConflict(
                        f"this node cannot start: every range it picks sandbox addresses from "
                        f"({AUTO_SLOT_CIDRS[-1]} to {AUTO_SLOT_CIDRS[0]}) is in use on this "
                        "host; set AENV_SLOT_CIDR to a free IPv4 range"
                    )
                cidr = chosen
            elif found := users(cidr):
                free = next((c for c in AUTO_SLOT_CIDRS if not taken(c)), None)
                raise HostConflict(
                    f"this node cannot start: its sandbox address range {cidr} "
                    f"(AENV_SLOT_CIDR) is in use on this host: {_some(found)}; set "
                    "AENV_SLOT_CIDR to a free range"
                    + (f" (such as {free})" if free else "")
                    + ", or unset it to have one picked"
                )
            claim = Claim(prefix=prefix, home=where, cidr=cidr, pid=os.getpid())
            os.ftruncate(fd, 0)
            os.pwrite(fd, claim.to_json().encode(), 0)
        except BaseException:
            os.close(fd)
            raise
    return HeldClaim(claim=claim, path=own_path, fd=fd)


async def _ip_json(*args: str) -> list[dict[str, object]]:
    proc = await trio.run_process(
        ["ip", "-j", *args], capture_stdout=True, capture_stderr=True, check=False
    )
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {err}")
    found = json.loads(proc.stdout or b"[]")
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


async def _addresses() -> list[tuple[str, str]]:
    """(interface, "address/prefixlen") of every IPv4 address on the host."""
    out: list[dict[str, Any]] = await _ip_json("-4", "addr", "show")
    return [
        (str(e.get("ifname", "")), f"{a['local']}/{a['prefixlen']}")
        for e in out
        for a in e.get("addr_info", [])
        if a.get("family") == "inet" and "local" in a and "prefixlen" in a
    ]


async def _routes() -> list[tuple[str, str]]:
    """(interface, destination) of the host's IPv4 routes (main table)."""
    out = await _ip_json("-4", "route", "show")
    return [(str(e.get("dev", "")), str(e["dst"])) for e in out if "dst" in e]


@asynccontextmanager
async def claim_host(
    *, prefix: str, home: Path, cidr: str | None, claims_dir: Path = CLAIMS_DIR
) -> AsyncIterator[Claim]:
    """Hold this node's claim on `prefix`, `home` and a slot range (`cidr`, or
    one picked if None) until the block is left; yields it (with the range).

    Raises `HostConflict` if another node or program holds any of them, and
    ValueError for a prefix or range aenv cannot use.
    """
    if not PREFIX_RE.match(prefix):
        raise ValueError(
            f"network names prefix must be 1-10 lowercase letters and digits, "
            f"starting with a letter (AENV_NET_PREFIX), got {prefix!r}"
        )
    if cidr is not None:
        try:
            ipaddress.IPv4Network(cidr)
        except ValueError as exc:
            raise ValueError(f"AENV_SLOT_CIDR {cidr!r} is not an IPv4 network: {exc}") from None
    addresses, routes = await _addresses(), await _routes()
    held = await trio.to_thread.run_sync(
        partial(
            hold_claim,
            prefix=prefix,
            home=home,
            cidr=cidr,
            claims_dir=claims_dir,
            addresses=addresses,
            routes=routes,
        )
    )
    log.info("network names prefix %s, sandbox addresses in %s", held.claim.prefix, held.claim.cidr)
    try:
        yield held.claim
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(held.release)
