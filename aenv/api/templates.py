"""Templates: list, detail, alias lookup and delete.

Snapshots share the template namespace (the SDK deletes a snapshot with
`DELETE /templates/{id}`). A template is not deleted while a sandbox (in
any state) uses it or a stored snapshot stands on it; its own warm-up
snapshots, its copy in the object store and, for a built template, the
snapshot it was built into go with it.
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import ApiError, delete_snapshot, deps, json_response, no_content
from aenv.node import service as sv
from aenv.proto.clusterroute import HOP_HEADER
from aenv.proto.ids import InvalidName
from aenv.storage.templates import Template, TemplateNotFound

bp = Blueprint("templates", __name__)


async def _template(name: str) -> Template:
    """The template `name` names: this node's, else one another node shared
    through the object store."""
    node = deps().node
    try:
        return node.templates.resolve(name)
    except InvalidName as e:
        raise ApiError(400, str(e)) from None
    except TemplateNotFound:
        shared = await node.durable.find_template(name)
        if shared is None:
            raise ApiError(404, f"template {name!r} not found") from None
        return shared


async def _listed() -> list[dict[str, object]]:
    """This node's templates and, in a cluster, every other node's, once each."""
    own = [t.to_api() for t in deps().node.templates.list()]
    member = deps().cluster
    if member is None:
        return own
    seen = {t["templateID"] for t in own}
    for t in await member.gather("/cluster/v1/templates"):
        if isinstance(t, dict) and t.get("templateID") not in seen:
            seen.add(t.get("templateID"))
            own.append(t)
    return own


@bp.get("/cluster/v1/templates")
async def own_templates() -> Response:
    """This node's own templates, for a peer's cluster-wide list."""
    return json_response([t.to_api() for t in deps().node.templates.list()])


@bp.get("/templates")
async def templates_v1() -> Response:
    return json_response(await _listed())


@bp.get("/v2/templates")
async def templates_v2() -> Response:
    return json_response(await _listed())


@bp.get("/templates/<template_id>")
async def template_detail(template_id: str) -> Response:
    return json_response(views.template_with_builds(await _template(template_id)))


@bp.get("/templates/aliases/<alias>")
async def template_alias(alias: str) -> Response:
    t = await _template(alias)
    return json_response({"templateID": t.template_id, "public": t.public})


@bp.delete("/templates/<template_id>")
async def template_delete(template_id: str) -> Response:
    d = deps()
    node = d.node
    snap = await node.snapshots.resolve(template_id)
    if snap is not None and snap["snapshotID"] == template_id:
        await delete_snapshot(node, template_id)
        return no_content()
    member = d.cluster
    if member is not None and HOP_HEADER not in request.headers:
        # every other node that holds it deletes its copy first
        answers = await member.ask_peers("DELETE", f"/templates/{template_id}", timeout_s=60)
        refusals = [r for r in answers.values() if r.status_code not in (204, 404)]
        if refusals:
            return Response(
                refusals[0].content, refusals[0].status_code, content_type="application/json"
            )
        if any(r.status_code == 204 for r in answers.values()):
            try:
                node.templates.resolve(template_id)
            except (TemplateNotFound, InvalidName):
                return no_content()
    t = await _template(template_id)
    sandboxes = await d.service.list(states=sv.EVERY_STATE)
    if any(a.template_id == t.template_id for a in sandboxes):
        raise ApiError(409, f"template {template_id!r} is in use by running sandboxes")
    await node.warmer.forget(t.template_id)  # the template's own snapshots go first
    await node.builds.forget_cache(t)  # and the cached build steps made for it or on it
    if await node.snapshots.of_template(t.template_id):
        raise ApiError(409, f"template {template_id!r} is the base of stored snapshots")
    await trio.to_thread.run_sync(node.templates.delete, t.template_id)
    await node.durable.unshare_template(t.template_id)
    await node.builds.forget_template(t)  # a built template's snapshot goes with it
    return no_content()
