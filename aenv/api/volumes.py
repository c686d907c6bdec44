"""Volumes: `/volumes` (create, list, get, delete) and the content API, `/volumecontent`.

The control routes take the API key like every other route; creating or
getting a volume hands out its token. The content routes - list, stat,
make_dir, file read and write (streamed both ways), remove and metadata, as
the SDKs' `Volume` sends them - take that token as `Authorization: Bearer`
(the node's API key works too) and are exempt from the app-wide key check
(`is_content_route`). A path is always inside the volume
(`aenv.proto.volumes.content_path`); a full volume answers 413, a volume a
sandbox mounts cannot be deleted (409). Volumes are this node's
(`aenv.storage.volumes`).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

from quart import Blueprint, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from aenv.api.common import ApiError, deps, json_response, no_content, read_body
from aenv.proto import volumes as pv
from aenv.storage.volumes import Owner, VolumeError, VolumeRecord, Volumes

bp = Blueprint("volumes", __name__)

CONTENT_PREFIX = "/volumecontent/"


def is_content_route(path: str) -> bool:
    """Routes authorised by a volume's token instead of the API key."""
    return path.startswith(CONTENT_PREFIX)


def is_streamed_upload(method: str, path: str) -> bool:
    """A file upload the route streams to disk (the app must not read it first)."""
    return method == "PUT" and path.startswith(CONTENT_PREFIX) and path.endswith("/file")


def _volumes() -> Volumes:
    return deps().node.volumes


@bp.errorhandler(VolumeError)
async def _volume_error(e: VolumeError) -> Response:
    return json_response({"code": e.status, "message": str(e)}, e.status)


@bp.errorhandler(pv.VolumeRequestError)
async def _bad_request(e: pv.VolumeRequestError) -> Response:
    return json_response({"code": 400, "message": str(e)}, 400)


def _and_token(rec: VolumeRecord) -> dict[str, object]:
    return pv.volume_and_token(rec.volume_id, rec.name, rec.token, sizeMB=rec.size_mb)


# -- control ------------------------------------------------------------------


@bp.post("/volumes")
async def volume_create() -> Response:
    name, size_mb = pv.parse_new_volume(await read_body())
    member = deps().cluster
    # names are the cluster's: sandboxes mount volumes by name
    elsewhere = [] if member is None else await member.gather("/cluster/v1/volumes")
    if any(isinstance(v, dict) and v.get("name") == name for v in elsewhere):
        raise ApiError(409, f"volume {name!r} already exists")
    rec = await _volumes().create(name, size_mb)
    return json_response(_and_token(rec), 201)


def _own_list() -> list[dict[str, object]]:
    return [pv.volume_view(r.volume_id, r.name) for r in _volumes().all()]


@bp.get("/cluster/v1/volumes")
async def own_volume_list() -> Response:
    """This node's own volumes, for a peer's cluster-wide list."""
    return json_response(_own_list())


@bp.get("/volumes")
async def volume_list() -> Response:
    out = _own_list()
    member = deps().cluster
    if member is not None:  # and every other node's, once each
        seen = {v["volumeID"] for v in out}
        for v in await member.gather("/cluster/v1/volumes"):
            if isinstance(v, dict) and v.get("volumeID") not in seen:
                seen.add(v.get("volumeID"))
                out.append(v)
    return json_response(out)


@bp.get("/volumes/<volume_id>")
async def volume_get(volume_id: str) -> Response:
    vols = _volumes()
    rec = vols.find(volume_id) or await vols.fetch(volume_id)
    if rec is None:
        raise ApiError(404, f"volume {volume_id!r} not found")
    return json_response(_and_token(rec))


@bp.delete("/volumes/<volume_id>")
async def volume_delete(volume_id: str) -> Response:
    await _volumes().delete(volume_id)
    return no_content()


@bp.post("/volumes/<volume_id>/persist")
async def volume_persist(volume_id: str) -> Response:
    """aenv extension: copy the volume to the object store now (only what changed)."""
    vols = _volumes()
    return json_response(await vols.persist(vols.get(volume_id).volume_id))


# -- content --------------------------------------------------------------------


def _authorised(volume_id: str) -> VolumeRecord:
    rec = _volumes().get(volume_id)
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    given = given or request.headers.get("X-API-Key", "")
    if not given:
        raise ApiError(401, "missing volume token (Authorization: Bearer <token>)")
    key = deps().api_key
    if not (
        hmac.compare_digest(given.encode(), rec.token.encode())
        or hmac.compare_digest(given.encode(), key)
    ):
        raise ApiError(401, "invalid volume token")
    return rec


def _path() -> str:
    return pv.content_path(request.args.get("path"))


def _owner() -> Owner:
    a = request.args
    return Owner(
        uid=pv.parse_mode(a.get("uid"), "uid"),
        gid=pv.parse_mode(a.get("gid"), "gid"),
        mode=pv.parse_mode(a.get("mode"), "mode"),
    )


@bp.get("/volumecontent/<volume_id>/dir")
async def content_list(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    try:
        depth = int(request.args.get("depth") or 1)
    except ValueError:
        raise ApiError(400, "depth must be an integer") from None
    return json_response(await _volumes().list_dir(rec.volume_id, _path(), depth))


@bp.post("/volumecontent/<volume_id>/dir")
async def content_make_dir(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    force = pv.parse_flag(request.args.get("force"))
    entry = await _volumes().make_dir(rec.volume_id, _path(), owner=_owner(), force=force)
    return json_response(entry, 201)


@bp.get("/volumecontent/<volume_id>/path")
async def content_stat(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    return json_response(await _volumes().stat(rec.volume_id, _path()))


@bp.patch("/volumecontent/<volume_id>/path")
async def content_update(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    body = await read_body()
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object {uid, gid, mode}")
    for key in ("uid", "gid", "mode"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ApiError(400, f"{key} must be a non-negative integer")
    owner = Owner(uid=body.get("uid"), gid=body.get("gid"), mode=body.get("mode"))
    return json_response(await _volumes().update(rec.volume_id, _path(), owner))


@bp.delete("/volumecontent/<volume_id>/path")
async def content_remove(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    await _volumes().remove(rec.volume_id, _path())
    return no_content()


def _uncapped_body() -> None:
    """Lift the app's body cap from this request (Quart sets it, from the
    Content-Length, when the request arrives: before any route runs)."""
    body = request.body
    body._max_content_length = None
    if isinstance(body._must_raise, RequestEntityTooLarge):
        body._must_raise = None


@bp.put("/volumecontent/<volume_id>/file")
async def content_write(volume_id: str) -> Response:
    # Streamed to disk: no body cap but the volume's own size. The app did
    # not read this body first (`is_streamed_upload`), so an answer given
    # before its end reads the rest: a keep-alive connection whose body was
    # left unread would stall the next request.
    _uncapped_body()

    async def body() -> AsyncIterator[bytes]:
        async for piece in request.body:
            yield piece

    try:
        rec = _authorised(volume_id)
        force = pv.parse_flag(request.args.get("force"))
        entry = await _volumes().write_file(
            rec.volume_id, _path(), body(), owner=_owner(), force=force
        )
    except Exception:
        async for _ in request.body:
            pass
        raise
    return json_response(entry, 201)


@bp.get("/volumecontent/<volume_id>/file")
async def content_read(volume_id: str) -> Response:
    rec = _authorised(volume_id)
    size, chunks = await _volumes().read_file(rec.volume_id, _path())
    resp = Response(chunks, status=200, content_type="application/octet-stream")
    resp.headers["Content-Length"] = str(size)
    return resp
