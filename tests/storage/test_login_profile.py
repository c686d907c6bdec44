"""The `base` template's /etc/profile answers bash without starting `id`
(aenv.storage.rootfs.fast_login_profile).

Rules: Debian's own /etc/profile (this machine's, the same file debootstrap
installs) is rewritten and then sourced by the real bash and dash, as root
and as an unprivileged user: PATH and the prompt are what the original
gives, and only dash still runs `id` (a stand-in `id` first on PATH
records each call and answers like the real one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.storage.rootfs import fast_login_profile

DEBIAN_PROFILE = Path("/etc/profile")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("setpriv") is None
    or shutil.which("dash") is None
    or '"$(id -u)"' not in (DEBIAN_PROFILE.read_text() if DEBIAN_PROFILE.exists() else ""),
    reason="needs root, setpriv, dash and Debian's /etc/profile",
)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the unprivileged user can read (pytest's temp dirs are root's alone)."""
    with tempfile.TemporaryDirectory(prefix="aenv-profile-") as d:
        Path(d).chmod(0o755)
        yield Path(d)


def source(shell: str, profile: Path, fake_bin: Path, uid: int) -> str:
    """PATH and PS1 after `shell` (interactive-looking: PS1 set) sources `profile`."""
    argv = [shell, "-c", f'PS1="x"; . {profile}; echo "$PATH|$PS1"']
    if uid:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": "/"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd="/")
    return done.stdout.strip()


def test_bash_reads_the_profile_without_id_and_gets_the_same_answers(shared_dir: Path) -> None:
    tmp_path = shared_dir
    original = tmp_path / "original"
    shutil.copy(DEBIAN_PROFILE, original)
    fast = tmp_path / "fast"
    shutil.copy(DEBIAN_PROFILE, fast)
    assert fast_login_profile(fast)
    assert not fast_login_profile(fast)  # a second pass changes nothing
    assert fast.read_text() != original.read_text()

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "calls"
    calls.touch()
    calls.chmod(0o666)
    (fake_bin / "id").write_text(f'#!/bin/sh\necho "$$" >> {calls}\nexec /usr/bin/id "$@"\n')
    (fake_bin / "id").chmod(0o755)

    for uid in (0, 1000):
        for shell in ("bash", "dash"):
            calls.write_text("")
            want = source(shell, original, fake_bin, uid)
            assert calls.read_text(), "the original profile asks id"
            calls.write_text("")
            assert source(shell, fast, fake_bin, uid) == want, (shell, uid)
            asked = bool(calls.read_text())
            assert asked == (shell == "dash"), (shell, uid, asked)
    # root and the user get different PATHs: the test tells them apart
    assert source("bash", fast, fake_bin, 0) != source("bash", fast, fake_bin, 1000)


def test_a_profile_without_the_question_is_left_alone(tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    profile.write_text('PATH="/usr/bin:/bin"\nexport PATH\n')
    assert not fast_login_profile(profile)
    assert profile.read_text() == 'PATH="/usr/bin:/bin"\nexport PATH\n'
    assert not fast_login_profile(tmp_path / "absent")
