"""The registry client against a real registry (Debian's docker-registry on loopback).

Images are pushed over the distribution API by a small helper here; failure
modes use real sockets: a blob corrupted on the registry's disk, a server
that accepts and never answers, a proxy that cuts the first blob download
mid-body, a closed port.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import h11
import httpx
import pytest
import trio

from aenv.images.registry import (
    DigestMismatch,
    ImageNotFound,
    RegistryAuthError,
    RegistryClient,
    RegistryConfig,
    RegistryNotAllowed,
    RegistryUnavailable,
    RetryPolicy,
    UnsupportedImage,
    open_registry_client,
)
from aenv.proto import oci
from aenv.proto.imageref import parse_reference

REGISTRY_BIN = shutil.which("docker-registry")
pytestmark = pytest.mark.skipif(REGISTRY_BIN is None, reason="needs docker-registry")

FAST = RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.05)


# -- a registry process and a pusher -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    host: str  # "127.0.0.1:PORT"
    root: Path
    auth: tuple[str, str] | None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _start(tmp: Path, auth: tuple[str, str] | None) -> Iterator[Registry]:
    port = _free_port()
    lines = [
        "version: 0.1",
        "log: {level: error, accesslog: {disabled: true}}",
        f"storage: {{filesystem: {{rootdirectory: {tmp / 'data'}}}}}",
        f"http: {{addr: '127.0.0.1:{port}'}}",
    ]
    if auth is not None:
        hashed = bcrypt.hashpw(auth[1].encode(), bcrypt.gensalt(rounds=4)).decode()
        (tmp / "htpasswd").write_text(f"{auth[0]}:{hashed}\n")
        lines.append(f"auth: {{htpasswd: {{realm: test, path: {tmp / 'htpasswd'}}}}}")
    (tmp / "config.yml").write_text("\n".join(lines) + "\n")
    assert REGISTRY_BIN is not None
    with open(tmp / "registry.log", "wb") as logf:
        proc = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(tmp / "config.yml")], stderr=logf, stdout=logf
        )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/").status_code in (200, 401):
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp / "registry.log").read_text()
            assert time.monotonic() < deadline, "registry did not start"
            time.sleep(0.05)
        yield Registry(f"127.0.0.1:{port}", tmp / "data", auth)
    finally:
        proc.terminate()
        proc.wait(10)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def push_blob(reg: Registry, repo: str, data: bytes) -> str:
    digest = _digest(data)
    with httpx.Client(auth=reg.auth) as http:
        r = http.post(f"{reg.url}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        url = httpx.URL(reg.url).join(r.headers["location"]).copy_merge_params({"digest": digest})
        r = http.put(url, content=data)
        assert r.status_code == 201, r.text
    return digest


def push_manifest(reg: Registry, repo: str, ref: str, doc: dict[str, object]) -> str:
    raw = json.dumps(doc).encode()
    with httpx.Client(auth=reg.auth) as http:
        r = http.put(
            f"{reg.url}/v2/{repo}/manifests/{ref}",
            content=raw,
            headers={"Content-Type": str(doc["mediaType"])},
        )
        assert r.status_code == 201, r.text
    return _digest(raw)


def make_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


@dataclass
class Pushed:
    ref: str
    digest: str  # manifest digest
    manifest_size: int
    layers: list[bytes]  # blobs as pushed
    config: dict[str, object]


def push_image(
    reg: Registry,
    repo: str,
    tag: str | None,
    layer_files: list[dict[str, bytes]],
    *,
    arch: str = "amd64",
    variant: str | None = None,
    compress: bool = True,
    env: tuple[str, ...] = ("PATH=/usr/bin:/bin",),
) -> Pushed:
    tars = [make_tar(f) for f in layer_files]
    blobs = [gzip.compress(t, mtime=0) if compress else t for t in tars]
    config: dict[str, object] = {
        "architecture": arch,
        "os": "linux",
        "config": {"Env": list(env), "Cmd": ["/bin/sh"], "WorkingDir": "/srv", "User": None},
        "rootfs": {"type": "layers", "diff_ids": [_digest(t) for t in tars]},
    }
    if variant:
        config["variant"] = variant
    raw_config = json.dumps(config).encode()
    layer_type = oci.OCI_LAYER_GZIP if compress else oci.OCI_LAYER
    manifest = {
        "schemaVersion": 2,
        "mediaType": oci.OCI_MANIFEST,
        "config": {
            "mediaType": oci.OCI_CONFIG,
            "digest": push_blob(reg, repo, raw_config),
            "size": len(raw_config),
        },
        "layers": [
            {"mediaType": layer_type, "digest": push_blob(reg, repo, b), "size": len(b)}
            for b in blobs
        ],
    }
    raw = json.dumps(manifest).encode()
    digest = push_manifest(reg, repo, tag or _digest(raw), manifest)
    return Pushed(f"{reg.host}/{repo}:{tag}", digest, len(raw), blobs, config)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from _start(tmp_path_factory.mktemp("registry"), None)


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from _start(tmp_path_factory.mktemp("authregistry"), ("alice", "s3cret"))


@pytest.fixture(scope="module")
def single(registry: Registry) -> Pushed:
    return push_image(
        registry,
        "app/single",
        "v1",
        [{"etc/os-release": b"ID=test\n"}, {"srv/app.py": b"print('hi')\n" * 100}],
        env=("PATH=/usr/bin", "LANG=C.UTF-8"),
    )


def _config(**kw: object) -> RegistryConfig:
    opts: dict[str, object] = {"retry": FAST, "connect_timeout": 2.0, "read_timeout": 5.0}
    opts.update(kw)
    return RegistryConfig(**opts)  # type: ignore[arg-type]


async def _read(client: RegistryClient, ref: str, desc: oci.Descriptor) -> bytes:
    out = bytearray()
    async for piece in client.blob_stream(parse_reference(ref), desc):
        out += piece
    return bytes(out)


# -- tests ----------------------------------------------------------------------------------


async def test_resolve_and_stream_single_arch_image(single: Pushed) -> None:
    async with open_registry_client(config=_config()) as client:
        image = await client.resolve(parse_reference(single.ref))
        assert image.manifest_digest == single.digest
        assert image.index_digest is None
        assert image.config.env == ("PATH=/usr/bin", "LANG=C.UTF-8")
        assert image.config.cmd == ("/bin/sh",)
        assert image.config.working_dir == "/srv"
        assert image.config.user == ""
        assert [d.size for d in image.layers] == [len(b) for b in single.layers]
        for desc, blob in zip(image.layers, single.layers, strict=True):
            assert await _read(client, single.ref, desc) == blob
        # the same image by digest, with the tag kept alongside
        again = await client.resolve(parse_reference(f"{single.ref}@{single.digest}"))
        assert again.manifest_digest == single.digest
        assert again.config_digest == image.config_digest


async def test_multi_arch_index_selects_platform(registry: Registry) -> None:
    amd = push_image(registry, "app/multi", None, [{"arch": b"amd64"}], arch="amd64")
    arm = push_image(registry, "app/multi", None, [{"arch": b"arm64"}], arch="arm64", variant="v8")
    entries = [
        (amd, {"os": "linux", "architecture": "amd64"}),
        (arm, {"os": "linux", "architecture": "arm64", "variant": "v8"}),
    ]
    index = {
        "schemaVersion": 2,
        "mediaType": oci.OCI_INDEX,
        "manifests": [],
    }
    for pushed, platform in entries:
        desc = {"digest": pushed.digest, "size": pushed.manifest_size, "platform": platform}
        index["manifests"].append({"mediaType": oci.OCI_MANIFEST, **desc})  # type: ignore[attr-defined]
    index_digest = push_manifest(registry, "app/multi", "v1", index)
    ref = parse_reference(f"{registry.host}/app/multi:v1")
    async with open_registry_client(config=_config()) as client:
        on_amd = await client.resolve(ref)
        assert on_amd.manifest_digest == amd.digest
        assert on_amd.index_digest == index_digest
        assert on_amd.config.architecture == "amd64"
        on_arm = await client.resolve(ref, platform=("linux", "arm64"))
        assert on_arm.manifest_digest == arm.digest
        assert on_arm.config.architecture == "arm64"
        assert await _read(client, str(ref), on_arm.layers[0]) == arm.layers[0]
        with pytest.raises(UnsupportedImage, match=r"linux/s390x.*linux/amd64, linux/arm64/v8"):
            await client.resolve(ref, platform=("linux", "s390x"))
        # a single-arch image of the wrong architecture is refused too
        with pytest.raises(UnsupportedImage, match="linux/arm64"):
            await client.resolve(parse_reference(f"{registry.host}/app/multi@{arm.digest}"))


async def test_unknown_repository_and_tag(registry: Registry, single: Pushed) -> None:
    async with open_registry_client(config=_config()) as client:
        with pytest.raises(ImageNotFound, match=rf"{registry.host}/app/nothere:v1.*not found"):
            await client.resolve(parse_reference(f"{registry.host}/app/nothere:v1"))
        with pytest.raises(ImageNotFound, match=r"app/single:nope.*MANIFEST_UNKNOWN"):
            await client.resolve(parse_reference(f"{registry.host}/app/single:nope"))


async def test_basic_auth(auth_registry: Registry) -> None:
    pushed = push_image(auth_registry, "private/app", "v1", [{"secret": b"x" * 1000}])
    ref = parse_reference(pushed.ref)
    good = _config(credentials={auth_registry.host: ("alice", "s3cret")})
    async with open_registry_client(config=good) as client:
        image = await client.resolve(ref)
        assert image.manifest_digest == pushed.digest
        assert await _read(client, pushed.ref, image.layers[0]) == pushed.layers[0]
    bad = _config(credentials={auth_registry.host: ("alice", "wrong")})
    async with open_registry_client(config=bad) as client:
        with pytest.raises(
            RegistryAuthError, match=rf"{auth_registry.host} rejected the configured"
        ):
            await client.resolve(ref)
    async with open_registry_client(config=_config()) as client:
        with pytest.raises(RegistryAuthError, match="no credentials are configured"):
            await client.resolve(ref)


async def test_corrupted_blob_is_detected(registry: Registry) -> None:
    pushed = push_image(
        registry, "app/corrupt", "v1", [{"a": os.urandom(5000)}, {"b": b"data" * 1000}]
    )
    path = registry.blob_file(_digest(pushed.layers[0]))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    async with open_registry_client(config=_config()) as client:
        image = await client.resolve(parse_reference(pushed.ref))
        got = bytearray()
        with pytest.raises(DigestMismatch, match=rf"blob {_digest(pushed.layers[0])}"):
            async for piece in client.blob_stream(image.ref, image.layers[0]):
                got += piece
        assert len(got) < len(data)  # the last piece is never handed out
        assert await _read(client, pushed.ref, image.layers[1]) == pushed.layers[1]
        # a corrupted config blob fails the resolve
        cfg = registry.blob_file(image.config_digest)
        cfg.write_bytes(cfg.read_bytes().replace(b"/srv", b"/tmp"))
        with pytest.raises(DigestMismatch, match="config blob"):
            await client.resolve(parse_reference(pushed.ref))


async def test_hanging_registry_fails_quickly() -> None:
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        held: list[trio.SocketStream] = []

        async def accept_and_hold() -> None:
            while True:
                held.append(await listeners[0].accept())

        nursery.start_soon(accept_and_hold)
        config = _config(connect_timeout=0.5, read_timeout=0.3)
        started = trio.current_time()
        async with open_registry_client(config=config) as client:
            with pytest.raises(RegistryUnavailable, match=rf"127.0.0.1:{port}.*3 attempts"):
                await client.resolve(parse_reference(f"127.0.0.1:{port}/x/y:z"))
        assert trio.current_time() - started < 3
        assert held  # it was reached, it just never answered
        nursery.cancel_scope.cancel()


async def test_connection_refused_is_unavailable() -> None:
    port = _free_port()
    async with open_registry_client(config=_config()) as client:
        with pytest.raises(RegistryUnavailable, match=rf"127.0.0.1:{port}.*cannot connect"):
            await client.resolve(parse_reference(f"127.0.0.1:{port}/x/y:z"))


async def _cutting_proxy(
    upstream: str,
    marker: bytes,
    cut_after: int,
    requests: list[bytes],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward to `upstream`; the first response to a request containing `marker` is cut
    after `cut_after` bytes by closing the connection."""
    host, _, port = upstream.partition(":")
    fired = False

    async def handle(client: trio.SocketStream) -> None:
        nonlocal fired
        cut = False
        async with client, await trio.open_tcp_stream(host, int(port)) as up:

            async def to_upstream() -> None:
                nonlocal fired, cut
                async for data in client:
                    requests.append(data)
                    if marker in data and not fired:
                        fired = cut = True
                    await up.send_all(data)

            async def to_client() -> None:
                sent = 0
                async for data in up:
                    if cut:
                        data = data[: cut_after - sent]
                    await client.send_all(data)
                    sent += len(data)
                    if cut and sent >= cut_after:
                        nursery.cancel_scope.cancel()
                        return

            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_upstream)
                nursery.start_soon(to_client)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as n:
        await n.start(trio.serve_listeners, handle, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def test_dropped_download_resumes_with_range(registry: Registry) -> None:
    payload = os.urandom(600_000)
    pushed = push_image(registry, "app/big", "v1", [{"blob": payload}], compress=False)
    layer_digest = _digest(pushed.layers[0])
    requests: list[bytes] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            _cutting_proxy, registry.host, f"/blobs/{layer_digest}".encode(), 200_000, requests
        )
        ref = parse_reference(f"127.0.0.1:{port}/app/big:v1")
        async with open_registry_client(config=_config()) as client:
            image = await client.resolve(ref)
            got = await _read(client, str(ref), image.layers[0])
        nursery.cancel_scope.cancel()
    assert got == pushed.layers[0]
    blob_requests = [r.lower() for r in requests if layer_digest.encode() in r]
    assert len(blob_requests) == 2
    assert b"range: bytes=" not in blob_requests[0]
    assert b"range: bytes=" in blob_requests[1]


