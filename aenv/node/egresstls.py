"""Interception for `network.rules` hosts: the node's egress CA and the relay that injects headers.

A connection to a host that has rules (`aenv.proto.egressrules`) is not
passed through: `Intercept` reads the request, adds the rule's headers with
their placeholders resolved on the host side (secrets from the node's
store), and forwards it. For HTTPS it terminates the sandbox's TLS with a
leaf certificate for the name the sandbox asked for, minted by the node's
CA (`NodeCA`: made once under `{home}/egress-ca`, its key never leaves the
node; sandboxes with rules trust its certificate), and opens its own TLS to
the real host, verifying the host's certificate against the node's trust
store (`/etc/ssl/certs`) plus `AENV_EGRESS_CA_FILE`. The upstream handshake
comes first: a host that cannot prove its name never sees a request.

Every request of an intercepted connection is rewritten: the rewritten
request asks for `Connection: close`, so one connection carries one request
(HTTP/1.1 only; ALPN offers nothing else).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import ssl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, cast

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aenv.kit.files import write_atomic
from aenv.node.egress import Transfer, _dial
from aenv.proto.egressrules import (
    HeadError,
    HostRules,
    Placeholder,
    head_end,
    placeholders,
    rewrite_head,
    substitute,
)
from aenv.proto.netpolicy import Decision, EgressPolicy

CA_DAYS: Final = 3650
LEAF_DAYS: Final = 90
SYSTEM_CAPATH: Final = "/etc/ssl/certs"
# what one relay step reads (ciphertext from a socket, plaintext from a TLS end)
RELAY_READ: Final = 256 * 1024


class NodeCA:
    """The node's egress CA and the leaf certificates it mints per host name.

    Blocking (key generation, files): call its methods from a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._lock = threading.Lock()
        self._contexts: dict[str, ssl.SSLContext] = {}
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        (directory / "leaves").mkdir(exist_ok=True, mode=0o700)
        key_path, cert_path = directory / "ca.key", directory / "ca.pem"
        if not key_path.exists() or not cert_path.exists():
            self._create(key_path, cert_path)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self.cert_pem = cert_path.read_text()
        self._cert = x509.load_pem_x509_certificate(self.cert_pem.encode())
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())

    def _create(self, key_path: Path, cert_path: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aenv"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"aenv egress CA {os.urandom(4).hex()}"),
            ]
        )
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        pem_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write(key_path, pem_key, 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for `name` (minted on first use, cached)."""
        with self._lock:
            ctx = self._contexts.get(name)
            if ctx is not None:
                return ctx
            path = self.dir / "leaves" / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".pem")
            now = datetime.datetime.now(datetime.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
                .issuer_name(self._cert.subject)
                .public_key(self._leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                    False,
                )
                .sign(self._key, hashes.SHA256())
            )
            pem = cert.public_bytes(serialization.Encoding.PEM) + self._leaf_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            _write(path, pem, 0o600)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(path)
            ctx.set_alpn_protocols(["http/1.1"])
            if len(self._contexts) > 10_000:
                self._contexts.clear()
            self._contexts[name] = ctx
            return ctx


def _write(path: Path, data: bytes, mode: int) -> None:
    """`data` into `path` with `mode` (the directory is the node's, mode 0700)."""
    write_atomic(path, data)
    os.chmod(path, mode)


def upstream_context(extra_ca_file: Path | None = None) -> ssl.SSLContext:
    """How the proxy verifies real hosts: the system store plus `extra_ca_file`."""
    ctx = ssl.create_default_context()
    with contextlib.suppress(OSError):
        ctx.load_verify_locations(capath=SYSTEM_CAPATH)
    if extra_ca_file is not None:
        ctx.load_verify_locations(cafile=str(extra_ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class _Replay(trio.abc.Stream):
    """`stream` with `head` (bytes read from it already) received first; closing is the owner's."""

    def __init__(self, stream: trio.SocketStream, head: bytes) -> None:
        self._stream = stream
        self._head = head

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._head:
            n = len(self._head) if max_bytes is None else max_bytes
            out, self._head = self._head[:n], self._head[n:]
            return out
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class _TlsEnd(trio.abc.Stream):
    """One TLS end of an intercepted connection: an `ssl.SSLObject` over memory
    BIOs on `sock`, with `head` (bytes read from `sock` already) received first.

    Why not `trio.SSLStream`: a relay wants every record that has arrived, not
    one 16 KiB record per call. `receive_some` reads up to `RELAY_READ` bytes
    of ciphertext at once and decrypts all the records they hold in one go;
    `send_all` encrypts a whole chunk and sends its records in one write.
    That is several times fewer trio round trips and syscalls per MiB (see
    bench/egress.py). A missing close_notify is an end of stream, as with
    `https_compatible=True`. Closing sends close_notify, never closes `sock`
    (its owner does).
    """

    def __init__(
        self,
        sock: trio.abc.Stream,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        head: bytes = b"",
    ) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        if head:
            self._in.write(head)
        self._eof = False
        self._plain = memoryview(bytearray(RELAY_READ))
        self._sending = trio.Lock()  # the two relay directions both flush this end

    async def _flush(self) -> None:
        async with self._sending:
            data = self._out.read()
            if data:
                await self._sock.send_all(data)

    async def _flush_if_idle(self) -> None:
        """What reading produced (TLS 1.3 post-handshake messages), unless the other
        direction is sending: then its next flush carries it. A reader never waits
        for a writer blocked on a peer that is itself waiting to be read."""
        if self._out.pending and not self._sending.locked():
            await self._flush()

    async def _fill(self) -> None:
        data = await self._sock.receive_some(RELAY_READ)
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    async def do_handshake(self) -> None:
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = min(RELAY_READ, RELAY_READ if max_bytes is None else max_bytes)
        view = self._plain  # records are decrypted straight into it, copied out once
        got = 0
        while not self._eof:
            try:
                while got < limit:
                    # with a buffer, read() returns a count (typeshed says bytes)
                    n: int = cast(Any, self._obj).read(limit - got, view[got:limit])
                    if not n:  # close_notify
                        self._eof = True
                        break
                    got += n
            except ssl.SSLWantReadError:
                if not got:  # nothing decrypted yet: wait for more records
                    await self._flush_if_idle()
                    await self._fill()
                    continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self._eof = True
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS: {exc}") from exc
            break
        await self._flush_if_idle()
        return bytes(view[:got])

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[self._obj.write(view) :]
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS: {exc}") from exc
        await self._flush()

    async def wait_send_all_might_not_block(self) -> None:
        await self._sock.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        raise NotImplementedError("TLS has no half-close")

    async def aclose(self) -> None:
        with contextlib.suppress(ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError):
            with contextlib.suppress(ssl.SSLWantReadError):
                self._obj.unwrap()
            await self._flush()
        await trio.lowlevel.checkpoint()


Resolve = Callable[[Placeholder], Awaitable[str]]
# (slot, its policy, placeholder) -> the value; LookupError: none
Reveal = Callable[[int, EgressPolicy, Placeholder], Awaitable[str]]


class Intercept:
    """The relay for a connection to a host with rules: inject `headers` into its request."""

    def __init__(
        self,
        *,
        name: str,
        headers: tuple[tuple[str, str], ...],
        resolve: Resolve,
        tls: tuple[NodeCA, ssl.SSLContext] | None,
    ) -> None:
        self.name = name
        self.headers = headers
        self.resolve = resolve
        self.tls = tls

    async def run(
        self,
        client: trio.SocketStream,
        head: bytes,
        target: tuple[str, int],
        done: Transfer,
        *,
        upstream: trio.SocketStream | None = None,
    ) -> None:
        raw = upstream if upstream is not None else await _dial(target)
        async with raw:
            down: trio.abc.Stream = _Replay(client, head)
            up: trio.abc.Stream = raw
            if self.tls is not None:
                ca, verify = self.tls
                tls_up = _TlsEnd(raw, verify, server_side=False, server_hostname=self.name)
                try:
                    await tls_up.do_handshake()
                except (ssl.SSLError, trio.BrokenResourceError) as exc:
                    raise OSError(f"upstream TLS: {exc.__cause__ or exc}") from None
                server = await trio.to_thread.run_sync(ca.server_context, self.name)
                tls_down = _TlsEnd(client, server, server_side=True, head=head)
                try:
                    await tls_down.do_handshake()
                except (ssl.SSLError, trio.BrokenResourceError) as exc:
                    raise OSError(f"sandbox TLS: {exc.__cause__ or exc}") from None
                up, down = tls_up, tls_down
            await self._relay(down, up, done)

    async def _relay(self, down: trio.abc.Stream, up: trio.abc.Stream, done: Transfer) -> None:
        buf = b""
        try:
            while (end := head_end(buf)) < 0:
                data = await down.receive_some(RELAY_READ)
                if not data:
                    return
                buf += data
            values: dict[Placeholder, str] = {}
            for _, v in self.headers:
                for p in _placeholders(v):
                    if p not in values:
                        values[p] = await self.resolve(p)
            inject = [(k, substitute(v, values.__getitem__)) for k, v in self.headers]
            request = rewrite_head(buf[:end], inject) + buf[end:]
        except (HeadError, LookupError) as exc:
            body = f"aenv egress proxy: {exc}\n".encode()
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await down.send_all(
                    b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
            raise OSError(f"request not forwarded: {exc}") from None
        await up.send_all(request)
        done.bytes_out += len(buf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, down, up, done, "bytes_out", None)
            # the response ends the exchange (Connection: close)
            nursery.start_soon(_pump, up, down, done, "bytes_in", nursery.cancel_scope)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await down.aclose()


def _placeholders(value: str) -> list[Placeholder]:
    return sorted(placeholders(value), key=lambda p: (p.kind, p.name))


async def _pump(
    src: trio.abc.Stream,
    dst: trio.abc.Stream,
    done: Transfer,
    what: str,
    finish: trio.CancelScope | None,
) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while data := await src.receive_some(RELAY_READ):
            await dst.send_all(data)
            setattr(done, what, getattr(done, what) + len(data))
    if finish is not None:
        finish.cancel()


def interceptor(
    ca: NodeCA,
    verify: ssl.SSLContext,
    reveal: Reveal,
) -> Callable[[int, EgressPolicy, Decision, str | None, str], Intercept | None]:
    """The `EgressProxy.intercept` hook: an `Intercept` for connections to
    hosts the sandbox's `network.rules` name (TLS or HTTP), None for the rest."""

    def choose(
        slot: int, policy: EgressPolicy, _d: Decision, name: str | None, proto: str
    ) -> Intercept | None:
        if not policy.rules or proto not in ("tls", "http"):
            return None
        headers = HostRules(policy.rules).headers_for(name)
        if headers is None or name is None:
            return None
        return Intercept(
            name=name,
            headers=headers,
            resolve=functools.partial(reveal, slot, policy),
            tls=(ca, verify) if proto == "tls" else None,
        )

    return choose
