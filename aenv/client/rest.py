"""A small synchronous client for the node's REST API and its envd file proxy.

Every failure becomes a `CliError` with the CLI's exit code: a refused
connection is `Unreachable`, 401 `AuthFailed`, 404 `NotFound`, a route the
node does not have (its generic 404/405) or 501 a `ServerError` that says the
node does not support the operation. Sandbox IDs may be given as unambiguous
prefixes (`resolve_sandbox`). File transfers stream through the node's proxy
to the sandbox's envd (`E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers) and never
hold a whole file in memory.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable, Iterator
from typing import IO, Any

import httpx

from aenv.client.config import Credentials
from aenv.client.errors import (
    CliError,
    NotFound,
    ProtocolViolation,
    ServerError,
    Unreachable,
    UsageError,
    from_status,
)

ENVD_PORT = 49983
SANDBOX_ID_LEN = 20
_PREFIX_RE = re.compile(r"^[a-z0-9]{1,20}$")
_CHUNK = 256 * 1024
PAGE = 1000


def _seg(value: str) -> str:
    return urllib.parse.quote(value, safe="")


class Client:
    """The node at `creds.url`, authenticated with `creds.api_key`."""

    def __init__(self, creds: Credentials, *, timeout: float = 60.0) -> None:
        self.creds = creds
        self.http = httpx.Client(
            base_url=creds.url,
            headers={"X-API-Key": creds.api_key, "User-Agent": "aenv-cli"},
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=False,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------

    def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return self.http.send(request, stream=stream)
        except httpx.TimeoutException as e:
            raise Unreachable(
                f"the node at {self.creds.url} did not answer in time ({e})"
            ) from None
        except httpx.TransportError as e:
            raise Unreachable(f"cannot reach the node at {self.creds.url}: {e}") from None

    def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one API request; return the response if it succeeded, else raise."""
        req = self.http.build_request(
            method,
            path,
            json=json_body,
            params=params,
            timeout=httpx.Timeout(timeout, connect=10.0) if timeout else httpx.USE_CLIENT_DEFAULT,
        )
        resp = self._send(req)
        if resp.status_code >= 400:
            raise self._error(resp, method, path, what)
        return resp

    def _error(self, resp: httpx.Response, method: str, path: str, what: str) -> CliError:
        status = resp.status_code
        message: str | None = None
        try:
            body = resp.json()
            if isinstance(body, dict) and isinstance(body.get("message"), str):
                message = body["message"]
        except (ValueError, UnicodeDecodeError):
            pass
        if message is None:
            text = resp.text.strip().splitlines()[0][:200] if resp.text.strip() else ""
            return ProtocolViolation(
                f"{what}: unexpected answer HTTP {status} from {self.creds.url}"
                + (f": {text}" if text else "")
            )
        if (status == 404 and message == "not found") or status == 405:
            return ServerError(
                f"{what}: this node does not support it ({method} {path} answered {status})",
                status,
            )
        if status == 501:
            return ServerError(f"{what}: {message}", status)
        err = from_status(status, f"{what}: {message}")
        return err

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise ProtocolViolation(
                f"the node answered {resp.request.url} with invalid JSON"
            ) from None

    # -- sandboxes ---------------------------------------------------------------

    def list_sandboxes(self, states: list[str] | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        params = {"limit": str(PAGE)}
        if states:
            params["state"] = ",".join(states)
        while True:
            resp = self.request("GET", "/v2/sandboxes", what="list sandboxes", params=params)
            page = self._json(resp)
            if not isinstance(page, list):
                raise ProtocolViolation("list sandboxes: the node did not answer a list")
            out.extend(p for p in page if isinstance(p, dict))
            token = resp.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    def resolve_sandbox(self, ref: str) -> str:
        """The full ID for an ID or an unambiguous prefix of one."""
        ref = ref.strip()
        if not _PREFIX_RE.fullmatch(ref):
            raise NotFound(f"sandbox {ref!r} not found")
        if len(ref) == SANDBOX_ID_LEN:
            return ref
        ids = [str(s.get("sandboxID", "")) for s in self.list_sandboxes()]
        matches = sorted({i for i in ids if i.startswith(ref)})
        if not matches:
            raise NotFound(f"sandbox {ref!r} not found")
        if len(matches) > 1:
            shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
            raise UsageError(f"sandbox prefix {ref!r} is ambiguous: {shown}")
        return matches[0]

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        resp = self.request("GET", f"/sandboxes/{_seg(sandbox_id)}", what="sandbox")
        body = self._json(resp)
        if not isinstance(body, dict):
            raise ProtocolViolation("sandbox: the node did not answer an object")
        return body

    def sandbox_logs(self, sandbox_id: str, *, limit: int = 1000) -> list[dict[str, Any]]:
        """The sandbox's log entries, oldest first (`GET /v2/sandboxes/{id}/logs`)."""
        resp = self.request(
            "GET",
            f"/v2/sandboxes/{_seg(sandbox_id)}/logs",
            params={"limit": str(limit)},
            what="sandbox logs",
        )
        body = self._json(resp)
        logs = body.get("logs") if isinstance(body, dict) else None
        if not isinstance(logs, list):
            raise ProtocolViolation("sandbox logs: the node did not answer a list of logs")
        return [e for e in logs if isinstance(e, dict)]

    def create_sandbox(
        self,
        template: str,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        cpu: int | None = None,
        memory: int | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"templateID": template}
        if cpu is not None:
            body["cpuCount"] = cpu
        if memory is not None:
            body["memoryMB"] = memory
        if timeout is not None:
            body["timeout"] = timeout
        if metadata:
            body["metadata"] = metadata
        if env_vars:
            body["envVars"] = env_vars
        resp = self.request("POST", "/sandboxes", what="start", json_body=body)
        created = self._json(resp)
        if not isinstance(created, dict) or not isinstance(created.get("sandboxID"), str):
            raise ProtocolViolation("start: the node did not answer a sandbox")
        return created

    def kill_sandbox(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}", what=f"delete {sandbox_id}")

    def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        self.request(
            "POST",
            f"/sandboxes/{_seg(sandbox_id)}/timeout",
            what="timeout",
            json_body={"timeout": seconds},
        )

    def refresh(self, sandbox_id: str, seconds: int) -> None:
        self.request(
            "POST",
            f"/sandboxes/{_seg(sandbox_id)}/refreshes",
            what="refresh",
            json_body={"duration": seconds},
        )

    def pause(self, sandbox_id: str) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/pause", what="pause")

    def resume(self, sandbox_id: str, timeout: int | None = None) -> Any:
        body = {} if timeout is None else {"timeout": timeout}
        resp = self.request(
            "POST", f"/sandboxes/{_seg(sandbox_id)}/resume", what="resume", json_body=body
        )
        return self._json(resp) if resp.content else None

    def fork(self, sandbox_id: str, count: int) -> Any:
        resp = self.request(
            "POST",
            f"/sandboxes/{_seg(sandbox_id)}/fork",
            what="fork",
            json_body={"count": count},
        )
        return self._json(resp) if resp.content else None

    # -- snapshots -------------------------------------------------------------

    def create_snapshot(self, sandbox_id: str, name: str | None) -> Any:
        body = {} if name is None else {"name": name}
        resp = self.request(
            "POST",
            f"/sandboxes/{_seg(sandbox_id)}/snapshots",
            what="snapshot create",
            json_body=body,
        )
        return self._json(resp) if resp.content else None

    def list_snapshots(self) -> list[dict[str, Any]]:
        resp = self.request("GET", "/snapshots", what="snapshot list")
        body = self._json(resp)
        if not isinstance(body, list):
            raise ProtocolViolation("snapshot list: the node did not answer a list")
        return [s for s in body if isinstance(s, dict)]

    def cluster_members(self) -> list[dict[str, Any]]:
        resp = self.request("GET", "/cluster/members", what="cluster members")
        body = self._json(resp)
        if not isinstance(body, list):
            raise ProtocolViolation("cluster members: the node did not answer a list")
        return [m for m in body if isinstance(m, dict)]

    def drain(self, node_id: str) -> dict[str, Any]:
        """Drain a node ("self": the one this client talks to); its report."""
        resp = self.request(
            "POST", f"/cluster/nodes/{node_id}/drain", what=f"drain {node_id}", timeout=3600.0
        )
        body = self._json(resp)
        if not isinstance(body, dict):
            raise ProtocolViolation("drain: the node did not answer an object")
        return body

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/snapshots/{_seg(snapshot_id)}", what="snapshot delete")

    # -- templates -------------------------------------------------------------

    def list_templates(self) -> list[dict[str, Any]]:
        body = self._json(self.request("GET", "/templates", what="template list"))
        if not isinstance(body, list):
            raise ProtocolViolation("template list: the node did not answer a list")
        return [t for t in body if isinstance(t, dict)]

    def get_template(self, name: str) -> dict[str, Any]:
        body = self._json(self.request("GET", f"/templates/{_seg(name)}", what="template"))
        if not isinstance(body, dict):
            raise ProtocolViolation("template: the node did not answer an object")
        return body

    def delete_template(self, name: str) -> None:
        self.request("DELETE", f"/templates/{_seg(name)}", what=f"template delete {name}")

    def pull(
        self,
        image: str,
        name: str,
        *,
        cpu: int | None,
        memory: int | None,
        start_cmd: str | bool | None = None,
        ready_cmd: str | None = None,
        wait: bool = True,
    ) -> Any:
        body: dict[str, Any] = {"image": image, "name": name, "wait": wait}
        if start_cmd is not None:
            body["startCmd"] = start_cmd
        if ready_cmd is not None:
            body["readyCmd"] = ready_cmd
        if cpu is not None:
            body["cpuCount"] = cpu
        if memory is not None:
            body["memoryMB"] = memory
        # A first pull downloads and converts every layer: allow it time.
        resp = self.request("POST", "/images", what=f"pull {image}", json_body=body, timeout=3600)
        return self._json(resp)

    def pulls(self) -> list[dict[str, Any]]:
        """Pulls the node is doing (or just did), with their progress."""
        resp = self.request("GET", "/images/pulls", what="pull progress", timeout=10)
        return list(self._json(resp))

    # -- files through the envd proxy -------------------------------------------------

    def _envd_headers(self, sandbox_id: str) -> dict[str, str]:
        token = self.get_sandbox(sandbox_id).get("envdAccessToken")
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if isinstance(token, str) and token:
            headers["X-Access-Token"] = token
        return headers

    def _envd_error(self, resp: httpx.Response, what: str) -> CliError:
        resp.read()
        message = resp.text.strip()[:300]
        try:
            body = json.loads(resp.content)
            if isinstance(body, dict) and isinstance(body.get("message"), str):
                message = body["message"]
        except (ValueError, UnicodeDecodeError):
            pass
        return from_status(resp.status_code, f"{what}: {message or f'HTTP {resp.status_code}'}")

    def upload(
        self, sandbox_id: str, source: IO[bytes], remote: str, *, size: int | None = None
    ) -> list[dict[str, Any]]:
        """Stream `source` to `remote` in the sandbox; return envd's entries."""

        def chunks() -> Iterator[bytes]:
            while True:
                data = source.read(_CHUNK)
                if not data:
                    return
                yield data

        headers = self._envd_headers(sandbox_id)
        headers["Content-Type"] = "application/octet-stream"
        if size is not None:
            headers["Content-Length"] = str(size)
        req = self.http.build_request(
            "POST",
            "/files",
            params={"path": remote},
            headers=headers,
            content=chunks(),
            timeout=httpx.Timeout(None, connect=10.0),
        )
        resp = self._send(req)
        if resp.status_code >= 400:
            raise self._envd_error(resp, "upload")
        body = self._json(resp)
        return [e for e in body if isinstance(e, dict)] if isinstance(body, list) else []

    def download(self, sandbox_id: str, remote: str, sink: Callable[[bytes], object]) -> int:
        """Stream `remote` from the sandbox into `sink`; return the byte count."""
        headers = self._envd_headers(sandbox_id)
        headers["Accept-Encoding"] = "identity"
        req = self.http.build_request(
            "GET",
            "/files",
            params={"path": remote},
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
        )
        resp = self._send(req, stream=True)
        try:
            if resp.status_code >= 400:
                raise self._envd_error(resp, "download")
            total = 0
            try:
                for chunk in resp.iter_bytes(_CHUNK):
                    sink(chunk)
                    total += len(chunk)
            except httpx.TransportError as e:
                raise Unreachable(f"download: the transfer broke: {e}") from None
            return total
        finally:
            resp.close()
