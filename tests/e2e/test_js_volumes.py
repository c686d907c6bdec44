"""Volumes with the e2b npm SDK against the node (node's test runner in tests/js)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]
JS = Path(__file__).resolve().parent.parent / "js"


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_js_volumes(node: NodeProc) -> None:
    if not (JS / "node_modules" / "e2b").is_dir():
        pytest.skip("npm e2b not installed (make test installs it)")
    env = dict(
        os.environ,
        E2B_API_URL=node.url,
        E2B_SANDBOX_URL=node.url,
        E2B_VOLUME_API_URL=node.url,
        E2B_API_KEY=node.api_key,
    )
    r = subprocess.run(
        ["node", "--test", "volumes.test.mjs"],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
