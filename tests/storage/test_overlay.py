"""Writable roots as host overlayfs mounts, and their removal.

Rules: every layer and workdir lives in `tmp_path`; mounting needs root, so
these tests are marked runsc like the other root-only tests. After each
block, the test checks /proc/mounts for anything under `tmp_path`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from aenv.storage.overlay import (
    MAX_MOUNT_OPTIONS,
    OverlayError,
    mount_options,
    open_writable_root,
    reap_stale_mounts,
)

pytestmark = pytest.mark.runsc


@pytest.fixture(autouse=True)
def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")


def mounts_under(path: Path) -> list[str]:
    return [m for m in Path("/proc/mounts").read_text().splitlines() if str(path) in m]


def make_layer(path: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    path.mkdir(parents=True, exist_ok=True)
    return path


async def test_writes_land_in_upper_and_layers_stay_untouched(tmp_path: Path) -> None:
    base = make_layer(tmp_path / "l0", {"etc/os": "base", "etc/gone": "x", "bin/a": "a"})
    top = make_layer(tmp_path / "l1", {"etc/os": "top"})
    work = tmp_path / "sbx"
    async with open_writable_root([top, base], work) as root:
        assert root == work / "merged"
        assert (root / "etc" / "os").read_text() == "top"  # first lower wins
        assert (root / "bin" / "a").read_text() == "a"
        (root / "etc" / "os").write_text("changed")
        (root / "new").write_text("new")
        (root / "etc" / "gone").unlink()
        assert (work / "upper" / "new").read_text() == "new"
        assert (work / "upper" / "etc" / "os").read_text() == "changed"
        assert (work / "upper" / "etc" / "gone").is_char_device()  # whiteout
        assert mounts_under(work)
    assert (base / "etc" / "os").read_text() == "base"
    assert (top / "etc" / "os").read_text() == "top"
    assert (base / "etc" / "gone").exists()
    assert not (base / "new").exists()
    assert mounts_under(tmp_path) == []
    assert not work.exists()


async def test_cancellation_unmounts_and_removes(tmp_path: Path) -> None:
    lower = make_layer(tmp_path / "l0", {"f": "x"})
    work = tmp_path / "sbx"
    with trio.move_on_after(5) as scope:
        async with open_writable_root([lower], work) as root:
            (root / "g").write_text("y")
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert mounts_under(tmp_path) == []
    assert not work.exists()


async def test_busy_mount_is_detached_lazily(tmp_path: Path) -> None:
    lower = make_layer(tmp_path / "l0", {"f": "x"})
    work = tmp_path / "sbx"
    async with open_writable_root([lower], work) as root:
        holder = await trio.lowlevel.open_process(["sleep", "60"], cwd=root)
    try:
        assert mounts_under(tmp_path) == []
        assert not work.exists()
    finally:
        holder.kill()
        await holder.wait()


async def test_many_long_layer_paths_fit_through_relative_options(tmp_path: Path) -> None:
    deep = tmp_path / ("layer-store-" + "x" * 60) / "sha256"
    lowers = [make_layer(deep / f"{i:064x}", {f"f{i}": str(i)}) for i in range(60)]
    absolute = sum(len(str(p)) + 1 for p in lowers)
    assert absolute > MAX_MOUNT_OPTIONS  # would not fit as absolute paths
    async with open_writable_root(lowers, deep / "sbx") as root:
        assert (root / "f0").read_text() == "0"
        assert (root / "f59").read_text() == "59"
    assert mounts_under(tmp_path) == []


def test_too_many_layers_is_a_clear_error(tmp_path: Path) -> None:
    lowers = [tmp_path / "a" / f"{i:064x}" for i in range(100)]
    with pytest.raises(OverlayError, match="flatten"):
        mount_options(lowers, tmp_path / "b" / "sbx")


async def test_bad_lower_fails_and_cleans_up(tmp_path: Path) -> None:
    work = tmp_path / "sbx"
    with pytest.raises(OverlayError, match="not a directory"):
        async with open_writable_root([tmp_path / "missing"], work):
            pass
    assert not work.exists()
    with pytest.raises(OverlayError, match="contains"):
        async with open_writable_root([make_layer(tmp_path / "a,b", {})], work):
            pass


async def test_reap_stale_mounts_unmounts_leftovers(tmp_path: Path) -> None:
    lower = make_layer(tmp_path / "l0", {"f": "x"})
    # A crashed node: mounted, never unmounted.
    for name in ("s1", "s2"):
        for d in ("upper", "work", "merged"):
            (tmp_path / "sandboxes" / name / d).mkdir(parents=True)
        await trio.run_process(
            ["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={lower},upperdir={tmp_path}/sandboxes/{name}/upper,"
             f"workdir={tmp_path}/sandboxes/{name}/work",
             str(tmp_path / "sandboxes" / name / "merged")],
        )  # fmt: skip
    assert len(mounts_under(tmp_path)) == 2
    await trio.to_thread.run_sync(reap_stale_mounts, tmp_path / "sandboxes")
    assert mounts_under(tmp_path) == []
    # The freed workdir can be mounted again.
    async with open_writable_root([lower], tmp_path / "again") as root:
        assert (root / "f").read_text() == "x"
