"""Progress of long node operations (image pulls) on the terminal.

`pull_with_progress` sends the pull and, while the node works, polls
`GET /images/pulls` and shows the pull's layers and bytes: a rich progress
bar on a terminal, a plain line whenever it changes (at most every two
seconds) otherwise. Progress goes to stderr; the result is returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from aenv.client.rest import Client
from aenv.proto.imageref import InvalidReference, parse_reference

__all__ = ["pull_with_progress"]

POLL_S = 0.5
PLAIN_EVERY_S = 2.0


def _canonical(image: str) -> str:
    try:
        return str(parse_reference(image))
    except InvalidReference:
        return image


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def pull_with_progress(client: Client, image: str, send: Callable[[], Any], *, out: TextIO) -> Any:
    """Run `send()` (the pull request) while showing the node's progress for `image`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = send()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    ref = _canonical(image)
    show = _Bar(ref, out) if out.isatty() else _Lines(ref, out)
    try:
        while worker.is_alive():
            worker.join(POLL_S)
            try:
                entry = next((p for p in client.pulls() if p.get("image") == ref), None)
            except Exception:
                entry = None  # progress is best effort; the pull's answer is what counts
            # only a pull under way with its layers known (an error is the answer's to say)
            if entry is not None and entry.get("state") == "pulling" and entry.get("layers"):
                show.update(entry)
    finally:
        show.close()
    if "error" in box:
        raise box["error"]
    result = box.get("result")
    if isinstance(result, dict) and "layers" in result:
        print(
            f"pulled {result.get('image', ref)}: {result['layers']} layers, "
            f"{_mib(int(result.get('compressedBytes', 0)))} compressed, "
            f"{_mib(int(result.get('contentBytes', 0)))} of files",
            file=out,
            flush=True,
        )
    return result


class _Lines:
    def __init__(self, ref: str, out: TextIO) -> None:
        self.ref, self.out = ref, out
        self._last: tuple[int, int] | None = None
        self._at = 0.0

    def update(self, e: dict[str, Any]) -> None:
        now = time.monotonic()
        state = (int(e.get("layersDone", 0)), int(e.get("bytesDone", 0)))
        if state == self._last or now - self._at < PLAIN_EVERY_S:
            return
        self._last, self._at = state, now
        print(
            f"pulling {self.ref}: {state[0]}/{e.get('layers', 0)} layers, "
            f"{_mib(state[1])} of {_mib(int(e.get('bytes', 0)))}",
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, ref: str, out: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("pulling {task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TextColumn("{task.fields[layers]}"),
            console=Console(file=out),
            transient=True,
        )
        self._task = self._progress.add_task(ref, total=None, layers="")
        self._progress.start()

    def update(self, e: dict[str, Any]) -> None:
        self._progress.update(
            self._task,
            total=int(e.get("bytes", 0)) or None,
            completed=int(e.get("bytesDone", 0)),
            layers=f"{e.get('layersDone', 0)}/{e.get('layers', 0)} layers",
        )

    def close(self) -> None:
        self._progress.stop()
