"""The CLI without a node: usage errors, missing credentials, an unreachable node.

Each failure is one `aenv: ...` line on stderr with its documented exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    base.update({"XDG_CONFIG_HOME": str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "-m", "aenv", *args],
        env=base,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aenv: "), r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["nonsense"],
        ["ls", "--output", "xml"],
        ["ls", "--state", "sleeping"],
        ["timeout", "abc", "soon"],
        ["exec", "abc"],
        ["start"],
        ["fork", "abc", "--count", "x"],
        ["completion", "tcsh"],
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str]) -> None:
    one_line(run(tmp_path, *args, AENV_URL="http://127.0.0.1:1", AENV_API_KEY="k"), 64)


def test_no_credentials(tmp_path: Path) -> None:
    assert "aenv auth" in one_line(run(tmp_path, "ls"), 78)


def test_unreachable(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["ls"], ["exec", "a" * 20, "--", "true"], ["template", "ls"]):
        assert url in one_line(run(tmp_path, *args, AENV_URL=url, AENV_API_KEY="k"), 69)


def test_auth_without_terminal_needs_flags(tmp_path: Path) -> None:
    one_line(run(tmp_path, "auth"), 64)
