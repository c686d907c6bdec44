"""The local terminal: raw mode, its size, and the detach key sequence.

`raw_mode(fd)` puts a TTY in raw mode and restores the saved attributes on
every way out (return, exception, cancellation). `DetachFilter` is a sans-IO
scanner for the detach sequence, Ctrl-] then `d`: it passes every other byte
through unchanged, turns Ctrl-] Ctrl-] into one literal Ctrl-], and holds a
lone Ctrl-] at the end of a read until the next byte decides.
"""

from __future__ import annotations

import contextlib
import os
import termios
import tty
from collections.abc import Iterator

DETACH_PREFIX = 0x1D  # Ctrl-]
DETACH_KEY = ord("d")
DETACH_HELP = "Ctrl-] d"


class DetachFilter:
    """Feed raw keyboard bytes; get (bytes to send, whether to detach)."""

    def __init__(self) -> None:
        self._pending = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        out = bytearray()
        for b in data:
            if self._pending:
                self._pending = False
                if b == DETACH_KEY:
                    return bytes(out), True
                if b == DETACH_PREFIX:
                    out.append(DETACH_PREFIX)
                    continue
                out.append(DETACH_PREFIX)
                out.append(b)
            elif b == DETACH_PREFIX:
                self._pending = True
            else:
                out.append(b)
        return bytes(out), False


def window_size(fd: int) -> tuple[int, int]:
    """(cols, rows) of the terminal on `fd`, 80x24 when it has none."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return (size.columns or 80), (size.lines or 24)


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Raw mode on the TTY `fd` for the block; attributes restored however it ends."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
