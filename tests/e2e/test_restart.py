"""Paused sandboxes and snapshots across node restarts and crashes, with the real e2b SDK.

Rules: each test runs its own node (its own home, netns prefix and slot
range) and restarts or SIGKILLs it; a sandbox must come back paused and
resume where it stopped, or be gone (404) - never half there. Snapshots
listed after a crash must start. Nothing of the node may leak at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
)
from tests.e2e.counter import COUNTER, count, counts_on
from tests.e2e.nodes import OneNode
from tests.registry import LocalRegistry, push_busybox

pytestmark = [requires_node, pytest.mark.runsc]

# AENV_TEST_RESTART_PREFIX / _CIDR: another pair for a run beside another suite
PREFIX = os.environ.get("AENV_TEST_RESTART_PREFIX", "aenvw")
# paused sandboxes go to disk a second after their pause (the default is a minute)
ENV = {
    "AENV_NET_PREFIX": PREFIX,
    "AENV_SLOT_CIDR": os.environ.get("AENV_TEST_RESTART_CIDR", "10.232.0.0/16"),
    "AENV_HIBERNATE_AFTER": "1",
    # a stop leaves running sandboxes running, as a deployed node does
    "AENV_ON_STOP": "keep",
}
TEMPLATE = "busybox"


class Restartable(OneNode):
    """One node home, started and stopped at will; the SDK points at the current node."""

    post_timeout = 120

    def __init__(self, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        self.home = home
        self.env = dict(ENV)

    def start(self) -> NodeProc:
        return self.run(self.home, self.env)


@pytest.fixture
def node_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Restartable]:
    built = built_home()
    assert built is not None
    home = tmp_path / "home"
    home.mkdir()
    link_home(built, home)
    r = Restartable(home, monkeypatch)
    try:
        yield r
    finally:
        # what the test left running runs on through a stop: kill it through the API
        with contextlib.suppress(Exception):
            if r.node is None:
                r.start()
            for sb in r.get("/v2/sandboxes?state=running,paused").json():
                httpx.delete(
                    f"{r.node.url}/sandboxes/{sb['sandboxID']}",  # type: ignore[union-attr]
                    headers={"X-API-Key": r.key},
                    timeout=60,
                )
        if r.node is not None:
            with contextlib.suppress(Exception):
                r.stop()
        left = leaks(home, PREFIX)
        assert not left, left


def _on_disk(r: Restartable, sid: str, within: float = 30.0) -> None:
    """Wait until a paused sandbox has been written to disk (hibernated)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        d = r.get(f"/sandboxes/{sid}").json()
        if d["state"] == "paused" and not d["pausedInMemory"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"sandbox {sid} was not written to disk within {within}s")


def _counting() -> tuple[Sandbox, int]:
    """A sandbox running a counter, with a file written: what `_paused_then_resumes` checks."""
    s = Sandbox.create(TEMPLATE, timeout=300)
    s.commands.run(COUNTER, background=True)
    s.files.write("/tmp/kept.txt", "written before the pause")
    counts_on(s)
    return s, count(s)


def _paused_then_resumes(r: Restartable, sid: str, before: int) -> None:
    listed = {s["sandboxID"]: s["state"] for s in r.get("/v2/sandboxes?state=paused").json()}
    assert listed.get(sid) == "paused", listed
    s = Sandbox.connect(sid)
    assert count(s) >= before  # the counter's value when it was paused (or later)
    counts_on(s)  # and the process itself came back
    assert s.files.read("/tmp/kept.txt") == "written before the pause"


