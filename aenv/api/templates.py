"""Templates: list, detail, alias lookup and delete.

Snapshots share the template namespace (the SDK deletes a snapshot with
`DELETE /templates/{id}`). A template is not deleted while a sandbox (in
any state) uses it or a stored snapshot stands on it; its own warm-up
snapshots, its copy in the object store and, for a built template, the
snapshot it was built into go with it.
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response

from aenv.api import views
from aenv.api.common import ApiError, delete_snapshot, deps, json_response, no_content
from aenv.node import service as sv
from aenv.proto.ids import InvalidName
from aenv.storage.templates import Template, TemplateNotFound

bp = Blueprint("templates", __name__)


def _template(name: str) -> Template:
    try:
        return deps().node.templates.resolve(name)
    except InvalidName as e:
        raise ApiError(400, str(e)) from None
    except TemplateNotFound:
        raise ApiError(404, f"template {name!r} not found") from None


@bp.get("/templates")
async def templates_v1() -> Response:
    return json_response([t.to_api() for t in deps().node.templates.list()])


@bp.get("/v2/templates")
async def templates_v2() -> Response:
    return json_response([t.to_api() for t in deps().node.templates.list()])


@bp.get("/templates/<template_id>")
async def template_detail(template_id: str) -> Response:
    return json_response(views.template_with_builds(_template(template_id)))


@bp.get("/templates/aliases/<alias>")
async def template_alias(alias: str) -> Response:
    t = _template(alias)
    return json_response({"templateID": t.template_id, "public": t.public})


@bp.delete("/templates/<template_id>")
async def template_delete(template_id: str) -> Response:
    d = deps()
    node = d.node
    snap = await node.snapshots.resolve(template_id)
    if snap is not None and snap["snapshotID"] == template_id:
        await delete_snapshot(node, template_id)
        return no_content()
    t = _template(template_id)
    sandboxes = await d.service.list(states=sv.EVERY_STATE)
    if any(a.template_id == t.template_id for a in sandboxes):
        raise ApiError(409, f"template {template_id!r} is in use by running sandboxes")
    await node.warmer.forget(t.template_id)  # the template's own snapshots go first
    if any(doc.get("templateID") == t.template_id for doc in await node.snapshots.list()):
        raise ApiError(409, f"template {template_id!r} is the base of stored snapshots")
    await trio.to_thread.run_sync(node.templates.delete, t.template_id)
    await node.durable.unshare_template(t.template_id)
    await node.builds.forget_template(t)  # a built template's snapshot goes with it
    return no_content()
