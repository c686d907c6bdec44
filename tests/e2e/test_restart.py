"""Paused sandboxes and snapshots across node restarts and crashes, with the real e2b SDK.

Rules: each test runs its own node (its own home, netns prefix and slot
range) and restarts or SIGKILLs it; a sandbox must come back paused and
resume where it stopped, or be gone (404) - never half there. Snapshots
listed after a crash must start. Nothing of the node may leak at the end.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
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
    start_node,
    stop_node,
)
from tests.e2e.counter import COUNTER, count, counts_on

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = "aenvw"
# paused sandboxes go to disk a second after their pause (the default is a minute)
ENV = {"AENV_NET_PREFIX": PREFIX, "AENV_SLOT_CIDR": "10.232.0.0/16", "AENV_HIBERNATE_AFTER": "1"}
TEMPLATE = "busybox"


class Restartable:
    """One node home, started and stopped at will; the SDK points at the current node."""

    def __init__(self, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.home = home
        self.env = dict(ENV)
        self.key = "k" + secrets.token_hex(8)
        self.monkeypatch = monkeypatch
        self.node: NodeProc | None = None

    def start(self) -> NodeProc:
        n = start_node(
            self.home, api_key=self.key, log_path=self.home / "node.log", extra_env=self.env
        )
        for var, value in (("E2B_API_URL", n.url), ("E2B_SANDBOX_URL", n.url)):
            self.monkeypatch.setenv(var, value)
        self.monkeypatch.setenv("E2B_API_KEY", self.key)
        self.node = n
        return n

    def stop(self, sig: int = signal.SIGTERM) -> None:
        assert self.node is not None
        code = stop_node(self.node, sig)
        if sig == signal.SIGTERM:
            assert code == 0, self.node.log_tail()
        self.node = None

    def get(self, path: str) -> httpx.Response:
        assert self.node is not None
        return httpx.get(self.node.url + path, headers={"X-API-Key": self.key}, timeout=30)

    def post(self, path: str, body: object = None) -> httpx.Response:
        assert self.node is not None
        return httpx.post(
            self.node.url + path, json=body, headers={"X-API-Key": self.key}, timeout=120
        )


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


@pytest.mark.parametrize("delay", [0.05, 0.2])
def test_a_crash_mid_pause_leaves_it_paused_or_gone(node_home: Restartable, delay: float) -> None:
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
    assert got.status_code in (200, 404), got.text
    if got.status_code == 200:
        assert got.json()["state"] == "paused"
        _paused_then_resumes(r, sid, before)
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
    assert r.get(f"/sandboxes/{sid}").status_code == 404  # it was running: gone
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