def test_a_paused_sandbox_survives_restarts_and_crashes(node_home: Restartable) -> None:
    r = node_home
    r.start()
    s, before = _counting()
    s.pause()  # frozen in memory: a clean stop writes it to disk
    sid = s.sandbox_id
    assert r.get(f"/sandboxes/{sid}").json()["pausedInMemory"] is True

    r.stop()  # a clean restart
    r.start()
    _paused_then_resumes(r, sid, before)

    before = count(Sandbox.connect(sid))
    Sandbox.connect(sid).pause()
    _on_disk(r, sid)
    r.stop(signal.SIGKILL)  # a crash while it is paused (on disk)
    r.start()
    _paused_then_resumes(r, sid, before)
    Sandbox.connect(sid).kill()
    assert r.get(f"/sandboxes/{sid}").status_code == 404

    # killed while paused: the record goes with it
    r.stop()
    r.start()
    assert r.get(f"/sandboxes/{sid}").status_code == 404


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "graceful"])
def test_sandboxes_run_on_through_a_node_restart(node_home: Restartable, how: int) -> None:
    """Running sandboxes keep running (their processes work on while no node
    runs), one paused in memory resumes with its memory, TTLs go on."""
    r = node_home
    r.start()
    running, _ = _counting()
    paused, paused_at = _counting()
    paused.pause()
    end_at = Sandbox.get_info(running.sandbox_id).end_at
    ps = running.commands.run("ps -o pid,args").stdout

    r.stop(how)
    time.sleep(2)
    r.start()
    # before any connect (which sets a timeout of its own): the TTL went on
    info = Sandbox.get_info(running.sandbox_id)
    assert abs((info.end_at - end_at).total_seconds()) < 1, (info.end_at, end_at)

    again = Sandbox.connect(running.sandbox_id)
    count_before = count(again)
    # the counter went on while no node ran: ~10 a second for the 2 s it was down
    assert count_before >= 15, count_before
    assert again.commands.run("ps -o pid,args").stdout.splitlines()[1:3] == (ps.splitlines()[1:3])
    assert again.files.read("/tmp/kept.txt") == "written before the pause"

    listed = {x["sandboxID"]: x["state"] for x in r.get("/v2/sandboxes?state=paused").json()}
    assert listed.get(paused.sandbox_id) == "paused", listed
    woke = Sandbox.connect(paused.sandbox_id)
    assert count(woke) >= paused_at
    counts_on(woke)

    # the node works as before: a new sandbox, a kill, nothing else left behind
    fresh = Sandbox.create(TEMPLATE, timeout=60)
    assert fresh.commands.run("echo ok").stdout.strip() == "ok"
    for sb in (fresh, again, woke):
        sb.kill()
    assert r.get(f"/sandboxes/{running.sandbox_id}").status_code == 404


def test_image_sandboxes_are_paused_through_a_stop_and_reported_after_a_crash(
    node_home: Restartable, registry: LocalRegistry
) -> None:
    """An image template's root is served by the node process: a stop pauses
    such a sandbox (with its memory) and the next start resumes it; a crash
    cannot keep it, and the restarted node says so."""
    img = push_busybox(registry, "restartable", "1")
    r = node_home
    r.start()
    s = Sandbox.create(img.ref, timeout=300)
    s.commands.run(COUNTER, background=True)
    before = counts_on(s)

    r.stop()
    r.start()
    deadline = time.monotonic() + 60
    while r.get(f"/sandboxes/{s.sandbox_id}").json()["state"] != "running":
        assert time.monotonic() < deadline, "not resumed after the restart"
        time.sleep(0.2)
    again = Sandbox.connect(s.sandbox_id)
    assert count(again) >= before  # memory kept: the counter went on from where it was
    counts_on(again)

    r.stop(signal.SIGKILL)
    r.start()
    got = r.get(f"/sandboxes/{s.sandbox_id}")
    assert got.status_code == 404
    assert "served by the node process" in got.json()["message"], got.text


def _written_behind(r: Restartable, sid: str, n: int, within: float = 30.0) -> None:
    """Wait until the node has logged the `n`th write-behind copy of `sid`."""
    assert r.node is not None
    deadline = time.monotonic() + within
    while r.node.log_path.read_text().count(f"{sid}: paused copy written to disk") < n:
        assert time.monotonic() < deadline, "no copy of the paused sandbox was written"
        time.sleep(0.1)


