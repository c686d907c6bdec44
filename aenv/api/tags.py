"""Template tags, PATCH of templates and the default templates list, as the E2B SDKs call them.

Tags (`aenv.node.buildtags`) name builds of a built template: `POST
/templates/tags` points tags at the build a `name:tag` (or `name:<build
ID>`) names, `DELETE /templates/tags` forgets tags of a template, and `GET
/templates/{id}/tags` (with `/count`, `/exists`, `/groups` and
`/{tag}/assignments`) lists them. `PATCH /templates/{id}` and `PATCH
/v2/templates/{id}` set whether a template is public. `GET
/default-templates` lists the node's default templates (`base`,
`busybox`, ...).
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import ApiError, deps, json_response, no_content, read_body
from aenv.node.buildtags import DEFAULT_TAG, BadTag, TagNotFound, check_tag
from aenv.proto.ids import InvalidName
from aenv.storage.templates import DEFAULT_TEMPLATE_IDS, Template, TemplateNotFound

bp = Blueprint("tags", __name__)


async def _built(name: str) -> Template:
    try:
        t = await trio.to_thread.run_sync(deps().node.templates.resolve, name)
    except InvalidName as e:
        raise ApiError(400, str(e)) from None
    except TemplateNotFound:
        raise ApiError(404, f"template {name!r} not found") from None
    if t.snapshot_id is None:
        raise ApiError(400, f"template {name!r} was not made by a build: it has no tags")
    return t


def _tag_list(body: dict[str, Any]) -> list[str]:
    tags = body.get("tags")
    if not isinstance(tags, list) or not tags or not all(isinstance(t, str) for t in tags):
        raise ApiError(400, "tags must be a non-empty list of strings")
    try:
        return list(dict.fromkeys(check_tag(t) for t in tags))
    except BadTag as e:
        raise ApiError(400, str(e)) from None


async def _object() -> dict[str, Any]:
    body = await read_body()
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


@bp.post("/templates/tags")
async def assign_tags() -> Response:
    body = await _object()
    target = body.get("target")
    if not isinstance(target, str) or not target:
        raise ApiError(400, "target must be a template name in name:tag format")
    tags = _tag_list(body)
    name, _, source = target.partition(":")
    t = await _built(name)
    builds = deps().node.builds
    try:
        build_id = await trio.to_thread.run_sync(
            lambda: builds.tags.assign(
                t.template_id, source.lower() or DEFAULT_TAG, tags, current=t.build_id
            )
        )
    except TagNotFound as e:
        if source in ("", DEFAULT_TAG):  # a build from before tags: its current one
            build_id = t.build_id
            await trio.to_thread.run_sync(
                lambda: builds.tags.record(t, [DEFAULT_TAG, *tags], current=t.build_id)
            )
        else:
            raise ApiError(404, str(e)) from None
    return json_response({"tags": tags, "buildID": build_id}, 201)


@bp.delete("/templates/tags")
async def remove_tags() -> Response:
    body = await _object()
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "name is required")
    tags = _tag_list(body)
    t = await _built(name.partition(":")[0])
    builds = deps().node.builds
    try:
        gone = await trio.to_thread.run_sync(
            lambda: builds.tags.remove(t.template_id, tags, current=t.build_id)
        )
    except TagNotFound as e:
        raise ApiError(404, str(e)) from None
    await builds.drop_snapshots(gone, keep=t.snapshot_id)
    return no_content()


async def _tags(template_id: str) -> list[dict[str, Any]]:
    t = await _built(template_id)
    tags = await trio.to_thread.run_sync(deps().node.builds.tags.tags, t.template_id)
    if not tags:  # a template built before tags: its build is the default
        when = t.updated_at
        tags.append(
            {
                "tag": DEFAULT_TAG,
                "buildID": t.build_id,
                "assignedAt": when,
                "history": [
                    {
                        "assignmentID": t.build_id,
                        "buildID": t.build_id,
                        "assignedAt": when,
                        "build": {"createdAt": when},
                    }
                ],
            }
        )
    return sorted(tags, key=lambda x: str(x["tag"]))


def _assignment(h: dict[str, Any]) -> dict[str, Any]:
    build = h.get("build") or {}
    created = build.get("createdAt") or h["assignedAt"]
    return {
        "assignmentID": h["assignmentID"],
        "buildID": h["buildID"],
        "assignedAt": views.iso(float(h["assignedAt"])),
        "buildCreatedAt": views.iso(float(created)),
        "buildFinishedAt": views.iso(float(created)),
    }


@bp.get("/templates/<template_id>/tags")
async def list_tags(template_id: str) -> Response:
    return json_response(
        [
            {"tag": x["tag"], "buildID": x["buildID"], "createdAt": views.iso(x["assignedAt"])}
            for x in await _tags(template_id)
        ]
    )


@bp.get("/templates/<template_id>/tags/count")
async def count_tags(template_id: str) -> Response:
    return json_response({"total": len(await _tags(template_id))})


@bp.get("/templates/<template_id>/tags/exists")
async def tag_exists(template_id: str) -> Response:
    raw = request.args.get("tag") or ""
    try:
        tag = check_tag(raw)
    except BadTag as e:
        raise ApiError(400, str(e)) from None
    tags = {x["tag"] for x in await _tags(template_id)}
    return json_response({"exists": tag in tags, "normalizedTag": tag})


@bp.get("/templates/<template_id>/tags/groups")
async def tag_groups(template_id: str) -> Response:
    limit = request.args.get("assignmentLimit", type=int) or 10
    search = (request.args.get("search") or "").lower()
    groups = []
    for x in await _tags(template_id):
        if search and search not in x["tag"]:
            continue
        history = x["history"]
        groups.append(
            {
                "tag": x["tag"],
                "assignments": [_assignment(h) for h in history[:limit]],
                "hasMore": len(history) > limit,
            }
        )
    return json_response({"tags": groups, "nextCursor": None})


@bp.get("/templates/<template_id>/tags/<tag>/assignments")
async def tag_assignments(template_id: str, tag: str) -> Response:
    limit = request.args.get("limit", type=int) or 100
    for x in await _tags(template_id):
        if x["tag"] == tag.lower():
            data = [_assignment(h) for h in x["history"][:limit]]
            return json_response({"data": data, "nextCursor": None})
    raise ApiError(404, f"tag {tag!r} of template {template_id!r} not found")


async def _patch(template_id: str) -> Template:
    body = await _object()
    public = body.get("public")
    if public is None:
        try:
            return await trio.to_thread.run_sync(deps().node.templates.resolve, template_id)
        except (TemplateNotFound, InvalidName):
            raise ApiError(404, f"template {template_id!r} not found") from None
    if not isinstance(public, bool):
        raise ApiError(400, "public must be a boolean")
    try:
        return await trio.to_thread.run_sync(deps().node.templates.set_public, template_id, public)
    except (TemplateNotFound, InvalidName):
        raise ApiError(404, f"template {template_id!r} not found") from None


@bp.patch("/templates/<template_id>")
async def patch_v1(template_id: str) -> Response:
    await _patch(template_id)
    return Response("", status=200)


@bp.patch("/v2/templates/<template_id>")
async def patch_v2(template_id: str) -> Response:
    t = await _patch(template_id)
    return json_response({"names": list(t.aliases) or [t.template_id]})


@bp.get("/default-templates")
async def default_templates() -> Response:
    node = deps().node
    own = await trio.to_thread.run_sync(node.templates.list)
    return json_response([t.to_api() for t in own if t.template_id in DEFAULT_TEMPLATE_IDS])
