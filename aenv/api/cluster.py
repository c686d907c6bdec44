"""The cluster's routes: members, each node's own sandboxes, and the nodes' links.

- `GET /cluster/members` (API key): every node this one knows, with its
  state (alive, suspect, dead, left), incarnation, URL and load. A node not
  in a cluster lists itself alone.
- `GET /cluster/v1/sandboxes` (API key): this node's own sandboxes as full
  records, for a peer building a cluster-wide list (`aenv.cluster.service`).
- `WS /cluster/v1/link`: a peer's link (`aenv.cluster.transport`); it
  authenticates with the cluster secret, not the API key.
"""

from __future__ import annotations

import json

from quart import Blueprint, Response, request, websocket

from aenv.api.common import ApiError, deps, json_response
from aenv.cluster.cluster import measure_load
from aenv.node.service import LocalSandboxService

bp = Blueprint("cluster", __name__)


@bp.get("/cluster/members")
async def members() -> Response:
    d = deps()
    if d.cluster is None:
        cfg = d.node.config
        load = await measure_load(d.node)
        alone = {
            "nodeID": cfg.effective_node_id,
            "url": cfg.effective_advertise_url,
            "state": "alive",
            "incarnation": 0,
            "tag": cfg.effective_node_tag,
            "load": load.to_json(),
        }
        return json_response([alone])
    return json_response([m.to_json() for m in d.cluster.cluster.members()])


@bp.get("/cluster/v1/sandboxes")
async def own_sandboxes() -> Response:
    try:
        metadata = json.loads(request.args.get("metadata") or "{}")
    except ValueError:
        raise ApiError(400, "metadata must be a JSON object") from None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ApiError(400, "metadata must be a JSON object of strings")
    raw = request.args.get("states")
    states = None if raw is None else frozenset(s for s in raw.split(",") if s)
    found = await LocalSandboxService(deps().node).list(metadata=metadata, states=states)
    return json_response([a.to_doc() for a in found])


class _QuartSocket:
    async def send(self, data: str | bytes) -> None:
        await websocket.send(data)

    async def receive(self) -> str | bytes:
        return await websocket.receive()


@bp.websocket("/cluster/v1/link")
async def link() -> None:
    d = deps()
    if d.cluster is None:
        await websocket.close(1008, "this node is not in a cluster")
        return
    await websocket.accept()
    remote = websocket.remote_addr or "?"
    await d.cluster.transport.accept(_QuartSocket(), remote)
