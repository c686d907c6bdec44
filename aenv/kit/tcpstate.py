"""Which of the host's TCP connections to an address are still open, from /proc/net/tcp.

Before a sandbox's memory is checkpointed the node closes its connections
into the sandbox, and the image must not catch one that the sandbox still
holds open. Rather than sleeping a fixed grace, the node waits until the
kernel shows that the sandbox has closed its own side of every connection
to its address: none left established, being opened, or half-closed by
the node only (FIN_WAIT1, FIN_WAIT2, CLOSING). TIME_WAIT (both sides
closed) counts as ended, and so do CLOSE_WAIT and LAST_ACK (the sandbox
closed first).

FIN_WAIT2 is not enough: it means the sandbox's network stack acknowledged
the node's FIN, not that the server read it and closed its socket. A
checkpoint by runsc (20240729, `--net-disconnect-ok`) resets every
connected TCP endpoint while it writes the image (the endpoints' save
hook); a reset socket that a process still holds notifies that process's
epoll instance in the middle of the write, and the restored epoll
instance never reports anything again. Seen with envd holding two such
sockets: a restored copy whose listener completes TCP handshakes and
whose event loop never wakes (a fork child's "envd did not start").
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import trio

# /proc/net/tcp states of a connection the peer has not closed its side of
_OPEN_STATES = {
    0x01,  # ESTABLISHED
    0x02,  # SYN_SENT
    0x04,  # FIN_WAIT1
    0x05,  # FIN_WAIT2: the peer acknowledged our FIN, its socket may still be open
    0x0B,  # CLOSING
}


def open_to(table: str, ip: str) -> int:
    """How many connections in `table` (/proc/net/tcp text) to `ip` the peer has not closed."""
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
    """Wait until the peer at `ip` has closed its side of every connection (True),
    or `within_s` passed (False)."""
    with trio.move_on_after(within_s):
        while open_to(await trio.to_thread.run_sync(path.read_text), ip):  # noqa: ASYNC110 - the kernel signals nothing: poll
            await trio.sleep(poll_s)
        return True
    return False
