"""Sandboxes move between the lab's nodes: paused copies in S3, resume anywhere, drain.

Rules: one lab of three clustered nodes sharing moto's S3 (tests/cluster/lab.py),
paused sandboxes hibernate to disk after a second; the e2b SDK is pointed at
one node per call (`**node.sdk()`). A sandbox's memory is checked with a
counter process that writes an increasing number to a file every 100 ms:
after a move the same process (same PID) goes on from where it was. Claims
are read from the store behind the nodes' backs (boto3). Every sandbox a
test creates is killed by that test; a node a test stops or drains is
started again by it (or by the fixture's reset).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from tests.cluster.lab import Lab, LabNode, requires_lab

pytestmark = [
    requires_lab,
    pytest.mark.runsc,
    pytest.mark.lab(nodes=3, store="s3", env={"AENV_HIBERNATE_AFTER": "1", "AENV_POOL_SIZE": "0"}),
]

TEMPLATE = "base"
COUNTER = (
    "sh -c 'echo $$ > /tmp/pid; i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; "
    "mv /tmp/count.new /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &"
)
# the default lease ttl: nothing moves sooner after its node's last renewal, which
# came at most a third of it (the renewal interval) before the node was cut off
FENCE_WINDOW_S = 10.0


def wait_for(what: str, check: Callable[[], Any], within: float = 90.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if got := check():
                return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def wait_claim(lab: Lab, sid: str, state: str, within: float = 90.0) -> dict[str, Any]:
    return wait_for(  # type: ignore[no-any-return]
        f"the claim of {sid} to say {state}",
        lambda: (c := lab.claim(sid)) is not None and c["state"] == state and c,
        within,
    )


def members(node: LabNode) -> dict[str, str]:
    with node.client() as api:
        return {m["nodeID"]: m["state"] for m in api.get("/cluster/members").json()}


def all_alive(node: LabNode) -> bool:
    """`node` sees every node of the lab alive (itself included)."""
    seen = members(node)
    return len(seen) == 3 and set(seen.values()) == {"alive"}


def owner(node: LabNode, sid: str) -> str:
    with node.client() as api:
        r = api.get(f"/sandboxes/{sid}")
        r.raise_for_status()
        return str(r.json()["clientID"])


def counting(sbx: Sandbox) -> tuple[int, int]:
    """(PID, count) of the sandbox's counter process."""
    out = sbx.commands.run("cat /tmp/pid /tmp/count", timeout=30).stdout.split()
    return int(out[0]), int(out[1])


def start_counter(sbx: Sandbox) -> tuple[int, int]:
    sbx.commands.run(COUNTER, timeout=30)
    return wait_for("the counter", lambda: counting(sbx)[1] > 2 and counting(sbx), 30)  # type: ignore[no-any-return]


def on(lab: Lab, index: int, n: int = 1, **kw: Any) -> list[Sandbox]:
    """`n` sandboxes created through node `index` (which places them there)."""
    out: list[Sandbox] = []
    node = lab.node(index)
    for _ in range(20):
        sbx = Sandbox.create(TEMPLATE, timeout=600, **node.sdk(), **kw)
        if sbx.sandbox_id.endswith(node.env["AENV_NODE_TAG"]):
            out.append(sbx)
            if len(out) == n:
                return out
        else:
            sbx.kill()
    for sbx in out:
        sbx.kill()
    pytest.fail(f"no create through node {index} stayed there")


@contextlib.contextmanager
def killing(lab: Lab, sids: list[str]) -> Iterator[None]:
    """Kill these sandboxes at the end, once every node runs again (a node
    started again drops its copy of a sandbox that moved away)."""
    try:
        yield
    except BaseException:
        for node in lab.nodes:  # what the nodes said, for the failure's report
            print(f"--- node {node.index} ---\n{node.log_tail(120)}")
        raise
    finally:
        lab.reset()
        for sid in sids:
            for node in lab.nodes:
                if node.running:
                    with contextlib.suppress(Exception):
                        Sandbox.kill(sid, **node.sdk())
                        break


