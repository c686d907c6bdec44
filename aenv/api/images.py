"""Images (an aenv extension): list pulled images and pulls, pull one, name it a template.

`POST /images` pulls an image reference, optionally in the background
(`"wait": false`, 202; follow it at `GET /images/pulls`). With `name` the
image also becomes a template of that name; with `startCmd` (or `true`: the
image's own Entrypoint and Cmd) and `readyCmd` that template is built: a
sandbox of the image runs the command and is captured once ready.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
from typing import Any

import trio
from quart import Blueprint, Response, request

from aenv.api.common import ApiError, deps, json_response, read_body
from aenv.images.store import ImageRecord, PullError
from aenv.node import service as sv
from aenv.node.builds import BuildSpec
from aenv.node.node import Node
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.storage.templates import TemplateConflict, TemplateNotFound

bp = Blueprint("images", __name__)


@bp.get("/images")
async def images_list() -> Response:
    """The pulled images, newest first; `?limit=N&offset=M` for a page of them."""
    try:
        limit = int(request.args["limit"]) if "limit" in request.args else None
        offset = int(request.args.get("offset", 0))
    except ValueError:
        raise ApiError(400, "limit and offset must be integers") from None
    if (limit is not None and limit < 0) or offset < 0:
        raise ApiError(400, "limit and offset must not be negative")
    records = await trio.to_thread.run_sync(
        functools.partial(deps().node.images.store.records, limit=limit, offset=offset)
    )
    return json_response([r.to_api() for r in records])


@bp.get("/images/pulls")
async def images_pulls() -> Response:
    return json_response(deps().node.images.store.pulls())


@bp.post("/images")
async def images_pull() -> Response:
    """Pull an image; with `name`, also make it a template of that name.

    With `"wait": false` the pull runs in the background (202): follow it
    at `GET /images/pulls`.
    """
    node = deps().node
    body = await read_body()
    if not isinstance(body, dict) or not isinstance(body.get("image"), str):
        raise ApiError(400, 'body must be {"image": REFERENCE[, "name": NAME]}')
    wait = body.get("wait", True)
    if not isinstance(wait, bool):
        raise ApiError(400, "wait must be a boolean")
    name, sizes = await _pull_request(node, body)
    if not wait:
        try:
            parse_reference(body["image"])
        except InvalidReference as e:
            raise ApiError(400, str(e)) from None

        async def in_background() -> None:
            await _pull_and_name(node, body, name, sizes)

        node.start_background(in_background, f"pulling {body['image']}")
        return json_response({"image": body["image"], "state": "pulling"}, 202)
    return json_response(await _pull_and_name(node, body, name, sizes), 201)


async def _pull_request(node: Node, body: dict[str, Any]) -> tuple[str | None, dict[str, int]]:
    """The template name and sizes a pull request asks for, checked."""
    name = body.get("name")
    sizes = {}
    for key, top in (
        ("cpuCount", node.limits.max_cpu),
        ("memoryMB", node.limits.max_memory_mb),
    ):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= top:
                raise ApiError(400, f"{key} must be an integer from 1 to {top}")
            sizes[key] = value
    if name is not None:
        if not isinstance(name, str):
            raise ApiError(400, "name must be a string")
        try:
            check_name(name, "template name")
        except InvalidName as e:
            raise ApiError(400, str(e)) from None
        with contextlib.suppress(TemplateNotFound):
            await trio.to_thread.run_sync(node.templates.resolve, name)
            raise ApiError(409, f"template {name!r} already exists")
    start_cmd = body.get("startCmd")
    if (start_cmd is not None or body.get("readyCmd") is not None) and name is None:
        raise ApiError(400, "startCmd and readyCmd need a template name")
    return name, sizes


async def _pull_and_name(
    node: Node, body: dict[str, Any], name: str | None, sizes: dict[str, int]
) -> dict[str, Any]:
    """Pull, then make the template asked for (runs outside a request with `wait: false`)."""
    try:
        record = await node.images.pull(body["image"])
    except PullError as e:
        raise sv.pull_error(e) from None
    out = record.to_api()
    start_cmd = body.get("startCmd")
    ready_cmd = body.get("readyCmd")
    if start_cmd is True:  # the image's own Entrypoint + Cmd, as `docker run` runs it
        argv = [*record.config.entrypoint, *record.config.cmd]
        if not argv:
            raise ApiError(400, f"image {record.reference} has no Entrypoint or Cmd")
        start_cmd = shlex.join(argv)
    if start_cmd is not None or ready_cmd is not None:
        if name is None:
            raise ApiError(400, "startCmd and readyCmd need a template name")
        for key, value in (("startCmd", start_cmd), ("readyCmd", ready_cmd)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ApiError(400, f"{key} must be a command (or startCmd: true)")
        out["template"] = await _build_image_template(
            node, record, name, start_cmd, ready_cmd, sizes
        )
    elif name is not None:
        try:
            t = await trio.to_thread.run_sync(
                functools.partial(
                    node.image_template,
                    record,
                    name,
                    cpu_count=sizes.get("cpuCount"),
                    memory_mb=sizes.get("memoryMB"),
                )
            )
        except TemplateConflict as e:
            raise ApiError(409, str(e)) from None
        node.durable.share_template(t)
        out["template"] = t.to_api()
    return out


async def _build_image_template(
    node: Node,
    record: ImageRecord,
    name: str,
    start_cmd: str | None,
    ready_cmd: str | None,
    sizes: dict[str, int],
) -> dict[str, Any]:
    """A template of `record` captured with `start_cmd` running: a build, awaited."""
    build = await node.builds.request(
        name,
        cpu_count=sizes.get("cpuCount", node.config.default_cpu),
        memory_mb=sizes.get("memoryMB", node.config.default_memory_mb),
    )
    ref = f"{record.registry}/{record.repository}@{record.manifest_digest}"
    node.builds.start(build, BuildSpec(from_image=ref, start_cmd=start_cmd, ready_cmd=ready_cmd))
    await build.done.wait()
    if build.status != "ready":
        raise ApiError(400, f"the template's start failed: {build.reason}")
    t = await trio.to_thread.run_sync(node.templates.resolve, build.template_id)
    return t.to_api()
