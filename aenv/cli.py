"""The `aenv` command (cyclopts): parse arguments, call the node, report.

`aenv serve` runs a node (what `make serve` ends with). Every other command
is a client of a node's REST API and exec WebSocket (aenv.client), found
through `--url`/`--api-key`, `AENV_URL`/`AENV_API_KEY` or the credentials
file `aenv auth` writes. Failures print one line on stderr and exit with the
codes in docs/cli.md; `exec`, `connect` and `start` exit with the remote
command's code.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import cyclopts
import trio
from cyclopts import Parameter

from aenv import __version__
from aenv.client import config as creds_config
from aenv.client import render
from aenv.client.errors import (
    EXIT_USAGE,
    CliError,
    NotFound,
    UsageError,
)
from aenv.client.progress import pull_with_progress
from aenv.client.render import OutputFormat
from aenv.client.rest import Client
from aenv.client.session import ExecRequest, SessionResult, run_attached
from aenv.client.terminal import DETACH_HELP

app = cyclopts.App(name="aenv", version=__version__, help="Self-hosted E2B-compatible sandboxes.")
template_app = cyclopts.App(name="template", help="List and delete templates.")
snapshot_app = cyclopts.App(name="snapshot", help="Create, list and delete snapshots.")
cluster_app = cyclopts.App(name="cluster", help="The cluster this node belongs to.")
node_app = cyclopts.App(name="node", help="One node of the cluster.")
app.command(template_app)
app.command(snapshot_app)
app.command(cluster_app)
app.command(node_app)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        sid = getattr(record, "sandbox_id", None)
        if sid:
            out["sandbox_id"] = sid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, json_logs: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # one line per upstream request is noise; the proxy and actors log what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)


@app.command
def serve(
    *,
    listen: Annotated[str | None, cyclopts.Parameter(help="host:port (env AENV_LISTEN)")] = None,
    home: Annotated[Path | None, cyclopts.Parameter(help="state directory (env AENV_HOME)")] = None,
    log_level: str = "info",
    json_logs: Annotated[bool, cyclopts.Parameter(help="one JSON object per log line")] = False,
) -> None:
    """Run a node in the foreground."""
    from aenv.api.server import serve as run_serve
    from aenv.config import Config
    from aenv.kit.tls import TLSSetupError
    from aenv.runtimes.hostclaim import HostConflict

    setup_logging(log_level, json_logs or not sys.stderr.isatty())
    try:
        config = Config.from_env(listen=listen, home=home)
    except ValueError as exc:  # a setting that cannot work: which, and why
        logging.getLogger("aenv.server").error("%s", exc)
        raise SystemExit(2) from None
    try:
        trio.run(run_serve, config)
    # settings that cannot work, or another node holding what this one needs:
    # say what, no trace (exit 2: a restart would not change it)
    except (HostConflict, TLSSetupError) as exc:
        logging.getLogger("aenv.server").error("%s", exc)
        raise SystemExit(2) from None


# -- client commands -----------------------------------------------------------


@Parameter(name="*")
@dataclass
class NodeOptions:
    """Which node to talk to (each overrides AENV_URL/AENV_API_KEY and the credentials file)."""

    url: Annotated[str | None, Parameter(help="node URL, e.g. http://127.0.0.1:8000")] = None
    api_key: Annotated[str | None, Parameter(help="the node's API key")] = None

    def client(self) -> Client:
        return Client(creds_config.resolve(self.url, self.api_key))


_NODE = NodeOptions()


def _complete_sandbox_ids(ctx: Any) -> list[tuple[str, str]]:
    """Live sandbox IDs for shell completion (quietly nothing when the node is away)."""
    try:
        creds = creds_config.resolve()
        with Client(creds, timeout=3.0) as c:
            items = c.list_sandboxes()
    except Exception:
        return []
    prefix = getattr(ctx, "incomplete", "") or ""
    return [
        (str(s.get("sandboxID")), str(s.get("alias") or s.get("templateID", "")))
        for s in items
        if str(s.get("sandboxID", "")).startswith(prefix)
    ]


def _complete_templates(ctx: Any) -> list[tuple[str, str]]:
    try:
        with Client(creds_config.resolve(), timeout=3.0) as c:
            items = c.list_templates()
    except Exception:
        return []
    prefix = getattr(ctx, "incomplete", "") or ""
    out: list[tuple[str, str]] = []
    for t in items:
        for name in [*(t.get("aliases") or []), t.get("templateID")]:
            if isinstance(name, str) and name.startswith(prefix):
                out.append((name, "template"))
    return out


SandboxRef = Annotated[
    str,
    Parameter(help="sandbox ID or an unambiguous prefix of one", completer=_complete_sandbox_ids),
]
TemplateRef = Annotated[str, Parameter(help="template name or ID", completer=_complete_templates)]
Output = Annotated[
    OutputFormat | None,
    Parameter(help="table or json (default: a table on a terminal, JSON when piped)"),
]


def _emit(data: Any, output: OutputFormat | None, as_table: Any) -> None:
    if render.choose_format(output) == "json":
        print(render.dumps(data))
    else:
        print(as_table(data))


def _shell_request() -> ExecRequest:
    envs = {"TERM": os.environ.get("TERM") or "xterm-256color"}
    if os.environ.get("LANG"):
        envs["LANG"] = os.environ["LANG"]
    # bash where the image has it (every E2B template does), else its sh
    login = "command -v bash >/dev/null 2>&1 && exec bash -i -l; exec sh -i -l"
    return ExecRequest("/bin/sh", ["-c", login], envs=envs, pty=True, stdin=True)


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@app.command
def auth(
    *,
    url: Annotated[str | None, Parameter(help="node URL (prompted when omitted)")] = None,
    api_key: Annotated[str | None, Parameter(help="API key (prompted when omitted)")] = None,
    verify: Annotated[bool, Parameter(help="check the key against the node first")] = True,
) -> None:
    """Save the node URL and API key to the credentials file."""
    if url is None:
        default = os.environ.get("AENV_URL") or creds_config.DEFAULT_URL
        if not sys.stdin.isatty():
            raise UsageError("no terminal to prompt on: pass --url and --api-key")
        url = input(f"Node URL [{default}]: ").strip() or default
    if api_key is None:
        if not sys.stdin.isatty():
            raise UsageError("no terminal to prompt on: pass --api-key")
        api_key = getpass.getpass("API key: ").strip()
    if not api_key:
        raise UsageError("the API key is empty")
    creds = creds_config.Credentials(creds_config.normalize_url(url), api_key)
    if verify:
        with Client(creds, timeout=15.0) as c:
            c.request("GET", "/v2/sandboxes", what="auth", params={"limit": "1"})
    path = creds_config.save(creds)
    _note(f"Saved credentials for {creds.url} to {path}")


# -- templates -------------------------------------------------------------------


@template_app.command(name="list", alias="ls")
def template_list(*, output: Output = None, node: NodeOptions = _NODE) -> None:
    """List templates."""
    with node.client() as c:
        _emit(c.list_templates(), output, render.templates_table)


@template_app.command(name="delete", alias="rm")
def template_delete(name: TemplateRef, /, *, node: NodeOptions = _NODE) -> None:
    """Delete a template (refused while sandboxes use it)."""
    with node.client() as c:
        c.delete_template(name)
    _note(f"Deleted template {name}")


@app.command
def pull(
    image: Annotated[str, Parameter(help="OCI image reference")],
    /,
    *,
    name: Annotated[str, Parameter(help="template name to create")],
    cpu: Annotated[int | None, Parameter(help="default vCPUs of the template")] = None,
    memory: Annotated[int | None, Parameter(help="default memory of the template, MB")] = None,
    start_cmd: Annotated[
        str | None,
        Parameter(help="command running in every sandbox of the template (captured running)"),
    ] = None,
    image_cmd: Annotated[
        bool, Parameter(negative="", help="run the image's Entrypoint + Cmd as the start command")
    ] = False,
    ready_cmd: Annotated[
        str | None, Parameter(help="command that succeeds once the start command is ready")
    ] = None,
    detach: Annotated[
        bool,
        Parameter(name=["--detach", "-d"], negative="", help="start the pull, do not wait"),
    ] = False,
    node: NodeOptions = _NODE,
) -> None:
    """Build a template from an OCI image (progress on stderr while it pulls)."""
    if image_cmd and start_cmd:
        raise UsageError("give --start-cmd or --image-cmd, not both")
    with node.client() as c:

        def send(wait: bool = True) -> Any:
            return c.pull(
                image,
                name,
                cpu=cpu,
                memory=memory,
                start_cmd=True if image_cmd else start_cmd,
                ready_cmd=ready_cmd,
                wait=wait,
            )

        if detach:
            send(wait=False)
            print(f"pulling {image} into template {name} on the node", file=sys.stderr)
            return
        result = pull_with_progress(c, image, send, out=sys.stderr)
    print(render.dumps(result) if result is not None else name)


# -- sandboxes ---------------------------------------------------------------------


def _positive(value: int | None, what: str) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{what} must be a positive number")


@app.command
def start(
    template: TemplateRef,
    /,
    *,
    detach: Annotated[
        bool, Parameter(name=["--detach", "-d"], negative="", help="print the ID, do not attach")
    ] = False,
    timeout: Annotated[int | None, Parameter(help="seconds until the sandbox is killed")] = None,
    cpu: Annotated[int | None, Parameter(help="vCPUs (default: the template's)")] = None,
    memory: Annotated[int | None, Parameter(help="memory in MB (default: the template's)")] = None,
    metadata: Annotated[
        list[str] | None, Parameter(help="KEY=VALUE metadata, repeatable", negative="")
    ] = None,
    env: Annotated[
        list[str] | None, Parameter(help="KEY=VALUE environment, repeatable", negative="")
    ] = None,
    node: NodeOptions = _NODE,
) -> int:
    """Start a sandbox and attach a shell to it (killed when the shell exits)."""
    if timeout is not None and timeout < 0:
        raise UsageError("--timeout must be 0 or more seconds")
    _positive(cpu, "--cpu")
    _positive(memory, "--memory")
    meta = _pairs(metadata, "--metadata")
    envs = _pairs(env, "--env")
    c = node.client()
    with c:
        created = c.create_sandbox(
            template, timeout=timeout, metadata=meta, env_vars=envs, cpu=cpu, memory=memory
        )
        sid = str(created["sandboxID"])
        if detach:
            print(sid)
            return 0
        _note(f"Sandbox {sid} started; detach with {DETACH_HELP}, the shell's exit kills it.")
        detached = False
        try:
            result = _attach(c, sid, timeout)
            detached = result.detached
        finally:
            if not detached:
                with contextlib.suppress(CliError):
                    c.kill_sandbox(sid)
        return result.exit_code


def _pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values or []:
        key, sep, val = v.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} takes KEY=VALUE, got {v!r}")
        out[key] = val
    return out


def _attach(c: Client, sid: str, timeout: int | None) -> SessionResult:
    keep = max(60, timeout or 300)
    result = run_attached(c.creds, sid, _shell_request(), refresh=lambda: c.refresh(sid, keep))
    if result.detached:
        _note(f"\r\nDetached from {sid}; it keeps running. Reattach with: aenv cn {sid}")
    return result


@app.command(name="connect", alias="cn")
def connect_(sandbox: SandboxRef, /, *, node: NodeOptions = _NODE) -> int:
    """Attach an interactive shell to a running sandbox."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        c.get_sandbox(sid)
        _note(f"Connected to {sid}; detach with {DETACH_HELP}.")
        return _attach(c, sid, None).exit_code


