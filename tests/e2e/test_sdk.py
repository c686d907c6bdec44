"""The real `e2b` Python SDK against a real node (gVisor sandboxes).

Rules: loopback only; the session `node` fixture owns the node process;
every test kills the sandboxes it creates (the `sbx` fixture) so the leak check
at session end sees a clean node. Commands run as the SDK's default `user`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")


@pytest.fixture
def sbx(node: NodeProc) -> Iterator[Sandbox]:
    s = Sandbox.create(TEMPLATE, timeout=300, metadata={"suite": "sdk"})
    try:
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def test_create_runs_commands_as_user(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo hello; id -un; pwd")
    assert r.exit_code == 0
    assert r.stdout.split() == ["hello", "user", "/home/user"]


def test_exit_code_and_stderr(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo oops >&2; exit 7")
    assert ei.value.exit_code == 7
    assert "oops" in ei.value.stderr


def test_envs_and_cwd(sbx: Sandbox) -> None:
    r = sbx.commands.run('echo "$FOO:$(pwd)"', envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout.strip() == "bar:/tmp"


def test_a_users_process_has_the_users_ids_only_and_cwd_errors_stay(sbx: Sandbox) -> None:
    # (the spawner switches its own credentials to the user's to vfork it)
    status = sbx.commands.run("grep -E '^(Uid|Gid|Groups|CapPrm|CapEff):' /proc/self/status")
    fields = {line.split(":")[0]: line.split()[1:] for line in status.stdout.splitlines()}
    assert fields["Uid"] == ["1000"] * 4 and fields["Gid"] == ["1000"] * 4
    assert int(fields["CapPrm"][0], 16) == 0 and int(fields["CapEff"][0], 16) == 0
    root = sbx.commands.run("id -u; grep -E '^CapEff:' /proc/self/status", user="root")
    assert root.stdout.split()[0] == "0" and int(root.stdout.split()[2], 16) != 0
    # a cwd the user may not enter still starts there, as it always did
    assert sbx.commands.run("pwd", cwd="/root").stdout.strip() == "/root"
    with pytest.raises(SandboxException, match="does not exist"):
        sbx.commands.run("true", cwd="/nonexistent/dir")
    assert sbx.commands.run("echo still").stdout.strip() == "still"


def test_sandbox_env_vars_from_create(node: NodeProc) -> None:
    s = Sandbox.create(TEMPLATE, envs={"GREETING": "hi there"})
    try:
        assert s.commands.run("echo $GREETING").stdout.strip() == "hi there"
    finally:
        s.kill()


def test_streaming_output_arrives_while_running(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done",
        on_stdout=lambda line: seen.append((time.monotonic() - t0, line.strip())),
    )
    assert [s[1] for s in seen] == ["line1", "line2", "line3"]
    # the first line arrived well before the command finished
    assert seen[0][0] < seen[-1][0] - 0.7


def test_background_list_and_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 600", background=True)
    pids = [p.pid for p in sbx.commands.list()]
    assert h.pid in pids
    assert sbx.commands.kill(h.pid)
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("read x; echo got:$x", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "abc\n")
    r = h.wait()
    assert r.stdout.strip() == "got:abc"


def test_pty(sbx: Sandbox) -> None:
    from e2b import PtySize

    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(h.pid, b"stty size > /tmp/size1\n")
    deadline = time.monotonic() + 10
    while not sbx.files.exists("/tmp/size1") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    assert sbx.files.read("/tmp/size1").strip() == "24 80"
    sbx.pty.resize(h.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; echo $((6*7)); exit 3\n")
    out = bytearray()
    with pytest.raises(CommandExitException) as ei:
        h.wait(on_pty=out.extend)
    assert ei.value.exit_code == 3
    text = out.decode(errors="replace")
    assert "40 100" in text
    assert "42" in text


def test_files_text_and_binary(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/hello.txt", "hello world")
    assert sbx.files.read("/home/user/hello.txt") == "hello world"
    blob = os.urandom(10 * 1024 * 1024)
    sbx.files.write("/home/user/blob.bin", blob)
    assert bytes(sbx.files.read("/home/user/blob.bin", format="bytes")) == blob
    r = sbx.commands.run("stat -c %U:%s /home/user/blob.bin")
    assert r.stdout.strip() == f"user:{len(blob)}"


def test_files_list_stat_mkdir_rename_remove(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("/home/user/d/e")
    sbx.files.write("/home/user/d/a.txt", "a")
    names = sorted(e.name for e in sbx.files.list("/home/user/d"))
    assert names == ["a.txt", "e"]
    info = sbx.files.get_info("/home/user/d/a.txt")
    assert info.size == 1 and info.type.value == "file"
    sbx.files.rename("/home/user/d/a.txt", "/home/user/d/b.txt")
    assert not sbx.files.exists("/home/user/d/a.txt")
    assert sbx.files.exists("/home/user/d/b.txt")
    sbx.files.remove("/home/user/d")
    assert not sbx.files.exists("/home/user/d")
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/nope.txt")


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/w")
    handle = sbx.files.watch_dir("/home/user/w")
    sbx.files.write("/home/user/w/new.txt", "x")
    deadline = time.monotonic() + 10
    events = []
    while time.monotonic() < deadline and not any(e.name == "new.txt" for e in events):
        events += handle.get_new_events()
        time.sleep(0.2)
    handle.stop()
    assert any(e.name == "new.txt" for e in events)


def test_metadata_and_list_filters(node: NodeProc) -> None:
    a = Sandbox.create(TEMPLATE, metadata={"team": "red", "n": "1"})
    b = Sandbox.create(TEMPLATE, metadata={"team": "blue"})
    try:
        from e2b import SandboxQuery, SandboxState

        red = Sandbox.list(query=SandboxQuery(metadata={"team": "red"})).next_items()
        assert [s.sandbox_id for s in red] == [a.sandbox_id]
        assert red[0].metadata == {"team": "red", "n": "1"}
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        ids = {s.sandbox_id for s in running}
        assert {a.sandbox_id, b.sandbox_id} <= ids
        paginator = Sandbox.list(limit=1)
        first = paginator.next_items()
        assert len(first) == 1 and paginator.has_next
        second = paginator.next_items()
        assert len(second) == 1 and second[0].sandbox_id != first[0].sandbox_id
    finally:
        a.kill()
        b.kill()


def test_timeout_extension_and_expiry(node: NodeProc) -> None:
    s = Sandbox.create(TEMPLATE, timeout=3)
    try:
        s.set_timeout(8)
        info = s.get_info()
        remaining = (info.end_at - info.started_at).total_seconds()
        assert remaining > 5
        time.sleep(4)
        assert s.is_running()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and s.is_running():
            time.sleep(0.5)
        assert not s.is_running()
        with pytest.raises(NotFoundException):
            Sandbox.connect(s.sandbox_id)
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def test_kill(node: NodeProc) -> None:
    s = Sandbox.create(TEMPLATE)
    s.kill()
    assert s.sandbox_id not in {x.sandbox_id for x in Sandbox.list().next_items()}
    assert not Sandbox.kill(s.sandbox_id)


def test_user_http_server_through_proxy(sbx: Sandbox, node: NodeProc) -> None:
    sbx.commands.run("mkdir -p /tmp/www && echo served-from-sandbox > /tmp/www/index.html")
    sbx.commands.run("cd /tmp/www && python3 -m http.server 8080", background=True)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(node.url + "/index.html", headers=headers, timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200
    assert r.text.strip() == "served-from-sandbox"


def test_wrong_api_key_refused(node: NodeProc) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="wrong")
    r = httpx.get(node.url + "/sandboxes", headers={"X-API-Key": "wrong"})
    assert r.status_code == 401 and r.json()["code"] == 401


def test_unknown_template(node: NodeProc) -> None:
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template")


def test_envd_requires_the_sandbox_access_token(sbx: Sandbox, node: NodeProc) -> None:
    route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    rpc = {"content-type": "application/json", "connect-protocol-version": "1"}
    url = node.url + "/process.Process/List"
    r = httpx.post(url, headers={**route, **rpc}, content=b"{}")
    assert r.status_code == 401
    token = sbx._envd_access_token  # what Sandbox.create returned as envdAccessToken
    assert token
    r = httpx.post(url, headers={**route, **rpc, "X-Access-Token": token}, content=b"{}")
    assert r.status_code == 200 and isinstance(r.json().get("processes", []), list)


def test_private_traffic_needs_traffic_token(node: NodeProc) -> None:
    r = httpx.post(
        node.url + "/v2/sandboxes",
        json={"templateID": TEMPLATE, "network": {"allowPublicTraffic": False}},
        headers={"X-API-Key": node.api_key},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    created = r.json()
    sid, traffic = created["sandboxID"], created["trafficAccessToken"]
    assert traffic
    try:
        s = Sandbox.connect(sid)
        s.commands.run("cd /tmp && python3 -m http.server 8081", background=True)
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8081"}
        assert httpx.get(node.url + "/", headers=route).status_code == 403
        deadline = time.monotonic() + 20
        while True:
            ok = httpx.get(
                node.url + "/", headers={**route, "e2b-traffic-access-token": traffic}, timeout=5
            )
            if ok.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert ok.status_code == 200
    finally:
        Sandbox.kill(sid)


def test_metrics_count_what_the_sandbox_wrote(node: NodeProc) -> None:
    s = Sandbox.create("base")
    try:
        s.commands.run("head -c 4194304 /dev/urandom > /home/user/blob")
        m = s.get_metrics()[-1]
        assert m.disk_used >= 4 * 1024 * 1024, m
        assert m.disk_total > m.disk_used
        assert m.mem_used > 0 and m.cpu_count >= 1
    finally:
        s.kill()
