"""A sandbox's logs: v1 (lifecycle entries and the guest's console) and v2 (entries).

v1 filters by start time (ms) and keeps the last `limit` lines; v2 filters by
level and substring, reads forward or backward, and keeps the first `limit`.
"""

from __future__ import annotations

import time

from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import ApiError, deps, json_response

bp = Blueprint("logs", __name__)
LEVELS = ("debug", "info", "warn", "error")
DEFAULT_LIMIT = 1000


@bp.get("/sandboxes/<sandbox_id>/logs")
async def logs_v1(sandbox_id: str) -> Response:
    service = deps().service
    await service.get(sandbox_id)  # an unknown sandbox is a 404 before a bad query's 400
    try:
        limit = int(request.args.get("limit", DEFAULT_LIMIT))
        start_ms = int(request.args.get("start", 0))
    except ValueError:
        raise ApiError(400, "start and limit must be integers") from None
    logs = await service.logs(sandbox_id, console=True)
    entries = [e for e in logs.entries if e.timestamp * 1000 >= start_ms]
    now = views.iso(time.time())
    return json_response(
        {
            "logs": [{"timestamp": views.iso(e.timestamp), "line": e.message} for e in entries][
                -limit:
            ]
            + [{"timestamp": now, "line": line} for line in logs.console][-limit:],
            "logEntries": [views.log_entry(e) for e in entries][-limit:],
        }
    )


@bp.get("/v2/sandboxes/<sandbox_id>/logs")
async def logs_v2(sandbox_id: str) -> Response:
    service = deps().service
    await service.get(sandbox_id)
    try:
        limit = int(request.args.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise ApiError(400, "limit must be an integer") from None
    level = request.args.get("level")
    search = request.args.get("search")
    entries = list((await service.logs(sandbox_id)).entries)
    if level:
        if level not in LEVELS:
            raise ApiError(400, f"unknown level {level!r}")
        entries = [e for e in entries if LEVELS.index(e.level) >= LEVELS.index(level)]
    if search:
        entries = [e for e in entries if search in e.message]
    if request.args.get("direction") == "backward":
        entries = entries[::-1]
    return json_response({"logs": [views.log_entry(e) for e in entries[:limit]]})
