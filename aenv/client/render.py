"""Output of listings: an aligned table for people, JSON for programs.

`choose_format` picks a table when stdout is a TTY and JSON when it is
piped, unless the user said which. Tables show times relative to now.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any, Literal

OutputFormat = Literal["table", "json"]


def choose_format(requested: OutputFormat | None) -> OutputFormat:
    if requested is not None:
        return requested
    return "table" if sys.stdout.isatty() else "json"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines
    )


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _span(seconds: float) -> str:
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def ago(value: Any, now: dt.datetime | None = None) -> str:
    t = _parse_time(value)
    if t is None:
        return "-"
    now = now or dt.datetime.now(dt.UTC)
    return _span((now - t).total_seconds()) + " ago"


def until(value: Any, now: dt.datetime | None = None) -> str:
    t = _parse_time(value)
    if t is None:
        return "-"
    now = now or dt.datetime.now(dt.UTC)
    left = (t - now).total_seconds()
    return "in " + _span(left) if left > 0 else "now"


def sandboxes_table(items: Sequence[dict[str, Any]], now: dt.datetime | None = None) -> str:
    rows = [
        [
            str(s.get("sandboxID", "")),
            str(s.get("alias") or s.get("templateID", "")),
            str(s.get("state", "")),
            ago(s.get("startedAt"), now),
            "-" if s.get("state") == "died" else until(s.get("endAt"), now),
            str(s.get("cpuCount", "")),
            f"{s.get('memoryMB', '')}",
            ",".join(f"{k}={v}" for k, v in sorted((s.get("metadata") or {}).items())),
        ]
        for s in items
    ]
    heads = ["SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "CPU", "MEM MB", "METADATA"]
    if any(s.get("reason") for s in items):  # died ones: why (`aenv list --all`)
        heads.append("REASON")
        for row, s in zip(rows, items, strict=True):
            row.append(str(s.get("reason") or ""))
    return table(heads, rows)


def templates_table(items: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            str(t.get("templateID", "")),
            ",".join(str(a) for a in (t.get("aliases") or [])),
            str(t.get("cpuCount", "")),
            str(t.get("memoryMB", "")),
            str(t.get("diskSizeMB", "")),
            str(t.get("buildStatus", "ready") or "ready"),
        ]
        for t in items
    ]
    return table(["TEMPLATE ID", "ALIASES", "CPU", "MEM MB", "DISK MB", "STATUS"], rows)


def snapshots_table(items: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            str(s.get("snapshotID", s.get("id", ""))),
            str(s.get("name", "")),
            str(s.get("sandboxID", "")),
            ago(s.get("createdAt")),
        ]
        for s in items
    ]
    return table(["SNAPSHOT ID", "NAME", "FROM SANDBOX", "CREATED"], rows)


def logs_table(items: Sequence[dict[str, Any]]) -> str:
    """Log entries as `TIME LEVEL MESSAGE` lines (no header: a log reads as one)."""
    return "\n".join(
        f"{e.get('timestamp', '')}  {str(e.get('level', '')).upper():5}  {e.get('message', '')}"
        for e in items
    )


def egress_table(items: Sequence[dict[str, Any]]) -> str:
    """Egress entries (`aenv logs --egress`): one connection a row."""
    rows = []
    for e in items:
        f = e.get("fields") or {}
        rows.append(
            [
                str(e.get("timestamp", "")),
                str(f.get("verdict", "")),
                str(f.get("host", "") or "-"),
                f"{f.get('ip', '')}:{f.get('port', '')}",
                str(f.get("bytesOut", "")),
                str(f.get("bytesIn", "")),
                str(f.get("reason", "")),
            ]
        )
    return table(["TIME", "VERDICT", "HOST", "ADDRESS", "OUT B", "IN B", "REASON"], rows)


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f}" if isinstance(n, int | float) else "-"


def members_table(items: Sequence[dict[str, Any]]) -> str:
    rows = []
    for m in items:
        raw = m.get("load")
        load: dict[str, Any] = raw if isinstance(raw, dict) else {}
        sandboxes = f"{load.get('sandboxes', '-')}/{load.get('maxSandboxes', '-')}"
        memory = f"{_gib(load.get('memFree'))}/{_gib(load.get('memTotal'))}"
        state = str(m.get("state", ""))
        if load.get("draining"):
            state += " (draining)"
        rows.append(
            [
                str(m.get("nodeID", "")),
                str(m.get("url", "")),
                state,
                str(m.get("incarnation", "")),
                sandboxes,
                memory,
                str(load.get("cpuLoad", "-")),
            ]
        )
    return table(["NODE", "URL", "STATE", "INC", "SANDBOXES", "MEM FREE GiB", "LOAD"], rows)


def drain_summary(report: dict[str, Any]) -> str:
    lines = [
        f"node {report.get('nodeID', '?')}: {report.get('moved', 0)} running sandboxes moved, "
        f"{report.get('rehomed', 0)} paused ones rehomed in {report.get('seconds', 0)}s"
    ]
    moves = report.get("sandboxes")
    if isinstance(moves, list) and moves:
        rows = [
            [
                str(m.get("sandboxID", "")),
                str(m.get("to", "")),
                "running" if m.get("running") else "paused",
                str(m.get("seconds", "")),
            ]
            for m in moves
            if isinstance(m, dict)
        ]
        lines.append(table(["SANDBOX", "TO", "STATE", "SECONDS"], rows))
    failed = report.get("failed")
    if isinstance(failed, dict):
        lines += [f"failed: {sid}: {why}" for sid, why in failed.items()]
    return "\n".join(lines)


def dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False)
