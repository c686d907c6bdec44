"""Fault points: where crash tests kill the node mid-operation.

`crash_point("pause.frozen")` does nothing unless the environment variable
`AENV_FAULT` names that point (a comma-separated list), in which case the
process kills itself with SIGKILL there, as an OOM kill or a power cut
would, leaving files, mounts, runtimes and records exactly as they are at
that line. Tests arm a point, drive an operation into it, and check that a
restarted node takes back whole sandboxes or none (tests/e2e/test_crash_matrix.py).
Unarmed, a point costs one set lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("aenv.faults")

_ARMED = frozenset(p.strip() for p in os.environ.get("AENV_FAULT", "").split(",") if p.strip())


def crash_point(name: str) -> None:
    """Die here, at once and uncleanly, if `AENV_FAULT` arms `name`."""
    if name in _ARMED:
        log.critical("fault point %s: killing the node", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
