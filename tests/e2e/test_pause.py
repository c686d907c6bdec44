"""Pause and resume with the real e2b SDK: memory, files, TTL auto-pause, modes.

Rules: loopback only; the session `node`; each test kills what it creates. A
"counter" is a shell loop writing an increasing number to /tmp/counter every
0.1 s: after a full resume it goes on from where it stopped. Resuming from
disk (hibernation, a copy written behind) is tested on a node of its own
(tests.e2e.test_restart's `node_home`) that writes paused sandboxes to disk
within seconds, after what the user did before the pause
(tests.e2e.sequences).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from tests.conftest import NodeProc, requires_node
from tests.e2e.counter import COUNTER, count, counts_on
from tests.e2e.sequences import KEPT, SEQUENCES, answers
from tests.e2e.test_restart import PREFIX, Restartable, _on_disk, node_home  # noqa: F401 (fixture)

pytestmark = [requires_node, pytest.mark.runsc]


def _wait_state(sid: str, state: str, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if Sandbox.get_info(sid).state.value == state:
            return
        time.sleep(0.3)
    raise AssertionError(f"{sid} never became {state}")


def test_pause_resume_keeps_processes_and_files(node: NodeProc) -> None:
    s = Sandbox.create("base")
    try:
        s.commands.run(COUNTER, background=True)
        s.files.write("/home/user/note.txt", "written before the pause")
        time.sleep(1)
        s.pause()
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert s.sandbox_id in [p.sandbox_id for p in paused]
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        time.sleep(2)
        r = Sandbox.connect(s.sandbox_id)
        # it carried on from its value: no restart from 0, and it counts again
        assert counts_on(r) >= 5
        assert r.files.read("/home/user/note.txt") == "written before the pause"
        assert r.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        Sandbox.kill(s.sandbox_id)


def test_connect_answers_200_running_201_resumed(node: NodeProc) -> None:
    s = Sandbox.create("busybox")
    h = {"X-API-Key": node.api_key}
    try:
        url = f"{node.url}/v2/sandboxes/{s.sandbox_id}/connect"
        assert httpx.post(url, json={"timeout": 60}, headers=h, timeout=60).status_code == 200
        r = httpx.post(f"{node.url}/sandboxes/{s.sandbox_id}/pause", headers=h, timeout=60)
        assert r.status_code == 204
        r = httpx.post(f"{node.url}/sandboxes/{s.sandbox_id}/pause", headers=h, timeout=60)
        assert r.status_code == 409
        assert httpx.post(url, json={"timeout": 60}, headers=h, timeout=60).status_code == 201
        r = httpx.post(f"{node.url}/sandboxes/{s.sandbox_id}/resume", headers=h, timeout=60)
        assert r.status_code == 409  # already running
    finally:
        Sandbox.kill(s.sandbox_id)


def test_ttl_auto_pause_then_connect(node: NodeProc) -> None:
    s = Sandbox.create("base", timeout=4, lifecycle={"on_timeout": "pause"})
    try:
        s.commands.run(COUNTER, background=True)
        time.sleep(1)
        _wait_state(s.sandbox_id, "paused")
        r = Sandbox.connect(s.sandbox_id, timeout=60)
        assert counts_on(r) > 0
        assert r.get_info().state == SandboxState.RUNNING
    finally:
        Sandbox.kill(s.sandbox_id)


def test_filesystem_pause_boots_fresh_with_files(node: NodeProc) -> None:
    s = Sandbox.create("base")
    try:
        s.commands.run("sleep 1000", background=True)
        s.files.write("/home/user/fs.txt", "on disk")
        s.pause(mode="filesystem")
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.PAUSED
        r = Sandbox.connect(s.sandbox_id)
        assert r.files.read("/home/user/fs.txt") == "on disk"
        assert "sleep 1000" not in r.commands.run("ps -eo args").stdout
    finally:
        Sandbox.kill(s.sandbox_id)


def test_kill_paused_sandbox(node: NodeProc) -> None:
    s = Sandbox.create("busybox")
    s.pause()
    assert Sandbox.kill(s.sandbox_id)
    assert s.sandbox_id not in [x.sandbox_id for x in Sandbox.list().next_items()]
    with pytest.raises(Exception):  # noqa: B017 - NotFound, whatever the SDK calls it
        Sandbox.connect(s.sandbox_id)


def test_pause_freezes_in_memory_then_hibernates(node: NodeProc) -> None:
    """A full pause answers once the sandbox is frozen; resuming thaws it."""
    s = Sandbox.create("base", timeout=120)
    try:
        s.commands.run(COUNTER, background=True)
        time.sleep(1)
        s.pause()
        info = httpx.get(
            f"{node.url}/sandboxes/{s.sandbox_id}", headers={"X-API-Key": node.api_key}
        ).json()
        assert info["state"] == "paused" and info["pausedInMemory"] is True
        s2 = Sandbox.connect(s.sandbox_id)
        counts_on(s2)
        info = httpx.get(
            f"{node.url}/sandboxes/{s.sandbox_id}", headers={"X-API-Key": node.api_key}
        ).json()
        assert info["state"] == "running" and info["pausedInMemory"] is False
    finally:
        s.kill()


def test_auto_resume_on_traffic(node: NodeProc) -> None:
    s = Sandbox.create("base", timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        s.commands.run(COUNTER, background=True)
        time.sleep(1)
        before = counts_on(s)
        s.pause()
        # no connect: a command through the proxy wakes it
        assert count(s) >= before
        counts_on(s)
        listed = {x.sandbox_id: x.state for x in Sandbox.list().next_items()}
        assert str(listed[s.sandbox_id]).endswith("running")
    finally:
        s.kill()


def test_traffic_to_a_timeout_paused_sandbox_resumes_it_with_a_new_timeout(
    node: NodeProc,
) -> None:
    """The request that wakes the sandbox is served, and it does not pause again at once."""
    s = Sandbox.create("base", timeout=5, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        s.commands.run("python3 -m http.server 8081 --directory /etc", background=True)
        deadline = time.monotonic() + 30
        while (
            "200"
            not in s.commands.run(
                "curl -s -o /dev/null -w '%{http_code}' -m 2 localhost:8081/hostname; true"
            ).stdout
        ):
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.3)
        _wait_state(s.sandbox_id, "paused")
        route = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8081"}
        r = httpx.get(f"{node.url}/hostname", headers=route, timeout=60)
        assert r.status_code == 200, r.text
        assert r.text.strip() == "sandbox"
        time.sleep(2)  # well inside the new timeout, well past the one banked at the pause
        assert Sandbox.get_info(s.sandbox_id).state == SandboxState.RUNNING
        assert httpx.get(f"{node.url}/hostname", headers=route, timeout=30).status_code == 200
    finally:
        Sandbox.kill(s.sandbox_id)


@pytest.mark.parametrize(
    "how",
    [
        # thawed after a second, then checkpointed to disk
        {"AENV_HIBERNATE_AFTER": "1"},
        # a copy checkpointed while it stays frozen, taken as it is by the hibernation
        {"AENV_WRITE_BEHIND_AFTER": "1", "AENV_HIBERNATE_AFTER": "4"},
    ],
    ids=["hibernated", "written-behind"],
)
def test_resume_from_disk_after_what_the_user_did(
    node_home: Restartable,  # noqa: F811 (the fixture imported above)
    how: dict[str, str],
) -> None:
    r = node_home
    r.env.update(how)
    r.start()
    _to_disk_and_back(r, Sandbox.create("base", timeout=300))


def test_a_sandbox_from_the_pool_pauses_to_disk_and_resumes(
    node_home: Restartable,  # noqa: F811 (the fixture imported above)
) -> None:
    """A pool member waits frozen by the cgroup freezer (v1 too: the one a pool
    member may use); once adopted it pauses, is copied to disk while paused,
    hibernates and resumes from disk as any sandbox does."""
    r = node_home
    r.env.update({"AENV_POOL_SIZE": "1", "AENV_WRITE_BEHIND_AFTER": "1",
                  "AENV_HIBERNATE_AFTER": "4"})  # fmt: skip
    r.start()
    # creates until the template is a snapshot and hot (asked for twice): the pool fills
    deadline = time.monotonic() + 120
    while not _frozen_by_cgroup(PREFIX):
        assert time.monotonic() < deadline, "no pool member frozen by the cgroup freezer"
        Sandbox.create("base", timeout=60).kill()
        time.sleep(2)
    s = Sandbox.create("base", timeout=300)
    logs = r.get(f"/sandboxes/{s.sandbox_id}/logs").json()["logs"]
    assert any("adopted from the pool" in e["line"] for e in logs)
    _to_disk_and_back(r, s)


def _frozen_by_cgroup(prefix: str) -> int:
    """How many of the node's sandboxes the cgroup freezer (v2 or v1) holds."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    base = Path("/sys/fs/cgroup") / ("" if v2 else "freezer") / prefix
    found = 0
    for d in base.glob("*"):
        with contextlib.suppress(OSError):
            if v2:
                found += "frozen 1" in (d / "cgroup.events").read_text().splitlines()
            else:
                found += (d / "freezer.state").read_text().strip() == "FROZEN"
    return found


