"""The `aenv` command (cyclopts): parse arguments, build a Config, run.

No logic lives here; `aenv serve` runs a node (what `make serve` ends with).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import cyclopts
import trio

from aenv import __version__

app = cyclopts.App(name="aenv", version=__version__, help="Self-hosted E2B-compatible sandboxes.")


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

    setup_logging(log_level, json_logs or not sys.stderr.isatty())
    config = Config.from_env(listen=listen, home=home)
    trio.run(run_serve, config)


def main() -> None:
    app()