def test_kill_9_the_owner_of_a_paused_sandbox_and_resume_it_elsewhere(lab: Lab) -> None:
    (sbx,) = on(lab, 0, metadata={"suite": "moves"}, envs={"WHERE": "env kept"})
    sid = sbx.sandbox_id
    with killing(lab, [sid]):
        sbx.files.write("/tmp/kept.txt", "written on node0")
        pid, _ = start_counter(sbx)
        paused_at = counting(sbx)[1]
        sbx.pause()
        first = wait_claim(lab, sid, "paused-durable")
        assert first["node"] == "node0"
        lab.kill_node(0)
        wait_for("node0 dead", lambda: members(lab.node(1)).get("node0") == "dead", 60)
        t0 = time.monotonic()
        again = Sandbox.connect(sid, timeout=600, **lab.node(1).sdk())
        took = time.monotonic() - t0
        moved = lab.claim(sid)
        assert moved is not None and moved["node"] in ("node1", "node2")
        assert moved["epoch"] == first["epoch"] + 1
        assert owner(lab.node(1), sid) == moved["node"]
        # the same process, its memory intact: it counts on from where it was
        again_pid, count = counting(again)
        assert again_pid == pid
        assert count >= paused_at
        assert wait_for("counting on", lambda: counting(again)[1] > count + 3, 30)
        assert again.files.read("/tmp/kept.txt") == "written on node0"
        assert again.commands.run("echo $WHERE").stdout.strip() == "env kept"
        info = Sandbox.get_info(sid, **lab.node(2).sdk())
        assert info.metadata.get("suite") == "moves"
        assert took < 60, took


def test_a_dead_nodes_paused_sandboxes_are_listed_and_resumable(lab: Lab) -> None:
    boxes = on(lab, 2, n=2)
    sids = [b.sandbox_id for b in boxes]
    with killing(lab, sids):
        pids = {}
        for b in boxes:
            pids[b.sandbox_id] = start_counter(b)[0]
            b.pause()
        for sid in sids:
            wait_claim(lab, sid, "paused-durable")
        lab.kill_node(2)

        def listed() -> dict[str, str]:
            found = Sandbox.list(**lab.node(0).sdk()).next_items()
            return {
                s.sandbox_id: str(getattr(s.state, "value", s.state))
                for s in found
                if s.sandbox_id in sids
            }

        # adopted without a call: each by one of the survivors
        got = wait_for("both listed paused", lambda: len(listed()) == 2 and listed(), 120)
        assert set(got.values()) == {"paused"}, got
        for sid in sids:
            c = lab.claim(sid)
            assert (
                c is not None
                and c["node"] in ("node0", "node1")
                and c["state"] == ("paused-durable")
            )
        for sid in sids:
            again = Sandbox.connect(sid, timeout=600, **lab.node(0).sdk())
            pid, count = counting(again)
            assert pid == pids[sid]
            assert wait_for("counting on", lambda a=again, c=count: counting(a)[1] > c + 3, 30)


def test_a_paused_sandbox_resumes_on_another_node_when_its_own_has_no_room(lab: Lab) -> None:
    (sbx,) = on(lab, 0)
    sid = sbx.sandbox_id
    with killing(lab, [sid]):
        pid, _ = start_counter(sbx)
        sbx.pause()
        wait_claim(lab, sid, "paused-durable")
        # node0 keeps 99 % of the host's memory free: no room to resume anything there
        lab.node(0).env["AENV_HIBERNATE_MEMORY_LOW"] = "99"
        try:
            lab.restart_node(0, sig=signal.SIGTERM)
            wait_for("node0 back", lambda: members(lab.node(1)).get("node0") == "alive", 60)
            again = Sandbox.connect(sid, timeout=600, **lab.node(1).sdk())
            moved = lab.claim(sid)
            assert moved is not None and moved["node"] in ("node1", "node2"), moved
            assert moved["state"] == "running"
            assert owner(lab.node(0), sid) == moved["node"]
            again_pid, count = counting(again)
            assert again_pid == pid
            assert wait_for("counting on", lambda: counting(again)[1] > count + 3, 30)
        finally:
            del lab.node(0).env["AENV_HIBERNATE_MEMORY_LOW"]
            lab.restart_node(0, sig=signal.SIGTERM)
            wait_for("node0 to see all alive", lambda: all_alive(lab.node(0)), 60)


