"""Cluster settings read from the environment (aenv.config).

Rules: a node joins only with a secret; ids and URLs that could not work
are refused at start with the variable to change named; defaults need no
setting at all.
"""

from __future__ import annotations

import socket

import pytest

from aenv.config import Config


def test_a_single_node_needs_no_cluster_setting() -> None:
    c = Config.from_env({"AENV_LISTEN": "127.0.0.1:9000"})
    assert not c.clustered
    assert c.effective_node_id == socket.gethostname().split(".")[0]
    assert c.effective_advertise_url == "http://127.0.0.1:9000"


def test_cluster_settings_are_read() -> None:
    c = Config.from_env(
        {
            "AENV_NODE_ID": "node-1",
            "AENV_CLUSTER_PEERS": "http://10.0.0.2:8000/, http://10.0.0.3:8000",
            "AENV_CLUSTER_SECRET": "x" * 32,
            "AENV_ADVERTISE_URL": "http://10.0.0.1:8000/",
            "AENV_CLUSTER_LISTEN": "0.0.0.0:7946",
            "AENV_STORE_URL": "s3://aenv",
        }
    )
    assert c.clustered and c.effective_node_id == "node-1"
    assert c.cluster_peers == ("http://10.0.0.2:8000", "http://10.0.0.3:8000")
    assert c.effective_advertise_url == "http://10.0.0.1:8000"
    assert c.cluster_listen == "0.0.0.0:7946"


def test_a_wildcard_listen_address_advertises_the_host_name() -> None:
    c = Config.from_env({"AENV_LISTEN": "0.0.0.0:8000"})
    assert c.effective_advertise_url == f"http://{socket.gethostname()}:8000"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"AENV_CLUSTER_PEERS": "http://10.0.0.2:8000"}, "AENV_CLUSTER_SECRET"),
        ({"AENV_CLUSTER_SECRET": "short", "AENV_STORE_URL": "s3://b"}, "at least 16"),
        ({"AENV_CLUSTER_SECRET": "s" * 16}, "AENV_STORE_URL"),
        ({"AENV_NODE_ID": "bad id/with slash"}, "AENV_NODE_ID"),
        (
            {
                "AENV_CLUSTER_SECRET": "s" * 16,
                "AENV_CLUSTER_PEERS": "10.0.0.2:8000",
                "AENV_STORE_URL": "s3://b",
            },
            "base URL",
        ),
        ({"AENV_ADVERTISE_URL": "http://10.0.0.1:8000/api"}, "base URL"),
    ],
)
def test_settings_that_cannot_work_are_refused(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Config.from_env(env)


def test_tls_needs_both_files_and_makes_the_node_advertise_https() -> None:
    for only in ({"AENV_TLS_CERT": "/etc/aenv/tls.pem"}, {"AENV_TLS_KEY": "/etc/aenv/tls.key"}):
        with pytest.raises(ValueError, match="TLS needs both the certificate chain and"):
            Config.from_env(only)
    c = Config.from_env(
        {
            "AENV_LISTEN": "10.0.0.1:8443",
            "AENV_TLS_CERT": "/etc/aenv/tls.pem",
            "AENV_TLS_KEY": "/etc/aenv/tls.key",
            "AENV_TLS_CA": "/etc/aenv/ca.pem",
        }
    )
    assert c.scheme == "https"
    assert c.effective_advertise_url == "https://10.0.0.1:8443"
    assert str(c.tls_ca) == "/etc/aenv/ca.pem"
