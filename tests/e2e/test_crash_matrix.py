"""The crash matrix: the node is killed (SIGKILL) at fault points inside create,
pause, resume, fork, snapshot, upload and hibernation, then started again.

Rules: each case runs its own node (tests.e2e.test_restart's `node_home`: its
own home, netns prefix and slot range, and a leak check at the end) with `AENV_FAULT` arming one point
(`aenv.kit.faults`); the operation drives the node into it and the node
dies there. The node is then started without the fault, and every sandbox
it lists must be whole and usable (running ones run a command and hold the
file written before the crash; paused ones resume with it), every snapshot
it lists must start, and once all are killed nothing is left behind: no
sandbox directory, runtime, mount, netns, veth or nft table. No pool, so
that no sandbox of the node's own is running when the check runs.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from e2b import Sandbox

from tests.conftest import requires_node
from tests.e2e.counter import COUNTER
from tests.e2e.test_restart import TEMPLATE, Restartable, node_home  # noqa: F401 (fixture)

pytestmark = [requires_node, pytest.mark.runsc]

KEPT = "written before the crash"


def _sandbox() -> Sandbox:
    s = Sandbox.create(TEMPLATE, timeout=300)
    s.commands.run(COUNTER, background=True)
    s.files.write("/home/user/kept.txt", KEPT)
    return s


def _quietly(fn: Callable[[], object]) -> None:
    """Run `fn`, which the node dies under (its error is the point), in a thread."""

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(90)


def _create() -> None:
    _quietly(_sandbox)


def _pause_frozen() -> None:
    s = _sandbox()
    _quietly(s.pause)


def _pause_to_disk() -> None:
    s = _sandbox()
    _quietly(lambda: s.pause(mode="filesystem"))


def _hibernate() -> None:
    s = _sandbox()
    s.pause()  # frozen; written to disk a second later (AENV_HIBERNATE_AFTER=1, or write-behind)


def _resume() -> None:
    s = _sandbox()
    s.pause(mode="filesystem")
    _quietly(lambda: Sandbox.connect(s.sandbox_id))


def _fork() -> None:
    s = _sandbox()
    _quietly(lambda: s.fork(count=2, timeout=120))


def _snapshot() -> None:
    s = _sandbox()
    _quietly(lambda: s.create_snapshot(name="crashy"))


CASES: dict[str, Callable[[], None]] = {
    "create.started": _create,
    "create.journaled": _create,
    "pause.frozen": _pause_frozen,
    "pause.captured": _pause_to_disk,
    "pause.layer-frozen": _pause_to_disk,
    "pause.written-behind": _hibernate,
    "hibernate.captured": _hibernate,
    "hibernate.layer-frozen": _hibernate,
    "resume.restored": _resume,
    "fork.captured": _fork,
    "fork.children-started": _fork,
    "snapshot.captured": _snapshot,
    "snapshot.recorded": _snapshot,
    "upload.stored": _snapshot,
}


def _sandbox_dirs(home: Path) -> list[str]:
    """The sandboxes' directories (not the node's own: its spare disks)."""
    return sorted(p.name for p in (home / "sandboxes").iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("point", list(CASES))
def test_a_crash_at_any_point_leaves_whole_sandboxes_or_none(
    node_home: Restartable,  # noqa: F811 (the fixture imported above)
    point: str,
) -> None:
    r = node_home
    r.env.update({"AENV_POOL_SIZE": "0", "AENV_FAULT": point})
    if point == "pause.written-behind":  # the copy on disk comes before the hibernation
        r.env.update({"AENV_WRITE_BEHIND_AFTER": "1", "AENV_HIBERNATE_AFTER": "3600"})
    if point.startswith(("snapshot.", "upload.")):
        # a template's warm-up is a snapshot too: it must not be the one that dies
        r.env["AENV_WARM_TEMPLATES"] = "0"
    try:
        r.start()
        assert r.node is not None
        CASES[point]()
        code = r.node.proc.wait(timeout=120)
        assert code == -signal.SIGKILL, f"the node did not die at {point}: {r.node.log_tail()}"
        r.node = None
    finally:
        del r.env["AENV_FAULT"]  # (node_home's clean-up starts the node again)
    r.start()

    listed = r.get("/v2/sandboxes?state=running,paused").json()
    for sb in listed:  # whole and usable
        s = Sandbox.connect(sb["sandboxID"], timeout=120)
        assert s.commands.run("echo ok").stdout.strip() == "ok"
        if not point.startswith("create."):  # (a create that died wrote nothing)
            assert s.files.read("/home/user/kept.txt") == KEPT, sb
    for snap in r.get("/snapshots").json():  # whatever is listed starts
        child = Sandbox.create(snap["snapshotID"], timeout=60)
        try:
            assert child.files.read("/home/user/kept.txt") == KEPT
        finally:
            child.kill()
    for sb in listed:
        Sandbox.kill(sb["sandboxID"])
    # nothing of any sandbox is left: what was not taken back was reaped
    # (node_home then checks that nothing of the node is left either)
    deadline = time.monotonic() + 30
    while _sandbox_dirs(r.home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _sandbox_dirs(r.home) == [], r.node and r.node.log_tail()
    assert not list((r.home / "run" / "runsc").glob("*_sandbox:*"))
