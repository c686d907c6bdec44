"""Sorting requests for the cluster router (aenv.proto.clusterroute).

Rules: anything about one sandbox goes to its owner, whichever way the
client addressed it; creates go to placement; a request that already hopped
is served where it is; everything else is local.
"""

from __future__ import annotations

import pytest

from aenv.proto.clusterroute import HOP_HEADER, Create, Local, ToSandbox, classify

SID = "abcdefghij0123456789"


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", f"/sandboxes/{SID}", {}),
        ("DELETE", f"/sandboxes/{SID}", {}),
        ("POST", f"/sandboxes/{SID}/pause", {}),
        ("POST", f"/sandboxes/{SID}/fork", {}),
        ("GET", f"/v2/sandboxes/{SID}/logs", {}),
        ("GET", f"/sandboxes/{SID}/exec", {}),
        ("POST", "/process.Process/Start", {"e2b-sandbox-id": SID, "e2b-sandbox-port": "49983"}),
        ("GET", "/files", {"host": f"49983-{SID}.sb.example.com"}),
    ],
)
def test_calls_about_one_sandbox_go_to_its_owner(
    method: str, path: str, headers: dict[str, str]
) -> None:
    assert classify(method, path, headers, "sb.example.com") == ToSandbox(SID)


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes", "/sandboxes/"])
def test_creates_go_to_placement(path: str) -> None:
    assert classify("POST", path, {}, None) == Create()


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", "/sandboxes", {}),
        ("GET", "/v2/sandboxes", {}),
        ("GET", "/sandboxes/metrics", {}),
        ("GET", "/templates", {}),
        ("GET", "/health", {}),
        ("GET", "/sandboxes/not-an-id", {}),
        ("GET", f"/sandboxes/{SID}", {HOP_HEADER: "node-a"}),
        ("POST", "/sandboxes", {HOP_HEADER: "node-a"}),
        ("GET", "/files", {"e2b-sandbox-id": "BAD!", "e2b-sandbox-port": "1"}),
    ],
)
def test_the_rest_is_served_where_it_arrives(
    method: str, path: str, headers: dict[str, str]
) -> None:
    assert classify(method, path, headers, None) == Local()
