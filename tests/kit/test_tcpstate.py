"""The host TCP table read for closing envd connections before a checkpoint."""

from __future__ import annotations

import socket

import trio

from aenv.kit.tcpstate import open_to, wait_closed

TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 010011AC:C350 020011AC:C2CF 01 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 010011AC:C352 020011AC:C2CF 05 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 010011AC:C354 020011AC:C2CF 06 00000000:00000000 00:00000000 00000000     0        0 0 3
   4: 010011AC:C356 030011AC:C2CF 01 00000000:00000000 00:00000000 00000000     0        0 4 1
"""


def test_counts_only_connections_to_the_address_the_peer_has_not_closed() -> None:
    # 172.17.0.2: one established, one whose FIN the peer acknowledged but
    # whose own side it still holds (FIN_WAIT2), one closed on both sides (TIME_WAIT)
    assert open_to(TABLE, "172.17.0.2") == 2
    assert open_to(TABLE, "172.17.0.3") == 1
    assert open_to(TABLE, "172.17.0.9") == 0
    assert open_to(TABLE, "127.0.0.1") == 0  # a listener is nobody's peer


async def test_waits_for_a_real_peer_to_close() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.2", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = trio.socket.socket()
    await client.connect(("127.0.0.2", port))
    server, _ = await listener.accept()
    assert not await wait_closed("127.0.0.2", within_s=0.2)  # both sides open
    client.shutdown(socket.SHUT_WR)  # the peer's kernel acknowledges the FIN at once
    # ... but the peer still holds its socket: a checkpoint would catch it open
    assert not await wait_closed("127.0.0.2", within_s=0.2)
    server.close()
    assert await wait_closed("127.0.0.2", within_s=5)
    client.close()
    listener.close()