@app.command(name="exec")
def exec_(
    sandbox: SandboxRef,
    /,
    *command: Annotated[
        str,
        Parameter(
            help="command and arguments (after -- when they start with -)",
            allow_leading_hyphen=True,
        ),
    ],
    tty: Annotated[
        bool, Parameter(name=["--tty", "-t"], negative="", help="run on a pseudo-terminal")
    ] = False,
    interactive: Annotated[
        bool,
        Parameter(
            name=["--interactive", "-i"],
            negative="",
            help="forward stdin even when it is a terminal (it always is when piped)",
        ),
    ] = False,
    cwd: Annotated[str | None, Parameter(help="working directory in the sandbox")] = None,
    user: Annotated[
        str | None, Parameter(help="user to run as (default: the template's, e.g. user)")
    ] = None,
    env: Annotated[
        list[str] | None, Parameter(help="KEY=VALUE environment, repeatable", negative="")
    ] = None,
    node: NodeOptions = _NODE,
) -> int:
    """Run one command in a sandbox, streaming its output; exit with its code."""
    if not command:
        raise UsageError("exec needs a command: aenv exec SANDBOX -- CMD [ARGS...]")
    envs = _pairs(env, "--env")
    if tty:
        envs.setdefault("TERM", os.environ.get("TERM") or "xterm-256color")
    forward_stdin = tty or interactive or not sys.stdin.isatty()
    req = ExecRequest(
        command[0], list(command[1:]), envs=envs, cwd=cwd, user=user, pty=tty, stdin=forward_stdin
    )
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        return run_attached(c.creds, sid, req).exit_code


