"""A crashed lab leaves nodes, sandboxes, namespaces and mounts; the next lab reaps them.

Rules: the crashed lab is a child Python process with one node and one
running sandbox, killed with SIGKILL (its nodes and their runsc processes
outlive it, as after a crashed pytest run). The next `open_lab` must start
on a clean machine and leave nothing of either behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.lab import (
    _NETNS_RE,
    LAB,
    _mounts_under,
    _netns_names,
    _processes,
    open_lab,
    requires_lab,
)

pytestmark = [requires_lab, pytest.mark.runsc]

CRASHING = """
import sys
from e2b import Sandbox
from tests.cluster.lab import open_lab
with open_lab(nodes=1) as lab:
    sbx = Sandbox.create("base", timeout=300, **lab.node(0).sdk())
    assert sbx.commands.run("echo up").stdout.strip() == "up"
    print(lab.root, lab.node(0).proc.pid, flush=True)
    sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_the_next_lab_reaps_what_a_crashed_one_left() -> None:
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, "-c", CRASHING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    ) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline().decode().split()
        finally:
            child.kill()
    assert line, "the crashing lab did not come up"
    root, node_pid = Path(line[0]), int(line[1])
    # what it left: its node, its sandbox's runsc, namespaces, its home with mounts
    assert _alive(node_pid)
    assert f"{LAB}-n0" in _netns_names()
    assert _processes(netns_inodes=set(), marker=str(root) + "/")
    assert _mounts_under(str(root) + "/")
    assert root.is_dir()

    with open_lab(nodes=1) as lab:
        assert not _alive(node_pid)
        assert not root.exists()
        assert not _processes(netns_inodes=set(), marker=str(root) + "/")
        assert not _mounts_under(str(root) + "/")
        assert lab.reachable(0, 0)
    assert lab.closed is not None
    codes, left = lab.closed
    assert codes == {0: 0} and not left, lab.closed
    assert not [n for n in _netns_names() if _NETNS_RE.match(n)]