async def test_blob_range_returns_exactly_that_range(single: Pushed) -> None:
    async with open_registry_client(config=_config()) as client:
        ref = parse_reference(single.ref)
        image = await client.resolve(ref)
        desc, blob = image.layers[0], single.layers[0]
        assert await client.blob_range(ref, desc, 3, 40) == blob[3:40]
        assert await client.blob_range(ref, desc, len(blob) - 5, len(blob)) == blob[-5:]
        with pytest.raises(ValueError):
            await client.blob_range(ref, desc, 0, len(blob) + 1)


async def test_allowlist_refuses_other_registries(single: Pushed) -> None:
    config = _config(allowlist={"ghcr.io"})
    async with open_registry_client(config=config) as client:
        with pytest.raises(RegistryNotAllowed, match=r"127\.0\.0\.1:\d+ is not allowed.*ghcr\.io"):
            await client.resolve(parse_reference(single.ref))
    async with open_registry_client(config=_config(allowlist={single.ref.split("/")[0]})) as client:
        await client.resolve(parse_reference(single.ref))


async def test_mirror_first_then_origin(registry: Registry, single: Pushed) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    # the origin is down, the mirror serves
    via_mirror = _config(mirrors={dead: [registry.url]})
    async with open_registry_client(config=via_mirror) as client:
        image = await client.resolve(parse_reference(f"{dead}/app/single:v1"))
        assert image.manifest_digest == single.digest
        ref = f"{dead}/app/single:v1"
        assert await _read(client, ref, image.layers[1]) == single.layers[1]
    # the mirror is down, the origin serves
    via_origin = _config(mirrors={registry.host: [f"http://{dead}"]})
    async with open_registry_client(config=via_origin) as client:
        image = await client.resolve(parse_reference(single.ref))
        assert image.manifest_digest == single.digest


