"""deploy/install.sh and the image's entrypoint, run for real against a temporary root.

Rules: `install.sh --root DIR` writes its files under DIR and prints the
commands that would change the system (apt, pip, building, systemctl)
instead of running them; the tests read both. A first run generates an API
key (printed, 0600 env file) and enables the unit; a second run keeps the
key whatever it is given, updates the settings it is given and restarts
(never stops) the node; a node set to stop its sandboxes is not restarted
without --allow-stop. The entrypoint runs with a stand-in venv whose
`python` and `aenv` print what they were called with: what is under test is
how it resolves peers from DNS and what it execs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "deploy" / "install.sh"


def _install(
    root: Path, *args: str, ok: bool = True, templates: bool = False
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [
            "bash",
            str(INSTALL),
            "--root",
            str(root),
            *([] if templates else ["--no-templates"]),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def _env(root: Path) -> dict[str, str]:
    lines = (root / "etc/aenv/aenv.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def _planned(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [
        line.removeprefix("would run: ") for line in done.stdout.splitlines() if "would run" in line
    ]


def test_a_first_install_makes_a_key_and_enables_the_node(tmp_path: Path) -> None:
    done = _install(
        tmp_path,
        "--new-cluster",
        "--listen=0.0.0.0:8000",
        "--advertise-url=https://10.0.0.1:8000",
        "--store-url=s3://bucket/aenv",
        "--tls-cert=/etc/aenv/tls/fullchain.pem",
        "--tls-key=/etc/aenv/tls/privkey.pem",
        "--domain=sandboxes.example.com",
    )
    env = _env(tmp_path)
    key = re.search(r"API key \(new.*\): (\S+)", done.stdout)
    secret = re.search(r"cluster secret \(new.*\): (\S+)", done.stdout)
    assert key and env["AENV_API_KEY"] == key.group(1) and len(key.group(1)) > 40
    assert secret and env["AENV_CLUSTER_SECRET"] == secret.group(1)
    assert env["AENV_LISTEN"] == "0.0.0.0:8000"
    assert env["AENV_STORE_URL"] == "s3://bucket/aenv"
    assert env["AENV_TLS_CERT"] == "/etc/aenv/tls/fullchain.pem"
    assert env["AENV_DOMAIN"] == "sandboxes.example.com"
    assert (tmp_path / "etc/aenv/aenv.env").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "etc/aenv").stat().st_mode & 0o777 == 0o700
    assert "https://0.0.0.0:8000" in done.stdout
    plan = _planned(done)
    assert plan[0].endswith("scripts/install-deps --node")
    assert any(
        re.search(r"/opt/aenv/releases/\S+/bin/pip install .* " + str(REPO), p) for p in plan
    )
    assert "mv -T /opt/aenv/venv.new /opt/aenv/venv" in plan
    assert plan[-1] == "systemctl enable --now aenv"
    unit = (tmp_path / "etc/systemd/system/aenv.service").read_text()
    assert "ExecStart=/opt/aenv/venv/bin/aenv serve" in unit


def test_templates_come_from_the_store_when_one_is_configured(tmp_path: Path) -> None:
    alone = _planned(_install(tmp_path / "alone", templates=True))
    assert "/opt/aenv/venv/bin/python -m aenv.storage.rootfs --home /var/lib/aenv" in alone
    etc = tmp_path / "joining" / "etc" / "aenv"
    etc.mkdir(parents=True)
    (etc / "aenv.env").write_text("AWS_SECRET_ACCESS_KEY=not-to-be-printed\n")
    done = _install(tmp_path / "joining", "--store-url=s3://bucket/aenv", templates=True)
    plan = _planned(done)
    want = (
        "/opt/aenv/venv/bin/python -m aenv.storage.rootfs --home /var/lib/aenv "
        "--from-store s3://bucket/aenv"
    )
    assert want in plan
    # after the settings (the store's credentials are read from them), before the start
    assert plan.index(want) < plan.index("systemctl enable --now aenv")
    assert "not-to-be-printed" not in done.stdout + done.stderr


def test_running_it_again_upgrades_in_place_and_keeps_the_key(tmp_path: Path) -> None:
    _install(tmp_path)
    key = _env(tmp_path)["AENV_API_KEY"]
    other = tmp_path / "other-key"
    other.write_text("aenv_someone_elses_key\n")
    refused = _install(tmp_path, f"--api-key-file={other}", ok=False)
    assert "never replaced" in refused.stderr
    again = _install(tmp_path, "--node-id=node-7", "--set", "AENV_POOL_SIZE=4")
    env = _env(tmp_path)
    assert env["AENV_API_KEY"] == key
    assert (env["AENV_NODE_ID"], env["AENV_POOL_SIZE"]) == ("node-7", "4")
    assert "API key: unchanged" in again.stdout and key not in again.stdout
    plan = _planned(again)
    assert plan[-1] == "systemctl restart aenv"  # the node drains; sandboxes run on
    assert not any("stop" in p or "enable" in p for p in plan)
    assert "systemctl daemon-reload" not in plan  # the unit did not change
    # settings given again replace their line rather than adding another
    _install(tmp_path, "--node-id=node-8")
    text = (tmp_path / "etc/aenv/aenv.env").read_text()
    assert text.count("AENV_NODE_ID=") == 1 and "AENV_NODE_ID=node-8" in text


def test_a_node_that_ran_keeps_the_key_it_generated(tmp_path: Path) -> None:
    secrets = tmp_path / "var/lib/aenv/secrets"
    secrets.mkdir(parents=True)
    (secrets / "api-key").write_text("aenv_generated_by_the_node\n")
    done = _install(tmp_path)
    assert _env(tmp_path)["AENV_API_KEY"] == "aenv_generated_by_the_node"
    assert "API key: unchanged" in done.stdout


def test_a_node_set_to_stop_its_sandboxes_is_not_restarted_unasked(tmp_path: Path) -> None:
    _install(tmp_path)
    refused = _install(tmp_path, "--set", "AENV_ON_STOP=stop", ok=False)
    assert "would stop every sandbox" in refused.stderr
    assert "systemctl restart aenv" not in refused.stdout
    assert _planned(_install(tmp_path, "--allow-stop"))[-1] == "systemctl restart aenv"


def test_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    assert "go together" in _install(tmp_path, "--tls-cert=/x.pem", ok=False).stderr
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    no_store = _install(tmp_path / "r", f"--cluster-secret-file={secret}", ok=False)
    assert "needs a store" in no_store.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_the_scripts_pass_shellcheck() -> None:
    scripts = [INSTALL, REPO / "deploy/container/entrypoint.sh", REPO / "scripts/install-deps"]
    done = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_the_entrypoint_finds_peers_by_dns_and_execs_serve(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "aenv"):
        script = venv / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $* peers=$AENV_CLUSTER_PEERS"\n')
        script.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "AENV_VENV": str(venv),
        "AENV_HOME": str(tmp_path / "home"),
        "AENV_TEMPLATES": "busybox",
        # localhost resolves to 127.0.0.1 here; this node is 10.0.0.5
        "AENV_PEERS_DNS": "localhost:8000",
        "AENV_ADVERTISE_URL": "https://10.0.0.5:8000",
        # templates another node shared there are fetched, not built
        "AENV_STORE_URL": "s3://bucket/aenv",
    }
    done = subprocess.run(
        ["bash", str(REPO / "deploy/container/entrypoint.sh"), "--log-level", "debug"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    lines = done.stdout.splitlines()
    home = tmp_path / "home"
    assert lines == [
        f"python -m aenv.storage.bundle {home}/bundle peers=https://127.0.0.1:8000",
        f"python -m aenv.storage.rootfs --home {home} --busybox-only --from-store "
        "s3://bucket/aenv peers=https://127.0.0.1:8000",
        "aenv serve --json-logs --log-level debug peers=https://127.0.0.1:8000",
    ]
    # the node itself is never its own peer: alone, it starts a cluster
    env.update({"AENV_ADVERTISE_URL": "http://127.0.0.1:8000", "AENV_PEERS_WAIT": "1"})
    env["AENV_TEMPLATES"] = "none"
    done = subprocess.run(
        ["bash", str(REPO / "deploy/container/entrypoint.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "aenv serve --json-logs peers="
    assert "none (a new cluster)" in done.stderr
