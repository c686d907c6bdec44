"""The code-execution server of `code-interpreter-v1` sandboxes, on port 49999.

Runs inside the sandbox under the guest's Python (started by the template's
start command, from the envd bundle, as a script) and speaks what the E2B
code-interpreter SDKs send:

- `POST /execute` `{code, context_id?, language?, env_vars?}`: runs the code
  in a context's Jupyter kernel and streams one JSON object a line as the
  kernel answers: `stdout`/`stderr` (`text`, `timestamp` in ns), `result`
  (the formats of an `execute_result` or `display_data`: text, html,
  markdown, svg, png, jpeg, pdf, latex, json, javascript, chart, others in
  `extra`; `is_main_result` for the cell's value), `error` (`name`,
  `value`, `traceback`) and `number_of_executions` (`execution_count`).
  Without a context the language's default context runs it (python by
  default). When the caller goes away mid-run (its timeout, a cancel) the
  kernel is interrupted, so the context is free for the next run.
- `GET /contexts`, `POST /contexts` `{language?, cwd?}` (a new kernel),
  `DELETE /contexts/{id}`, `POST /contexts/{id}/restart`.
- `GET /health`: 200 once the default python context is up and warm.

One thread per connection (the standard library's `ThreadingHTTPServer`);
runs of one context are serialised by its lock, contexts run in parallel.
Kernels talk to the server over Unix sockets, which a memory snapshot of
the sandbox keeps, so a restored or forked sandbox keeps every kernel's state.
Only the standard library and `jupyter_client` are imported.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import shlex
import socket
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from collections.abc import Callable, Generator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

KERNEL_FILE = Path(__file__).with_name("kernel.py")
KERNEL_MODULE = "_aenv_interp"
CHART_MIME = "application/vnd.aenv.chart+json"  # aenv.interp.kernel.CHART_MIME
START_TIMEOUT_S = 120.0
ENVD_ENVS = "http://127.0.0.1:49983/envs"  # the sandbox's env vars, from its envd
POLL_S = 0.2  # how often a waiting run checks that its caller is still there
MAX_BODY = 64 * 1024 * 1024
# Jupyter MIME types and the names the SDKs' `Result` gives them.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    CHART_MIME: "chart",
}
# What a context's language may be called, and the language it means.
LANGUAGES = {
    "python": "python",
    "python3": "python",
    "py": "python",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
KERNELS = {"python": "python3", "bash": "bash"}  # language -> Jupyter kernel name
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _now_ns() -> int:
    return time.time_ns()


def _setup_code() -> str:
    """Silently run in each new kernel: load `kernel.py` as a hidden module."""
    return (
        "def __aenv_setup():\n"
        "    import importlib.util, sys\n"
        f"    spec = importlib.util.spec_from_file_location({KERNEL_MODULE!r}, {str(KERNEL_FILE)!r})\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        f"    sys.modules[{KERNEL_MODULE!r}] = module\n"
        "    spec.loader.exec_module(module)\n"
        "    module.install(get_ipython())\n"
        "__aenv_setup()\n"
        "del __aenv_setup\n"
    )


def _call_kernel_module(function: str, *args: Any) -> str:
    """Code that calls a function of the hidden module without naming anything."""
    rendered = ", ".join(repr(a) for a in args)
    return f"__import__('sys').modules[{KERNEL_MODULE!r}].{function}({rendered})\n"


def _bash_push_env(envs: dict[str, str]) -> str:
    """Bash that exports `envs`, keeping what each name held for `_bash_pop_env`."""
    lines = []
    for key, value in envs.items():
        lines.append(f'__aenv_old_{key}="${{{key}-__aenv_unset__}}"')
        lines.append(f"export {key}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _bash_pop_env(envs: dict[str, str]) -> str:
    lines = []
    for key in envs:
        old = f"__aenv_old_{key}"
        lines.append(
            f'if [ "${old}" = __aenv_unset__ ]; then unset {key}; '
            f'else export {key}="${old}"; fi; unset {old}'
        )
    return "\n".join(lines) + "\n"


class Context:
    """One Jupyter kernel and its client; `lock` serialises its runs."""

    def __init__(self, context_id: str, language: str, cwd: str, runtime_dir: Path) -> None:
        self.id = context_id
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self._runtime_dir = runtime_dir
        self._km: Any = None
        self._kc: Any = None
        self._sandbox_envs: dict[str, str] = {}  # applied by `apply_sandbox_envs`

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # -- lifecycle (hold `lock`) ---------------------------------------------------

    def start(self) -> None:
        from jupyter_client.manager import KernelManager

        prefix = self._runtime_dir / self.id
        km = KernelManager(
            kernel_name=KERNELS[self.language],
            transport="ipc",
            ip=str(prefix),
            connection_file=str(prefix) + ".json",
        )
        km.start_kernel(cwd=self.cwd, env=dict(os.environ))
        kc = km.blocking_client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=START_TIMEOUT_S)
        except RuntimeError:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            raise
        self._km, self._kc = km, kc
        if self.language == "python":
            self._silent(_setup_code())

    def warm(self) -> None:
        if self.language == "python":
            self._silent(_call_kernel_module("warm"))

    def stop(self) -> None:
        if self._kc is not None:
            self._kc.stop_channels()
        if self._km is not None:
            self._km.shutdown_kernel(now=True)
            self._km.cleanup_resources()
        self._km = self._kc = None

    def restart(self) -> None:
        self.stop()
        self._sandbox_envs = {}
        self.start()

    def alive(self) -> bool:
        return self._km is not None and bool(self._km.is_alive())

    # -- runs (hold `lock`) --------------------------------------------------------

    def _silent(self, code: str) -> None:
        """Run `code` without output or history; raise if it fails."""
        reply = self._kc.execute(
            code, silent=True, store_history=False, reply=True, timeout=START_TIMEOUT_S
        )
        content = reply["content"]
        if content.get("status") != "ok":
            raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")

    def run(
        self, code: str, env_vars: dict[str, str], gone: Callable[[], bool]
    ) -> Generator[dict[str, Any], None, None]:
        """Run `code`; yield its output as the SDKs' stream events. If `gone()`
        turns true while it runs, or the consumer stops iterating, the kernel is
        interrupted and the run drained before the context is given back."""
        if env_vars:
            self._silent(self._push_env(env_vars))
        msg_id = self._kc.execute(code, store_history=True, allow_stdin=False)
        finished = False
        try:
            while True:
                try:
                    msg = self._kc.get_iopub_msg(timeout=POLL_S)
                except queue.Empty:
                    if not self.alive():
                        yield {
                            "type": "error",
                            "name": "KernelDied",
                            "value": "the kernel died while running the code; it was restarted",
                            "traceback": "",
                        }
                        self.restart()
                        finished = True
                        return
                    if gone():
                        return  # the finally interrupts
                    continue
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                event = _event(msg)
                if event is not None:
                    yield event
                if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                    finished = True
                    return
        finally:
            if not finished:
                self._interrupt_and_drain(msg_id)
            self._drain_shell(msg_id)
            if env_vars and self.alive():
                self._silent(self._pop_env(env_vars))

    def apply_sandbox_envs(self, envs: dict[str, str]) -> None:
        """Set the sandbox's own environment variables (those given at its
        create) in the kernel, once per change: the kernel started before the
        sandbox had them (in the template's capture)."""
        envs = {k: v for k, v in envs.items() if ENV_NAME.fullmatch(k)}
        if envs == self._sandbox_envs:
            return
        if self.language == "bash":
            code = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in envs.items())
        else:
            code = f"__import__('os').environ.update({envs!r})\n"
        if envs:
            self._silent(code)
        self._sandbox_envs = envs

    def _push_env(self, envs: dict[str, str]) -> str:
        if self.language == "bash":
            return _bash_push_env(envs)
        return _call_kernel_module("push_env", envs)

    def _pop_env(self, envs: dict[str, str]) -> str:
        if self.language == "bash":
            return _bash_pop_env(envs)
        return _call_kernel_module("pop_env")

    def _interrupt_and_drain(self, msg_id: str) -> None:
        self._km.interrupt_kernel()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                msg = self._kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if not self.alive():
                    break
                self._km.interrupt_kernel()
                continue
            if (
                msg.get("parent_header", {}).get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"].get("execution_state") == "idle"
            ):
                return
        self.restart()  # would not stop: a fresh kernel beats a stuck one

    def _drain_shell(self, msg_id: str) -> None:
        """Take the run's reply (and anything older) off the shell channel."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and self._kc is not None:
            try:
                reply = self._kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                return
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return


def _event(msg: dict[str, Any]) -> dict[str, Any] | None:
    kind = msg["msg_type"]
    content = msg["content"]
    if kind == "stream":
        stream = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": stream, "text": content.get("text", ""), "timestamp": _now_ns()}
    if kind in ("execute_result", "display_data"):
        return _result(content.get("data", {}), is_main=kind == "execute_result")
    if kind == "error":
        return {
            "type": "error",
            "name": content.get("ename", ""),
            "value": content.get("evalue", ""),
            "traceback": "\n".join(content.get("traceback", [])),
        }
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


def _result(data: dict[str, Any], *, is_main: bool) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "result", "is_main_result": is_main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        name = FORMATS.get(mime)
        if name is None:
            extra[mime] = value
        elif isinstance(value, str) and name in ("png", "jpeg", "pdf"):
            event[name] = value.strip()  # base64 as the kernel sent it
        else:
            event[name] = value
    if extra:
        event["extra"] = extra
    return event


class Interpreter:
    """The server's contexts: the default context of each language and those made
    by `POST /contexts`."""

    def __init__(self, default_cwd: str) -> None:
        self.default_cwd = default_cwd
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="aenv-interp-"))
        self._lock = threading.Lock()
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}  # language -> context id
        self._envs: tuple[str | None, dict[str, str]] | None = None  # token, envd's env vars
        self.ready = threading.Event()

    def sandbox_envs(self, token: str | None) -> dict[str, str] | None:
        """The sandbox's env vars (`_sandbox_envs`), asked once per access token:
        they are set when the sandbox is made (create, fork, restore), which
        always gives it a new token."""
        with self._lock:
            if self._envs is not None and self._envs[0] == token:
                return self._envs[1]
        envs = _sandbox_envs(token)
        if envs is not None:
            with self._lock:
                self._envs = (token, envs)
        return envs

    def start_default(self) -> None:
        """Start and warm the default python context; exit the server if that
        fails, so that the template's start command fails at once rather than
        its ready command timing out."""
        try:
            ctx = self.default_context("python")
            with ctx.lock:
                ctx.warm()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        self.ready.set()

    def contexts(self) -> list[Context]:
        with self._lock:
            return list(self._contexts.values())

    def get(self, context_id: str) -> Context:
        with self._lock:
            ctx = self._contexts.get(context_id)
        if ctx is None:
            raise HTTPError(404, f"context {context_id!r} not found")
        return ctx

    def create(self, language: str | None, cwd: str | None) -> Context:
        lang = _language(language)
        cwd = cwd or self.default_cwd
        if not os.path.isdir(cwd):
            raise HTTPError(400, f"cwd {cwd!r} is not a directory")
        ctx = Context(str(uuid.uuid4()), lang, cwd, self.runtime_dir)
        with ctx.lock:
            ctx.start()
        with self._lock:
            self._contexts[ctx.id] = ctx
        return ctx

    def default_context(self, language: str | None) -> Context:
        lang = _language(language)
        with self._lock:
            context_id = self._defaults.get(lang)
            if context_id in self._contexts:
                return self._contexts[context_id]
        ctx = self.create(lang, None)
        with self._lock:
            if self._defaults.get(lang) in self._contexts:  # made meanwhile
                other = self._contexts[self._defaults[lang]]
            else:
                self._defaults[lang] = ctx.id
                return ctx
        self.remove(ctx.id)
        return other

    def remove(self, context_id: str) -> None:
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise HTTPError(404, f"context {context_id!r} not found")
        with ctx.lock:
            ctx.stop()


def _language(language: str | None) -> str:
    name = (language or "python").strip().lower()
    lang = LANGUAGES.get(name)
    if lang is None or KERNELS[lang] not in _kernel_names():
        available = sorted({v for v in LANGUAGES.values() if KERNELS[v] in _kernel_names()})
        raise HTTPError(
            400,
            f"language {language!r} is not available in this template "
            f"(available: {', '.join(available) or 'none'})",
        )
    return lang


_kernels: set[str] | None = None


def _kernel_names() -> set[str]:
    """The Jupyter kernels installed in the guest (looked up once)."""
    global _kernels
    if _kernels is None:
        from jupyter_client.kernelspec import KernelSpecManager

        _kernels = set(KernelSpecManager().find_kernel_specs())
    return _kernels


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "aenv-interp"
    interp: Interpreter  # set on the subclass `serve` makes
    _raw = b""  # the current request's body

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing --------------------------------------------------------------------

    def _read_body(self) -> bytes:
        """The request's body, read whole whatever the route (a body left unread
        would be taken for the next request on the connection)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise HTTPError(413, "request body too large")
        return self.rfile.read(length) if length else b""

    def _body(self) -> dict[str, Any]:
        raw = self._raw
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise HTTPError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body is not a JSON object")
        return body

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()
            if len(out) > MAX_BODY:
                self.close_connection = True
                raise HTTPError(413, "request body too large")

    def _send(self, status: int, body: Any) -> None:
        self.send_response(status)
        if body is None:  # 204: no body, and no Content-Length either (RFC 9110)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message, "message": message})

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        try:
            self._raw = self._read_body()
            if method == "GET" and parts == ["health"]:
                if not self.interp.ready.is_set():
                    raise HTTPError(503, "starting")
                self._send(200, {"status": "ok"})
            elif method == "GET" and parts == ["contexts"]:
                self._send(200, [c.describe() for c in self.interp.contexts()])
            elif method == "POST" and parts == ["contexts"]:
                body = self._body()
                ctx = self.interp.create(_opt_str(body, "language"), _opt_str(body, "cwd"))
                self._send(200, ctx.describe())
            elif method == "DELETE" and len(parts) == 2 and parts[0] == "contexts":
                self.interp.remove(parts[1])
                self._send(204, None)
            elif method == "POST" and len(parts) == 3 and parts[::2] == ["contexts", "restart"]:
                ctx = self.interp.get(parts[1])
                with ctx.lock:
                    ctx.restart()
                self._send(204, None)
            elif method == "POST" and parts == ["execute"]:
                self._execute(self._body())
            else:
                raise HTTPError(404, f"no route for {method} {path}")
        except HTTPError as exc:
            self._error(exc.status, exc.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            traceback.print_exc()
            self._error(500, f"{type(exc).__name__}: {exc}")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # -- /execute --------------------------------------------------------------------

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code must be a string")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and ENV_NAME.fullmatch(k) and isinstance(v, str)
            for k, v in env_vars.items()
        ):
            raise HTTPError(400, "env_vars must map variable names to strings")
        context_id = _opt_str(body, "context_id")
        language = _opt_str(body, "language")
        ctx = self.interp.get(context_id) if context_id else self.interp.default_context(language)
        sandbox_envs = self.interp.sandbox_envs(self.headers.get("X-Access-Token"))
        with ctx.lock:
            if not ctx.alive():
                ctx.restart()
            if sandbox_envs is not None:
                ctx.apply_sandbox_envs(sandbox_envs)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = ctx.run(code, env_vars, self._caller_gone)
            try:
                for event in events:
                    self._chunk(json.dumps(event).encode() + b"\n")
                self._chunk(b"")
            except OSError:
                self.close_connection = True
            finally:
                events.close()  # a caller gone mid-run: interrupt, drain

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _caller_gone(self) -> bool:
        """Whether the caller closed its connection (its body was read whole, so
        readable with nothing to read means closed)."""
        sock: socket.socket = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy to envd


def _sandbox_envs(token: str | None) -> dict[str, str] | None:
    """The sandbox's environment variables, asked of its envd (`GET /envs`) with
    the access token the SDK sent; None if envd does not say."""
    request = urllib.request.Request(ENVD_ENVS, headers={"X-Access-Token": token or ""})
    try:
        with _DIRECT.open(request, timeout=2) as answer:
            envs = json.loads(answer.read())
    except (OSError, ValueError):
        return None
    if not isinstance(envs, dict):
        return None
    return {str(k): str(v) for k, v in envs.items()}


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise HTTPError(400, f"{key} must be a string")
    return value


def serve(port: int, host: str = "0.0.0.0", cwd: str | None = None) -> None:
    interp = Interpreter(cwd or os.path.expanduser("~"))
    handler = type("BoundHandler", (Handler,), {"interp": interp})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=interp.start_default, name="default context", daemon=True).start()
    print(f"aenv code interpreter listening on {host}:{port}", flush=True)
    httpd.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="aenv's code interpreter server")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--cwd", default=None, help="the default contexts' directory ($HOME)")
    args = parser.parse_args(argv)
    serve(args.port, args.host, args.cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