async def _bearer_gateway(
    upstream: str,
    creds: tuple[str, str],
    token_requests: list[str],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A registry front that demands Bearer tokens, issued by its own /token endpoint to
    `creds` (Basic); authorised requests are forwarded to `upstream`."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    realm = f"http://127.0.0.1:{port}/token"
    issued: set[str] = set()
    good_basic = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()

    async def respond(
        request: h11.Request, headers: dict[str, str], http: httpx.AsyncClient
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        target = request.target.decode()
        if target.startswith("/token"):
            token_requests.append(target)
            if headers.get("authorization") != good_basic:
                return 401, [], b'{"details": "bad credentials"}'
            token = f"tok{len(issued)}"
            issued.add(token)
            return (
                200,
                [("content-type", "application/json")],
                json.dumps({"token": token}).encode(),
            )
        auth = headers.get("authorization", "")
        if auth.removeprefix("Bearer ") not in issued:
            name = target.removeprefix("/v2/").rsplit("/", 2)[0]
            challenge = f'Bearer realm="{realm}",service="gw",scope="repository:{name}:pull"'
            return 401, [("www-authenticate", challenge)], b"{}"
        fwd = {k: v for k, v in headers.items() if k in ("accept", "range")}
        r = await http.get(f"http://{upstream}{target}", headers=fwd)
        keep = ("content-type", "docker-content-digest", "content-range")
        return r.status_code, [(k, r.headers[k]) for k in keep if k in r.headers], r.content

    async def handle(stream: trio.SocketStream) -> None:
        async with stream, httpx.AsyncClient() as http:
            with contextlib.suppress(trio.BrokenResourceError):
                await serve(h11.Connection(h11.SERVER), stream, http)

    async def serve(
        conn: h11.Connection, stream: trio.SocketStream, http: httpx.AsyncClient
    ) -> None:
        while True:
            request: h11.Request | None = None
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            headers = {k.decode().lower(): v.decode() for k, v in request.headers}
            status, extra, body = await respond(request, headers, http)
            out = [*extra, ("content-length", str(len(body)))]
            await stream.send_all(conn.send(h11.Response(status_code=status, headers=out)))
            await stream.send_all(conn.send(h11.Data(data=body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    async with trio.open_nursery() as n:
        await n.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


async def test_bearer_token_auth(registry: Registry, single: Pushed) -> None:
    tokens: list[str] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_bearer_gateway, registry.host, ("bob", "pw"), tokens)
        host = f"127.0.0.1:{port}"
        ref = parse_reference(f"{host}/app/single:v1")
        async with open_registry_client(config=_config(credentials={host: ("bob", "pw")})) as c:
            image = await c.resolve(ref)
            assert image.manifest_digest == single.digest
            for desc, blob in zip(image.layers, single.layers, strict=True):
                assert await _read(c, str(ref), desc) == blob
        assert len(tokens) == 1  # one token, cached for the manifest, config and blobs
        assert "scope=repository%3Aapp%2Fsingle%3Apull" in tokens[0]
        assert "service=gw" in tokens[0]
        wrong = _config(credentials={host: ("bob", "nope")})
        async with open_registry_client(config=wrong) as c:
            with pytest.raises(RegistryAuthError, match=r"credentials configured for .* rejected"):
                await c.resolve(ref)
        async with open_registry_client(config=_config()) as c:
            with pytest.raises(RegistryAuthError, match="refused anonymous access"):
                await c.resolve(ref)
        nursery.cancel_scope.cancel()
