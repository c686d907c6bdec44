"""A process whose state shows through a pause, fork or snapshot.

COUNTER is a shell loop writing an increasing number to /tmp/counter every
0.1 s (atomically: write, then rename). After a full restore it goes on from where it stopped, so a value that
keeps rising from above zero shows the process itself came back.
"""

from __future__ import annotations

import time

from e2b import Sandbox

# written to a temporary file and renamed: a capture taken mid-write must not
# leave an empty counter behind (that would read as 0)
COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.tmp; "
    "mv /tmp/counter.tmp /tmp/counter; sleep 0.1; done"
)


def count(s: Sandbox) -> int:
    return int(s.files.read("/tmp/counter").strip() or 0)


def counts_on(s: Sandbox, limit: float = 10.0) -> int:
    """The counter's value once it has moved on (it must, within `limit` s)."""
    # a counter just started may not have written its first value yet
    first = count(s) if s.files.exists("/tmp/counter") else 0
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if count(s) > first:
            return first
    raise AssertionError(f"the counter is stuck at {first}")
