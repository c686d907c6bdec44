"""The node's OIDC issuer documents (no API key: relying parties such as cloud
STS services fetch them to verify sandboxes' workload tokens)."""

from __future__ import annotations

from quart import Blueprint, Response

from aenv.api.common import deps, error_response, json_response

bp = Blueprint("identity", __name__)

PREFIX = "/.well-known/"


@bp.get("/.well-known/openid-configuration")
async def openid_configuration() -> Response:
    issuer = deps().node.issuer
    if issuer is None:
        return error_response(404, "this node issues no workload tokens")
    return json_response(issuer.discovery())


@bp.get("/.well-known/jwks.json")
async def jwks() -> Response:
    issuer = deps().node.issuer
    if issuer is None:
        return error_response(404, "this node issues no workload tokens")
    return json_response(issuer.jwks())
