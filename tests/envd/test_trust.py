"""envd trusting the node's egress CA: system bundle, own bundle, env vars; idempotent."""

from __future__ import annotations

from pathlib import Path

from aenv.envd import trust

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_install_appends_once_and_points_clients_at_it(tmp_path: Path) -> None:
    system = tmp_path / "etc/ssl/certs/ca-certificates.crt"
    system.parent.mkdir(parents=True)
    system.write_text("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----")
    env = trust.install(PEM, root=tmp_path)
    trust.install(PEM, root=tmp_path)
    text = system.read_text()
    assert text.count("MIIB") == 1 and "SYSTEM" in text
    bundle = tmp_path / str(trust.BUNDLE_FILE).lstrip("/")
    assert bundle.read_text() == text
    assert (tmp_path / str(trust.CA_FILE).lstrip("/")).read_text() == PEM
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == str(trust.BUNDLE_FILE)
    assert env["NODE_EXTRA_CA_CERTS"] == str(trust.CA_FILE)


def test_install_without_a_system_bundle(tmp_path: Path) -> None:
    trust.install(PEM, root=tmp_path)
    assert (tmp_path / "etc/ssl/certs/ca-certificates.crt").read_text() == PEM
