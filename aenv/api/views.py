"""JSON views of sandboxes and templates, shaped as the E2B SDK models expect."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aenv.node.sandbox import LogEntry, SandboxActor
from aenv.proto.envd_schema import ENVD_VERSION
from aenv.runtimes.base import Usage
from aenv.storage.templates import Template

CLIENT_ID = "aenv"


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat().replace("+00:00", "Z")


PAUSED_STATES = frozenset({"pausing", "paused", "resuming"})


def api_state(a: SandboxActor) -> str:
    # E2B knows only running and paused; creating/stopping sandboxes are not listed.
    return "paused" if a.state.value in PAUSED_STATES else "running"


def sandbox_created(a: SandboxActor, domain: str | None) -> dict[str, Any]:
    return {
        "templateID": a.template.template_id,
        "sandboxID": a.sandbox_id,
        "alias": a.template.aliases[0] if a.template.aliases else a.template.template_id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": a.envd_access_token,
        "trafficAccessToken": None if a.allow_public_traffic else a.traffic_access_token,
        "domain": domain,
    }


def _common(a: SandboxActor) -> dict[str, Any]:
    d: dict[str, Any] = {
        "templateID": a.template.template_id,
        "sandboxID": a.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": iso(a.started_at),
        "endAt": iso(a.end_at()),
        "cpuCount": a.cpu_count,
        "memoryMB": a.memory_mb,
        "diskSizeMB": a.template.disk_size_mb,
        "state": api_state(a),
        "envdVersion": ENVD_VERSION,
        "metadata": a.metadata,
    }
    if a.template.aliases:
        d["alias"] = a.template.aliases[0]
    return d


def sandbox_listed(a: SandboxActor) -> dict[str, Any]:
    return _common(a)


def sandbox_detail(a: SandboxActor, domain: str | None) -> dict[str, Any]:
    d = _common(a)
    network = a.policy.to_api()
    network["allowPublicTraffic"] = a.allow_public_traffic
    d.update(
        {
            "envdAccessToken": a.envd_access_token,
            "allowInternetAccess": a.allow_internet_access,
            "domain": domain,
            "network": network,
            "lifecycle": {
                "autoResume": a.auto_resume,
                "onTimeout": "pause" if a.auto_pause else "kill",
            },
            # aenv extension: a paused sandbox still in memory (resumes in
            # milliseconds) or written to disk (survives a node crash)
            "pausedInMemory": a.paused_in_memory,
        }
    )
    if a.state.value == "paused":
        d["pauseMode"] = a.pause_mode
    return d


def metric(a: SandboxActor, u: Usage, ts: float, disk_used: int) -> dict[str, Any]:
    return {
        "timestamp": iso(ts),
        "timestampUnix": int(ts),
        "cpuCount": a.cpu_count,
        "cpuUsedPct": round(u.cpu_used_pct, 2),
        "memUsed": u.mem_used_bytes,
        "memTotal": u.mem_total_bytes,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": a.template.disk_size_mb * 1024 * 1024,
    }


def log_entry(e: LogEntry) -> dict[str, Any]:
    return {
        "timestamp": iso(e.timestamp),
        "message": e.message,
        "level": e.level,
        "fields": e.fields,
    }


def template_with_builds(t: Template) -> dict[str, Any]:
    d = t.to_api()
    d["builds"] = [
        {
            "buildID": t.build_id,
            "status": "ready",
            "createdAt": iso(t.created_at),
            "updatedAt": iso(t.updated_at),
            "finishedAt": iso(t.updated_at),
            "cpuCount": t.cpu_count,
            "memoryMB": t.memory_mb,
            "diskSizeMB": t.disk_size_mb,
            "envdVersion": ENVD_VERSION,
        }
    ]
    return d
