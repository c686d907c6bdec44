"""JSON views of sandboxes and templates, shaped as the E2B SDK models expect."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aenv.node.service import PAUSED, LogEntry, SandboxInfo, SandboxMetrics, SnapshotInfo
from aenv.proto.envd_schema import ENVD_VERSION
from aenv.storage.templates import Template


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat().replace("+00:00", "Z")


def api_state(a: SandboxInfo) -> str:
    # E2B knows only running and paused; creating/stopping sandboxes are not listed.
    # "died" (aenv's) is listed only when asked for by name (`state=died`).
    if a.died is not None:
        return "died"
    return "paused" if a.state in PAUSED else "running"


def sandbox_created(a: SandboxInfo, domain: str | None) -> dict[str, Any]:
    return {
        "templateID": a.template_id,
        "sandboxID": a.sandbox_id,
        "alias": a.alias or a.template_id,
        "clientID": a.node,
        "envdVersion": a.envd_version,
        "envdAccessToken": a.envd_access_token,
        "trafficAccessToken": None if a.allow_public_traffic else a.traffic_access_token,
        "domain": domain,
    }


def _common(a: SandboxInfo) -> dict[str, Any]:
    d: dict[str, Any] = {
        "templateID": a.template_id,
        "sandboxID": a.sandbox_id,
        "clientID": a.node,
        "startedAt": iso(a.started_at),
        "endAt": iso(a.end_at),
        "cpuCount": a.cpu_count,
        "memoryMB": a.memory_mb,
        "diskSizeMB": a.disk_size_mb,
        "state": api_state(a),
        "envdVersion": a.envd_version,
        "metadata": dict(a.metadata),
        "volumeMounts": [dict(m) for m in a.volume_mounts],
    }
    if a.alias is not None:
        d["alias"] = a.alias
    if a.died is not None:  # aenv extension: when and why it died (its endAt: when)
        d["reason"] = a.died
    return d


def sandbox_listed(a: SandboxInfo) -> dict[str, Any]:
    return _common(a)


def sandbox_detail(a: SandboxInfo, domain: str | None) -> dict[str, Any]:
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
    if a.state == "paused":
        d["pauseMode"] = a.pause_mode
    if a.policy.iam_tokens:
        # E2B's `SandboxIam`: token definitions only (a minted token is never stored)
        d["iam"] = {
            "tokens": {n: {"audience": aud, "tokenType": t} for n, aud, t in a.policy.iam_tokens}
        }
    return d


def metric(m: SandboxMetrics) -> dict[str, Any]:
    return {
        "timestamp": iso(m.timestamp),
        "timestampUnix": int(m.timestamp),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": round(m.cpu_used_pct, 2),
        "memUsed": m.mem_used_bytes,
        "memTotal": m.mem_total_bytes,
        "memCache": 0,
        "diskUsed": m.disk_used_bytes,
        "diskTotal": m.disk_total_bytes,
    }


def log_entry(e: LogEntry) -> dict[str, Any]:
    return {
        "timestamp": iso(e.timestamp),
        "message": e.message,
        "level": e.level,
        "fields": dict(e.fields),
    }


def snapshot(s: SnapshotInfo) -> dict[str, Any]:
    return {
        "snapshotID": s.snapshot_id,
        "names": list(s.names),
        "storage": s.storage,  # aenv extension: local|uploading|durable
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
