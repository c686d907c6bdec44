"""The deployment files say what docs/cluster.md promises (no cluster needed to check).

Rules: the files are parsed as YAML (Compose, Kubernetes) or read as text
(the Containerfile, the systemd unit); each assertion is a property an
operator relies on: privileged nodes, per-node identity and state, secrets
from Secrets or the environment, peers wired, readiness on /health, a stop
grace long enough for the node to drain. No network, no container engine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kube() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for d in _docs(f):
            if "kind" in d and d["kind"] != "Kustomization":
                out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def test_compose_runs_three_privileged_nodes_sharing_one_store() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    nodes = {k: v for k, v in compose["services"].items() if k.startswith("node-")}
    assert len(nodes) == 3
    ids, homes, advertised = set(), set(), {}
    for name, svc in nodes.items():
        env = svc["environment"]
        assert svc["privileged"] is True
        assert svc["build"]["dockerfile"] == "deploy/container/Containerfile"
        assert env["AENV_API_KEY"].startswith("${AENV_API_KEY:?")
        assert env["AENV_CLUSTER_SECRET"].startswith("${AENV_CLUSTER_SECRET:?")
        assert env["AENV_STORE_URL"].startswith("s3://")
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        ids.add(env["AENV_NODE_ID"])
        homes.add(svc["volumes"][0].split(":")[0])
        assert svc["volumes"][0].endswith(":/var/lib/aenv")
        advertised[name] = env["AENV_ADVERTISE_URL"]
        assert env["AENV_ADVERTISE_URL"] == f"http://{name}:8000"
        assert int(svc["stop_grace_period"].rstrip("s")) >= 90
    assert len(ids) == 3 and len(homes) == 3  # each its own identity and state
    for name, svc in nodes.items():
        peers = set(svc["environment"]["AENV_CLUSTER_PEERS"].split(","))
        assert peers == {u for n, u in advertised.items() if n != name}
    assert "minio" in compose["services"]
    assert set(compose["volumes"]) >= homes


def test_kubernetes_daemonset_is_privileged_with_host_state_and_secrets() -> None:
    kube = _kube()
    ds = kube["DaemonSet/aenv"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    assert pod["hostNetwork"] is True
    assert pod["terminationGracePeriodSeconds"] >= 90
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert paths["home"] == mounts["home"] == "/var/lib/aenv"
    assert paths["run"] == mounts["run"] == "/run/aenv"
    env = {e["name"]: e for e in c["env"]}
    assert env["AENV_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["AENV_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8000"
    secrets = {s["secretRef"]["name"] for s in c["envFrom"]}
    assert secrets == {"aenv-cluster", "aenv-store"}
    example = {d["metadata"]["name"]: d for d in _docs(DEPLOY / "kubernetes/secrets.example.yaml")}
    assert set(example["aenv-cluster"]["stringData"]) == {"AENV_API_KEY", "AENV_CLUSTER_SECRET"}
    assert {"AENV_STORE_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(
        example["aenv-store"]["stringData"]
    )
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8000}
    # peers: the headless Service's name, in the namespace, on the API port
    headless = kube["Service/aenv-peers"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    ns = kube["Namespace/aenv"]["metadata"]["name"]
    assert env["AENV_PEERS_DNS"]["value"] == f"aenv-peers.{ns}.svc.cluster.local:8000"
    assert all(d["metadata"].get("namespace", ns) == ns for d in kube.values())


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_renders_the_manifests() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "kubernetes")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == ["DaemonSet", "Namespace", "Service", "Service"]


def test_container_image_installs_runsc_from_debian_and_serves() -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert re.search(r"^FROM debian:12", text, re.M)
    assert "install-deps --node" in text  # runsc from Debian (trixie, pinned)
    assert "python3 -m venv /opt/aenv/venv" in text
    assert 'ENTRYPOINT ["/usr/local/bin/aenv-entrypoint"]' in text
    entry = (DEPLOY / "container" / "entrypoint.sh").read_text()
    assert entry.rstrip().splitlines()[-1].startswith('exec "$VENV/bin/aenv" serve')


def test_systemd_unit_keeps_sandboxes_across_restarts_and_reloads_tls() -> None:
    unit = (DEPLOY / "systemd" / "aenv.service").read_text()
    assert "KillMode=process" in unit  # a restart signals the node, not its sandboxes
    assert "ExecStart=/opt/aenv/venv/bin/aenv serve" in unit
    assert "EnvironmentFile=-/etc/aenv/aenv.env" in unit
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit
    example = (DEPLOY / "systemd" / "aenv.env.example").read_text()
    for name in (
        "AENV_NODE_ID",
        "AENV_CLUSTER_PEERS",
        "AENV_CLUSTER_SECRET",
        "AENV_ADVERTISE_URL",
        "AENV_STORE_URL",
        "AENV_TLS_CERT",
        "AENV_TLS_KEY",
        "AENV_TLS_CA",
        "AENV_DOMAIN",
    ):
        assert re.search(rf"^#?{name}=", example, re.M), name
