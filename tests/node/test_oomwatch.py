"""The node's reader of OOM kills from a sandbox's console (`aenv.node.oomwatch`)."""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from aenv.node.oomwatch import follow_kills, read_from
from aenv.proto.oomevent import OomKill, format_kill

KILL = OomKill(pid=12, name="python3", rss_bytes=600 << 20, memory_bytes=512 << 20, time=1.0)


def test_read_from_returns_whole_lines_only(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    console.write_text("one\ntwo\npart")
    text, offset = read_from(console, 0)
    assert (text, offset) == ("one\ntwo\n", 8)
    console.write_text("one\ntwo\npartial line\n")
    assert read_from(console, offset) == ("partial line\n", 21)
    console.write_text("new\n")  # replaced: from the start again
    assert read_from(console, 21) == ("new\n", 4)


async def test_follow_reports_kills_appended_after_it_started(tmp_path: Path) -> None:
    # (a real clock: its reads are in worker threads, which an autojump clock outruns)
    console = tmp_path / "console.log"
    before = format_kill(KILL) + "\n"  # already reported
    console.write_text(before)
    seen: list[OomKill] = []
    arrived = trio.Event()

    def on_kill(kill: OomKill) -> None:
        seen.append(kill)
        arrived.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(follow_kills, console, on_kill, start=len(before), poll_s=0.01)
        )
        with console.open("a") as f:
            f.write("envd chatter\n" + format_kill(KILL) + "\n")
        with trio.fail_after(5):
            await arrived.wait()
        nursery.cancel_scope.cancel()
    assert seen == [KILL]