def _kill_runtime(r: Restartable, sid: str) -> None:
    """What a reboot does to a sandbox's runtime."""
    pids = subprocess.run(
        ["pgrep", "-f", f"runsc.*{r.home}.*{sid}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "no runsc process of the sandbox found"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def test_a_paused_sandbox_gets_a_copy_on_disk_that_survives_a_reboot(
    node_home: Restartable,
) -> None:
    r = node_home
    r.env.update({"AENV_WRITE_BEHIND_AFTER": "1", "AENV_HIBERNATE_AFTER": "4"})
    r.start()
    s, before = _counting()
    sid = s.sandbox_id
    s.pause()
    _written_behind(r, sid, 1)
    # the copy leaves it frozen in memory, so resuming stays a thaw
    assert r.get(f"/sandboxes/{sid}").json()["pausedInMemory"] is True
    _on_disk(r, sid)  # its hibernation takes that copy instead of checkpointing again
    again = Sandbox.connect(sid)
    assert count(again) >= before
    before = counts_on(again)

    again.pause()
    _written_behind(r, sid, 2)
    r.stop(signal.SIGKILL)
    _kill_runtime(r, sid)  # the host "reboots": the frozen runtime is gone
    r.start()
    _paused_then_resumes(r, sid, before)


def test_a_sandbox_that_died_while_the_node_was_down_is_reported(
    node_home: Restartable,
) -> None:
    r = node_home
    r.start()
    s = Sandbox.create(TEMPLATE, timeout=300)
    sid = s.sandbox_id
    r.stop(signal.SIGKILL)
    # its runtime dies while no node watches it
    pids = subprocess.run(
        ["pgrep", "-f", f"runsc-sandbox.*{sid}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "no runsc sandbox process found"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    r.start()
    got = r.get(f"/sandboxes/{sid}")
    assert got.status_code == 404
    assert "stopped while the node was down" in got.json()["message"], got.text
    metrics = r.get("/metrics").text
    assert "aenv_sandboxes_lost_total 1" in metrics, metrics


@pytest.mark.parametrize("delay", [0.05, 0.2])
def test_a_crash_mid_pause_leaves_it_paused_or_running(
    node_home: Restartable, delay: float
) -> None:
    r = node_home
    r.start()
    s, before = _counting()
    sid = s.sandbox_id

    def pause() -> None:
        with contextlib.suppress(Exception):
            r.post(f"/sandboxes/{sid}/pause")

    t = threading.Thread(target=pause, daemon=True)
    t.start()
    time.sleep(delay)
    r.stop(signal.SIGKILL)
    t.join(10)
    r.start()
    got = r.get(f"/sandboxes/{sid}")
    assert got.status_code == 200, got.text
    if got.json()["state"] == "paused":  # the pause was done
        _paused_then_resumes(r, sid, before)
    else:  # it was not: the sandbox runs on, its processes too
        assert got.json()["state"] == "running", got.text
        s = Sandbox.connect(sid)
        assert count(s) >= before
        counts_on(s)
    Sandbox.connect(sid).kill()


def test_a_crash_mid_snapshot_leaves_no_broken_snapshot(node_home: Restartable) -> None:
    r = node_home
    r.start()
    s = Sandbox.create(TEMPLATE, timeout=300)
    s.files.write("/tmp/kept.txt", "written before the snapshot")
    sid = s.sandbox_id

    def snapshot() -> None:
        with contextlib.suppress(Exception):
            r.post(f"/sandboxes/{sid}/snapshots", {"name": "crashy"})

    t = threading.Thread(target=snapshot, daemon=True)
    t.start()
    time.sleep(0.3)
    r.stop(signal.SIGKILL)
    t.join(10)
    r.start()
    got = r.get(f"/sandboxes/{sid}")  # it was running: it runs on
    assert got.status_code == 200 and got.json()["state"] == "running", got.text
    assert Sandbox.connect(sid).files.read("/tmp/kept.txt") == "written before the snapshot"
    snaps = r.get("/snapshots").json()
    for snap in snaps:  # whatever is listed is whole and starts
        child = Sandbox.create(snap["snapshotID"], timeout=60)
        try:
            assert child.files.read("/tmp/kept.txt") == "written before the snapshot"
        finally:
            child.kill()


def test_paused_sandboxes_go_to_disk_when_memory_runs_short(node_home: Restartable) -> None:
    """Under memory pressure a frozen sandbox is hibernated at once, not after
    its idle time, and resumes from disk where it stopped."""
    r = node_home
    # the idle time is far away; "short of memory" is every level below 100 %
    r.env |= {"AENV_HIBERNATE_AFTER": "600", "AENV_HIBERNATE_MEMORY_LOW": "100"}
    r.start()
    s, before = _counting()
    s.pause()
    _on_disk(r, s.sandbox_id, within=20)
    assert "memory available" in (r.home / "node.log").read_text()
    _paused_then_resumes(r, s.sandbox_id, before)


def test_a_failed_hibernation_keeps_the_sandbox_paused_in_memory(
    node_home: Restartable,
) -> None:
    """When its memory image cannot be written, a paused sandbox stays paused
    (frozen, in memory), is written to disk once that works, and resumes."""
    r = node_home
    r.start()
    s, before = _counting()
    workdir = r.home / "sandboxes" / s.sandbox_id
    blockers = [workdir / f"image{n}.tmp" for n in range(1, 6)]
    for blocker in blockers:  # where the memory image is staged: taken
        blocker.write_text("in the way")
    s.pause()
    deadline = time.monotonic() + 30
    while "hibernating" not in (r.home / "node.log").read_text():
        assert time.monotonic() < deadline, "the node never tried to hibernate"
        time.sleep(0.2)
    time.sleep(1)
    d = r.get(f"/sandboxes/{s.sandbox_id}").json()
    assert d["state"] == "paused" and d["pausedInMemory"] is True, d
    for blocker in blockers:
        blocker.unlink()
    _on_disk(r, s.sandbox_id, within=30)
    _paused_then_resumes(r, s.sandbox_id, before)
