"""Which of the host's TCP connections to an address are still open, from /proc/net/tcp.

Before a sandbox's memory is checkpointed the node closes its connections
into the sandbox, and the image must not catch one that envd's network
stack still takes for open (a restored copy cannot use it). Rather than
sleeping a fixed grace, the node waits until the kernel shows that the
sandbox has acknowledged the end of every connection to its address: none
left established, being opened, or with the node's FIN unacknowledged
(FIN_WAIT1, CLOSING). FIN_WAIT2 (envd knows; its server may close its side
later, in the sandbox or in a restored copy) and TIME_WAIT count as ended.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import trio

# /proc/net/tcp states: a connection whose end the peer has not acknowledged
_OPEN_STATES = {
    0x01,  # ESTABLISHED
    0x02,  # SYN_SENT
    0x04,  # FIN_WAIT1
    0x0B,  # CLOSING
}


def open_to(table: str, ip: str) -> int:
    """How many connections in `table` (/proc/net/tcp text) to `ip` the peer takes for open."""
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
    """Wait until the peer at `ip` has acknowledged the end of every connection (True),
    or `within_s` passed (False)."""
    with trio.move_on_after(within_s):
        while open_to(await trio.to_thread.run_sync(path.read_text), ip):  # noqa: ASYNC110 - the kernel signals nothing: poll
            await trio.sleep(poll_s)
        return True
    return False
