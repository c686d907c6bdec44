"""Fixtures for storage tests: the envd bundle and a busybox-only root layer.

The bundle is built once per session into pytest's base temp directory (the
runtime tests build to the same path; `build_bundle` is idempotent, so the
second build is a hash check). The busybox layer has no libc and no Python.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.storage.bundle import build_bundle

BUSYBOX = Path("/bin/busybox")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.getbasetemp() / "aenv-bundle"
    build_bundle(dest)
    return dest


@pytest.fixture(scope="session")
def busybox_lower(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not BUSYBOX.exists():
        pytest.skip("needs Debian's busybox-static")
    root = tmp_path_factory.getbasetemp() / "busybox-lower"
    if (root / "bin" / "busybox").exists():
        return root
    for d in ("bin", "etc", "root", "tmp", "proc", "sys", "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    for applet in applets:
        link = root / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    os.chmod(root / "tmp", 0o1777)
    (root / "etc" / "lower-marker").write_text("from the lower layer\n")
    return root
