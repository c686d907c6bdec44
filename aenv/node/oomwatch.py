"""Follow a sandbox's console for the kills of its OOM killer (envd).

envd writes one line per process it kills for memory (`aenv.proto.oomevent`)
to its console, which the runtime appends to the sandbox's console log on
the host. `follow_kills` looks at the file's size once a second and reads
what was appended since its last look, handing every kill to `on_kill` (the
sandbox actor logs it and counts it in `/metrics`). It starts at the file's
end: kills before a node restart were reported by the node that saw them.

The size is a `stat` of a file in the node's own home, on the event loop (a
few microseconds, against tens for a worker thread's handoff: every running
sandbox pays this once a second); the read, when there is one, runs in a
worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import trio

from aenv.proto.oomevent import OOM_MARK, OomKill, parse_kills

POLL_S = 1.0
# at most this much of the console is read per look (a chatty guest cannot make the node read without end)
READ_MAX = 1 << 20


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_from(path: Path, offset: int) -> tuple[str, int]:
    """The whole lines appended to `path` after `offset`, and the offset after them."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < offset:  # truncated or replaced: start again
                offset = 0
            if size - offset > READ_MAX:
                offset = size - READ_MAX
            f.seek(offset)
            data = f.read(READ_MAX)
    except OSError:
        return "", offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace"), offset + end


async def follow_kills(
    path: Path,
    on_kill: Callable[[OomKill], None],
    *,
    poll_s: float = POLL_S,
    start: int | None = None,
) -> None:
    """Forever: report the kills appended to the console log at `path` after
    offset `start` (None: its current end)."""
    offset = _size(path) if start is None else start
    while True:
        await trio.sleep(poll_s)
        if _size(path) == offset:
            continue
        text, offset = await trio.to_thread.run_sync(read_from, path, offset)
        if OOM_MARK in text:
            for kill in parse_kills(text):
                on_kill(kill)