@app.command(name="list", alias="ls")
def list_(
    *,
    output: Output = None,
    state: Annotated[
        list[Literal["running", "paused", "died"]] | None,
        Parameter(
            help="only sandboxes in this state (repeatable); died: runtimes that stopped "
            "by themselves (a crash, the host out of memory) within the last hour",
            negative="",
        ),
    ] = None,
    all_: Annotated[
        bool,
        Parameter(name="--all", help="running, paused and died sandboxes (and why they died)"),
    ] = False,
    node: NodeOptions = _NODE,
) -> None:
    """List sandboxes."""
    states: list[str] = ["running", "paused", "died"] if all_ else list(state or [])
    with node.client() as c:
        items = c.list_sandboxes(states or None)
    _emit(items, output, render.sandboxes_table)


@app.command
def logs(
    sandbox: SandboxRef,
    /,
    *,
    egress: Annotated[
        bool,
        Parameter(help="only the egress log: each outbound connection the egress proxy decided"),
    ] = False,
    limit: Annotated[int, Parameter(help="at most this many entries")] = 1000,
    output: Output = None,
    node: NodeOptions = _NODE,
) -> None:
    """Show a sandbox's log (lifecycle events; with --egress, its outbound connections)."""
    _positive(limit, "--limit")
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        entries = c.sandbox_logs(sid, limit=limit if not egress else 100_000)
    if egress:
        entries = [e for e in entries if (e.get("fields") or {}).get("kind") == "egress"][-limit:]
    _emit(entries, output, render.egress_table if egress else render.logs_table)


