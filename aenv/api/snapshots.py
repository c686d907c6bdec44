"""Snapshots: capture a running sandbox, list, inspect and delete captures.

`POST /sandboxes/{id}/snapshots` is a `SandboxService` call (with
`"durable": true`, an aenv extension, it answers once the object store
holds the snapshot). Listing, detail and deletion read the node's snapshot
records, its own and, for detail and deletion, those only the object store
holds. The node's internal snapshots (template warm-ups) are never listed.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import (
    V2_PAGE_DEFAULT,
    V2_PAGE_MAX,
    ApiError,
    delete_snapshot,
    deps,
    json_response,
    no_content,
    read_body,
)
from aenv.node.service import SnapshotInfo
from aenv.node.snapshots import is_internal
from aenv.proto import requests as rq
from aenv.proto.clusterroute import HOP_HEADER

bp = Blueprint("snapshots", __name__)


def _info(doc: dict[str, Any]) -> dict[str, Any]:
    return views.snapshot(SnapshotInfo.from_doc(doc))


@bp.post("/sandboxes/<sandbox_id>/snapshots")
async def snapshot_create(sandbox_id: str) -> Response:
    body = await read_body()
    try:
        name, memory = rq.parse_snapshot(body)
    except rq.BadRequest as e:
        raise ApiError(400, str(e)) from None
    durable = isinstance(body, dict) and body.get("durable") is True  # aenv extension
    snap = await deps().service.snapshot(sandbox_id, name=name, memory=memory, durable=durable)
    return json_response(views.snapshot(snap), 201)


async def _own_snapshots() -> list[dict[str, Any]]:
    return [d for d in await deps().node.snapshots.list() if not is_internal(d)]


@bp.get("/cluster/v1/snapshots")
async def own_snapshot_list() -> Response:
    """This node's own snapshot records, for a peer's cluster-wide list."""
    return json_response(await _own_snapshots())


@bp.get("/snapshots")
async def snapshot_list() -> Response:
    docs = await _own_snapshots()
    member = deps().cluster
    if member is not None:  # and every other node's, once each
        seen = {d["snapshotID"] for d in docs}
        for d in await member.gather("/cluster/v1/snapshots"):
            if isinstance(d, dict) and d.get("snapshotID") not in seen:
                seen.add(d.get("snapshotID"))
                docs.append(d)
        docs.sort(key=lambda d: (float(d.get("createdAt") or 0), str(d.get("snapshotID"))))
    sid, name = request.args.get("sandboxID"), request.args.get("name")
    if sid:
        docs = [d for d in docs if d.get("sourceSandboxID") == sid]
    if name:
        docs = [d for d in docs if name in (d.get("names") or [])]
    try:
        limit = int(request.args.get("limit", V2_PAGE_DEFAULT))
        start = int(request.args.get("nextToken") or 0)
    except ValueError:
        raise ApiError(400, "limit and nextToken must be integers") from None
    if not 1 <= limit <= V2_PAGE_MAX or start < 0:
        raise ApiError(400, f"limit must be between 1 and {V2_PAGE_MAX}")
    resp = json_response([_info(d) for d in docs[start : start + limit]])
    if start + limit < len(docs):
        resp.headers["x-next-token"] = str(start + limit)
    return resp


@bp.delete("/snapshots/<snapshot_id>")
async def snapshot_delete(snapshot_id: str) -> Response:
    node = deps().node
    member = deps().cluster
    if member is not None and HOP_HEADER not in request.headers:
        # every node that holds it deletes its copy; the store's goes with the first
        answers = await member.ask_peers("DELETE", f"/snapshots/{snapshot_id}", timeout_s=60)
        refusals = [r for r in answers.values() if r.status_code not in (204, 404)]
        if refusals:
            return Response(
                refusals[0].content, refusals[0].status_code, content_type="application/json"
            )
        if await node.snapshots.resolve(snapshot_id) is None and any(
            r.status_code == 204 for r in answers.values()
        ):
            return no_content()
    doc = await node.snapshots.resolve(snapshot_id)
    if doc is None:
        remote = await node.durable.locate(snapshot_id)  # only in the object store?
        if remote is None:
            raise ApiError(404, f"snapshot {snapshot_id!r} not found")
        await node.durable.delete_remote(remote)
        return no_content()
    await delete_snapshot(node, doc["snapshotID"])
    return no_content()


@bp.get("/snapshots/<snapshot_id>")
async def snapshot_detail(snapshot_id: str) -> Response:
    doc = await deps().node.find_snapshot(snapshot_id)
    if doc is None:
        raise ApiError(404, f"snapshot {snapshot_id!r} not found")
    info = _info(doc)
    if doc.get("storageError") and info["storage"] != "durable":
        info["storageError"] = doc["storageError"]
    if doc.get("upload"):
        info["storageUpload"] = doc["upload"]  # what its upload added to the store
    info.update(
        {
            "sourceSandboxID": doc.get("sourceSandboxID"),
            "templateID": doc.get("templateID"),
            "createdAt": views.iso(float(doc["createdAt"])),
            "mode": "full" if doc.get("memory") else "filesystem",
        }
    )
    return json_response(info)
