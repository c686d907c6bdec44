"""Bad input to the REST API gets a clear 4xx, changes nothing, and the node keeps serving.

Rules: loopback only, plain httpx against the session `node`; each case
checks the status, the E2B error body and that the sandbox list is unchanged.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]


def _client(node: NodeProc) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, timeout=60)


BAD_CREATES = [
    (b"{not json", 400),
    (b"[]", 400),
    (b'{"templateID": 5}', 400),
    (b'{"templateID": "../etc"}', 400),
    (b'{"templateID": "/base"}', 400),
    (b'{"templateID": "ba\\u0000se"}', 400),
    (b'{"templateID": "base", "timeout": -1}', 400),
    (b'{"templateID": "base", "timeout": 99999999}', 400),
    (b'{"templateID": "base", "timeout": "10"}', 400),
    (b'{"templateID": "base", "metadata": {"a": 1}}', 400),
    (b'{"templateID": "base", "envVars": "x"}', 400),
    (b'{"templateID": "base", "autoPause": "yes"}', 400),
    (b'{"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}', 400),
    (b'{"templateID": "base", "network": {"allowOut": ["not-a-cidr/99"]}}', 400),
    (b'{"templateID": "base", "network": {"egressProxy": {"address": "x"}}}', 400),
    (b'{"templateID": "no-such-template"}', 404),
]


@pytest.mark.parametrize(("body", "status"), BAD_CREATES)
def test_bad_create_refused(node: NodeProc, body: bytes, status: int) -> None:
    with _client(node) as c:
        before = c.get("/sandboxes").json()
        for path in ("/sandboxes", "/v2/sandboxes"):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, r.text
            err = r.json()
            assert err["code"] == status and isinstance(err["message"], str) and err["message"]
        assert c.get("/sandboxes").json() == before
        assert c.get("/health").status_code == 200


def test_oversized_body(node: NodeProc) -> None:
    with _client(node) as c:
        r = c.post("/v2/sandboxes", content=b"{" + b" " * (2 << 20) + b"}")
        assert r.status_code == 413
        assert r.json()["code"] == 413


@pytest.mark.parametrize("sandbox_id", ["nope", "..%2F..%2Fetc", "a" * 300, "0123456789abcdef0000"])
def test_unknown_sandbox_ids(node: NodeProc, sandbox_id: str) -> None:
    with _client(node) as c:
        for method, path in [
            ("GET", f"/sandboxes/{sandbox_id}"),
            ("DELETE", f"/sandboxes/{sandbox_id}"),
            ("POST", f"/sandboxes/{sandbox_id}/timeout"),
            ("GET", f"/sandboxes/{sandbox_id}/logs"),
            ("GET", f"/sandboxes/{sandbox_id}/metrics"),
            ("POST", f"/v2/sandboxes/{sandbox_id}/connect"),
        ]:
            r = c.request(method, path, json={"timeout": 10})
            assert r.status_code == 404, (method, path, r.text)


@pytest.mark.parametrize("name", ["..", "..%2F..%2Fsecrets", "%2Fetc", "a%00b"])
def test_template_names_cannot_escape(node: NodeProc, name: str) -> None:
    with _client(node) as c:
        r = c.get(f"/templates/{name}")
        assert r.status_code in (400, 404), r.text
        r = c.delete(f"/templates/{name}")
        assert r.status_code in (400, 404), r.text
        assert any(t["templateID"] == "base" for t in c.get("/templates").json())


def test_health_needs_no_key_but_metrics_does(node: NodeProc) -> None:
    assert httpx.get(node.url + "/health").status_code == 200
    assert httpx.get(node.url + "/metrics").status_code == 401
    r = httpx.get(node.url + "/metrics", headers={"X-API-Key": node.api_key})
    assert r.status_code == 200 and "aenv_sandboxes_created_total" in r.text


def test_proxy_routing_errors(node: NodeProc) -> None:
    r = httpx.get(node.url + "/x", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "80"})
    assert r.status_code == 400
    r = httpx.get(
        node.url + "/x",
        headers={"E2b-Sandbox-Id": "0123456789abcdef0000", "E2b-Sandbox-Port": "80"},
    )
    assert r.status_code == 502
