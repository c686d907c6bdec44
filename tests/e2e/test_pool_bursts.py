"""Creates from the pool: bursts of concurrent creates through the real e2b SDK.

Rules: a node of this module's own (private home with the built bundle and
templates linked, netns prefix `aenvpb` and slots in 10.217.0.0/16, both
overridable), its pool small and quick to shrink (`AENV_POOL_SIZE=1`,
`AENV_POOL_MAX=6`, `AENV_POOL_HALF_LIFE=20`);
loopback only; every sandbox created is killed. Behaviour, not timing: every
create of a burst succeeds with a sandbox of its own (its ID, its env vars,
its metadata, its token: one sandbox's token does not open another's envd),
the pool grows beyond its minimum after a burst and shrinks back once the
bursts stop (`aenv_pool_ready` on /metrics), and a later burst is served
from it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import (
    NodeProc,
    private_node,
    requires_node,
)

pytestmark = [requires_node, pytest.mark.runsc, pytest.mark.slow]

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")
BURST = 6
PREFIX = os.environ.get("AENV_TEST_POOL_PREFIX", "aenvpb")
SLOT_CIDR = os.environ.get("AENV_TEST_POOL_CIDR", "10.217.0.0/16")


@pytest.fixture(scope="module")
def pool_node() -> Iterator[NodeProc]:
    env = {"AENV_NET_PREFIX": PREFIX, "AENV_SLOT_CIDR": SLOT_CIDR,
           "AENV_POOL_SIZE": "1", "AENV_POOL_MAX": str(BURST), "AENV_POOL_HALF_LIFE": "20"}  # fmt: skip
    with private_node(env, leak_prefix=PREFIX) as node:
        yield node


def _ready(node: NodeProc) -> int:
    text = httpx.get(f"{node.url}/metrics", headers={"X-API-Key": node.api_key}).text
    lines = [line for line in text.splitlines() if line.startswith("aenv_pool_ready{")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines))


def _wait(what: str, predicate: object, limit_s: float = 120.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {limit_s:g} s"
        time.sleep(0.5)


def _adopted(node: NodeProc, sandbox_id: str) -> bool:
    logs = httpx.get(
        f"{node.url}/sandboxes/{sandbox_id}/logs", headers={"X-API-Key": node.api_key}
    ).json()["logs"]
    return any("adopted from the pool" in e["line"] for e in logs)


def _burst(node: NodeProc, tag: str) -> list[tuple[Sandbox, bool]]:
    """BURST creates at once, each with env vars and metadata of its own; each
    checked to be its own sandbox. Returns them with whether each came from the pool."""
    barrier = threading.Barrier(BURST)

    def create(i: int) -> tuple[Sandbox, bool]:
        barrier.wait(timeout=60)
        who = f"{tag}-{i}"
        sbx = Sandbox.create(TEMPLATE, timeout=300, envs={"WHO": who}, metadata={"who": who})
        return sbx, _adopted(node, sbx.sandbox_id)

    with concurrent.futures.ThreadPoolExecutor(BURST) as ex:
        got = list(ex.map(create, range(BURST)))
    sandboxes = [s for s, _ in got]
    assert len({s.sandbox_id for s in sandboxes}) == BURST
    for i, sbx in enumerate(sandboxes):
        who = f"{tag}-{i}"
        assert sbx.commands.run("echo $WHO").stdout.strip() == who
        assert sbx.get_info().metadata == {"who": who}
        # no file of another create's sandbox, and this one's stays its own
        assert sbx.commands.run("ls /tmp/who-* 2>/dev/null; true").stdout.strip() == ""
        sbx.files.write(f"/tmp/who-{who}", who)
    # a sandbox's envd takes its own token and refuses the others'
    first, second = sandboxes[0], sandboxes[1]
    url = node.url + "/process.Process/List"
    route = {"E2b-Sandbox-Id": first.sandbox_id, "E2b-Sandbox-Port": "49983",
             "content-type": "application/json", "connect-protocol-version": "1"}  # fmt: skip
    for token, status in ((second._envd_access_token, 401), (first._envd_access_token, 200)):
        assert token
        r = httpx.post(url, headers={**route, "X-Access-Token": token}, content=b"{}")
        assert r.status_code == status, r.text
    return got


def test_bursts_of_creates_get_sandboxes_of_their_own_and_the_pool_follows_demand(
    pool_node: NodeProc,
) -> None:
    node = pool_node
    for _ in range(2):  # the template becomes a snapshot, and hot
        Sandbox.create(TEMPLATE, timeout=60).kill()
    _wait("the template is a snapshot", lambda: "is now a snapshot" in node.log_tail(400))
    Sandbox.create(TEMPLATE, timeout=60).kill()
    created: list[Sandbox] = []
    try:
        first = _burst(node, "a")
        created += [s for s, _ in first]
        for sbx in created:
            sbx.kill()
        # the pool grew beyond AENV_POOL_SIZE, towards the burst's size
        _wait("the pool grows", lambda: _ready(node) >= 3)
        second = _burst(node, "b")
        created += [s for s, _ in second]
        assert sum(adopted for _, adopted in second) >= 3, second
        for sbx, _ in second:
            sbx.kill()
        # no more creates: it shrinks back to AENV_POOL_SIZE
        _wait("the pool shrinks back", lambda: _ready(node) == 1, limit_s=240)
    finally:
        for sbx in created:
            with contextlib.suppress(Exception):
                sbx.kill()
