"""A create whose host side fails answers what failed in words, never a raw tool dump.

Rules: pure; the errors are built as the network, overlay and runtime layers
raise them (a tool's whole stderr in the message), and `setup_error` is what
the sandbox service answers a create with.
"""

from __future__ import annotations

from aenv.node import service as sv
from aenv.runtimes.gvisor import GVisorError
from aenv.runtimes.netns import NetworkSetupError
from aenv.storage.overlay import OverlayError

NFT_DUMP = (
    "installing its firewall rules failed (nft: Error: Could not process rule: No such file "
    "or directory)\nadd chain inet aenv1a2b3c slot3\n^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^"
)


def test_a_network_failure_says_what_failed_and_is_a_500() -> None:
    e = sv.setup_error(NetworkSetupError(NFT_DUMP), network_repairing=False)
    assert isinstance(e, sv.Failed)
    assert e.message == (
        "the node's network could not be set up for the sandbox: installing its firewall "
        "rules failed (nft: Error: Could not process rule: No such file or directory)"
    )


def test_while_the_node_repairs_its_network_a_create_is_told_to_retry() -> None:
    e = sv.setup_error(NetworkSetupError(NFT_DUMP), network_repairing=True)
    assert isinstance(e, sv.Unavailable) and e.retry_after == sv.REPAIR_RETRY_S
    assert e.message.startswith("the node's network could not be set up for the sandbox: ")
    assert e.message.endswith("the node is repairing its network, retry shortly")


def test_overlay_and_runtime_failures_are_told_apart() -> None:
    e = sv.setup_error(OverlayError("mount: too many lower layers\nmore"), network_repairing=True)
    assert isinstance(e, sv.Failed)
    assert (
        e.message == "the sandbox's file system could not be mounted: mount: too many lower layers"
    )
    e = sv.setup_error(
        GVisorError("runsc create: exit 128\n" + "x" * 5000), network_repairing=False
    )
    assert e.message == "the sandbox's runtime could not start it: runsc create: exit 128"
