"""A node that joins with an empty home takes the default templates from the store.

Rules: real nodes (real runsc), a `file://` store in the test's temp dir
named by AENV_STORE_URL. Node A has the built test home's templates and
shares them; node B's home holds only the envd bundle. B must start
sandboxes of `base` and `busybox` that run commands, with templates whose
root filesystems are A's builds to the index digest, and must never build
one: no rootfs builder runs in a node, and B's log says each came from the
store. While B fetches (held back, deterministically, by the test holding
the templates' build lock that every build or fetch takes), a create of a
missing template answers 503 with Retry-After and says so, never 404.
Nothing of either node may leak.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.storage.rootfs import build_lock, recipe
from aenv.storage.snapstore.defaults import StoredRootfs, pointer_key, rootfs_index
from aenv.storage.templates import TemplateStore
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

DEFAULTS = ("busybox", "base")
# this module's own network names and slot range (the session's node may run meanwhile)
PREFIX = os.environ.get("AENV_TEST_DEFAULTS_PREFIX", "aenvd")
CIDRS = os.environ.get("AENV_TEST_DEFAULTS_CIDRS", "10.239.0.0/16,10.240.0.0/16").split(",")


def _wait_shared(store: Path, node: NodeProc, limit: float = 240) -> dict[str, StoredRootfs]:
    """The store's pointers to node A's builds, once both are there."""
    deadline = time.monotonic() + limit
    found: dict[str, StoredRootfs] = {}
    while len(found) < len(DEFAULTS):
        assert time.monotonic() < deadline, f"not shared in {limit}s:\n{node.log_tail()}"
        for tid in DEFAULTS:
            path = store / pointer_key(tid, recipe(tid))
            if tid not in found and path.exists():
                found[tid] = StoredRootfs.from_json(path.read_bytes())
        time.sleep(0.5)
    return found


def _create(node: NodeProc, template: str, limit: float = 300) -> tuple[str, int]:
    """Create a sandbox of `template` through the REST API, retrying the 503s a node
    answers while it fetches the template; (sandbox ID, how many 503s)."""
    deadline = time.monotonic() + limit
    waits = 0
    while True:
        r = httpx.post(
            f"{node.url}/sandboxes",
            json={"templateID": template, "timeout": 120},
            headers={"X-API-Key": node.api_key},
            timeout=120,
        )
        if r.status_code == 201:
            return str(r.json()["sandboxID"]), waits
        assert r.status_code == 503, r.text  # never "not found" while it is fetched
        assert "being fetched from the object store" in r.json()["message"], r.text
        assert int(r.headers["Retry-After"]) >= 1
        waits += 1
        assert time.monotonic() < deadline, f"{template} not fetched:\n{node.log_tail()}"
        time.sleep(1)


def test_a_node_with_an_empty_home_takes_the_templates_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = built_home()
    assert built is not None
    store = tmp_path / "store"
    env = {
        "AENV_STORE_URL": store.as_uri(),
        "AENV_NET_PREFIX": PREFIX,
        "AENV_SLOT_CIDR": CIDRS[0],
    }
    key = "k" + secrets.token_hex(8)
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    home_a.mkdir()
    link_home(built, home_a)
    home_b.mkdir()
    (home_b / "bundle").symlink_to(built / "bundle")  # the node's software, no templates
    nodes: list[NodeProc] = []
    try:
        a = start_node(home_a, api_key=key, log_path=tmp_path / "a.log", extra_env=env)
        nodes.append(a)
        shared = _wait_shared(store, a)
        for tid in DEFAULTS:
            assert shared[tid].shared_by
            assert (home_a / "templates" / tid / "rootfs-index").read_text() == shared[tid].index
        assert stop_node(nodes.pop()) == 0

        # B: another slot range, so it could run next to A
        b_env = {**env, "AENV_SLOT_CIDR": CIDRS[1]}
        with build_lock(TemplateStore(home_b / "templates")):  # B's fetches wait for it
            b = start_node(home_b, api_key=key, log_path=tmp_path / "b.log", extra_env=b_env)
            nodes.append(b)
            for tid in DEFAULTS:
                r = httpx.post(
                    f"{b.url}/sandboxes",
                    json={"templateID": tid},
                    headers={"X-API-Key": key},
                    timeout=60,
                )
                assert r.status_code == 503, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert f"template '{tid}' is being fetched from the object store" in r.text
            listed = httpx.get(f"{b.url}/templates", headers={"X-API-Key": key}, timeout=30)
            assert not {t["templateID"] for t in listed.json()} & set(DEFAULTS)
        monkeypatch.setenv("E2B_API_URL", b.url)
        monkeypatch.setenv("E2B_SANDBOX_URL", b.url)
        monkeypatch.setenv("E2B_API_KEY", key)
        for tid in DEFAULTS:
            sandbox_id, _waits = _create(b, tid)
            sbx = Sandbox.connect(sandbox_id)
            try:
                out = sbx.commands.run("cat /etc/hostname; id -un")
                assert out.exit_code == 0
                assert out.stdout.split() == ["sandbox", "user"]
            finally:
                sbx.kill()
            rootfs = home_b / "templates" / tid / "rootfs"
            assert rootfs_index(rootfs)[1] == shared[tid].index  # A's build, exactly
        log = b.log_path.read_text()
        for tid in DEFAULTS:
            assert f"template {tid} taken from the object store" in log, log[-4000:]
        assert "debootstrap" not in log and "building template" not in log
        listed = httpx.get(f"{b.url}/templates", headers={"X-API-Key": key}, timeout=30).json()
        assert {t["templateID"] for t in listed} >= set(DEFAULTS)
    finally:
        while nodes:
            n = nodes.pop()
            code = stop_node(n)
            assert code == 0, n.log_tail()
        for home in (home_a, home_b):
            assert not leaks(home, PREFIX), leaks(home, PREFIX)
        shutil.rmtree(tmp_path / "a", ignore_errors=True)
