"""The envd interpreter bundle: layout, idempotence, and running on a libc-less root.

Rules: bundles are built into pytest's temp directories; running the bundle
"as a guest" is a chroot into a busybox-only root with the bundle
bind-mounted read-only at /opt/aenv (needs root; marked runsc like the other
tests that need root), started exactly as `envd_command` says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import aenv
from aenv.storage.bundle import (
    BUNDLE_MOUNT,
    ENVD_MAIN,
    LOADER_NAME,
    build_bundle,
    envd_command,
    python_command,
)


def test_envd_command_starts_envd_through_the_bundled_loader() -> None:
    argv, env = envd_command(port=1234)
    assert argv[0] == f"{BUNDLE_MOUNT}/lib/{LOADER_NAME}"
    assert argv[1:3] == ("--library-path", f"{BUNDLE_MOUNT}/lib")
    assert argv[3] == f"{BUNDLE_MOUNT}/bin/python3"
    assert argv[4:10] == ("-S", "-P", "-OO", "-c", ENVD_MAIN, "--host")
    assert argv[-5:] == ("--host", "0.0.0.0", "--port", "1234", "--guard")
    assert argv[:5] == python_command()[0]
    assert env["PYTHONHOME"] == BUNDLE_MOUNT
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PYTHONNOUSERSITE"] == "1"
    assert envd_command()[0][-2] == "49983"


def test_bundle_layout(bundle: Path) -> None:
    assert (bundle / "bin" / "python3").is_file()
    assert (bundle / "lib" / LOADER_NAME).is_file()
    for lib in ("libc.so.6", "libm.so.6", "libz.so.1", "libexpat.so.1", "libffi.so.8"):
        assert (bundle / "lib" / lib).is_file(), lib
    stdlib = bundle / "lib" / "python3.11"
    assert (stdlib / "os.py").is_file()
    assert list((stdlib / "lib-dynload").glob("_ssl.*.so"))
    for skipped in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3"):
        assert not (stdlib / skipped).exists(), skipped
    assert list((stdlib / "__pycache__").glob("os.cpython-311.pyc"))
    site = bundle / "lib" / "aenv-site"
    for pkg in ("trio", "hypercorn", "h11", "h2", "hpack", "hyperframe", "priority",
                "wsproto", "attr", "attrs", "sortedcontainers", "idna", "outcome", "sniffio"):  # fmt: skip
        assert (site / pkg).is_dir(), pkg
    assert (site / "aenv" / "__init__.py").is_file()
    assert (site / "aenv" / "proto").is_dir()
    assert not (site / "aenv" / "node").exists()
    assert not (site / "pytest").exists()


def test_rebuild_is_skipped_when_inputs_are_unchanged(tmp_path: Path) -> None:
    # A private copy of the aenv sources: the checkout may change meanwhile.
    src = tmp_path / "src" / "aenv"
    shutil.copytree(Path(aenv.__file__).parent, src, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "b"
    lines: list[str] = []
    build_bundle(dest, progress=lines.append, aenv_source=src)
    stamp = (dest / ".complete").read_text()
    inode = (dest / "bin" / "python3").stat().st_ino
    lines.clear()
    build_bundle(dest, progress=lines.append, aenv_source=src)
    assert lines == [f"bundle {dest} is up to date"]
    assert (dest / ".complete").read_text() == stamp
    assert (dest / "bin" / "python3").stat().st_ino == inode
    # A stale stamp forces a complete, atomic rebuild; no temp dirs remain.
    (dest / ".complete").write_text("stale\n")
    build_bundle(dest, aenv_source=src)
    assert (dest / ".complete").read_text() == stamp
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    # Changing aenv's own sources changes the stamp.
    (src / "proto" / "added.py").write_text("X = 1\n")
    build_bundle(dest, aenv_source=src)
    assert (dest / ".complete").read_text() != stamp
    assert (dest / "lib" / "aenv-site" / "aenv" / "proto" / "added.py").is_file()


def test_cli_builds_with_progress(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aenv.storage.bundle", str(tmp_path / "b")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "copying trio" in out
    assert out.strip().endswith(f"bundle ready at {tmp_path / 'b'}")


@pytest.fixture
def guest_root(tmp_path: Path, bundle: Path, busybox_lower: Path) -> Iterator[Path]:
    """A copy of the busybox root with the bundle bind-mounted read-only."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    root = tmp_path / "guest"
    subprocess.run(["cp", "-a", str(busybox_lower), str(root)], check=True)
    target = root / BUNDLE_MOUNT.lstrip("/")
    target.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(bundle), str(target)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        yield root
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.runsc
def test_bundle_runs_in_a_root_without_libc(guest_root: Path) -> None:
    assert not list(guest_root.glob("lib*/**/libc.so*"))
    env = envd_command()[1]
    code = textwrap.dedent(
        """
        import sys, ssl, json, hashlib, zlib, ctypes, decimal, lzma, bz2, uuid
        import trio, hypercorn.trio, h2.connection, wsproto, aenv.proto

        async def main():
            await trio.sleep(0)
            return "trio ok"

        print(trio.run(main), sys.prefix, sys.path, sep="|")
        """
    )
    out = subprocess.run(
        ["chroot", str(guest_root), *python_command()[0], "-c", code],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result, prefix, path = out.split("|")
    assert result == "trio ok"
    assert prefix == BUNDLE_MOUNT
    assert all(p == "" or p.startswith(BUNDLE_MOUNT) for p in eval(path))
