"""The node's TLS (aenv.kit.tls) over real handshakes on loopback.

Rules: a server on port 0 with `ServerTLS.context`, clients verifying with
`client_context`; a certificate reloaded while serving is what the next
handshake gets, with and without SNI; a reload that fails keeps the one in
use; a server signed by another CA, or a name the certificate does not
cover, fails verification; bad files are refused at load with their name.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from aenv.kit.tls import ServerTLS, TLSSetupError, client_context
from tests.tlscerts import TestCA, common_name


@asynccontextmanager
async def _serve(tls: ServerTLS) -> AsyncIterator[int]:
    async def handler(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.do_handshake()
            await stream.send_all(b"ok")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_ssl_over_tcp, handler, 0, tls.context)
        yield int(listeners[0].transport_listener.socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def _handshake(port: int, ca: Path, name: str) -> tuple[str, str | None]:
    """Connect as `name` (an IP address sends no SNI); the server's CN and ALPN pick."""
    ctx = client_context(ca)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, ctx, server_hostname=name)
    try:
        await stream.do_handshake()
        assert await stream.receive_some(2) == b"ok"
        der = stream.getpeercert(binary_form=True)
        assert der is not None
        return common_name(der), stream.selected_alpn_protocol()
    finally:
        await trio.aclose_forcefully(stream)


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


def _issue(ca: TestCA, cn: str) -> tuple[Path, Path]:
    return ca.issue(cn, dns=["*.aenv.test", "aenv.test"], ips=["127.0.0.1"])


async def test_a_reloaded_certificate_is_served_to_the_next_handshake(ca: TestCA) -> None:
    cert, key = _issue(ca, "first")
    tls = ServerTLS.load(cert, key)
    async with _serve(tls) as port:
        assert await _handshake(port, ca.pem, "49983-abc.aenv.test") == ("first", "h2")
        assert (await _handshake(port, ca.pem, "127.0.0.1"))[0] == "first"
        new_cert, new_key = _issue(ca, "second")
        new_cert.replace(cert)
        new_key.replace(key)
        assert await tls.reload()
        assert await _handshake(port, ca.pem, "49983-abc.aenv.test") == ("second", "h2")
        assert (await _handshake(port, ca.pem, "127.0.0.1"))[0] == "second"  # no SNI sent
        # a broken file on reload: the certificate in use stays
        cert.write_text("not a certificate")
        assert not await tls.reload()
        assert (await _handshake(port, ca.pem, "api.aenv.test"))[0] == "second"
        assert tls.reloads == 1


async def test_peers_are_verified_against_the_configured_ca(ca: TestCA, tmp_path: Path) -> None:
    other = TestCA(tmp_path / "other", name="someone else")
    tls = ServerTLS.load(*_issue(ca, "node"))
    async with _serve(tls) as port:
        with pytest.raises(trio.BrokenResourceError) as wrong_ca:
            await _handshake(port, other.pem, "127.0.0.1")
        assert "certificate verify failed" in str(_cause(wrong_ca.value))
        with pytest.raises(trio.BrokenResourceError) as wrong_name:
            await _handshake(port, ca.pem, "node.elsewhere.test")
        assert "match" in str(_cause(wrong_name.value))
        with pytest.raises(trio.BrokenResourceError) as system:
            await _handshake_system(port)  # the system store does not know the test CA
        assert isinstance(_cause(system.value), ssl.SSLCertVerificationError)


def _cause(e: BaseException) -> BaseException:
    """trio reports a failed handshake as BrokenResourceError from the ssl error."""
    assert isinstance(e.__cause__, ssl.SSLCertVerificationError), repr(e.__cause__)
    return e.__cause__


async def _handshake_system(port: int) -> None:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, client_context(None), server_hostname="aenv.test")
    try:
        await stream.do_handshake()
    finally:
        await trio.aclose_forcefully(stream)


def test_unusable_files_are_refused_with_their_name(ca: TestCA, tmp_path: Path) -> None:
    cert, key = _issue(ca, "node")
    with pytest.raises(TLSSetupError, match=r"key not found: .*missing\.key"):
        ServerTLS.load(cert, tmp_path / "missing.key")
    with pytest.raises(TLSSetupError, match=r"certificate not found: .*missing\.pem"):
        ServerTLS.load(tmp_path / "missing.pem", key)
    _, other_key = _issue(ca, "other")
    with pytest.raises(TLSSetupError, match="cannot use TLS certificate"):
        ServerTLS.load(cert, other_key)  # a key that is not the certificate's
    with pytest.raises(TLSSetupError, match="CA bundle not found"):
        client_context(tmp_path / "missing-ca.pem")
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(TLSSetupError, match="cannot use TLS CA bundle"):
        client_context(tmp_path / "junk.pem")
