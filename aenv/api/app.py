"""The E2B REST API (control plane) on Quart-Trio.

Routes and bodies follow the `e2b` SDKs' generated clients: v1 and v2 create,
list (with state/metadata filters and `x-next-token` pagination), detail,
kill, timeout, refresh, network, metrics, logs, connect and templates. Every
route but `/health` needs `X-API-Key`, compared in constant time. Errors are
E2B's `{"code", "message"}` bodies with its status codes; a feature this node
cannot honour yet is refused with 400 (or 501 for whole endpoints), never
silently ignored.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import shlex
import time
import urllib.parse
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from aenv.api import views
from aenv.api.auth import api_key_refusal
from aenv.images.store import ImageRecord, PullError
from aenv.kit.mailbox import Busy
from aenv.node import service as sv
from aenv.node.builds import BuildSpec
from aenv.node.node import Node
from aenv.node.service import SandboxService, SnapshotInfo
from aenv.node.warm import is_internal
from aenv.proto import requests as rq
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.storage.templates import TemplateConflict, TemplateNotFound

log = logging.getLogger("aenv.api")

V2_PAGE_DEFAULT = 100
V2_PAGE_MAX = 1000


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


def _json(value: object, status: int = 200) -> Response:
    return Response(json.dumps(value), status=status, content_type="application/json")


def _no_content() -> Response:
    return Response("", status=204)


async def _body() -> Any:
    data = await request.get_data(as_text=False)
    if not data:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


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
    retry_after = e.retry_after if isinstance(e, sv.Busy) else None
    # the node has retried the registry already: the SDK's own retries would
    # only multiply the wait for the same answer
    should_retry = False if isinstance(e, sv.UpstreamFailed) else None
    return error_response(status, e.message, retry_after, should_retry=should_retry)


def create_app(service: SandboxService, node: Node) -> QuartTrio:
    app = QuartTrio("aenv")
    app.config["MAX_CONTENT_LENGTH"] = node.config.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    # never redirect `//x` to `/x`: an ID or name with a slash is just not found
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = False
    key = node.api_key.encode()
    domain = node.config.domain

    @app.before_request
    async def _auth() -> Response | None:
        # Consume the (size-capped) body before any early answer: a keep-alive
        # connection whose request body was left unread stalls the next request.
        await request.get_data()
        if request.path == "/health":
            return None
        refusal = api_key_refusal(
            request.headers.get("X-API-Key", ""), request.headers.get("Authorization", ""), key
        )
        return None if refusal is None else error_response(401, refusal)

    @app.after_request
    async def _count(resp: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        node.m_requests.inc(route=rule, method=request.method, status=str(resp.status_code))
        return resp

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

    # -- health and metrics ---------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(node.metrics.render(), content_type="text/plain; version=0.0.4")

    # -- sandboxes ------------------------------------------------------------

    async def create() -> Response:
        try:
            req = rq.parse_new_sandbox(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        a = await service.create(req)
        return _json(views.sandbox_created(a, domain), 201)

    app.add_url_rule("/sandboxes", "create_v1", create, methods=["POST"])
    app.add_url_rule("/v2/sandboxes", "create_v2", create, methods=["POST"])

    @app.get("/sandboxes")
    async def list_v1() -> Response:
        meta = _metadata_filter(request.args.get("metadata"))
        return _json([views.sandbox_listed(a) for a in await service.list(metadata=meta)])

    @app.get("/v2/sandboxes")
    async def list_v2() -> Response:
        meta = _metadata_filter(request.args.get("metadata"))
        states = {s for s in request.args.get("state", "").split(",") if s}
        bad = states - {"running", "paused"}
        if bad:
            raise ApiError(400, f"unknown state filter {sorted(bad)}: use running and/or paused")
        try:
            limit = int(request.args.get("limit", V2_PAGE_DEFAULT))
        except ValueError:
            raise ApiError(400, "limit must be an integer") from None
        if not 1 <= limit <= V2_PAGE_MAX:
            raise ApiError(400, f"limit must be between 1 and {V2_PAGE_MAX}")
        items = [
            a
            for a in await service.list(metadata=meta)
            if not states or views.api_state(a) in states
        ]
        token = request.args.get("nextToken")
        if token:
            try:
                after = json.loads(base64.urlsafe_b64decode(token.encode()))
                cursor = (float(after[0]), str(after[1]))
            except (ValueError, TypeError, IndexError, KeyError):
                raise ApiError(400, "invalid nextToken") from None
            items = [a for a in items if (a.started_at, a.sandbox_id) > cursor]
        page = items[:limit]
        resp = _json([views.sandbox_listed(a) for a in page])
        if len(items) > limit:
            last = page[-1]
            resp.headers["x-next-token"] = base64.urlsafe_b64encode(
                json.dumps([last.started_at, last.sandbox_id]).encode()
            ).decode()
        return resp

    @app.get("/sandboxes/metrics")
    async def list_metrics() -> Response:
        ids = [s for s in request.args.get("sandbox_ids", "").split(",") if s]
        out: dict[str, Any] = {}
        for sid in ids[:100]:
            try:
                out[sid] = views.metric(await service.metrics(sid))
            except sv.NotFound:
                continue
        return _json({"sandboxes": out})

    @app.get("/sandboxes/<sandbox_id>")
    async def detail(sandbox_id: str) -> Response:
        return _json(views.sandbox_detail(await service.get(sandbox_id), domain))

    @app.delete("/sandboxes/<sandbox_id>")
    async def kill(sandbox_id: str) -> Response:
        await service.kill(sandbox_id)
        return _no_content()

    @app.post("/sandboxes/<sandbox_id>/timeout")
    async def set_timeout(sandbox_id: str) -> Response:
        await service.get(sandbox_id)  # not found before a bad body
        try:
            timeout = rq.parse_timeout_request(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        await service.set_timeout(sandbox_id, timeout)
        return _no_content()

    @app.post("/sandboxes/<sandbox_id>/refreshes")
    async def refresh(sandbox_id: str) -> Response:
        await service.get(sandbox_id)
        try:
            duration = rq.parse_refresh(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        await service.refresh(sandbox_id, duration)
        return _no_content()

    @app.put("/sandboxes/<sandbox_id>/network")
    async def network(sandbox_id: str) -> Response:
        await service.get(sandbox_id)
        try:
            policy, allow_internet = rq.parse_network_update(await _body())
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        await service.set_network(sandbox_id, policy, allow_internet)
        return _no_content()

    @app.get("/sandboxes/<sandbox_id>/metrics")
    async def sandbox_metrics(sandbox_id: str) -> Response:
        return _json([views.metric(await service.metrics(sandbox_id))])

    @app.get("/sandboxes/<sandbox_id>/logs")
    async def logs_v1(sandbox_id: str) -> Response:
        await service.get(sandbox_id)
        try:
            limit = int(request.args.get("limit", 1000))
            start_ms = int(request.args.get("start", 0))
        except ValueError:
            raise ApiError(400, "start and limit must be integers") from None
        logs = await service.logs(sandbox_id, console=True)
        entries = [e for e in logs.entries if e.timestamp * 1000 >= start_ms]
        console = logs.console
        now = views.iso(time.time())
        return _json(
            {
                "logs": [{"timestamp": views.iso(e.timestamp), "line": e.message} for e in entries][
                    -limit:
                ]
                + [{"timestamp": now, "line": line} for line in console][-limit:],
                "logEntries": [views.log_entry(e) for e in entries][-limit:],
            }
        )

    @app.get("/v2/sandboxes/<sandbox_id>/logs")
    async def logs_v2(sandbox_id: str) -> Response:
        await service.get(sandbox_id)
        try:
            limit = int(request.args.get("limit", 1000))
        except ValueError:
            raise ApiError(400, "limit must be an integer") from None
        level = request.args.get("level")
        search = request.args.get("search")
        entries = list((await service.logs(sandbox_id)).entries)
        if level:
            order = ["debug", "info", "warn", "error"]
            if level not in order:
                raise ApiError(400, f"unknown level {level!r}")
            entries = [e for e in entries if order.index(e.level) >= order.index(level)]
        if search:
            entries = [e for e in entries if search in e.message]
        if request.args.get("direction") == "backward":
            entries = entries[::-1]
        return _json({"logs": [views.log_entry(e) for e in entries[:limit]]})

    async def connect(sandbox_id: str) -> Response:
        """Running: extend the timeout, 200. Paused: resume with it, 201."""
        try:
            timeout = rq.parse_connect(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        c = await service.connect(sandbox_id, timeout)
        return _json(views.sandbox_created(c.sandbox, domain), 201 if c.resumed else 200)

    app.add_url_rule("/sandboxes/<sandbox_id>/connect", "connect_v1", connect, methods=["POST"])
    app.add_url_rule("/v2/sandboxes/<sandbox_id>/connect", "connect_v2", connect, methods=["POST"])

    @app.post("/sandboxes/<sandbox_id>/resume")
    async def resume(sandbox_id: str) -> Response:
        try:
            timeout = rq.parse_connect(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        a = await service.resume(sandbox_id, timeout)
        return _json(views.sandbox_created(a, domain), 201)

    @app.post("/sandboxes/<sandbox_id>/pause")
    async def pause(sandbox_id: str) -> Response:
        try:
            mode = rq.parse_pause(await _body())
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        await service.pause(sandbox_id, mode)
        return _no_content()

    @app.post("/sandboxes/<sandbox_id>/fork")
    async def fork(sandbox_id: str) -> Response:
        """Capture once, resume the source, start `count` independent children."""
        try:
            count, ttl = rq.parse_fork(await _body(), service.limits)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        out: list[dict[str, Any]] = []
        for r in await service.fork(sandbox_id, count, ttl):
            if isinstance(r, sv.SandboxInfo):
                out.append({"sandbox": views.sandbox_created(r, domain)})
            else:
                status = 429 if isinstance(r, sv.Busy) else 500
                out.append({"error": {"code": status, "message": f"fork failed: {r}"}})
        return _json(out, 201)

    @app.post("/sandboxes/<sandbox_id>/snapshots")
    async def snapshot_create(sandbox_id: str) -> Response:
        body = await _body()
        try:
            name, memory = rq.parse_snapshot(body)
        except rq.BadRequest as e:
            raise ApiError(400, str(e)) from None
        durable = isinstance(body, dict) and body.get("durable") is True  # aenv extension
        snap = await service.snapshot(sandbox_id, name=name, memory=memory, durable=durable)
        return _json(views.snapshot(snap), 201)

    def _snapshot_info(doc: dict[str, Any]) -> dict[str, Any]:
        return views.snapshot(SnapshotInfo.from_doc(doc))

    @app.get("/snapshots")
    async def snapshot_list() -> Response:
        docs = [d for d in await node.snapshots.list() if not is_internal(d)]
        sid, name = request.args.get("sandboxID"), request.args.get("name")
        if sid:
            docs = [d for d in docs if d.get("sourceSandboxID") == sid]
        if name:
            docs = [d for d in docs if name in (d.get("names") or [])]
        try:
            limit = int(request.args.get("limit", V2_PAGE_DEFAULT))
            start = int(request.args.get("nextToken") or 0)
        except ValueError:
            raise ApiError(400, "limit and nextToken must be integers") from None
        if not 1 <= limit <= V2_PAGE_MAX or start < 0:
            raise ApiError(400, f"limit must be between 1 and {V2_PAGE_MAX}")
        resp = _json([_snapshot_info(d) for d in docs[start : start + limit]])
        if start + limit < len(docs):
            resp.headers["x-next-token"] = str(start + limit)
        return resp

    @app.delete("/snapshots/<snapshot_id>")
    async def snapshot_delete(snapshot_id: str) -> Response:
        doc = await node.snapshots.resolve(snapshot_id)
        if doc is None:
            remote = await node.durable.locate(snapshot_id)  # only in the object store?
            if remote is None:
                raise ApiError(404, f"snapshot {snapshot_id!r} not found")
            await node.durable.delete_remote(remote)
            return _no_content()
        await _refuse_backing(doc["snapshotID"])
        await node.snapshots.delete(doc["snapshotID"])
        await node.collect_layers()
        return _no_content()

    @app.get("/snapshots/<snapshot_id>")
    async def snapshot_detail(snapshot_id: str) -> Response:
        doc = await node.find_snapshot(snapshot_id)
        if doc is None:
            raise ApiError(404, f"snapshot {snapshot_id!r} not found")
        info = _snapshot_info(doc)
        if doc.get("storageError") and info["storage"] != "durable":
            info["storageError"] = doc["storageError"]
        if doc.get("upload"):
            info["storageUpload"] = doc["upload"]  # what its upload added to the store
        info.update(
            {
                "sourceSandboxID": doc.get("sourceSandboxID"),
                "templateID": doc.get("templateID"),
                "createdAt": views.iso(float(doc["createdAt"])),
                "mode": "full" if doc.get("memory") else "filesystem",
            }
        )
        return _json(info)

    # -- templates ------------------------------------------------------------

    def template(name: str) -> Any:
        try:
            return node.templates.resolve(name)
        except InvalidName as e:
            raise ApiError(400, str(e)) from None
        except TemplateNotFound:
            raise ApiError(404, f"template {name!r} not found") from None

    @app.get("/templates")
    async def templates_v1() -> Response:
        return _json([t.to_api() for t in node.templates.list()])

    @app.get("/v2/templates")
    async def templates_v2() -> Response:
        return _json([t.to_api() for t in node.templates.list()])

    @app.get("/templates/<template_id>")
    async def template_detail(template_id: str) -> Response:
        return _json(views.template_with_builds(template(template_id)))

    @app.get("/templates/aliases/<alias>")
    async def template_alias(alias: str) -> Response:
        t = template(alias)
        return _json({"templateID": t.template_id, "public": t.public})

    @app.delete("/templates/<template_id>")
    async def template_delete(template_id: str) -> Response:
        # snapshots share the template namespace (the SDK deletes them here)
        snap = await node.snapshots.resolve(template_id)
        if snap is not None and snap["snapshotID"] == template_id:
            await _refuse_backing(template_id)
            await node.snapshots.delete(template_id)
            await node.collect_layers()
            return _no_content()
        t = template(template_id)
        in_use = await service.list(states=sv.EVERY_STATE)
        if any(a.template_id == t.template_id for a in in_use):
            raise ApiError(409, f"template {template_id!r} is in use by running sandboxes")
        await node.warmer.forget(t.template_id)  # the template's own snapshots go first
        if any(d.get("templateID") == t.template_id for d in await node.snapshots.list()):
            raise ApiError(409, f"template {template_id!r} is the base of stored snapshots")
        await trio.to_thread.run_sync(node.templates.delete, t.template_id)
        await node.durable.unshare_template(t.template_id)
        await node.builds.forget_template(t)  # a built template's snapshot goes with it
        return _no_content()

    async def _refuse_backing(snapshot_id: str) -> None:
        t = await node.builds.backing(snapshot_id)
        if t is not None:
            raise ApiError(409, f"snapshot {snapshot_id!r} is template {t.template_id!r}'s build")

    # -- images (aenv extension) ------------------------------------------------

    @app.get("/images")
    async def images_list() -> Response:
        records = await trio.to_thread.run_sync(node.images.store.records)
        return _json([r.to_api() for r in records])

    @app.get("/images/pulls")
    async def images_pulls() -> Response:
        return _json(node.images.store.pulls())

    @app.post("/images")
    async def images_pull() -> Response:
        """Pull an image; with `name`, also make it a template of that name.

        With `"wait": false` the pull runs in the background (202): follow it
        at `GET /images/pulls`.
        """
        body = await _body()
        if not isinstance(body, dict) or not isinstance(body.get("image"), str):
            raise ApiError(400, 'body must be {"image": REFERENCE[, "name": NAME]}')
        wait = body.get("wait", True)
        if not isinstance(wait, bool):
            raise ApiError(400, "wait must be a boolean")
        name, sizes = await _pull_request(body)
        if not wait:
            try:
                parse_reference(body["image"])
            except InvalidReference as e:
                raise ApiError(400, str(e)) from None

            async def in_background() -> None:
                await _pull_and_name(body, name, sizes)

            node.start_background(in_background, f"pulling {body['image']}")
            return _json({"image": body["image"], "state": "pulling"}, 202)
        return _json(await _pull_and_name(body, name, sizes), 201)

    async def _pull_request(body: dict[str, Any]) -> tuple[str | None, dict[str, int]]:
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
        body: dict[str, Any], name: str | None, sizes: dict[str, int]
    ) -> dict[str, Any]:
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

    from aenv.api import builds, exec_ws  # the exec WebSocket (docs/exec-protocol.md)

    exec_ws.register(app, service, node, error_response)
    builds.register(app, node)  # template builds (Template.build)
    return app


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
