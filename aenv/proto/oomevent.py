"""The line envd writes to a sandbox's console when it kills a process for memory.

envd (`aenv.envd.guard`) is the sandbox's OOM killer; the node reads its
console to turn each kill into a sandbox log entry and a metric. One kill is
one line: `OOM_MARK` and a JSON object. `format_kill` writes it, `parse_kills`
finds the kills in a chunk of console text (other lines and garbage are
skipped: the console is also the guest's to write to).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OOM_MARK = "aenv-oom "


@dataclass(frozen=True)
class OomKill:
    pid: int
    name: str
    rss_bytes: int
    memory_bytes: int
    time: float

    def describe(self) -> str:
        return (
            f"out of memory: killed process {self.pid} ({self.name}), "
            f"{self.rss_bytes >> 20} MiB resident, sandbox memory {self.memory_bytes >> 20} MiB"
        )


def format_kill(kill: OomKill) -> str:
    return OOM_MARK + json.dumps(
        {
            "pid": kill.pid,
            "name": kill.name,
            "rssBytes": kill.rss_bytes,
            "memoryBytes": kill.memory_bytes,
            "time": kill.time,
        }
    )


def parse_kills(text: str) -> list[OomKill]:
    found: list[OomKill] = []
    for line in text.splitlines():
        if not line.startswith(OOM_MARK):
            continue
        try:
            doc = json.loads(line[len(OOM_MARK) :])
            kill = OomKill(
                pid=int(doc["pid"]),
                name=str(doc["name"])[:64],
                rss_bytes=int(doc["rssBytes"]),
                memory_bytes=int(doc["memoryBytes"]),
                time=float(doc["time"]),
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
        found.append(kill)
    return found
