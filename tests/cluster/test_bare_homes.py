"""A node that joins the cluster with an empty home takes the default templates from the store.

Rules: two real nodes in the lab (tests/cluster/lab.py) forming one cluster
over an S3 (moto) store; node 0's home has the built templates, node 1's
only the envd bundle. The nodes start together, so node 1 may find the
store empty at its start: once node 0 has shared them, a create of a
default template on node 1 itself (the hop header: no placement) must look
again, fetch it and answer 503 with Retry-After until it is there, never
404; then the sandbox runs on node 1, from node 0's build, and node 1 has
built nothing.
"""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from tests.cluster.lab import Lab, requires_lab

pytestmark = [
    requires_lab,
    pytest.mark.runsc,
    pytest.mark.slow,  # 262 MB through moto and back: about 90 s here
    pytest.mark.lab(nodes=2, store="s3", bare_homes=(1,), env={"AENV_POOL_SIZE": "0"}),
]


def test_a_bare_node_runs_the_default_templates_from_the_store(lab: Lab) -> None:
    bare, sharing = lab.node(1), lab.node(0)
    deadline = time.monotonic() + 300
    for template in ("busybox", "base"):
        done = f"template {template}: put in the object store for nodes that lack it"
        while done not in sharing.log_path.read_text():
            assert time.monotonic() < deadline, sharing.log_tail()
            time.sleep(0.5)
    for template in ("busybox", "base"):
        deadline = time.monotonic() + 300
        with bare.client(timeout=120) as c:
            while True:
                r = c.post(
                    "/sandboxes",
                    json={"templateID": template, "timeout": 120},
                    headers={"x-aenv-hop": "test"},
                )
                if r.status_code == 201:
                    break
                assert r.status_code == 503, r.text
                assert "being fetched from the object store" in r.json()["message"], r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert time.monotonic() < deadline, bare.log_tail()
                time.sleep(1)
        assert r.json()["clientID"] == "node1"
        sbx = Sandbox.connect(r.json()["sandboxID"], **bare.sdk())
        try:
            assert sbx.commands.run("cat /etc/hostname").stdout.strip() == "sandbox"
        finally:
            sbx.kill()
    log = bare.log_path.read_text()
    for template in ("busybox", "base"):
        assert f"template {template} taken from the object store (build shared by node0)" in log
    assert "building template" not in log and "debootstrap" not in log
