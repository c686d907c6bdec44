"""envd's ASGI application: routing, access-token checks and the small routes.

`EnvdApp` serves the Connect services (process.Process, filesystem.Filesystem)
and the plain HTTP routes `/health`, `/init`, `/envs`, `/metrics` and
`/files`. Once `/init` has set an access token, every request except
`/health`, `/init` (which checks the token itself) and `/files` (which also
accepts signed URLs) must carry it in `X-Access-Token`. The calling user of
an RPC is the username of its HTTP Basic `Authorization` header, else the
default user.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import time
from typing import Any

import trio

from aenv.envd.asgi import ASGIMessage, Receive, Request, Response, Scope, Send
from aenv.envd.files_http import FilesAPI
from aenv.envd.filesystem import FilesystemService
from aenv.envd.process import ProcessService
from aenv.envd.rpc import CallContext, ConnectRouter
from aenv.envd.spawner import SpawnerClient
from aenv.envd.state import EnvdState, InitError
from aenv.envd.users import UnknownUser, User, UserDB
from aenv.proto import jsonbody
from aenv.proto.connect import Code, ConnectError
from aenv.proto.envd_schema import ENVD_VERSION

log = logging.getLogger("aenv.envd")

MAX_INIT_BODY = 1024 * 1024


def basic_username(header: str | None) -> str | None:
    """The username of an HTTP Basic Authorization header, or None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[0]


class EnvdApp:
    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        state: EnvdState | None = None,
        users: UserDB | None = None,
        spawner: SpawnerClient | None = None,
    ) -> None:
        self.state = state or EnvdState()
        self.users = users or UserDB()
        self.started_at = time.time()
        self.process = ProcessService(
            nursery, self.state, self.users, self.rpc_user, spawner=spawner
        )
        self.filesystem = FilesystemService(nursery, self.state, self.users, self.rpc_user)
        self.router = ConnectRouter(
            {**self.process.handlers(), **self.filesystem.handlers()}, watchers=nursery
        )
        self.files = FilesAPI(self.state, self.users)
        self._cpu_sample: tuple[float, float] | None = None

    def rpc_user(self, ctx: CallContext) -> User:
        name = basic_username(ctx.header("authorization"))
        if name is None:
            name = self.state.default_user
        try:
            return self.users.lookup(name)
        except UnknownUser:
            raise ConnectError(Code.UNAUTHENTICATED, f"invalid username: '{name}'") from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = Response(send)
        try:
            await self._dispatch(request, response)
        except Exception:
            log.exception("request %s %s failed", request.method, request.path)
            if not response.started:
                await response.error(500, "internal error")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message: ASGIMessage = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, request: Request, response: Response) -> None:
        path, method = request.path, request.method
        if method == "OPTIONS":
            await response.full(
                204,
                b"",
                [
                    ("access-control-allow-methods", "GET, POST, PUT, DELETE, OPTIONS"),
                    ("access-control-allow-headers", "*"),
                    ("access-control-max-age", "7200"),
                ],
            )
            return
        if path == "/health":
            await response.full(204, b"", [("x-envd-version", ENVD_VERSION)])
            return
        if path == "/init":
            if method != "POST":
                await response.error(405, "method not allowed")
                return
            await self._init(request, response)
            return
        if path == "/files":
            await self.files.handle(request, response)
            return
        if not self.state.token_ok(request.headers.get("x-access-token")):
            await response.error(
                401,
                "unauthorized access, please provide a valid access token or method signing if supported",
            )
            return
        if self.router.handles(path):
            await self.router(request, response)
        elif path == "/envs" and method == "GET":
            await response.json(200, self.state.env_vars)
        elif path == "/metrics" and method == "GET":
            await response.json(200, await trio.to_thread.run_sync(self._metrics))
        else:
            await response.error(404, f"no route for {method} {path}")

    async def _init(self, request: Request, response: Response) -> None:
        try:
            raw = await request.read_body(MAX_INIT_BODY)
        except Exception:
            await response.error(400, "init body too large")
            return
        try:
            body: Any = jsonbody.loads(raw) if raw.strip() else {}
        except ValueError as e:
            await response.error(400, f"invalid JSON: {e}")
            return
        try:
            self.state.apply_init(body, request.headers.get("x-access-token"))
        except InitError as e:
            await response.error(e.status, e.message)
            return
        await response.full(
            204, b"", [("x-envd-version", ENVD_VERSION), ("cache-control", "no-store")]
        )

    def _metrics(self) -> dict[str, Any]:
        mem: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    mem[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        total = mem.get("MemTotal", 0)
        available = mem.get("MemAvailable", mem.get("MemFree", 0))
        cache = mem.get("Cached", 0)
        used = max(total - available, 0)
        cpu_pct = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
            busy = sum(fields) - idle
            if self._cpu_sample is not None:
                d_busy, d_idle = busy - self._cpu_sample[0], idle - self._cpu_sample[1]
                if d_busy + d_idle > 0:
                    cpu_pct = round(100.0 * d_busy / (d_busy + d_idle), 2)
            self._cpu_sample = (busy, idle)
        except (OSError, ValueError, IndexError):
            pass
        try:
            st = os.statvfs("/")
            disk_total = st.f_blocks * st.f_frsize
            disk_used = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            disk_total = disk_used = 0
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": cpu_pct,
            "mem_total": total,
            "mem_used": used,
            "mem_cache": cache,
            "mem_total_mib": total // (1024 * 1024),
            "mem_used_mib": used // (1024 * 1024),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
