"""Real nodes, one at a time, for the e2e tests: alone, or sharing one S3 store (moto).

`OneNode` starts one node at a time on a home and points the e2b SDK at it
(test_restart.py's `Restartable` adds its one home). `Nodes` (a context
manager) gives each node name a private home under `root` linked to the
built one; `start(name)` starts a node there against the S3 store (under a
prefix of its own) on the suite's netns prefix and slot range. On leaving
it stops the node left running and fails on whatever of the nodes leaked.
Used by test_durable.py and test_cold_restore.py; `wait_storage` also
serves the session node (test_snapshots.py).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import NodeProc, built_home, leaks, link_home, start_node, stop_node
from tests.s3 import MotoS3


def snapshot_storage(url: str, api_key: str, snapshot_id: str) -> str:
    """Where the node at `url` says the snapshot is: local, uploading or durable."""
    r = httpx.get(f"{url}/snapshots/{snapshot_id}", headers={"X-API-Key": api_key}, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["storage"])


def wait_storage(url: str, api_key: str, snapshot_id: str, want: str, limit: float = 90) -> None:
    """Wait until the snapshot's storage is `want` (an upload finishes on its own time)."""
    deadline = time.monotonic() + limit
    while (got := snapshot_storage(url, api_key, snapshot_id)) != want:
        assert time.monotonic() < deadline, f"{snapshot_id} still {got}, not {want}"
        time.sleep(0.2)


class OneNode:
    """One node at a time, started on a home and stopped at will; the e2b SDK
    (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) points at the current node."""

    post_timeout: float = 300  # seconds: a create or a snapshot, on a busy machine

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.key = "k" + secrets.token_hex(8)
        self.monkeypatch = monkeypatch
        self.node: NodeProc | None = None

    def run(self, home: Path, env: dict[str, str]) -> NodeProc:
        """Start a node on `home` with `env` (its log: home/node.log) and point the SDK at it."""
        n = start_node(home, api_key=self.key, log_path=home / "node.log", extra_env=env)
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
            self.node.url + path,
            json=body,
            headers={"X-API-Key": self.key},
            timeout=self.post_timeout,
        )

    def delete(self, path: str) -> httpx.Response:
        assert self.node is not None
        return httpx.delete(self.node.url + path, headers={"X-API-Key": self.key}, timeout=60)


class Nodes(OneNode):
    """Nodes sharing one S3 store, each on a private home linked to the built
    one, one at a time. As a context manager: on leaving, the node left running
    is stopped and nothing of any of them (runsc processes, mounts, netns) may
    be left."""

    def __init__(
        self,
        root: Path,
        s3: MotoS3,
        monkeypatch: pytest.MonkeyPatch,
        *,
        net_prefix: str,
        cidr: str,
        store_prefix: str,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(monkeypatch)
        self.root = root
        self.s3 = s3
        self.net_prefix = net_prefix
        self.cidr = cidr
        self.prefix = f"{store_prefix}/{secrets.token_hex(4)}"
        self.env = dict(env or {})
        self.homes: list[Path] = []

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.node is not None:
            with contextlib.suppress(Exception):
                self.stop()
        for home in self.homes:
            left = leaks(home, self.net_prefix)
            assert not left, left

    def home(self, name: str) -> Path:
        home = self.root / name
        if not home.exists():
            home.mkdir()
            built = built_home()
            assert built is not None
            link_home(built, home)
            self.homes.append(home)
        return home

    def start(self, name: str, **extra: str) -> NodeProc:
        env = {
            "AENV_NET_PREFIX": self.net_prefix,
            "AENV_SLOT_CIDR": self.cidr,
            **self.s3.env(),
            "AENV_STORE_URL": self.s3.url(self.prefix),
            "AENV_SHARE_DEFAULT_TEMPLATES": "off",  # not what these tests are about
            **self.env,
            **extra,
        }
        return self.run(self.home(name), env)

    def snapshot(self, sandbox_id: str, **body: Any) -> dict[str, Any]:
        r = self.post(f"/sandboxes/{sandbox_id}/snapshots", body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def storage(self, snapshot_id: str) -> str:
        assert self.node is not None
        return snapshot_storage(self.node.url, self.key, snapshot_id)

    def wait_storage(self, snapshot_id: str, want: str, limit: float = 90) -> None:
        assert self.node is not None
        wait_storage(self.node.url, self.key, snapshot_id, want, limit)

    # -- the store, behind the node's back --------------------------------------------

    def objects(self, under: str) -> dict[str, int]:
        """{key below the store prefix: size} of the objects under `under`."""
        client = self.s3.boto()
        out: dict[str, int] = {}
        token: dict[str, str] = {}
        while True:
            got = client.list_objects_v2(
                Bucket=self.s3.bucket, Prefix=f"{self.prefix}/{under}", **token
            )
            for o in got.get("Contents", []):
                out[o["Key"][len(self.prefix) + 1 :]] = int(o["Size"])
            if not got.get("IsTruncated"):
                return out
            token = {"ContinuationToken": got["NextContinuationToken"]}

    def wait_template(self, template_id: str, why: str, limit: float = 120) -> None:
        deadline = time.monotonic() + limit
        while f"templates/{template_id}.json" not in self.objects("templates/"):
            assert time.monotonic() < deadline, why
            time.sleep(0.2)

    def manifest(self, snapshot_id: str) -> dict[str, Any]:
        body = self.s3.boto().get_object(
            Bucket=self.s3.bucket, Key=f"{self.prefix}/snapshots/{snapshot_id}.json"
        )["Body"]
        return dict(json.loads(body.read()))

    def overwrite(self, key: str, data: bytes) -> None:
        self.s3.boto().put_object(Bucket=self.s3.bucket, Key=f"{self.prefix}/{key}", Body=data)
