"""What every route of the REST app shares: errors, bodies, answers and dependencies.

Routes raise `ApiError` (or let a `ServiceError` of the sandbox service, a
full mailbox's `Busy` or a werkzeug `HTTPException` through); the handlers
`install_error_handlers` adds turn each into E2B's `{"code", "message"}`
body with its status. `deps()` is what `create_app` gave the app: the
sandbox service and the node's other facilities. This module imports none
of the blueprints.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, cast

from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from aenv.cluster.member import ClusterMember
from aenv.kit.mailbox import Busy
from aenv.node import service as sv
from aenv.node.node import Node
from aenv.proto import jsonbody

log = logging.getLogger("aenv.api")

V2_PAGE_DEFAULT = 100
V2_PAGE_MAX = 1000
_DEPS = "aenv"


@dataclass(frozen=True, kw_only=True)
class Deps:
    """What the routes work with (`create_app` puts it on the app)."""

    service: sv.SandboxService  # every sandbox operation
    node: Node  # templates, snapshots, images, builds and metrics: not sandbox operations
    api_key: bytes
    domain: str | None
    cluster: ClusterMember | None = None  # when the node is in a cluster


def install_deps(app: QuartTrio, deps: Deps) -> None:
    app.extensions[_DEPS] = deps


def deps() -> Deps:
    """The app's dependencies (in a request or WebSocket handler)."""
    return cast(Deps, current_app.extensions[_DEPS])


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        retry_after: float | None = None,
        *,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.should_retry = should_retry


def error_response(
    status: int,
    message: str,
    retry_after: float | None = None,
    *,
    should_retry: bool | None = None,
) -> Response:
    """The E2B error body; `should_retry` sets the SDK's `Should-Retry` header
    (without it, the SDK retries 429 and 502-504 on its own)."""
    resp = Response(
        json.dumps({"code": status, "message": message}),
        status=status,
        content_type="application/json",
    )
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, round(retry_after)))
    if should_retry is not None:
        resp.headers["Should-Retry"] = "true" if should_retry else "false"
    return resp


# HTTP statuses of the sandbox service's errors
_STATUS: tuple[tuple[type[sv.ServiceError], int], ...] = (
    (sv.BadRequest, 400),
    (sv.Forbidden, 403),
    (sv.NotFound, 404),
    (sv.Conflict, 409),
    (sv.Busy, 429),
    (sv.Failed, 500),
    (sv.UpstreamFailed, 502),
    (sv.Unavailable, 503),
)


def service_error_response(e: sv.ServiceError) -> Response:
    status = next((code for kind, code in _STATUS if isinstance(e, kind)), 500)
    retry_after = e.retry_after if isinstance(e, sv.Busy | sv.Unavailable) else None
    # the node has retried the registry already: the SDK's own retries would
    # only multiply the wait for the same answer
    should_retry = False if isinstance(e, sv.UpstreamFailed) else None
    return error_response(status, e.message, retry_after, should_retry=should_retry)


def install_error_handlers(app: QuartTrio) -> None:
    """Answer every error as E2B does: `{"code", "message"}` with its status."""

    @app.errorhandler(ApiError)
    async def _api_error(e: ApiError) -> Response:
        return error_response(e.status, e.message, e.retry_after, should_retry=e.should_retry)

    @app.errorhandler(sv.ServiceError)
    async def _service_error(e: sv.ServiceError) -> Response:
        return service_error_response(e)

    @app.errorhandler(Busy)
    async def _busy(e: Busy) -> Response:
        return error_response(429, str(e), e.retry_after)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        msg = {413: "request body too large", 404: "not found", 405: "method not allowed"}.get(
            status, e.description or e.name
        )
        return error_response(status, msg)

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")


def json_response(value: object, status: int = 200) -> Response:
    return Response(json.dumps(value), status=status, content_type="application/json")


def no_content() -> Response:
    return Response("", status=204)


async def read_body() -> Any:
    """The request's JSON body, None if it is empty (400 if it is not JSON)."""
    data = await request.get_data(as_text=False)
    if not data:
        return None
    try:
        return jsonbody.loads(data)
    except jsonbody.JSONBodyError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


async def refuse_backing(node: Node, snapshot_id: str) -> None:
    """409 if `snapshot_id` is what a built template's sandboxes start from."""
    t = await node.builds.backing(snapshot_id)
    if t is not None:
        raise ApiError(409, f"snapshot {snapshot_id!r} is template {t.template_id!r}'s build")


async def delete_snapshot(node: Node, snapshot_id: str) -> None:
    """Delete a snapshot this node holds (not one backing a template) and its layers."""
    await refuse_backing(node, snapshot_id)
    await node.snapshots.delete(snapshot_id)
    await node.collect_layers()
