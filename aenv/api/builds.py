"""The E2B template build API: what the SDKs' `Template.build` calls.

`POST /v3/templates` reserves a build (a new template ID for a new name, the
same one for a rebuild), `GET /templates/{id}/files/{hash}` says whether the
node holds a COPY step's files and, if not, names the signed URL to `PUT`
them to (`PUT /build-files/{hash}`, `aenv.node.buildfiles`: served by this
node, content-addressed, resumable, outside the API key check), `POST
/v2/templates/{id}/builds/{build}` validates the steps and starts the build
in the background (`aenv.node.builds`), and `GET
/templates/{id}/builds/{build}/status` and `/logs` report its state and logs.
Bodies and answers follow the SDK's generated models (TemplateBuildRequestV3,
TemplateRequestResponseV3, TemplateBuildStartV2, TemplateBuildInfo,
BuildLogEntry, BuildStatusReason, TemplateBuildFileUpload).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio
from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import ApiError, deps, error_response, json_response, read_body
from aenv.node.buildfiles import BadUpload, parse_content_range
from aenv.node.builds import (
    STEP_TYPES,
    Build,
    BuildConflict,
    BuildLog,
    BuildNotFound,
    BuildSpec,
    Step,
)
from aenv.node.buildtags import DEFAULT_TAG, BadTag, check_tag
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.storage.templates import TemplateNotFound

MAX_STEPS = 1000
MAX_ARG = 1024 * 1024
DEFAULT_LOG_LIMIT = 100
MAX_LOG_LIMIT = 1000
LEVELS = ("debug", "info", "warn", "error")
# bound on a build's `diskSizeMB` (MiB): 16 TiB
MAX_DISK_MB = 16 << 20
START_WAIT_S = 0.2
_HASH = re.compile(r"[0-9a-f]{64}")
# Where COPY uploads go (signed URLs; app.py exempts them from the API key
# check and the request body cap).
UPLOAD_PREFIX = "/build-files/"

bp = Blueprint("builds", __name__)


class BadBuild(ValueError):
    pass


def _opt_str(b: Mapping[str, Any], key: str) -> str | None:
    v = b.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise BadBuild(f"{key} must be a string")
    return v


def parse_build_start(body: object) -> BuildSpec:
    """`TemplateBuildStartV2` as a BuildSpec (raises BadBuild)."""
    if not isinstance(body, Mapping):
        raise BadBuild("request body must be a JSON object")
    from_image, from_template = _opt_str(body, "fromImage"), _opt_str(body, "fromTemplate")
    if (from_image is None) == (from_template is None):
        raise BadBuild("exactly one of fromImage and fromTemplate must be given")
    if from_image is not None:
        try:
            parse_reference(from_image)
        except InvalidReference as e:
            raise BadBuild(f"fromImage: {e}") from None
    if from_template is not None:
        name, _, tag = from_template.partition(":")
        try:
            check_name(name, "fromTemplate")
            if tag:
                check_tag(tag)
        except (InvalidName, BadTag) as e:
            raise BadBuild(str(e)) from None
    if body.get("fromImageRegistry") is not None:
        raise BadBuild(
            "fromImageRegistry (registry credentials in the build request) is not supported "
            "by this node: put the credentials in the node's registry auth file instead"
        )
    force = body.get("force", False)
    if force is None:
        force = False
    if not isinstance(force, bool):
        raise BadBuild("force must be a boolean")
    raw_steps = body.get("steps") or []
    if not isinstance(raw_steps, list):
        raise BadBuild("steps must be a list")
    if len(raw_steps) > MAX_STEPS:
        raise BadBuild(f"at most {MAX_STEPS} steps")
    steps: list[Step] = []
    for i, raw in enumerate(raw_steps, 1):
        if not isinstance(raw, Mapping):
            raise BadBuild(f"steps[{i - 1}] must be an object")
        kind = raw.get("type")
        if kind not in STEP_TYPES:
            raise BadBuild(
                f"steps[{i - 1}].type {kind!r} is not one of {', '.join(sorted(STEP_TYPES))}"
            )
        args = raw.get("args") or []
        if not isinstance(args, list) or not all(
            isinstance(a, str) and len(a) <= MAX_ARG and "\0" not in a for a in args
        ):
            raise BadBuild(f"steps[{i - 1}].args must be a list of strings")
        files_hash = raw.get("filesHash")
        if files_hash is not None and (
            not isinstance(files_hash, str) or not _HASH.fullmatch(files_hash)
        ):
            raise BadBuild(f"steps[{i - 1}].filesHash must be a lowercase hex SHA-256")
        if kind == "COPY" and (files_hash is None or len(args) < 2):
            raise BadBuild(f"steps[{i - 1}]: COPY needs a source, a destination and filesHash")
        step_force = raw.get("force") or False
        if not isinstance(step_force, bool):
            raise BadBuild(f"steps[{i - 1}].force must be a boolean")
        steps.append(Step(str(kind), tuple(args), files_hash=files_hash, force=step_force))
    return BuildSpec(
        from_image=from_image,
        from_template=from_template,
        steps=tuple(steps),
        start_cmd=_opt_str(body, "startCmd"),
        ready_cmd=_opt_str(body, "readyCmd"),
        force=force,
    )


def log_entry(e: BuildLog) -> dict[str, Any]:
    out: dict[str, Any] = {"timestamp": views.iso(e.timestamp), "level": e.level}
    out["message"] = e.message
    if e.step is not None:
        out["step"] = e.step
    return out


def build_info(b: Build, entries: list[BuildLog]) -> dict[str, Any]:
    """`TemplateBuildInfo` with the log `entries` asked for."""
    out: dict[str, Any] = {
        "templateID": b.template_id,
        "buildID": b.build_id,
        "status": b.status,
        "logs": [f"[{views.iso(e.timestamp)}] {e.message}" for e in entries],
        "logEntries": [log_entry(e) for e in entries],
    }
    if b.reason is not None:
        related = [e for e in b.logs if e.step == b.reason_step][-20:]
        out["reason"] = {
            "message": b.reason,
            "logEntries": [log_entry(e) for e in related],
        }
        if b.reason_step is not None:
            out["reason"]["step"] = b.reason_step
    return out


def _int_arg(name: str, default: int, low: int, high: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer") from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}")
    return value


def _level_filter(entries: list[BuildLog]) -> list[BuildLog]:
    level = request.args.get("level")
    if not level:
        return entries
    if level not in LEVELS:
        raise ApiError(400, f"level must be one of {', '.join(LEVELS)}")
    return [e for e in entries if LEVELS.index(e.level) >= LEVELS.index(level)]


def _build(template_id: str, build_id: str) -> Build:
    try:
        return deps().node.builds.get(template_id, build_id)
    except BuildNotFound as e:
        raise ApiError(404, str(e)) from None


@bp.post("/v3/templates")
async def build_request() -> Response:
    node = deps().node
    body = await read_body()
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    name = body.get("name") or body.get("alias")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "name is required and must be a string")
    name, _, tag = name.partition(":")
    raw_tags = body.get("tags") or []
    if not isinstance(raw_tags, list) or not all(isinstance(t, str) for t in raw_tags):
        raise ApiError(400, "tags must be a list of strings")
    try:
        tags = tuple(dict.fromkeys(check_tag(t) for t in ([tag] if tag else []) + raw_tags))
    except BadTag as e:
        raise ApiError(400, str(e)) from None
    sizes: dict[str, int] = {}
    for key, low, high, default in (
        ("cpuCount", 1, node.limits.max_cpu, node.config.default_cpu),
        ("memoryMB", 128, node.limits.max_memory_mb, node.config.default_memory_mb),
    ):
        value = body.get(key)
        if value is None:
            sizes[key] = min(default, high)
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ApiError(400, f"{key} must be an integer from {low} to {high}")
        sizes[key] = value
    disk = body.get("diskSizeMB")  # aenv's: its sandboxes' disk size (None: the node's)
    if disk is not None and (
        not isinstance(disk, int) or isinstance(disk, bool) or not 64 <= disk <= MAX_DISK_MB
    ):
        raise ApiError(400, f"diskSizeMB must be an integer from 64 to {MAX_DISK_MB}")
    try:
        b = await node.builds.request(
            name,
            cpu_count=sizes["cpuCount"],
            memory_mb=sizes["memoryMB"],
            disk_mb=disk,
            tags=tags or (DEFAULT_TAG,),
        )
    except InvalidName as e:
        raise ApiError(400, str(e)) from None
    except BuildConflict as e:
        raise ApiError(409, str(e)) from None
    return json_response(
        {
            "templateID": b.template_id,
            "buildID": b.build_id,
            "public": True,
            "names": [b.name],
            "aliases": [b.name],
            "tags": list(b.tags),
        },
        202,
    )


@bp.get("/templates/<template_id>/files/<files_hash>")
async def build_files(template_id: str, files_hash: str) -> Response:
    node = deps().node
    if not _HASH.fullmatch(files_hash):
        raise ApiError(400, "the files hash must be a lowercase hex SHA-256")
    if not node.builds.of_template(template_id):
        try:
            await trio.to_thread.run_sync(node.templates.resolve, template_id)
        except (TemplateNotFound, InvalidName):
            raise ApiError(404, f"template {template_id!r} not found") from None
    files = node.builds.files
    if await trio.to_thread.run_sync(files.present, files_hash):
        return json_response({"present": True}, 201)
    url = f"{request.host_url.rstrip('/')}{UPLOAD_PREFIX}{files_hash}?{files.upload_query(files_hash)}"
    return json_response({"present": False, "url": url}, 201)


async def _body_chunks() -> AsyncIterator[bytes]:
    async for chunk in request.body:
        yield chunk


@bp.put(f"{UPLOAD_PREFIX}<files_hash>")
async def build_files_upload(files_hash: str) -> Response:
    """The upload a files answer points to (signed: no API key)."""
    files = deps().node.builds.files
    try:
        files.path(files_hash)
        files.check_signature(
            files_hash, request.args.get("expires", ""), request.args.get("sig", "")
        )
        raw_range = request.headers.get("Content-Range")
        content_range = parse_content_range(raw_range) if raw_range else None
        whole = await files.receive(files_hash, _body_chunks(), content_range)
    except BadUpload as e:
        if e.status in (308, 416):
            have = await trio.to_thread.run_sync(files.received, files_hash)
            resp = Response("", status=e.status)
            if have:
                resp.headers["Range"] = f"bytes=0-{have - 1}"
        else:
            resp = error_response(e.status, e.message)
        # the body may be unread: the connection cannot carry another request
        resp.headers["Connection"] = "close"
        return resp
    if whole:
        return Response("", status=200)
    have = await trio.to_thread.run_sync(files.received, files_hash)
    return Response("", status=308, headers={"Range": f"bytes=0-{have - 1}"})


@bp.post("/v2/templates/<template_id>/builds/<build_id>")
async def build_start(template_id: str, build_id: str) -> Response:
    b = _build(template_id, build_id)
    try:
        spec = parse_build_start(await read_body())
    except BadBuild as e:
        raise ApiError(400, str(e)) from None
    try:
        deps().node.builds.start(b, spec)
    except BuildConflict as e:
        raise ApiError(409, str(e)) from None
    # A build the cache holds whole is over in a few milliseconds: answer once
    # it is, so the SDK's first status poll sees it done (not a poll later).
    with trio.move_on_after(START_WAIT_S):
        await b.done.wait()
    return Response("", status=202)


@bp.get("/templates/<template_id>/builds/<build_id>/status")
async def build_status(template_id: str, build_id: str) -> Response:
    b = _build(template_id, build_id)
    offset = _int_arg("logsOffset", 0, 0, 1 << 31)
    limit = _int_arg("limit", DEFAULT_LOG_LIMIT, 0, MAX_LOG_LIMIT)
    entries = _level_filter(b.logs[offset : offset + limit])
    return json_response(build_info(b, entries))


@bp.get("/templates/<template_id>/builds/<build_id>/logs")
async def build_logs(template_id: str, build_id: str) -> Response:
    b = _build(template_id, build_id)
    cursor = _int_arg("cursor", 0, 0, 1 << 62)
    limit = _int_arg("limit", DEFAULT_LOG_LIMIT, 0, MAX_LOG_LIMIT)
    direction = request.args.get("direction") or "forward"
    if direction not in ("forward", "backward"):
        raise ApiError(400, "direction must be forward or backward")
    entries = _level_filter(b.logs)
    if direction == "forward":
        entries = [e for e in entries if e.timestamp * 1000 >= cursor][:limit]
    else:
        entries = [e for e in entries if not cursor or e.timestamp * 1000 <= cursor]
        entries = entries[::-1][:limit]
    return json_response({"logs": [log_entry(e) for e in entries]})
