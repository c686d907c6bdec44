"""Fork with the real e2b SDK: one capture, independent children, source unchanged.

Rules: loopback only; the session `node`; each test kills the source and every
child it made. Children must keep the source's running processes (a counter
loop) and files, and a write in one is invisible to the others and the source.
A fork works whatever the source did before (tests.e2e.sequences: stdin
closed, a PTY session, killed or still running background commands).
"""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import NodeProc, requires_node
from tests.e2e.counter import COUNTER, counts_on
from tests.e2e.sequences import KEPT, SEQUENCES, answers

pytestmark = [requires_node, pytest.mark.runsc]


def test_fork_three_independent_children(node: NodeProc) -> None:
    src = Sandbox.create("base", timeout=300)
    children: list[Sandbox] = []
    try:
        src.commands.run(COUNTER, background=True)
        src.files.write("/home/user/shared.txt", "from the source")
        time.sleep(1)
        end_before = src.get_info().end_at
        results = src.fork(count=3, timeout=120)
        children = [r for r in results if isinstance(r, Sandbox)]
        assert len(children) == 3, results
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 3 and src.sandbox_id not in ids
        # the source keeps its ID, its TTL and its processes
        # (end_at is derived from the clock at each call: allow its jitter, not the capture)
        assert abs((src.get_info().end_at - end_before).total_seconds()) < 0.5
        counts_on(src)
        for i, c in enumerate(children):
            # each child carries on the source's counter and sees its files
            assert counts_on(c) > 0
            assert c.files.read("/home/user/shared.txt") == "from the source"
            c.files.write("/home/user/mine.txt", f"child {i}")
            assert c._envd_access_token != src._envd_access_token
        for i, c in enumerate(children):
            assert c.files.read("/home/user/mine.txt") == f"child {i}"
        assert not src.files.exists("/home/user/mine.txt")
        # each child has its own network: a server in one is not the other's
        children[0].commands.run("cd /tmp && python3 -m http.server 8085", background=True)
        headers = {"E2b-Sandbox-Id": children[0].sandbox_id, "E2b-Sandbox-Port": "8085"}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if httpx.get(node.url + "/", headers=headers, timeout=5).status_code == 200:
                break
            time.sleep(0.3)
        other = {"E2b-Sandbox-Id": children[1].sandbox_id, "E2b-Sandbox-Port": "8085"}
        assert httpx.get(node.url + "/", headers=other, timeout=5).status_code == 502
    finally:
        for c in children:
            Sandbox.kill(c.sandbox_id)
        src.kill()


def test_fork_count_is_bounded(node: NodeProc) -> None:
    src = Sandbox.create("busybox")
    h = {"X-API-Key": node.api_key}
    try:
        for body in ({"count": 0}, {"count": 21}, {"count": "2"}):
            r = httpx.post(f"{node.url}/sandboxes/{src.sandbox_id}/fork", json=body, headers=h)
            assert r.status_code == 400, body
        src.pause()
        r = httpx.post(f"{node.url}/sandboxes/{src.sandbox_id}/fork", json={"count": 1}, headers=h)
        assert r.status_code == 409
    finally:
        src.kill()


def _fork(src: Sandbox, count: int = 2) -> list[Sandbox]:
    results = src.fork(count=count, timeout=120)
    children = [r for r in results if isinstance(r, Sandbox)]
    if len(children) != count:
        for c in children:
            Sandbox.kill(c.sandbox_id)
        raise AssertionError(results)
    return children


@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_fork_after_what_the_source_did(node: NodeProc, sequence: str) -> None:
    """Every child answers at once, and so does the source (envd's idle connections
    from the SDK's calls are closed on both sides before the image is taken)."""
    src = Sandbox.create("base", timeout=300)
    children: list[Sandbox] = []
    try:
        SEQUENCES[sequence](src)
        src.files.write("/home/user/kept.txt", KEPT)
        children = _fork(src)
        for c in children:
            answers(c)
        answers(src)
    finally:
        for c in children:
            Sandbox.kill(c.sandbox_id)
        src.kill()


def test_fork_with_a_background_command_running(node: NodeProc) -> None:
    """Each child and the source have their own copy of it, and each kills its own."""
    src = Sandbox.create("base", timeout=300)
    children: list[Sandbox] = []
    try:
        pid = src.commands.run("sleep 1000", background=True, stdin=True).pid
        src.files.write("/home/user/kept.txt", KEPT)
        children = _fork(src)
        for c in [*children, src]:
            answers(c)
            assert pid in {p.pid for p in c.commands.list()}
        assert children[0].commands.kill(pid)
        deadline = time.monotonic() + 10
        while pid in {p.pid for p in children[0].commands.list()}:
            assert time.monotonic() < deadline, "the killed command still runs"
            time.sleep(0.1)
        # the others still have theirs
        for c in [children[1], src]:
            assert pid in {p.pid for p in c.commands.list()}
            assert c.commands.kill(pid)
    finally:
        for c in children:
            Sandbox.kill(c.sandbox_id)
        src.kill()
