"""A small SOCKS5 server (RFC 1928 CONNECT, RFC 1929 auth, optional TLS) for egress tests.

Run inside the test "internet" namespace (`open_socks`): it listens on
`PROXY_IP:port`, dials out from `PROXY_IP` (so a server sees the proxy's
address, not the node's), resolves names from the internet's own table, and
writes one line per request to its log: `CONNECT <host> <port> user=<name>
ok|denied|auth-failed`. Written on the server side of the protocol from the
RFCs, independently of `aenv.proto.socks5`, so the two check each other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trio


@dataclass(frozen=True)
class Options:
    listen: str
    port: int
    out: str
    names: dict[str, str]
    user: str | None
    password: str | None
    log: Path
    tls: ssl.SSLContext | None


async def read_exactly(stream: trio.abc.ReceiveStream, n: int, buf: bytearray) -> bytes:
    while len(buf) < n:
        data = await stream.receive_some(4096)
        if not data:
            raise EOFError
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def note(opts: Options, line: str) -> None:
    with opts.log.open("a") as f:
        f.write(line + "\n")


async def serve_one(opts: Options, raw: trio.SocketStream) -> None:
    stream: trio.abc.Stream = raw
    if opts.tls is not None:
        stream = trio.SSLStream(raw, opts.tls, server_side=True, https_compatible=True)
    async with stream:
        buf = bytearray()
        ver, n = await read_exactly(stream, 2, buf)
        methods = await read_exactly(stream, n, buf)
        want = 0x02 if opts.user is not None else 0x00
        if ver != 5 or want not in methods:
            await stream.send_all(b"\x05\xff")
            return
        await stream.send_all(bytes([5, want]))
        user = ""
        if want == 0x02:
            _v, ulen = await read_exactly(stream, 2, buf)
            user = (await read_exactly(stream, ulen, buf)).decode()
            (plen,) = await read_exactly(stream, 1, buf)
            password = (await read_exactly(stream, plen, buf)).decode()
            if (user, password) != (opts.user, opts.password):
                note(opts, f"AUTH-FAILED user={user}")
                await stream.send_all(b"\x01\x01")
                return
            await stream.send_all(b"\x01\x00")
        _v, cmd, _r, atyp = await read_exactly(stream, 4, buf)
        if cmd != 1:
            await stream.send_all(b"\x05\x07\x00\x01" + bytes(6))
            return
        if atyp == 1:
            host = ".".join(str(b) for b in await read_exactly(stream, 4, buf))
        elif atyp == 3:
            (ln,) = await read_exactly(stream, 1, buf)
            host = (await read_exactly(stream, ln, buf)).decode()
        else:
            await stream.send_all(b"\x05\x08\x00\x01" + bytes(6))
            return
        port = int.from_bytes(await read_exactly(stream, 2, buf), "big")
        ip = opts.names.get(host, host)
        try:
            sock = trio.socket.socket()
            await sock.bind((opts.out, 0))
            with trio.fail_after(5):
                await sock.connect((ip, port))
        except (OSError, trio.TooSlowError):
            note(opts, f"CONNECT {host} {port} user={user} refused")
            await stream.send_all(b"\x05\x05\x00\x01" + bytes(6))
            return
        note(opts, f"CONNECT {host} {port} user={user} ok")
        bound = sock.getsockname()
        up = trio.SocketStream(sock)
        reply = b"\x05\x00\x00\x01" + trio.socket.inet_aton(bound[0])
        await stream.send_all(reply + int(bound[1]).to_bytes(2, "big"))
        async with up, trio.open_nursery() as nursery:

            async def copy(src: trio.abc.ReceiveStream, dst: trio.abc.SendStream) -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    if buf and src is stream:
                        await dst.send_all(bytes(buf))
                    while data := await src.receive_some(65536):
                        await dst.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(copy, stream, up)
            nursery.start_soon(copy, up, stream)


async def main(opts: Options) -> None:
    listeners = await trio.open_tcp_listeners(opts.port, host=opts.listen)

    async def handle(s: trio.SocketStream) -> None:
        with contextlib.suppress(Exception):
            await serve_one(opts, s)

    print("ready", flush=True)
    await trio.serve_listeners(handle, listeners)


def parse(argv: list[str]) -> Options:
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--port", type=int, default=1080)
    p.add_argument("--out", required=True)
    p.add_argument("--names", default="")
    p.add_argument("--user")
    p.add_argument("--password")
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--cert")
    p.add_argument("--key")
    a = p.parse_args(argv)
    tls = None
    if a.cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(a.cert, a.key)
    names = dict(kv.split("=", 1) for kv in a.names.split(",") if kv)
    return Options(a.listen, a.port, a.out, names, a.user, a.password, a.log, tls)


@contextlib.contextmanager
def open_socks(
    netns: str,
    listen: str,
    log: Path,
    *,
    port: int = 1080,
    names: dict[str, list[str]] | None = None,
    user: str | None = None,
    password: str | None = None,
    cert: Path | None = None,
    key: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """The server running in `netns` until the block ends (`proc.kill()` takes it down early)."""
    argv = [sys.executable, "-m", "tests.socksserver", "--listen", listen, "--port", str(port)]
    argv += ["--out", listen, "--log", str(log)]
    argv += ["--names", ",".join(f"{n}={ips[0]}" for n, ips in (names or {}).items())]
    if user is not None:
        argv += ["--user", user, "--password", password or ""]
    if cert is not None and key is not None:
        argv += ["--cert", str(cert), "--key", str(key)]
    log.touch()
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, *argv], stdout=subprocess.PIPE, env=env, cwd=root
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        line = proc.stdout.readline()
        if b"ready" not in line or time.monotonic() > deadline:
            raise RuntimeError(f"the SOCKS5 server did not start: {line!r}")
        yield proc
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    trio.run(main, parse(sys.argv[1:]))
