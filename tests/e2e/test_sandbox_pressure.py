"""Sandboxes under pressure behave like machines: the unmodified e2b SDK against a real node.

Rules: loopback only; the session `node` fixture owns the node (default
512 MiB sandboxes); every test kills the sandboxes it creates. A memory hog
is the process that dies (the sandbox, its other processes and envd live
on, and the kill shows in the sandbox's logs and the node's metrics); a
fork bomb meets the process limit (EAGAIN) while envd keeps answering; a
sandbox whose runtime the host kills stays known, with the reason; hostile
bodies and Host headers get a 400.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import NotFoundException, SandboxException

from tests.conftest import (
    NET_PREFIX,
    NodeProc,
    private_node,
    requires_node,
)

pytestmark = [requires_node, pytest.mark.runsc]

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")


# Two hogs, each a loop counting its rounds in a file: memory (each round killed
# by the sandbox's OOM killer) and disk (filled to ENOSPC, then emptied).
MEMORY_HOG = (
    "i=0; while true; do python3 -c 'x = bytearray(2*1024**3)'; i=$((i+1)); "
    "echo $i > /var/tmp/mem; done"
)
DISK_HOG = (
    "i=0; while true; do dd if=/dev/zero of=/home/user/fill bs=1M 2>/dev/null; "
    "rm -f /home/user/fill; i=$((i+1)); echo $i > /var/tmp/disk; done"
)


def _memory_and_disk_hogs(s: Sandbox, seconds: int) -> None:
    """Start both hogs as root in the background, each ending after `seconds`."""
    for loop in (MEMORY_HOG, DISK_HOG):
        s.commands.run(
            f"timeout {seconds} sh -c {shlex.quote(loop)} >/dev/null 2>&1",
            background=True,
            user="root",
        )


def _kill_the_users_processes(s: Sandbox, timeout: float) -> None:
    """Kill every process of `user`, until none is left (a fork bomb forks
    again between pkill's reads)."""
    with contextlib.suppress(CommandExitException):
        s.commands.run(
            "for i in $(seq 100); do pkill -9 -u user || break; sleep 0.2; done",
            user="root",
            timeout=timeout,
        )


@pytest.fixture
def sbx(node: NodeProc) -> Iterator[Sandbox]:
    s = Sandbox.create(TEMPLATE, timeout=300)
    try:
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def _logs(node: NodeProc, sandbox_id: str) -> list[dict[str, object]]:
    r = httpx.get(f"{node.url}/v2/sandboxes/{sandbox_id}/logs", headers={"X-API-Key": node.api_key})
    r.raise_for_status()
    logs: list[dict[str, object]] = r.json()["logs"]
    return logs


def _metric(node: NodeProc, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", headers={"X-API-Key": node.api_key}).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _cli(node: NodeProc, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`aenv *args` against `node`, with no configuration but the node's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(XDG_CONFIG_HOME=str(config), AENV_URL=node.url, AENV_API_KEY=node.api_key)
    return subprocess.run(
        [sys.executable, "-m", "aenv", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_memory_hog_dies_alone(node: NodeProc, sbx: Sandbox) -> None:
    oom_before = _metric(node, "aenv_sandbox_oom_kills_total")
    bystander = sbx.commands.run("sleep 600", background=True)
    sbx.files.write("/home/user/kept.txt", "still here")
    assert "MemTotal:         524288 kB" in sbx.commands.run("cat /proc/meminfo").stdout
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("python3 -c 'x = bytearray(2*1024**3)'", timeout=120)
    assert ei.value.exit_code in (-1, 137)
    # from a shell the kill is the familiar 137
    r = sbx.commands.run("python3 -c 'x = bytearray(2*1024**3)'; echo status=$?", timeout=120)
    assert "status=137" in r.stdout
    # the sandbox, its files and its other processes live on
    assert sbx.commands.run("echo alive").stdout.strip() == "alive"
    assert sbx.files.read("/home/user/kept.txt") == "still here"
    assert bystander.pid in [p.pid for p in sbx.commands.list()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kills = [e for e in _logs(node, sbx.sandbox_id) if "out of memory" in str(e["message"])]
        if len(kills) >= 2:
            break
        time.sleep(0.5)
    assert len(kills) >= 2, _logs(node, sbx.sandbox_id)
    assert "python3" in str(kills[0]["message"])
    assert _metric(node, "aenv_sandbox_oom_kills_total") >= oom_before + 2


def test_fork_bomb_meets_the_process_limit(sbx: Sandbox) -> None:
    assert sbx.commands.run("ulimit -u").stdout.strip() == "128"
    # the shell that starts it returns at once; its descendants fork on, orphaned
    sbx.commands.run("bash -c 'b(){ b|b& }; b' >/tmp/bomb.log 2>&1", timeout=60)
    # envd keeps answering while the bomb runs (how fast depends on the machine:
    # a busy 2-core host answered a few calls in these 12 s, a quiet one dozens)
    t0 = time.monotonic()
    busiest = 0
    while time.monotonic() - t0 < 12:
        r = sbx.commands.run("pgrep -c -u user || true", user="root", timeout=60)
        busiest = max(busiest, int(r.stdout.strip() or 0))
    assert 64 <= busiest <= 128  # it was at it, up to the limit
    assert "Resource temporarily unavailable" in sbx.files.read("/tmp/bomb.log")
    # once it is killed the sandbox is as usable as before
    _kill_the_users_processes(sbx, timeout=60)
    assert sbx.commands.run("echo ok").stdout.strip() == "ok"


def test_fork_bomb_memory_hog_and_disk_writer_at_once(node: NodeProc, sbx: Sandbox) -> None:
    # all three at once: the runtime's memory for the bomb's tasks, a guest whose
    # memory is full and the page cache of a disk being filled stay inside the
    # host's limit, so the process limit, envd's OOM killer and the disk's size act
    # first and the sandbox lives on
    hogs_s = 25
    sbx.commands.run(
        f"timeout {hogs_s} bash -c 'b(){{ b|b& }}; b' >/dev/null 2>&1", background=True
    )
    _memory_and_disk_hogs(sbx, hogs_s)
    t0 = time.monotonic()
    bombs = 0
    while time.monotonic() - t0 < hogs_s:  # envd answers throughout
        r = sbx.commands.run("pgrep -c -u user || true", user="root", timeout=60)
        bombs = max(bombs, int(r.stdout.strip() or 0))
    time.sleep(3)  # the hogs have ended
    with contextlib.suppress(CommandExitException):
        sbx.commands.run("pkill -9 -u user", user="root", timeout=60)
    rounds = sbx.commands.run("cat /var/tmp/mem /var/tmp/disk", user="root").stdout.split()
    assert bombs >= 64  # the bomb was at it ...
    assert int(rounds[0]) >= 2  # ... while hogs were killed for memory, one after another ...
    assert int(rounds[1]) >= 1  # ... and the disk was filled (ENOSPC) and emptied
    assert sbx.commands.run("echo alive").stdout.strip() == "alive"
    kills = [e for e in _logs(node, sbx.sandbox_id) if "out of memory" in str(e["message"])]
    assert len(kills) >= 2


def test_orphans_are_collected(sbx: Sandbox) -> None:
    # background children of a shell that exits are handed to pid 1 (envd)
    sbx.commands.run("bash -c 'sleep 0.2 & sleep 0.2 &'", timeout=60)
    zombies = "x"
    for _ in range(50):
        zombies = sbx.commands.run("ps -eo stat= | grep -c '^Z' || true", user="root").stdout
        if zombies.strip() == "0":
            break
        time.sleep(0.2)
    assert zombies.strip() == "0"


def test_sandbox_killed_by_the_host_says_why(node: NodeProc, tmp_path: Path) -> None:
    s = Sandbox.create(TEMPLATE, timeout=300, metadata={"case": "died"})
    try:
        sid = s.sandbox_id
        # the host runs short: its cgroup limit just above what the sandbox holds now
        memory = Path(f"/sys/fs/cgroup/memory/{NET_PREFIX}/{sid}")
        if memory.is_dir():
            use = int((memory / "memory.usage_in_bytes").read_text())
            (memory / "memory.limit_in_bytes").write_text(str(use + (16 << 20)))
        else:
            v2 = Path(f"/sys/fs/cgroup/{NET_PREFIX}/{sid}")
            use = int((v2 / "memory.current").read_text())
            (v2 / "memory.max").write_text(str(use + (16 << 20)))
        with pytest.raises(SandboxException):
            s.commands.run("python3 -c 'x = bytearray(300*1024**2)'", timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = httpx.get(f"{node.url}/sandboxes/{sid}", headers={"X-API-Key": node.api_key})
            if "died" in r.text:
                break
            time.sleep(0.5)
        assert r.status_code == 404
        assert "died at" in r.json()["message"]
        assert "out of memory" in r.json()["message"]
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sid)
        assert _metric(node, "aenv_sandboxes_died_total") >= 1
        # the SDK's list still parses (it knows only running and paused) and leaves it out
        assert sid not in [i.sandbox_id for i in Sandbox.list().next_items()]
        # asked for by name, lists show it with the reason
        r = httpx.get(
            f"{node.url}/v2/sandboxes",
            params={"state": "died", "metadata": "case=died"},
            headers={"X-API-Key": node.api_key},
        )
        assert r.status_code == 200
        [died] = [d for d in r.json() if d["sandboxID"] == sid]
        assert died["state"] == "died"
        assert "out of memory" in died["reason"]
        assert died["memoryMB"] == 512
        cli = _cli(node, tmp_path, "list", "--all", "--output", "table")
        assert cli.returncode == 0, cli.stderr
        [row] = [line for line in cli.stdout.splitlines() if sid in line]
        assert "died" in row and "out of memory" in row
        assert "REASON" in cli.stdout.splitlines()[0]
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def test_hostile_requests_get_400(node: NodeProc) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(
        f"{node.url}/sandboxes",
        content=deep,
        headers={"X-API-Key": node.api_key, "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert "nested" in r.json()["message"]
    for host in ("a" * 5000, "49983-" + "a" * 5000 + ".example", "a..b"):
        r = httpx.get(f"{node.url}/health", headers={"Host": host})
        assert r.status_code == 400, host[:20]
        assert r.json()["code"] == 400


@pytest.mark.slow
def test_all_three_hogs_for_minutes_under_systrap() -> None:
    # The default-suite test above runs them for 25 s under the session node's
    # platform; here for minutes, on a node of its own with systrap (under ptrace
    # the runtime's host threads grow with every new process and are never freed;
    # there the task valve ends the bomb before they run out: the slow test below
    # and docs/performance.md). The host's memory limit is reached now and then:
    # the relief valve lets envd act instead of the host killing the sandbox.
    env = {"AENV_RUNSC_PLATFORM": "systrap", "AENV_NET_PREFIX": "", "AENV_SLOT_CIDR": ""}
    hogs_s = 200
    with private_node(env, leak_prefix=None):
        s = Sandbox.create(TEMPLATE, timeout=900)
        s.commands.run("bash -c 'b(){ b|b& }; b' >/dev/null 2>&1", background=True)
        _memory_and_disk_hogs(s, hogs_s)
        t0 = time.monotonic()
        rounds: list[list[str]] = []
        while time.monotonic() - t0 < hogs_s:
            time.sleep(20)
            r = s.commands.run("cat /var/tmp/mem /var/tmp/disk", user="root", timeout=120)
            rounds.append(r.stdout.split())
        _kill_the_users_processes(s, timeout=120)
        assert s.commands.run("echo alive").stdout.strip() == "alive"
        # both hogs went on to the end, one round after another
        assert int(rounds[-1][0]) > int(rounds[len(rounds) // 2][0]) > int(rounds[0][0])
        assert int(rounds[-1][1]) > int(rounds[len(rounds) // 2][1]) > int(rounds[0][1])
        s.kill()


@pytest.mark.slow
def test_fork_bomb_is_ended_before_the_runtimes_host_tasks_run_out() -> None:
    # Under ptrace the runtime keeps a host thread per guest address space and
    # sentry thread, never freed: a bomb grows the sandbox's host tasks until
    # its pids.max kills it (here 4,096: without the valve dead within ~15 s; the
    # default, 8,192 on this host, in ~2 minutes). The node signals envd at half of it, which ends
    # the largest process group; the sandbox and its other processes live on.
    env = {"AENV_SANDBOX_HOST_TASKS": "4096", "AENV_NET_PREFIX": "", "AENV_SLOT_CIDR": ""}
    with private_node(env, leak_prefix=None) as n:
        s = Sandbox.create(TEMPLATE, timeout=600)
        quiet = s.commands.run("sleep 600", background=True, timeout=0)
        # (the shell that starts it returns at once; its descendants fork on. A
        # bash bomb can die out by itself when every fork fails at the process
        # limit, once here at ~1,600 host tasks, before the valve's mark: the
        # loop seeds it again each second, in the same process group)
        s.commands.run(
            "timeout 90 bash -c 'b(){ b|b& }; while :; do b; sleep 1; done'", background=True
        )
        t0 = time.monotonic()
        bombs: list[int] = []
        while time.monotonic() - t0 < 60:  # envd answers throughout
            r = s.commands.run("pgrep -c -u user bash || true", user="root", timeout=60)
            bombs.append(int(r.stdout.strip() or 0))
            time.sleep(1)
        assert max(bombs) >= 8  # it was at it (for the first seconds) ...
        assert bombs[-1] == 0  # ... and was ended, long before its timeout
        assert s.commands.run("echo alive").stdout.strip() == "alive"
        assert quiet.pid in [p.pid for p in s.commands.list()]  # the other command lives on
        r = httpx.get(f"{n.url}/v2/sandboxes/{s.sandbox_id}/logs", headers={"X-API-Key": n.api_key})
        events = [e for e in r.json()["logs"] if "host tasks near" in str(e["message"])]
        assert events and "of 4096" in str(events[0]["message"])
        s.kill()
