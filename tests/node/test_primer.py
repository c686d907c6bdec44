"""A node does its once-per-process work as it starts (aenv.node.primer).

Rules: real runsc for the flag probe, real moto for the store; what a start
must never do is fail or hang because a warm-up could not be done.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from aenv.node import primer
from aenv.runtimes.gvisor import GVisorRuntime
from tests.s3 import MotoS3, s3_store


@pytest.fixture
def moto() -> Iterator[MotoS3]:
    """A moto S3 server of the test's own (one test stops it)."""
    server = MotoS3(bucket="aenv-primer")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("runsc") is None, reason="needs runsc")
async def test_prime_asks_runsc_what_the_first_start_and_checkpoint_would(
    tmp_path: Path,
) -> None:
    rt = GVisorRuntime(runsc=shutil.which("runsc") or "runsc", state_root=tmp_path / "s")
    await primer.prime(rt)
    # the answers a first start and a first checkpoint would have asked for
    assert rt.net_disconnect_ok is rt._knows_net_disconnect_ok()
    assert rt.exclude_zero_pages is rt._knows_zero_page_exclusion()


async def test_a_runsc_that_cannot_run_does_not_stop_a_start(tmp_path: Path) -> None:
    rt = GVisorRuntime(runsc=str(tmp_path / "no-runsc"), state_root=tmp_path / "s")
    with trio.fail_after(10):
        await primer.prime(rt)
    # unknown: the first start asks again (and fails as it always did)
    assert rt.net_disconnect_ok is None and rt.exclude_zero_pages is None


async def test_a_configured_flag_is_kept(tmp_path: Path) -> None:
    rt = GVisorRuntime(
        runsc=str(tmp_path / "no-runsc"), state_root=tmp_path / "s", net_disconnect_ok=False
    )
    await primer.prime(rt)
    assert rt.net_disconnect_ok is False


async def test_warm_store_opens_connections_without_writing(moto: MotoS3) -> None:
    store = s3_store(moto)
    await primer.warm_store(store)
    stats = store.statistics()
    assert (stats.requests, stats.errors, stats.bytes_uploaded) == (
        primer.WARM_CONNECTIONS,
        0,
        0,
    )
    assert await store.list() == []


async def test_warm_store_gives_up_quietly_on_a_store_that_is_down(moto: MotoS3) -> None:
    store = s3_store(moto)
    moto.stop()
    with trio.fail_after(primer.WARM_TIMEOUT_S + 5):
        await primer.warm_store(store)  # no error: the first restore meets it, as before
    assert store.statistics().errors > 0
