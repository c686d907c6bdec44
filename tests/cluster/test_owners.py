"""`Owners`: which sandboxes here may be another node's before their claim is settled.

Rules: real `Ownership` on a `file://` store under the test's temp dir, on a
`MockClock` (as in test_leases.py); the node's sandboxes are a dict the test
changes; a reconcile is called directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trio.testing import MockClock

from aenv.cluster.leases import open_ownership
from aenv.cluster.owners import Owners
from tests.cluster.test_leases import SLOW, dir_store


@pytest.fixture
def clock() -> MockClock:
    return MockClock(autojump_threshold=0.1)


async def test_only_what_was_here_when_the_epoch_began_is_doubtful(
    tmp_path: Path, clock: MockClock
) -> None:
    store = dir_store(tmp_path)
    async with open_ownership(store, node="b", timing=SLOW) as b:
        await b.claim("taken", state="running")  # b took it while a was away
        async with open_ownership(store, node="a", timing=SLOW) as first:
            await first.claim("mine", state="running")
        # a restarts: both copies are back here
        async with open_ownership(store, node="a", timing=SLOW, resume=True) as a:
            here = {"mine": "running", "taken": "paused"}
            stopped: list[str] = []
            owners = Owners(a, local=lambda: here, stop=lambda sid, why: stopped.append(sid))
            # before the epoch's first reconcile nothing here is known to be a's
            assert owners.doubtful("mine") and owners.doubtful("taken")
            await owners.reconcile()
            assert not owners.doubtful("mine") and a.grant("mine") is not None
            # another node's: stopped, and never served here meanwhile
            assert stopped == ["taken"] and owners.doubtful("taken")
            # a sandbox made now is a's before its claim is written
            here["new"] = "running"
            assert a.grant("new") is None and not owners.doubtful("new")
            await owners.reconcile()
            assert a.grant("new") is not None and not owners.doubtful("new")
            # gone from here: forgotten
            del here["taken"]
            await owners.reconcile()
            assert not owners.doubtful("taken")
