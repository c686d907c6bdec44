"""`aenv serve` refuses TLS settings that cannot work, at once and in one line.

Rules: a real `aenv serve` process with a private home and a free loopback
port; it must exit with status 2 (systemd's unit does not restart on 2)
before opening the node, naming the setting or file to fix, with no
traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NET_PREFIX, SLOT_CIDR, free_port
from tests.tlscerts import TestCA


def _serve(home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        "AENV_HOME": str(home),
        "AENV_LISTEN": f"127.0.0.1:{free_port()}",
        "AENV_NET_PREFIX": NET_PREFIX,
        "AENV_SLOT_CIDR": SLOT_CIDR,
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "aenv", "serve"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("only", ["AENV_TLS_CERT", "AENV_TLS_KEY"])
def test_half_a_tls_setting_stops_the_node_at_start(tmp_path: Path, only: str) -> None:
    done = _serve(tmp_path / "home", **{only: str(tmp_path / "x.pem")})
    assert done.returncode == 2, done.stderr
    assert "TLS needs both the certificate chain and its private key" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "home").exists()  # nothing was opened


def test_a_certificate_that_cannot_be_read_stops_the_node_at_start(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    cert, _ = ca.issue("node", dns=["*.aenv.test"])
    done = _serve(
        tmp_path / "home",
        AENV_TLS_CERT=str(cert),
        AENV_TLS_KEY=str(tmp_path / "missing.key"),
    )
    assert done.returncode == 2, done.stderr
    assert f"TLS key not found: {tmp_path / 'missing.key'}" in done.stderr
    assert "Traceback" not in done.stderr
    _, other_key = ca.issue("other", dns=["*.aenv.test"])
    done = _serve(tmp_path / "home", AENV_TLS_CERT=str(cert), AENV_TLS_KEY=str(other_key))
    assert done.returncode == 2, done.stderr
    assert "cannot use TLS certificate" in done.stderr
