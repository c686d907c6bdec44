"""Fixtures for the cluster tests: a lab of real nodes (tests/cluster/lab.py).

`lab` is the module's lab, healthy at the start of every test (faults
cleared, paused nodes continued, stopped or crashed nodes started again on
their homes); its nodes and their sandboxes live for the whole module. A
module chooses its lab with a mark, as keyword arguments of `open_lab`:

    pytestmark = pytest.mark.lab(nodes=3, store="file", env={"AENV_POOL_SIZE": "0"})

The module's last test fails in teardown if a node did not exit cleanly or
left anything behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster.lab import Lab, open_lab
from tests.conftest import built_home


@pytest.fixture(scope="module")
def lab_module(request: pytest.FixtureRequest) -> Iterator[Lab]:
    if os.geteuid() != 0 or built_home() is None:
        pytest.skip("needs root and AENV_TEST_HOME built by `make test`")
    mark = request.node.get_closest_marker("lab")
    options = dict(mark.kwargs) if mark is not None else {}
    with open_lab(**options) as lab:
        yield lab
    assert lab.closed is not None
    codes, left = lab.closed
    failed = {i: code for i, code in codes.items() if code != 0}
    if failed or left:
        for node in lab.nodes:
            print(f"--- node {node.index} ---\n{node.log_tail()}")
    assert not failed, f"nodes exited with {failed}"
    assert not left, f"the lab's nodes left behind: {left}"


@pytest.fixture
def lab(lab_module: Lab) -> Lab:
    """The module's lab, healthy: no faults, every node running."""
    lab_module.reset()
    return lab_module
