"""The cluster's routes: members, each node's own sandboxes, and the nodes' links.

- `GET /cluster/members` (API key): every node this one knows, with its
  state (alive, suspect, dead, left), incarnation, URL and load. A node not
  in a cluster lists itself alone.
- `GET /cluster/v1/sandboxes` (API key): this node's own sandboxes as full
  records, for a peer building a cluster-wide list (`aenv.cluster.service`).
- `POST /cluster/nodes/{id}/drain` (API key): move node `id`'s sandboxes to
  the others, then it leaves (`aenv.cluster.moves`); sent on to that node if
  it is not this one. Answers the counts when done.
- `POST /cluster/v1/sandboxes/{id}/adopt` (API key): a draining node handed
  sandbox `id` to this one: take it up (and resume it with `resume=N`).
- `WS /cluster/v1/link`: a peer's link (`aenv.cluster.transport`); it
  authenticates with the cluster secret, not the API key.
"""

from __future__ import annotations

import httpx
from quart import Blueprint, Response, request, websocket

from aenv.api.common import ApiError, deps, json_response
from aenv.cluster.cluster import measure_load
from aenv.cluster.moves import MoveError
from aenv.node.service import LocalSandboxService
from aenv.proto import jsonbody
from aenv.proto.clusterroute import HOP_HEADER

DRAIN_TIMEOUT_S = 3600.0

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
        metadata = jsonbody.loads(request.args.get("metadata") or "{}")
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


@bp.post("/cluster/v1/sandboxes/<sandbox_id>/adopt")
async def adopt(sandbox_id: str) -> Response:
    """Take up a sandbox another node handed to this one (a drain); with
    `resume=N` (seconds of timeout), resume it too."""
    d = deps()
    moves = d.cluster.moves if d.cluster is not None else None
    if moves is None:
        raise ApiError(409, "this node is not in a cluster with an object store")
    try:
        resume_s = int(request.args.get("resume") or 0)
    except ValueError:
        raise ApiError(400, "resume must be a number of seconds") from None
    try:
        actor = await moves.take_up(sandbox_id, resume_s=resume_s)
    except MoveError as e:
        raise ApiError(409, str(e)) from None
    return json_response({"sandboxID": actor.sandbox_id, "state": actor.state.value})


@bp.post("/cluster/nodes/<node_id>/drain")
async def drain(node_id: str) -> Response:
    """Drain node `node_id` (this one, or forwarded to it): move its sandboxes to
    the other nodes, then it leaves the cluster. Answers the counts when done."""
    d = deps()
    if d.cluster is None:
        raise ApiError(409, "this node is not in a cluster: there is nowhere to move to")
    member = d.cluster
    if node_id not in ("self", member.cluster.node_id):
        peer = next((m for m in member.cluster.members() if m.id == node_id), None)
        if peer is None or peer.state not in ("alive", "suspect"):
            raise ApiError(404, f"node {node_id!r} is not a live member of the cluster")
        try:
            r = await member.http.post(
                f"{peer.url}/cluster/nodes/{node_id}/drain",
                headers={"X-API-Key": member.api_key, HOP_HEADER: member.cluster.node_id},
                timeout=DRAIN_TIMEOUT_S,
            )
        except httpx.HTTPError as e:
            raise ApiError(502, f"node {node_id} did not answer: {e}") from None
        return Response(r.content, status=r.status_code, content_type="application/json")
    if member.moves is None:
        raise ApiError(409, "this node has no object store: its sandboxes cannot move")
    report = await member.drain()
    return json_response(report.to_json())


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
