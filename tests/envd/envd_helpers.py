"""Test support for envd: a real envd subprocess, a test user, an E2B API stub.

Rules: loopback only; envd listens on 127.0.0.1 on a free port and is killed
after the session; the `aenvtest` user is created with useradd when missing
(envd runs as root here) and removed again if this session created it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from aenv.proto.envd_schema import ENVD_VERSION

REPO = Path(__file__).resolve().parents[2]
TEST_USER = "aenvtest"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Envd:
    url: str
    port: int
    proc: subprocess.Popen[bytes]


def start_envd(extra_env: dict[str, str] | None = None) -> Envd:
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["AENV_ENVD_TEST_MARKER"] = "leak-check"
    env.update(extra_env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=str(REPO),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 204:
                return Envd(url, port, proc)
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("envd did not become healthy")


def stop_envd(envd: Envd) -> None:
    envd.proc.terminate()
    try:
        envd.proc.wait(10)
    except subprocess.TimeoutExpired:
        envd.proc.kill()
        envd.proc.wait()


@pytest.fixture(scope="session")
def test_user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as another user")
    created = False
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", TEST_USER], check=True)
        created = True
        entry = pwd.getpwnam(TEST_USER)
    try:
        yield entry
    finally:
        if created:
            subprocess.run(["userdel", "-r", TEST_USER], check=False, capture_output=True)


@pytest.fixture(scope="session")
def envd(test_user: pwd.struct_passwd) -> Iterator[Envd]:
    server = start_envd()
    try:
        httpx.post(
            server.url + "/init", json={"defaultUser": TEST_USER}, timeout=5
        ).raise_for_status()
        yield server
    finally:
        stop_envd(server)


@pytest.fixture
def home(test_user: pwd.struct_passwd) -> Iterator[Path]:
    """A fresh directory in the test user's home, removed afterwards."""
    path = Path(test_user.pw_dir) / f"t{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    os.chown(path, test_user.pw_uid, test_user.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _StubHandler(BaseHTTPRequestHandler):
    """Stands in for the node's REST API: create answers with a sandbox record."""

    envd_version = ENVD_VERSION
    access_token: str | None = None

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path in ("/v2/sandboxes", "/sandboxes"):
            record: dict[str, object] = {
                "sandboxID": "sbxtest",
                "templateID": body.get("templateID", "base"),
                "clientID": "client",
                "envdVersion": self.envd_version,
                "domain": "localhost",
            }
            if self.access_token:
                record["envdAccessToken"] = self.access_token
            self._json(201, record)
        else:
            self._json(404, {"code": 404, "message": "not found"})

    def do_DELETE(self) -> None:
        self.send_response(204)
        self.end_headers()


@dataclass
class Stub:
    url: str
    handler: type[_StubHandler]


@pytest.fixture(scope="session")
def api_stub() -> Iterator[Stub]:
    handler = type("Handler", (_StubHandler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Stub(f"http://127.0.0.1:{server.server_address[1]}", handler)
    finally:
        server.shutdown()
        server.server_close()
