"""Crashes leave state recoverable; one sandbox's crash never takes the node down.

Rules: each test runs its own node (not the session node) in a temp home
whose bundle and templates link to AENV_TEST_HOME, with its own netns prefix
and slot range, so killing it cannot disturb the session node. Loopback only.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    start_node,
    stop_node,
)

pytestmark = [requires_node, pytest.mark.runsc]
PREFIX = "aenvr"
ENV = {
    "AENV_NET_PREFIX": PREFIX,
    "AENV_SLOT_CIDR": "10.236.0.0/16",
    "AENV_EGRESS_CAP": "198.51.100.0/24",
}


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    src = built_home()
    assert src is not None
    h = tmp_path / "home"
    h.mkdir()
    link_home(src, h)
    yield h


def _start(home: Path) -> NodeProc:
    return start_node(
        home, api_key="k" + secrets.token_hex(8), log_path=home / "node.log", extra_env=ENV
    )


def _create(n: NodeProc) -> str:
    r = httpx.post(
        n.url + "/v2/sandboxes",
        json={"templateID": "busybox", "timeout": 120},
        headers={"X-API-Key": n.api_key},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def _runsc_pids(home: Path) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        int(line.split()[0]) for line in out.splitlines() if "runsc" in line and str(home) in line
    ]


def test_sigkill_node_then_restart_takes_back_its_sandboxes_and_reaps_the_rest(
    home: Path,
) -> None:
    n = _start(home)
    try:
        ids = [_create(n), _create(n)]
        assert len(ids) == 2 and _runsc_pids(home)
    finally:
        n.proc.send_signal(signal.SIGKILL)
        n.proc.wait()
    # what no journal names: a slot's netns, a runtime directory
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-900"], check=True)
    (home / "sandboxes" / "notjournaled" / "runtime").mkdir(parents=True)
    n2 = _start(home)
    try:
        h = {"X-API-Key": n2.api_key}
        for sid in ids:
            r = httpx.get(n2.url + f"/sandboxes/{sid}", headers=h)
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{PREFIX}-900" not in netns
        assert not (home / "sandboxes" / "notjournaled").exists()
        # and it works
        for sid in [*ids, _create(n2)]:
            r = httpx.delete(n2.url + f"/sandboxes/{sid}", headers=h, timeout=60)
            assert r.status_code == 204
        assert httpx.get(n2.url + "/sandboxes", headers=h).json() == []
    finally:
        assert stop_node(n2) == 0
    assert not leaks(home, PREFIX)


def test_one_sandbox_dying_does_not_take_the_node_down(home: Path) -> None:
    n = _start(home)
    try:
        victim, survivor = _create(n), _create(n)
        pid_file = home / "sandboxes" / victim / "runtime"
        pids = [
            int(p.read_text()) for p in pid_file.glob("*.pid") if p.read_text().strip().isdigit()
        ]
        assert pids, f"no pid file under {pid_file}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = httpx.get(n.url + f"/sandboxes/{victim}", headers={"X-API-Key": n.api_key})
            if r.status_code == 404:
                break
            time.sleep(0.2)
        assert r.status_code == 404
        r = httpx.get(n.url + f"/sandboxes/{survivor}", headers={"X-API-Key": n.api_key})
        assert r.status_code == 200 and r.json()["state"] == "running"
        # the record goes once teardown finishes (it is 404 from the moment it stops)
        want = 'aenv_sandboxes_stopped_total{reason="exited"} 1'
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = httpx.get(n.url + "/metrics", headers={"X-API-Key": n.api_key}).text
            if want in metrics:
                break
            time.sleep(0.2)
        assert want in metrics
    finally:
        assert stop_node(n) == 0
    assert not leaks(home, PREFIX)