@app.command
def pause(sandbox: SandboxRef, /, *, node: NodeOptions = _NODE) -> None:
    """Pause a sandbox (memory and disk kept, CPU stopped)."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        c.pause(sid)
    _note(f"Paused {sid}")


@app.command
def resume(sandbox: SandboxRef, /, *, node: NodeOptions = _NODE) -> None:
    """Resume a paused sandbox."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        c.resume(sid)
    _note(f"Resumed {sid}")


@app.command(name="timeout")
def timeout_(
    sandbox: SandboxRef,
    seconds: Annotated[int, Parameter(help="seconds from now until the sandbox is killed")],
    /,
    *,
    node: NodeOptions = _NODE,
) -> None:
    """Set when a sandbox expires, counted from now."""
    if seconds < 0:
        raise UsageError("the timeout must be 0 or more seconds")
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        c.set_timeout(sid, seconds)
    _note(f"{sid} now expires in {seconds} s")


@app.command(name="delete", alias="rm")
def delete(*sandboxes: SandboxRef, node: NodeOptions = _NODE) -> int:
    """Kill sandboxes."""
    if not sandboxes:
        raise UsageError("delete needs at least one sandbox ID")
    first_error = 0
    with node.client() as c:
        for ref in sandboxes:
            try:
                sid = c.resolve_sandbox(ref)
                c.kill_sandbox(sid)
                print(sid)
            except CliError as e:
                _report(e)
                first_error = first_error or e.exit_code
    return first_error


@app.command
def fork(
    sandbox: SandboxRef,
    /,
    *,
    count: Annotated[int, Parameter(help="number of copies")] = 1,
    node: NodeOptions = _NODE,
) -> None:
    """Fork a running sandbox into copies."""
    _positive(count, "--count")
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        result = c.fork(sid, count)
    print(render.dumps(result))