def test_drain_moves_running_sandboxes_with_their_processes(lab: Lab) -> None:
    boxes = on(lab, 1, n=2)
    writer, other = boxes
    sids = [b.sandbox_id for b in boxes]
    with killing(lab, sids):
        pid, _ = start_counter(writer)
        other.files.write("/tmp/kept.txt", "kept across the drain")
        other.commands.run("sleep 3600 >/dev/null 2>&1 &", timeout=30)
        # the CLI, pointed at node 0, which sends the drain on to node 1
        wait_for("node0 to see all alive", lambda: all_alive(lab.node(0)), 60)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update({"AENV_URL": lab.node(0).url, "AENV_API_KEY": lab.api_key})
        done = subprocess.run(
            [sys.executable, "-m", "aenv", "node", "drain", "node1", "--output", "json"],
            env=env,
            capture_output=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["moved"], report["failed"]) == (2, {}), report
        assert {m["sandboxID"] for m in report["sandboxes"]} == set(sids)
        for sid in sids:
            c = lab.claim(sid)
            assert c is not None and c["node"] in ("node0", "node2") and c["state"] == "running"
        wait_for("node1 left", lambda: members(lab.node(0)).get("node1") == "left", 30)
        # the SDK reconnects (through any node, even the drained one) and carries on
        for via in (0, 2):
            w = Sandbox.connect(writer.sandbox_id, timeout=600, **lab.node(via).sdk())
            again_pid, count = counting(w)
            assert again_pid == pid
            assert wait_for("counting on", lambda w=w, c=count: counting(w)[1] > c + 3, 30)
            o = Sandbox.connect(other.sandbox_id, timeout=600, **lab.node(via).sdk())
            assert o.files.read("/tmp/kept.txt") == "kept across the drain"
            assert "sleep 3600" in o.commands.run("ps -o args", timeout=30).stdout
        with httpx.Client(timeout=10) as c:
            left = c.get(f"{lab.node(1).url}/cluster/members", headers={"X-API-Key": lab.api_key})
        assert left.status_code == 200
    lab.restart_node(1, sig=15)  # a drained node starts again empty and rejoins
    wait_for("node1 back", lambda: members(lab.node(0)).get("node1") == "alive", 60)


def test_a_partitioned_owner_keeps_its_sandboxes_until_fenced(lab: Lab) -> None:
    running, parked = on(lab, 2, n=2)
    sids = [running.sandbox_id, parked.sandbox_id]
    with killing(lab, sids):
        pid, _ = start_counter(parked)
        parked.pause()
        wait_claim(lab, parked.sandbox_id, "paused-durable")
        running.files.write("/tmp/where", "node2")
        # cut from its peers only: it still renews its lease, so nothing moves
        lab.partition(2, [0, 1])
        wait_for("node2 dead to node0", lambda: members(lab.node(0)).get("node2") == "dead", 60)
        with lab.node(0).client(timeout=120) as api:
            r = api.post(f"/sandboxes/{parked.sandbox_id}/connect", json={"timeout": 300})
            assert r.status_code == 503 and "alive" in r.json()["message"], r.text
            r = api.post(f"/sandboxes/{running.sandbox_id}/connect", json={"timeout": 300})
            assert r.status_code == 503, r.text
        assert lab.claim(parked.sandbox_id)["node"] == "node2"  # type: ignore[index]
        # ... and from the store: its lease lapses; only then may others fence it
        lab.cut_store(2)
        cut = time.monotonic()
        moved = wait_for(
            "the paused sandbox adopted",
            lambda: (c := lab.claim(parked.sandbox_id)) and c["node"] != "node2" and c,
            120,
        )
        assert time.monotonic() - cut >= FENCE_WINDOW_S * 2 / 3
        assert moved["state"] == "paused-durable"
        # the running one never moves: its memory is only on node2
        assert lab.claim(running.sandbox_id)["node"] == "node2"  # type: ignore[index]
        lab.restore_store(2)
        lab.heal()
        # node2 learns it was fenced, drops its copy of the moved one, takes the running back
        wait_for("node2 alive", lambda: members(lab.node(0)).get("node2") == "alive", 60)
        # ... and node2 sees the others alive again (until then it answers 503: their
        # sandboxes are on nodes it takes for dead)
        wait_for(
            "node2 to see all alive",
            lambda: all_alive(lab.node(2)),
            60,
        )
        again = Sandbox.connect(parked.sandbox_id, timeout=600, **lab.node(2).sdk())
        assert counting(again)[0] == pid
        assert owner(lab.node(0), parked.sandbox_id) == moved["node"]
        r2 = Sandbox.connect(running.sandbox_id, timeout=600, **lab.node(0).sdk())
        assert wait_for("node2 serves it", lambda: r2.files.read("/tmp/where") == "node2", 60)
        assert owner(lab.node(0), running.sandbox_id) == "node2"
        with lab.node(2).client() as api:
            here = {s["sandbox_id"] for s in api.get("/cluster/v1/sandboxes").json()}
        assert parked.sandbox_id not in here  # never on two nodes
