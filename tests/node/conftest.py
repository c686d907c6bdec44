"""Fixtures for the in-process node tests (tests/fakes/node.py says how they work).

Rules: the node is the real `Node` and its sandbox actors on a `FakeHost`
(no root, no runsc, no network), in pytest's temp dir, on trio's MockClock.
A test that asks for `clock` also asks for `autojump` (or for `node`, which
does), which advances it whenever everything waits and no thread runs;
`autojump.until(predicate)` waits for a state without moving the clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from aenv.config import Config
from aenv.node.node import Node
from tests.fakes.host import FakeHost
from tests.fakes.node import AutoJump, node_config, open_test_node


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock()


@pytest.fixture
async def autojump(
    clock: trio.testing.MockClock, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> AutoJump:
    jumper = AutoJump(clock)
    monkeypatch.setattr(
        trio.to_thread, "run_sync", jumper.threads.counting(trio.to_thread.run_sync)
    )
    nursery.start_soon(jumper.run)
    return jumper


@pytest.fixture
def fake() -> FakeHost:
    return FakeHost()


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return node_config(tmp_path)


@pytest.fixture
async def node(autojump: AutoJump, config: Config, fake: FakeHost) -> AsyncIterator[Node]:
    async with open_test_node(config, fake) as node:
        yield node
