"""The E2B sandbox routes: create, list, detail, kill and the calls on one sandbox.

v1 and v2 create, list (metadata and state filters, `x-next-token`
pagination over start time and ID), detail, kill, timeout, refresh,
network, metrics, connect, resume, pause and fork (an aenv extension). Every
route is a call of the `SandboxService`; request bodies are validated by
`aenv.proto.requests` first, so a bad body is a 400 whatever the sandbox.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import (
    V2_PAGE_DEFAULT,
    V2_PAGE_MAX,
    ApiError,
    deps,
    json_response,
    no_content,
    read_body,
)
from aenv.node import service as sv
from aenv.proto import jsonbody
from aenv.proto import requests as rq

bp = Blueprint("sandboxes", __name__)
MAX_METRICS_IDS = 100
P = ParamSpec("P")
T = TypeVar("T")


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """`metadata=k1%3Dv1%26k2%3Dv2` (the SDK url-encodes a query string)."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True):
        out[k] = v
    if not out:
        raise ApiError(400, "metadata filter must look like key=value&key2=value2")
    return out


async def _parsed(
    parse: Callable[Concatenate[object, P], T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`parse(body, ...)` of `aenv.proto.requests`; its BadRequest is a 400."""
    try:
        return parse(await read_body(), *args, **kwargs)
    except rq.BadRequest as e:
        raise ApiError(400, str(e)) from None


async def create() -> Response:
    t0 = time.perf_counter()
    d = deps()
    req = await _parsed(rq.parse_new_sandbox, d.service.limits)
    t1 = time.perf_counter()
    info = await d.service.create(req)
    t2 = time.perf_counter()
    resp = json_response(views.sandbox_created(info, d.domain), 201)
    # where the node's part of a create went (bench/creates.py reads it; browsers
    # show it): parsing the body, the service's create, the whole handler
    resp.headers["Server-Timing"] = (
        f"parse;dur={(t1 - t0) * 1000:.1f}, create;dur={(t2 - t1) * 1000:.1f}, "
        f"handler;dur={(time.perf_counter() - t0) * 1000:.1f}"
    )
    return resp


bp.add_url_rule("/sandboxes", "create_v1", create, methods=["POST"])
bp.add_url_rule("/v2/sandboxes", "create_v2", create, methods=["POST"])


@bp.get("/sandboxes")
async def list_v1() -> Response:
    meta = _metadata_filter(request.args.get("metadata"))
    found = await deps().service.list(metadata=meta)
    return json_response([views.sandbox_listed(a) for a in found])


@bp.get("/v2/sandboxes")
async def list_v2() -> Response:
    meta = _metadata_filter(request.args.get("metadata"))
    states = {s for s in request.args.get("state", "").split(",") if s}
    bad = states - {"running", "paused", sv.DIED}
    if bad:
        raise ApiError(400, f"unknown state filter {sorted(bad)}: use running, paused and/or died")
    try:
        limit = int(request.args.get("limit", V2_PAGE_DEFAULT))
    except ValueError:
        raise ApiError(400, "limit must be an integer") from None
    if not 1 <= limit <= V2_PAGE_MAX:
        raise ApiError(400, f"limit must be between 1 and {V2_PAGE_MAX}")
    # died sandboxes (aenv's) only when asked for: E2B's SDKs parse no other state
    wanted = sv.ADDRESSABLE | {sv.DIED} if sv.DIED in states else None
    items = [
        a
        for a in await deps().service.list(metadata=meta, states=wanted)
        if not states or views.api_state(a) in states
    ]
    token = request.args.get("nextToken")
    if token:
        try:
            after = jsonbody.loads(base64.urlsafe_b64decode(token.encode()))
            cursor = (float(after[0]), str(after[1]))
        except (ValueError, TypeError, IndexError, KeyError):
            raise ApiError(400, "invalid nextToken") from None
        items = [a for a in items if (a.started_at, a.sandbox_id) > cursor]
    page = items[:limit]
    resp = json_response([views.sandbox_listed(a) for a in page])
    if len(items) > limit:
        last = page[-1]
        resp.headers["x-next-token"] = base64.urlsafe_b64encode(
            json.dumps([last.started_at, last.sandbox_id]).encode()
        ).decode()
    return resp


@bp.get("/sandboxes/metrics")
async def list_metrics() -> Response:
    ids = [s for s in request.args.get("sandbox_ids", "").split(",") if s]
    out: dict[str, Any] = {}
    for sid in ids[:MAX_METRICS_IDS]:
        try:
            out[sid] = views.metric(await deps().service.metrics(sid))
        except sv.NotFound:
            continue
    return json_response({"sandboxes": out})


@bp.get("/sandboxes/<sandbox_id>")
async def detail(sandbox_id: str) -> Response:
    d = deps()
    return json_response(views.sandbox_detail(await d.service.get(sandbox_id), d.domain))


@bp.delete("/sandboxes/<sandbox_id>")
async def kill(sandbox_id: str) -> Response:
    await deps().service.kill(sandbox_id)
    return no_content()


@bp.post("/sandboxes/<sandbox_id>/timeout")
async def set_timeout(sandbox_id: str) -> Response:
    service = deps().service
    await service.get(sandbox_id)  # an unknown sandbox is a 404 before a bad body's 400
    await service.set_timeout(sandbox_id, await _parsed(rq.parse_timeout_request, service.limits))
    return no_content()


@bp.post("/sandboxes/<sandbox_id>/refreshes")
async def refresh(sandbox_id: str) -> Response:
    service = deps().service
    await service.get(sandbox_id)
    await service.refresh(sandbox_id, await _parsed(rq.parse_refresh, service.limits))
    return no_content()


@bp.put("/sandboxes/<sandbox_id>/network")
async def network(sandbox_id: str) -> Response:
    service = deps().service
    await service.get(sandbox_id)
    policy, allow_internet = await _parsed(rq.parse_network_update)
    await service.set_network(sandbox_id, policy, allow_internet)
    return no_content()


@bp.get("/sandboxes/<sandbox_id>/metrics")
async def sandbox_metrics(sandbox_id: str) -> Response:
    return json_response([views.metric(await deps().service.metrics(sandbox_id))])


async def connect(sandbox_id: str) -> Response:
    """Running: extend the timeout, 200. Paused: resume with it, 201."""
    d = deps()
    timeout = await _parsed(rq.parse_connect, d.service.limits)
    c = await d.service.connect(sandbox_id, timeout)
    return json_response(views.sandbox_created(c.sandbox, d.domain), 201 if c.resumed else 200)


bp.add_url_rule("/sandboxes/<sandbox_id>/connect", "connect_v1", connect, methods=["POST"])
bp.add_url_rule("/v2/sandboxes/<sandbox_id>/connect", "connect_v2", connect, methods=["POST"])


@bp.post("/sandboxes/<sandbox_id>/resume")
async def resume(sandbox_id: str) -> Response:
    d = deps()
    timeout = await _parsed(rq.parse_connect, d.service.limits)
    a = await d.service.resume(sandbox_id, timeout)
    return json_response(views.sandbox_created(a, d.domain), 201)


@bp.post("/sandboxes/<sandbox_id>/pause")
async def pause(sandbox_id: str) -> Response:
    mode = await _parsed(rq.parse_pause)
    await deps().service.pause(sandbox_id, mode)
    return no_content()


@bp.post("/sandboxes/<sandbox_id>/fork")
async def fork(sandbox_id: str) -> Response:
    """Capture once, resume the source, start `count` independent children."""
    d = deps()
    count, ttl = await _parsed(rq.parse_fork, d.service.limits)
    out: list[dict[str, Any]] = []
    for r in await d.service.fork(sandbox_id, count, ttl):
        if isinstance(r, sv.SandboxInfo):
            out.append({"sandbox": views.sandbox_created(r, d.domain)})
        else:
            status = 429 if isinstance(r, sv.Busy) else 500
            out.append({"error": {"code": status, "message": f"fork failed: {r}"}})
    return json_response(out, 201)
