"""A cluster of three real nodes in the lab, under real faults, with the real e2b SDK.

Rules: every node runs in its own network namespace and all share one S3
(moto) store (tests/cluster/lab.py). Through a node that does not own it, a
sandbox answers commands, files, PTY, its own ports and exec streams as if
called directly. A node that leaves, dies, stalls or is cut off is seen so
by the others within the failure detector's bounds, and calls for its
sandboxes answer a clear error at once, never hang; a node cut off from the
store stops serving its sandboxes; and in no fault does a sandbox run on two
nodes. Healed, everything works again.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from tests.cluster.lab import Lab, LabNode, requires_lab

pytestmark = [
    requires_lab,
    pytest.mark.runsc,
    pytest.mark.lab(nodes=3, store="s3", env={"AENV_POOL_SIZE": "0"}),
]

EVERYONE = {"node0": "alive", "node1": "alive", "node2": "alive"}


def members(node: LabNode) -> dict[str, str]:
    with node.client() as c:
        r = c.get("/cluster/members")
    r.raise_for_status()
    return {m["nodeID"]: m["state"] for m in r.json()}


def wait_members(lab: Lab, want: dict[str, str], *, on: list[int], within: float = 40) -> float:
    """Wait until nodes `on` all see `want`; returns how long it took."""
    t0 = time.monotonic()
    seen: dict[int, dict[str, str]] = {}
    while time.monotonic() - t0 < within:
        with contextlib.suppress(httpx.HTTPError):
            seen = {i: members(lab.node(i)) for i in on}
            if all(v == want for v in seen.values()):
                return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"never {want} on {on}: {seen}")


def sandbox_on(lab: Lab, index: int) -> Sandbox:
    """A sandbox created on node `index` itself (the hop header: no placement), for
    the SDK through node 0."""
    with lab.node(index).client(timeout=120) as c:
        r = c.post(
            "/sandboxes",
            json={"templateID": "base", "timeout": 300},
            headers={"x-aenv-hop": "test"},
        )
    r.raise_for_status()
    sid = r.json()["sandboxID"]
    assert r.json()["clientID"] == f"node{index}"
    return Sandbox.connect(sid, **lab.node(0).sdk())


@pytest.fixture
def formed(lab: Lab) -> Iterator[Lab]:
    wait_members(lab, EVERYONE, on=[0, 1, 2])
    yield lab


def test_calls_through_a_node_that_does_not_own_the_sandbox(formed: Lab) -> None:
    lab = formed
    sb = sandbox_on(lab, 1)
    try:
        assert Sandbox.get_info(sb.sandbox_id, **lab.node(0).sdk()).sandbox_id == sb.sandbox_id
        # commands, streamed output, files
        out: list[str] = []
        r = sb.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done", on_stdout=out.append)
        assert r.stdout.split() == ["line1", "line2", "line3"] and len(out) >= 2
        sb.files.write("/home/user/big.bin", b"x" * (3 << 20))
        assert len(sb.files.read("/home/user/big.bin", format="bytes")) == 3 << 20
        # a PTY session
        got = bytearray()
        pty = sb.pty.create(PtySize(rows=24, cols=80))
        sb.pty.send_stdin(pty.pid, b"echo pty-$((40+2)); exit 0\n")
        pty.wait(on_pty=got.extend)
        assert b"pty-42" in got
        # a port of the sandbox, through the proxy of the node that does not own it
        sb.commands.run("python3 -m http.server 8080 >/dev/null 2>&1", background=True)
        host = sb.get_host(8080)
        body = ""
        for _ in range(50):
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(
                    f"{lab.node(0).url}/",
                    headers={"e2b-sandbox-id": sb.sandbox_id, "e2b-sandbox-port": "8080"},
                    timeout=5,
                )
                if resp.status_code == 200:
                    body = resp.text
                    break
            time.sleep(0.2)
        assert "Directory listing" in body, host
        # the exec stream of the CLI, through node 0
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update({"AENV_URL": lab.node(0).url, "AENV_API_KEY": lab.api_key})
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "aenv",
                "exec",
                sb.sandbox_id,
                "--",
                "sh",
                "-c",
                "echo via-$((1+1)); exit 3",
            ],
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 3 and b"via-2" in done.stdout, done.stderr
    finally:
        sb.kill()


def test_a_node_that_leaves_is_seen_leaving_and_comes_back(formed: Lab) -> None:
    lab = formed
    lab.stop_node(2)
    took = wait_members(lab, {**EVERYONE, "node2": "left"}, on=[0, 1], within=15)
    assert took < 10, took  # a graceful leave is gossiped, not detected
    lab.start_node(2)
    wait_members(lab, EVERYONE, on=[0, 1, 2])


def test_a_dead_owner_fails_fast_and_its_sandbox_is_back_with_it(formed: Lab) -> None:
    lab = formed
    sb = sandbox_on(lab, 2)
    try:
        sb.files.write("/tmp/kept", "yes")
        lab.kill_node(2)
        wait_members(lab, {**EVERYONE, "node2": "dead"}, on=[0, 1])
        with lab.node(0).client() as c:
            t0 = time.monotonic()
            r = c.get(f"/sandboxes/{sb.sandbox_id}")
        assert time.monotonic() - t0 < 5
        assert r.status_code == 503 and "node2" in r.json()["message"], r.text
        lab.start_node(2)
        wait_members(lab, EVERYONE, on=[0, 1, 2])
        assert Sandbox.connect(sb.sandbox_id, **lab.node(0).sdk()).files.read("/tmp/kept") == "yes"
    finally:
        with contextlib.suppress(Exception):
            Sandbox.kill(sb.sandbox_id, **lab.node(0).sdk())


def test_a_stalled_node_is_suspected_then_refutes_when_it_wakes(formed: Lab) -> None:
    lab = formed
    lab.pause_node(1)
    try:
        wait_members(lab, {**EVERYONE, "node1": "dead"}, on=[0, 2])
    finally:
        lab.resume_node(1)
    # alive again everywhere: it refuted its death with a new incarnation
    wait_members(lab, EVERYONE, on=[0, 1, 2])


def test_an_isolated_owner_keeps_its_sandbox_and_nobody_else_runs_it(formed: Lab) -> None:
    lab = formed
    sb = sandbox_on(lab, 2)
    try:
        lab.isolate(2)
        wait_members(lab, {**EVERYONE, "node2": "dead"}, on=[0, 1])
        with lab.node(0).client() as c:
            r = c.get(f"/sandboxes/{sb.sandbox_id}")
        assert r.status_code == 503, r.text
        # its owner, which still reaches the store, serves it to whoever reaches it
        direct = Sandbox.connect(sb.sandbox_id, **lab.node(2).sdk())
        assert direct.commands.run("echo still-here").stdout.strip() == "still-here"
        # and no other node runs it
        for i in (0, 1):
            with lab.node(i).client() as c:
                own = c.get("/cluster/v1/sandboxes", headers={"x-aenv-hop": "test"}).json()
            assert sb.sandbox_id not in {s["sandbox_id"] for s in own}
        lab.heal()
        wait_members(lab, EVERYONE, on=[0, 1, 2])
        again = Sandbox.connect(sb.sandbox_id, **lab.node(0).sdk())
        assert again.commands.run("echo healed").stdout.strip() == "healed"
    finally:
        lab.heal()
        with contextlib.suppress(Exception):
            Sandbox.kill(sb.sandbox_id, **lab.node(0).sdk())


def test_an_owner_cut_from_the_store_stops_serving_until_it_is_back(formed: Lab) -> None:
    lab = formed
    sb = sandbox_on(lab, 1)
    try:
        lab.cut_store(1)
        # within its lease (10 s) and a grace, the owner stops serving it: directly...
        deadline = time.monotonic() + 40
        status = 0
        while time.monotonic() < deadline:
            with lab.node(1).client() as c:
                r = c.get(f"/sandboxes/{sb.sandbox_id}")
            status = r.status_code
            if status == 503:
                assert "lease" in r.json()["message"], r.text
                break
            time.sleep(0.5)
        assert status == 503
        lab.restore_store(1)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            with lab.node(0).client() as c:
                if c.get(f"/sandboxes/{sb.sandbox_id}").status_code == 200:
                    break
            time.sleep(0.5)
        assert sb.commands.run("echo back").stdout.strip() == "back"
    finally:
        lab.restore_store(1)
        with contextlib.suppress(Exception):
            sb.kill()


def test_loss_on_a_link_kills_nobody(formed: Lab) -> None:
    lab = formed
    sb = sandbox_on(lab, 1)
    try:
        lab.set_loss(1, 10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 12:
            for i in (0, 2):
                assert members(lab.node(i))["node1"] in ("alive", "suspect")
            time.sleep(1)
        lab.set_loss(1, 0)
        assert sb.commands.run("echo fine").stdout.strip() == "fine"
    finally:
        lab.set_loss(1, 0)
        with contextlib.suppress(Exception):
            sb.kill()


def test_lists_span_the_cluster(formed: Lab) -> None:
    lab = formed
    boxes = [sandbox_on(lab, i) for i in range(3)]
    try:
        for i in range(3):
            with lab.node(i).client() as c:
                ids = {s["sandboxID"] for s in c.get("/v2/sandboxes").json()}
            assert ids >= {b.sandbox_id for b in boxes}, (i, ids)
        out = json.dumps([b.sandbox_id for b in boxes])
        assert out
    finally:
        for b in boxes:
            with contextlib.suppress(Exception):
                b.kill()
