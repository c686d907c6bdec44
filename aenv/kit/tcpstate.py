"""Which of the host's TCP connections to an address are still open, from /proc/net/tcp.

Before a sandbox's memory is checkpointed the node closes its connections
into the sandbox, and the image must not catch envd still holding one (a
restored copy cannot use it). Rather than sleeping a fixed grace, the node
waits until the kernel shows that every connection to the sandbox's
address has been closed by both sides: none left established, half-closed
(FIN_WAIT1/2, CLOSING) or being opened; TIME_WAIT means the peer's FIN came.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import trio

# /proc/net/tcp states: a connection the peer has not closed yet
_OPEN_STATES = {
    0x01,  # ESTABLISHED
    0x02,  # SYN_SENT
    0x04,  # FIN_WAIT1
    0x05,  # FIN_WAIT2
    0x0B,  # CLOSING
}


def open_to(table: str, ip: str) -> int:
    """How many connections in `table` (/proc/net/tcp text) to `ip` are not closed by both sides."""
    found = 0
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4:
            continue
        remote, state = fields[2], int(fields[3], 16)
        addr = remote.partition(":")[0]
        if len(addr) != 8:
            continue  # not IPv4
        if socket.inet_ntoa(struct.pack("<I", int(addr, 16))) == ip and state in _OPEN_STATES:
            found += 1
    return found


async def wait_closed(
    ip: str, *, within_s: float, path: Path = Path("/proc/net/tcp"), poll_s: float = 0.002
) -> bool:
    """Wait until no connection to `ip` is open (True), or `within_s` passed (False)."""
    with trio.move_on_after(within_s):
        while open_to(await trio.to_thread.run_sync(path.read_text), ip):  # noqa: ASYNC110 - the kernel signals nothing: poll
            await trio.sleep(poll_s)
        return True
    return False