def _to_disk_and_back(r: Restartable, s: Sandbox) -> None:
    """What the user did (tests.e2e.sequences), a full pause, on disk, then resumed."""
    sid = s.sandbox_id
    for sequence in SEQUENCES.values():
        sequence(s)
    running = s.commands.run("sleep 1000", background=True, stdin=True)
    s.files.write("/home/user/kept.txt", KEPT)
    s.pause()
    _on_disk(r, sid)
    again = Sandbox.connect(sid)
    answers(again)
    assert running.pid in {p.pid for p in again.commands.list()}
    assert again.commands.kill(running.pid)


def test_a_hibernated_sandbox_is_stored_as_its_difference_from_its_template(
    node_home: Restartable,  # noqa: F811 (the fixture imported above)
) -> None:
    """Restored from its template's memory image, hibernated, it keeps on disk
    only the pages it changed (aenv.runtimes.pagepack); resumed from that
    twice, it is where it was."""
    r = node_home
    r.env.update({"AENV_HIBERNATE_AFTER": "1"})
    r.start()
    Sandbox.create("base", timeout=60).kill()  # (booted: the template's snapshot is taken)
    deadline = time.monotonic() + 120
    assert r.node is not None
    while "is now a snapshot" not in r.node.log_tail(400):
        assert time.monotonic() < deadline, "no memory image of the template"
        time.sleep(0.5)
    s = Sandbox.create("base", timeout=300)
    sid = s.sandbox_id
    s.commands.run(COUNTER, background=True)
    # state held only in a process's memory
    held = s.commands.run(
        "python3 -c 'import sys; x = sys.stdin.readline(); print(x, flush=True); sys.stdin.read()'",
        background=True,
        stdin=True,
    )
    s.commands.send_stdin(held.pid, "kept in memory\n")
    for _ in range(2):
        s.pause()
        # in memory (frozen) first, also after a resume from disk
        assert r.get(f"/sandboxes/{sid}").json()["pausedInMemory"] is True
        _on_disk(r, sid)
        images = [p for p in (r.home / "sandboxes" / sid).glob("image*") if p.is_dir()]
        assert len(images) == 1, images
        files = {p.name: p.stat().st_size for p in images[0].iterdir()}
        assert "pages.img" not in files and files["pages.pack"] < files["pages.base"] / 4, files
        s = Sandbox.connect(sid)
        counts_on(s)
        assert held.pid in {p.pid for p in s.commands.list()}
    s.commands.send_stdin(held.pid, "")
    s.kill()
