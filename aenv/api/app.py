"""The E2B REST API (control plane) on Quart-Trio: one blueprint per resource.

Routes and bodies follow the `e2b` SDKs' generated clients. `create_app`
only assembles the app: the API key check and request counting around every
route, the error handlers (`aenv.api.common`), and the blueprints:
sandboxes, logs, snapshots, templates, builds, images, health and metrics,
and the exec WebSocket. Every route but `/health` and the OIDC documents
(`/.well-known/...`) needs `X-API-Key`,
compared in constant time. Errors are E2B's `{"code", "message"}` bodies
with its status codes; a feature this node cannot honour yet is refused
with 400 (or 501 for whole endpoints), never silently ignored.
"""

from __future__ import annotations

from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.wrappers import TrioRequest

from aenv.api import (
    builds,
    cluster,
    exec_ws,
    health,
    identity,
    images,
    logs,
    sandboxes,
    secrets,
    snapshots,
    tags,
    templates,
    volumes,
)
from aenv.api.auth import api_key_refusal
from aenv.api.common import Deps, error_response, install_deps, install_error_handlers
from aenv.cluster.member import ClusterMember
from aenv.node.node import Node
from aenv.node.service import SandboxService

BLUEPRINTS = (
    health.bp,
    identity.bp,  # OIDC discovery and JWKS of workload tokens (no API key)
    sandboxes.bp,
    logs.bp,
    snapshots.bp,
    templates.bp,
    builds.bp,  # template builds (Template.build)
    tags.bp,  # template tags, PATCH of templates, default templates
    images.bp,
    exec_ws.bp,  # the exec WebSocket (docs/exec-protocol.md)
    cluster.bp,  # members, each node's own sandboxes, the nodes' links
    secrets.bp,  # write-only secret values (Secret)
    volumes.bp,  # volumes and their content API (docs/volumes.md)
)


class _Request(TrioRequest):
    """Quart's request, without the body cap for COPY uploads (streamed to disk)."""

    def __init__(self, method: str, scheme: str, path: str, *args: Any, **kwargs: Any) -> None:
        if path.startswith(builds.UPLOAD_PREFIX):
            kwargs["max_content_length"] = None
        super().__init__(method, scheme, path, *args, **kwargs)


def create_app(
    service: SandboxService, node: Node, cluster: ClusterMember | None = None
) -> QuartTrio:
    """The REST app: sandbox operations go to `service`; templates, snapshots,
    images, builds and metrics are `node`'s."""
    app = QuartTrio("aenv")
    app.request_class = _Request
    app.config["MAX_CONTENT_LENGTH"] = node.config.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    # never redirect `//x` to `/x`: an ID or name with a slash is just not found
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = False
    key = node.api_key.encode()
    install_deps(
        app,
        Deps(service=service, node=node, api_key=key, domain=node.config.domain, cluster=cluster),
    )

    @app.before_request
    async def _auth() -> Response | None:
        if request.path.startswith(builds.UPLOAD_PREFIX):
            return None  # a signed upload URL: its route checks the signature
        if volumes.is_streamed_upload(request.method, request.path):
            return None  # streamed to disk by the route, which checks the volume's token
        # Consume the (size-capped) body before any early answer: a keep-alive
        # connection whose request body was left unread stalls the next request.
        await request.get_data()
        if request.path == "/health" or request.path.startswith(identity.PREFIX):
            return None  # public: load balancers; relying parties of workload tokens
        if volumes.is_content_route(request.path):
            return None  # the content API takes a volume's token (the route checks it)
        refusal = api_key_refusal(
            request.headers.get("X-API-Key", ""), request.headers.get("Authorization", ""), key
        )
        return None if refusal is None else error_response(401, refusal)

    @app.after_request
    async def _count(resp: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        node.m_requests.inc(route=rule, method=request.method, status=str(resp.status_code))
        return resp

    install_error_handlers(app)
    for bp in BLUEPRINTS:
        app.register_blueprint(bp)
    return app