@snapshot_app.command(name="create")
def snapshot_create(
    sandbox: SandboxRef,
    /,
    *,
    name: Annotated[str | None, Parameter(help="snapshot name")] = None,
    node: NodeOptions = _NODE,
) -> None:
    """Snapshot a sandbox."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        result = c.create_snapshot(sid, name)
    print(render.dumps(result))


@snapshot_app.command(name="list", alias="ls")
def snapshot_list(*, output: Output = None, node: NodeOptions = _NODE) -> None:
    """List snapshots."""
    with node.client() as c:
        _emit(c.list_snapshots(), output, render.snapshots_table)


@snapshot_app.command(name="delete", alias="rm")
def snapshot_delete(snapshot: str, /, *, node: NodeOptions = _NODE) -> None:
    """Delete a snapshot."""
    with node.client() as c:
        c.delete_snapshot(snapshot)
    _note(f"Deleted snapshot {snapshot}")


# -- cluster -----------------------------------------------------------------------


@cluster_app.command(name="members")
def cluster_members(*, output: Output = None, node: NodeOptions = _NODE) -> None:
    """List the cluster's nodes: id, URL, state, incarnation and load."""
    with node.client() as c:
        _emit(c.cluster_members(), output, render.members_table)


@node_app.command(name="drain")
def node_drain(
    target: Annotated[
        str | None,
        Parameter(name="NODE", help="the node to drain (default: the one the CLI talks to)"),
    ] = None,
    *,
    output: Output = None,
    node: NodeOptions = _NODE,
) -> None:
    """Move every sandbox of a node to the others (running ones keep their memory
    and processes), then the node leaves the cluster."""
    with node.client() as c:
        report = c.drain(target or "self")
    _emit(report, output, render.drain_summary)
    if report.get("failed"):
        raise SystemExit(1)  # the node stays in the cluster with what did not move


# -- files -----------------------------------------------------------------------


@app.command
def upload(
    sandbox: SandboxRef,
    local: Annotated[str, Parameter(help="local file, or - for stdin", allow_leading_hyphen=True)],
    remote: Annotated[str, Parameter(help="path in the sandbox")],
    /,
    *,
    node: NodeOptions = _NODE,
) -> None:
    """Copy a local file into a sandbox."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        if local == "-":
            entries = c.upload(sid, sys.stdin.buffer, remote)
        else:
            try:
                f = open(local, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                raise NotFound(f"upload: local file {local!r} not found") from None
            except OSError as e:
                raise CliError(f"upload: cannot read {local!r}: {e.strerror}") from None
            with f:
                if not Path(local).is_file():
                    raise UsageError(f"upload: {local!r} is not a regular file")
                entries = c.upload(sid, f, remote, size=os.fstat(f.fileno()).st_size)
    for entry in entries:
        print(entry.get("path", remote))


@app.command
def download(
    sandbox: SandboxRef,
    remote: Annotated[str, Parameter(help="path in the sandbox")],
    local: Annotated[
        str | None, Parameter(help="local path, or - for stdout", allow_leading_hyphen=True)
    ] = None,
    /,
    *,
    node: NodeOptions = _NODE,
) -> None:
    """Copy a file out of a sandbox."""
    with node.client() as c:
        sid = c.resolve_sandbox(sandbox)
        if local == "-":
            out = sys.stdout.buffer
            c.download(sid, remote, out.write)
            out.flush()
            return
        target = Path(local) if local else Path(Path(remote).name or "download")
        if target.is_dir():
            target = target / (Path(remote).name or "download")
        tmp = target.with_name(f".{target.name}.aenv-partial")
        try:
            with open(tmp, "wb") as f:
                n = c.download(sid, remote, f.write)
            os.replace(tmp, target)
        except OSError as e:
            raise CliError(f"download: cannot write {str(target)!r}: {e.strerror}") from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    _note(f"{remote} -> {target} ({n} bytes)")


# -- completion ------------------------------------------------------------------


@app.command
def completion(shell: Literal["bash", "zsh", "fish"], /) -> None:
    """Print the shell completion script (e.g. `eval "$(aenv completion bash)"`)."""
    print(app.generate_completion(prog_name="aenv", shell=shell))


# -- entry point -----------------------------------------------------------------


def _report(e: CliError) -> None:
    print(f"aenv: {e.message}", file=sys.stderr, flush=True)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.strip(" │╭╮╰╯─\t")
        if line and line.lower() != "error":
            return line
    return text.strip() or "invalid arguments"


def main(argv: list[str] | None = None) -> None:
    tokens = sys.argv[1:] if argv is None else argv
    try:
        result = app(tokens, exit_on_error=False, print_error=False, result_action="return_value")
    except cyclopts.CycloptsError as e:
        print(f"aenv: {_first_line(str(e))} (see aenv --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except CliError as e:
        _report(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("aenv: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - quiet the flush at exit
        sys.exit(141)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)
