"""The sandbox routes over HTTP, on an in-memory `SandboxService`.

Rules: the app is driven in-process with Quart's test client (no socket,
no node, no runsc); `Sandboxes` below is a fake implementing the
`SandboxService` protocol, with records instead of sandboxes, so these
tests check what the API makes of the service's answers and errors (status
codes, E2B bodies, headers, pagination, the order of checks). The real
service is covered end to end by tests/e2e.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping
from typing import Any, cast

import pytest
from quart_trio import QuartTrio

from aenv.api import sandboxes
from aenv.api.common import Deps, install_deps, install_error_handlers
from aenv.node import service as sv
from aenv.node.node import Node
from aenv.proto.envd_schema import ENVD_VERSION
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.requests import Limits, NewSandbox

DOMAIN = "sandboxes.example"


class Sandboxes:
    """A `SandboxService` of records: running or paused, nothing runs."""

    limits = Limits()

    def __init__(self) -> None:
        self.boxes: dict[str, sv.SandboxInfo] = {}
        self.refused: sv.ServiceError | None = None  # what the next call on a sandbox raises
        self._clock = itertools.count(1000)

    def _record(self, req: NewSandbox) -> sv.SandboxInfo:
        now = float(next(self._clock))
        info = sv.SandboxInfo(
            sandbox_id=f"sbx{len(self.boxes):017d}",
            template_id=req.template,
            alias=None,
            state="running",
            metadata=dict(req.metadata),
            cpu_count=2,
            memory_mb=512,
            disk_size_mb=1024,
            started_at=now,
            end_at=now + req.timeout_s,
            envd_version=ENVD_VERSION,
            envd_access_token="envd-token",
            traffic_access_token="traffic-token",
            allow_public_traffic=req.allow_public_traffic,
            allow_internet_access=req.allow_internet_access,
            policy=req.policy,
            auto_pause=req.auto_pause,
            auto_resume=req.auto_resume,
            paused_in_memory=False,
            pause_mode="full",
            node="node-a",
        )
        self.boxes[info.sandbox_id] = info
        return info

    def _box(self, sandbox_id: str) -> sv.SandboxInfo:
        if self.refused is not None:
            raise self.refused
        try:
            return self.boxes[sandbox_id]
        except KeyError:
            raise sv.NotFound(f"sandbox {sandbox_id!r} not found") from None

    def _set(self, info: sv.SandboxInfo, **changes: Any) -> sv.SandboxInfo:
        info = dataclasses.replace(info, **changes)
        self.boxes[info.sandbox_id] = info
        return info

    async def create(self, req: NewSandbox) -> sv.SandboxInfo:
        if req.template == "registry.example/down:1":
            raise sv.UpstreamFailed("pulling registry.example/down:1 failed: 503")
        return self._record(req)

    async def get(self, sandbox_id: str) -> sv.SandboxInfo:
        return self._box(sandbox_id)

    async def list(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        states: Collection[str] | None = None,
    ) -> tuple[sv.SandboxInfo, ...]:
        wanted = sv.ADDRESSABLE if states is None else states
        return tuple(
            b
            for b in self.boxes.values()
            if b.state in wanted
            and all(b.metadata.get(k) == v for k, v in (metadata or {}).items())
        )

    async def connect(self, sandbox_id: str, timeout_s: int) -> sv.Connected:
        box = self._box(sandbox_id)
        resumed = box.state == "paused"
        return sv.Connected(self._set(box, state="running", end_at=box.end_at + timeout_s), resumed)

    async def resume(self, sandbox_id: str, timeout_s: int) -> sv.SandboxInfo:
        box = self._box(sandbox_id)
        if box.state == "running":
            raise sv.Conflict(f"sandbox {sandbox_id!r} is already running")
        return self._set(box, state="running")

    async def pause(self, sandbox_id: str, mode: str) -> None:
        box = self._box(sandbox_id)
        if box.state != "running":
            raise sv.NotRunning(f"sandbox {sandbox_id} is {box.state}", box.state)
        self._set(box, state="paused", pause_mode=mode)

    async def fork(
        self, sandbox_id: str, count: int, timeout_s: int
    ) -> tuple[sv.SandboxInfo | sv.ServiceError, ...]:
        box = self._box(sandbox_id)
        child = self._record(NewSandbox(template=box.template_id, timeout_s=timeout_s))
        return (child, *[sv.Busy("node is busy", 5.0)] * (count - 1))

    async def snapshot(
        self, sandbox_id: str, *, name: str | None, memory: bool, durable: bool = False
    ) -> sv.SnapshotInfo:
        self._box(sandbox_id)
        return sv.SnapshotInfo("snap", (name,) if name else (), "local")

    async def kill(self, sandbox_id: str) -> None:
        self._box(sandbox_id)
        del self.boxes[sandbox_id]

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        box = self._box(sandbox_id)
        self._set(box, end_at=box.started_at + timeout_s)

    async def refresh(self, sandbox_id: str, timeout_s: int) -> None:
        self._box(sandbox_id)

    async def set_network(
        self, sandbox_id: str, policy: EgressPolicy, allow_internet_access: bool | None
    ) -> None:
        self._set(self._box(sandbox_id), policy=policy)

    async def metrics(self, sandbox_id: str) -> sv.SandboxMetrics:
        box = self._box(sandbox_id)
        return sv.SandboxMetrics(
            timestamp=box.started_at,
            cpu_count=box.cpu_count,
            cpu_used_pct=12.345,
            mem_used_bytes=1 << 20,
            mem_total_bytes=box.memory_mb << 20,
            disk_used_bytes=0,
            disk_total_bytes=box.disk_size_mb << 20,
        )

    async def logs(self, sandbox_id: str, *, console: bool = False) -> sv.SandboxLogs:
        self._box(sandbox_id)
        return sv.SandboxLogs((), ())

    async def endpoint(
        self, sandbox_id: str, port: int, *, auto_resume: bool = False
    ) -> sv.Endpoint:
        raise sv.NotFound(f"sandbox {sandbox_id!r} not found")


def _service(s: Sandboxes) -> sv.SandboxService:
    return s  # the fake is a SandboxService (mypy checks this line)


@pytest.fixture
def service() -> Sandboxes:
    return Sandboxes()


@pytest.fixture
def app(service: Sandboxes) -> QuartTrio:
    app = QuartTrio("test")
    # the sandbox routes never use the node: only the service
    install_deps(
        app, Deps(service=_service(service), node=cast(Node, None), api_key=b"", domain=DOMAIN)
    )
    install_error_handlers(app)
    app.register_blueprint(sandboxes.bp)
    return app


async def _call(app: QuartTrio, method: str, path: str, body: object = None) -> Any:
    client = app.test_client()
    return await client.open(path, method=method, json=body)


async def _create(app: QuartTrio, **fields: Any) -> dict[str, Any]:
    r = await _call(app, "POST", "/v2/sandboxes", {"templateID": "base", **fields})
    assert r.status_code == 201
    return cast(dict[str, Any], await r.get_json())


async def test_create_detail_kill(app: QuartTrio) -> None:
    made = await _create(app, metadata={"team": "a"})
    assert made["alias"] == "base"  # no alias: the template ID, as E2B answers
    assert made["envdAccessToken"] == "envd-token" and made["domain"] == DOMAIN
    assert made["trafficAccessToken"] is None  # public traffic allowed
    sid = made["sandboxID"]
    r = await _call(app, "GET", f"/sandboxes/{sid}")
    detail = await r.get_json()
    assert r.status_code == 200
    assert detail["state"] == "running" and detail["metadata"] == {"team": "a"}
    assert "alias" not in detail
    r = await _call(app, "DELETE", f"/sandboxes/{sid}")
    assert r.status_code == 204
    r = await _call(app, "GET", f"/sandboxes/{sid}")
    assert r.status_code == 404
    assert await r.get_json() == {"code": 404, "message": f"sandbox {sid!r} not found"}


async def test_a_create_says_where_its_time_went(app: QuartTrio) -> None:
    """`Server-Timing` (bench/creates.py splits a burst's creates with it): the body's
    parsing, the service's create and the whole handler, in ms."""
    r = await _call(app, "POST", "/sandboxes", {"templateID": "base"})
    assert r.status_code == 201
    parts = dict(p.strip().split(";dur=") for p in r.headers["Server-Timing"].split(","))
    assert set(parts) == {"parse", "create", "handler"}
    assert float(parts["handler"]) >= float(parts["create"]) >= 0


async def test_not_found_comes_before_a_bad_body(app: QuartTrio) -> None:
    for path in ("/sandboxes/nope/timeout", "/sandboxes/nope/refreshes"):
        assert (await _call(app, "POST", path, {"timeout": "x"})).status_code == 404
    sid = (await _create(app))["sandboxID"]
    r = await _call(app, "POST", f"/sandboxes/{sid}/timeout", {"timeout": "x"})
    assert r.status_code == 400
    r = await _call(app, "POST", f"/sandboxes/{sid}/timeout", {"timeout": 60})
    assert r.status_code == 204


async def test_service_errors_become_e2b_answers(app: QuartTrio, service: Sandboxes) -> None:
    sid = (await _create(app))["sandboxID"]
    assert (await _call(app, "POST", f"/sandboxes/{sid}/pause")).status_code == 204
    r = await _call(app, "POST", f"/sandboxes/{sid}/pause")
    assert r.status_code == 409
    assert (await r.get_json())["message"] == f"sandbox {sid} is paused"
    r = await _call(app, "POST", "/v2/sandboxes", {"templateID": "registry.example/down:1"})
    assert r.status_code == 502
    assert r.headers["Should-Retry"] == "false"  # the node retried the registry already
    service.refused = sv.Busy("sandbox is busy, retry in 3s", 3.0)
    r = await _call(app, "POST", f"/sandboxes/{sid}/refreshes")
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    service.refused = sv.Unavailable("the node is repairing its network", retry_after=5.0)
    r = await _call(app, "POST", f"/sandboxes/{sid}/refreshes")
    assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    service.refused = sv.Unavailable("snapshot s1 is not durable yet")
    r = await _call(app, "POST", f"/sandboxes/{sid}/refreshes")
    assert r.status_code == 503 and "Retry-After" not in r.headers


async def test_connect_and_resume(app: QuartTrio) -> None:
    sid = (await _create(app))["sandboxID"]
    assert (
        await _call(app, "POST", f"/sandboxes/{sid}/connect", {"timeout": 30})
    ).status_code == 200
    assert (await _call(app, "POST", f"/sandboxes/{sid}/resume")).status_code == 409
    await _call(app, "POST", f"/sandboxes/{sid}/pause")
    r = await _call(app, "POST", f"/v2/sandboxes/{sid}/connect", {"timeout": 30})
    assert r.status_code == 201 and (await r.get_json())["sandboxID"] == sid


async def test_v2_list_pages_and_filters(app: QuartTrio) -> None:
    ids = [(await _create(app, metadata={"n": str(i)}))["sandboxID"] for i in range(3)]
    await _call(app, "POST", f"/sandboxes/{ids[1]}/pause")
    r = await _call(app, "GET", "/v2/sandboxes?limit=2")
    assert [s["sandboxID"] for s in await r.get_json()] == ids[:2]
    token = r.headers["x-next-token"]
    r = await _call(app, "GET", f"/v2/sandboxes?limit=2&nextToken={token}")
    assert [s["sandboxID"] for s in await r.get_json()] == ids[2:]
    assert "x-next-token" not in r.headers
    r = await _call(app, "GET", "/v2/sandboxes?state=paused")
    assert [(s["sandboxID"], s["state"]) for s in await r.get_json()] == [(ids[1], "paused")]
    r = await _call(app, "GET", "/v2/sandboxes?metadata=n%3D2")
    assert [s["sandboxID"] for s in await r.get_json()] == ids[2:]
    assert (await _call(app, "GET", "/v2/sandboxes?state=gone")).status_code == 400
    assert (await _call(app, "GET", "/v2/sandboxes?nextToken=%%%")).status_code == 400


async def test_fork_answers_one_result_per_child(app: QuartTrio) -> None:
    sid = (await _create(app))["sandboxID"]
    r = await _call(app, "POST", f"/sandboxes/{sid}/fork", {"count": 2})
    assert r.status_code == 201
    child, refused = await r.get_json()
    assert child["sandbox"]["templateID"] == "base"
    assert refused == {"error": {"code": 429, "message": "fork failed: node is busy"}}


async def test_metrics_skip_unknown_sandboxes(app: QuartTrio) -> None:
    sid = (await _create(app))["sandboxID"]
    r = await _call(app, "GET", f"/sandboxes/metrics?sandbox_ids={sid},nope")
    found = (await r.get_json())["sandboxes"]
    assert list(found) == [sid]
    assert found[sid]["cpuUsedPct"] == 12.35 and found[sid]["memTotal"] == 512 << 20


def test_the_fake_has_every_call_of_the_protocol() -> None:
    # mypy checks the signatures (`_service`); this catches a call added to the protocol
    protocol = {n for n in vars(sv.SandboxService) if not n.startswith("_")}
    assert protocol <= set(dir(Sandboxes)), protocol - set(dir(Sandboxes))
