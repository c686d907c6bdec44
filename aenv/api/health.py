"""`/health` (no API key: load balancers and the CLI probe it) and `/metrics` (Prometheus)."""

from __future__ import annotations

from quart import Blueprint, Response

from aenv.api.common import deps, json_response

bp = Blueprint("health", __name__)


@bp.get("/health")
async def health() -> Response:
    return json_response({"status": "ok"})


@bp.get("/metrics")
async def metrics() -> Response:
    return Response(deps().node.metrics.render(), content_type="text/plain; version=0.0.4")
