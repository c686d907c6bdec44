"""The single-node SDK and CLI suites through a cluster of three nodes.

The Python SDK's (tests/e2e/test_sdk.py), the npm SDK's
(tests/e2e/test_js_sdk.py), the CLI's (tests/e2e/test_cli.py) and template
builds (tests/e2e/test_template_build.py: a template built through node-a on
whichever node runs the build is found and started through any node).

Rules: the same tests, unchanged; the `node` they get is node-a of a
three-node cluster (tests/e2e/cluster.py), so their sandboxes are placed on
any node and every call about them reaches the owner through node-a.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import NodeProc
from tests.e2e.cluster import three_nodes
from tests.e2e.test_cli import *  # noqa: F403  (the tests, collected again here)
from tests.e2e.test_js_sdk import test_js_sdk  # noqa: F401
from tests.e2e.test_sdk import *  # noqa: F403
from tests.e2e.test_template_build import *  # noqa: F403


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    with three_nodes(tmp_path_factory.mktemp("sdk-cluster")) as c:
        c.wait_members({n: "alive" for n in c.nodes})
        yield c.nodes["node-a"]
