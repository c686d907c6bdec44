"""Registry client: resolve image references and stream blobs over the distribution API.

`open_registry_client(config=...)` yields a `RegistryClient` (httpx under
trio). `resolve(ref)` fetches the manifest (following an index to the
requested platform), verifies every document it trusts by digest (the
manifest when pulled by digest or via an index, the config blob always),
and returns a `ResolvedImage`. `blob_stream(ref, desc)` yields a blob's raw
(still compressed) bytes; a dropped connection is resumed with a `Range`
request, and the bytes are checked against the descriptor's size and digest
before the last piece is handed out, so a consumer that sees the stream end
normally has seen exactly the right bytes (on `DigestMismatch` it discards
what it got).

Policy comes from `RegistryConfig`: per-registry credentials (Basic auth, or
sent to the token server of a Bearer challenge), mirrors (tried in order
before the origin; a mirror that is unreachable is skipped for the client's
lifetime), an allowlist, plain-HTTP registries (loopback registries always
are), timeouts and a retry policy (connection errors, timeouts, 429 and 5xx
are retried with capped, jittered exponential backoff on trio's clock; other
4xx are not). Every failure is a `RegistryError` subclass whose message names
the image or blob and the host.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import httpx
import trio

from aenv.kit.retry import Backoff, Retries
from aenv.proto import oci
from aenv.proto.imageref import DOCKER_HUB, ImageRef, is_loopback
from aenv.proto.oci import Descriptor, ImageConfig, Manifest

__all__ = [
    "BlobInfo",
    "DigestMismatch",
    "ImageNotFound",
    "RangeNotSupported",
    "RegistryAuthError",
    "RegistryClient",
    "RegistryConfig",
    "RegistryError",
    "RegistryNotAllowed",
    "RegistryUnavailable",
    "ResolvedImage",
    "RetryPolicy",
    "UnsupportedImage",
    "open_registry_client",
]

log = logging.getLogger("aenv.images.registry")

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 16 << 20
MAX_ERROR_BYTES = 64 << 10
_INLINE_CPU_BYTES = 256 << 10  # hash/parse smaller pieces on the trio thread
_T = TypeVar("_T")


class RegistryError(Exception):
    """Talking to a registry failed."""


class RegistryNotAllowed(RegistryError):
    """The registry is not on the configured allowlist."""


class ImageNotFound(RegistryError):
    """The repository, tag, manifest or blob does not exist."""


class RegistryUnavailable(RegistryError):
    """The registry could not be reached or kept failing after retries."""


class RegistryAuthError(RegistryError):
    """Authentication failed or access was denied."""


class DigestMismatch(RegistryError):
    """Content did not match its digest or size."""


class RangeNotSupported(RegistryError):
    """The registry answered a range request with something other than that range."""


class UnsupportedImage(RegistryError):
    """The image is valid but not something aenv can run (platform, media types)."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """`attempts` tries per request; the wait before retry n (from 0) is jittered in
    [d/2, d] with d = min(backoff_max, backoff_base * 2**n); `Retry-After` is honoured up
    to backoff_max."""

    attempts: int = 4
    backoff_base: float = 0.5
    backoff_max: float = 8.0

    def retries(self, rng: random.Random) -> Retries:
        """A new budget for one request (or one stall of a download)."""
        backoff = Backoff(base_s=self.backoff_base, max_s=self.backoff_max, jitter=0.5)
        return Retries(backoff, attempts=self.attempts, rng=rng)


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    """Registry policy. Registry keys are as in references: `docker.io`, `ghcr.io`,
    `localhost:5000` (for Docker Hub, `registry-1.docker.io` works as a key too)."""

    credentials: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # registry -> mirror base URLs ("https://mirror.example", "http://10.0.0.5:5000")
    mirrors: Mapping[str, Sequence[str]] = field(default_factory=dict)
    allowlist: Collection[str] | None = None  # None: every registry is allowed
    insecure: Collection[str] = ()  # reached over plain HTTP (loopback always is)
    connect_timeout: float = 10.0
    read_timeout: float = 60.0  # longest silence while waiting for bytes
    retry: RetryPolicy = field(default_factory=RetryPolicy)


@dataclass(frozen=True, kw_only=True)
class ResolvedImage:
    ref: ImageRef
    manifest_digest: str  # the platform-specific image manifest
    index_digest: str | None  # the index it was selected from, if any
    manifest: Manifest
    config: ImageConfig
    config_digest: str
    layers: tuple[Descriptor, ...]  # bottom first; media types checked as supported


class BlobInfo(Protocol):
    """What `blob_stream` needs to know about a blob (a `Descriptor` has it)."""

    @property
    def digest(self) -> str: ...

    @property
    def size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Endpoint:
    base: str  # "https://registry-1.docker.io", "http://127.0.0.1:5000", a mirror's base
    host: str  # netloc: auth-cache key and what messages name
    creds: tuple[str, str] | None
    mirror: bool


def _lookup(mapping: Mapping[str, _T], registry: str) -> _T | None:
    if registry in mapping:
        return mapping[registry]
    if registry == DOCKER_HUB:
        for alias in ("registry-1.docker.io", "index.docker.io"):
            if alias in mapping:
                return mapping[alias]
    return None


def _describe(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer (timed out)"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc or 'connection refused'})"
    return f"{type(exc).__name__}: {exc or 'connection lost'}"


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("retry-after", "")))
    except ValueError:
        return None


async def _read_limited(resp: httpx.Response, limit: int, what: str) -> bytes:
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RegistryError(f"{what}: {declared} bytes is over the {limit}-byte limit")
    buf = bytearray()
    async for piece in resp.aiter_bytes():  # decoded: a CDN may gzip JSON documents
        buf += piece
        if len(buf) > limit:
            raise RegistryError(f"{what}: over the {limit}-byte limit")
    return bytes(buf)


class RegistryClient:
    """Resolves images and streams blobs; create with `open_registry_client`."""

    def __init__(self, http: httpx.AsyncClient, config: RegistryConfig) -> None:
        self._http = http
        self._config = config
        self._tokens = oci.TokenCache()
        self._basic: dict[str, str] = {}  # host -> Authorization, for hosts that want Basic
        self._down: set[str] = set()  # mirror bases found unreachable
        self._rng = random.Random()
        self._cpu = trio.CapacityLimiter(2)

    # -- public ----------------------------------------------------------------------------

    async def resolve(
        self,
        ref: ImageRef,
        *,
        platform: tuple[str, str] | tuple[str, str, str] = ("linux", "amd64"),
    ) -> ResolvedImage:
        """Fetch and verify `ref`'s manifest and config for `platform` (os, arch[, variant])."""
        self._check_allowed(ref)
        os_, arch = platform[0], platform[1]
        variant = platform[2] if len(platform) == 3 else None
        raw, ctype = await self._fetch_small(
            ref, f"manifests/{ref.reference}", oci.ACCEPT, MAX_MANIFEST_BYTES, f"image {ref}"
        )
        if ref.digest is not None:
            await self._verify(raw, ref.digest, None, f"manifest of {ref}")
            digest = ref.digest
        else:
            digest = str(await self._run(oci.Digest.of, raw))
        doc = self._parse_manifest(raw, ctype, ref)
        index_digest = None
        if isinstance(doc, oci.Index):
            index_digest = digest
            try:
                desc = oci.select_platform(doc, os_, arch, variant)
            except oci.NoMatchingPlatform as e:
                raise UnsupportedImage(f"{ref}: {e}") from None
            raw, ctype = await self._fetch_small(
                ref, f"manifests/{desc.digest}", oci.ACCEPT, MAX_MANIFEST_BYTES, f"image {ref}"
            )
            await self._verify(raw, desc.digest, desc.size, f"{desc.platform} manifest of {ref}")
            digest = desc.digest
            doc = self._parse_manifest(raw, ctype or desc.media_type, ref)
            if isinstance(doc, oci.Index):
                raise UnsupportedImage(f"{ref}: nested image indexes are not supported")
        manifest = doc
        if manifest.config.media_type not in (oci.DOCKER_CONFIG, oci.OCI_CONFIG):
            raise UnsupportedImage(
                f"{ref} is not a container image (config type {manifest.config.media_type})"
            )
        for layer in manifest.layers:
            try:
                oci.layer_compression(layer.media_type)
            except oci.UnsupportedMediaType as e:
                raise UnsupportedImage(f"{ref}: {e}") from None
        cdesc = manifest.config
        raw_cfg, _ = await self._fetch_small(
            ref, f"blobs/{cdesc.digest}", "*/*", MAX_CONFIG_BYTES, f"config of {ref}"
        )
        await self._verify(raw_cfg, cdesc.digest, cdesc.size, f"config blob of {ref}")
        try:
            config = await self._run(oci.parse_image_config, raw_cfg)
        except oci.BadManifest as e:
            raise UnsupportedImage(f"{ref}: {e}") from None
        if not oci.platform_matches(config, os_, arch, variant):
            want = "/".join(platform)
            have = "/".join(p for p in (config.os, config.architecture, config.variant) if p)
            raise UnsupportedImage(f"{ref} is a {have} image, not {want}")
        if len(config.diff_ids) != len(manifest.layers):
            raise UnsupportedImage(
                f"{ref}: config lists {len(config.diff_ids)} layer diff IDs but the manifest "
                f"has {len(manifest.layers)} layers"
            )
        return ResolvedImage(
            ref=ref,
            manifest_digest=digest,
            index_digest=index_digest,
            manifest=manifest,
            config=config,
            config_digest=cdesc.digest,
            layers=manifest.layers,
        )

    async def blob_stream(self, ref: ImageRef, desc: BlobInfo) -> AsyncGenerator[bytes, None]:
        """Yield blob `desc` of `ref`'s repository, raw, resuming after dropped connections.

        Raises `DigestMismatch` instead of yielding the last piece if the content is
        wrong, `RegistryUnavailable` when resuming keeps failing without progress.
        Closing the iterator early (or dropping it) releases the connection.
        """
        self._check_allowed(ref)
        reader = _BlobReader(self, ref, desc)
        try:
            while (piece := await reader.next()) is not None:
                yield piece
        finally:
            await reader.aclose()

    async def blob_range(self, ref: ImageRef, desc: BlobInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of blob `desc`, with one `Range` request (retried).

        Not verified (a part of a blob has no digest of its own: the caller checks
        what it decodes). `RangeNotSupported` when the registry answers with
        anything but that range (a 200 with the whole blob, say).
        """
        self._check_allowed(ref)
        if not 0 <= start < end <= desc.size:
            raise ValueError(f"range {start}-{end} is outside a blob of {desc.size} bytes")
        what = f"bytes {start}-{end - 1} of blob {desc.digest} of {ref.name}"
        headers = {
            "Accept": "*/*",
            "Accept-Encoding": "identity",
            "Range": f"bytes={start}-{end - 1}",
        }
        retries = self._config.retry.retries(self._rng)
        while True:
            resp = await self._get(ref, f"blobs/{desc.digest}", headers, what)
            try:
                got = resp.headers.get("content-range", "")
                if resp.status_code != 206 or not got.startswith(f"bytes {start}-{end - 1}/"):
                    raise RangeNotSupported(
                        f"{what}: the registry answered HTTP {resp.status_code} {got!r}"
                    )
                buf = bytearray()
                async for piece in resp.aiter_raw():
                    buf += piece
                    if len(buf) > end - start:
                        raise RangeNotSupported(f"{what}: the registry sent more than asked")
                if len(buf) == end - start:
                    return bytes(buf)
                problem = f"connection closed after {len(buf)} bytes"
            except httpx.TransportError as e:
                problem = _describe(e)
            finally:
                await resp.aclose()
            delay = retries.failed()
            if delay is None:
                raise RegistryUnavailable(f"{what} kept failing: {problem}")
            await trio.sleep(delay)

    # -- requests --------------------------------------------------------------------------

    def _check_allowed(self, ref: ImageRef) -> None:
        allow = self._config.allowlist
        if allow is None:
            return
        names = {ref.registry, ref.api_host}
        if not names & set(allow):
            raise RegistryNotAllowed(
                f"registry {ref.registry} is not allowed (allowed: {', '.join(sorted(allow))})"
            )

    def _endpoints(self, ref: ImageRef) -> list[_Endpoint]:
        cfg = self._config
        out = []
        for base in _lookup(cfg.mirrors, ref.registry) or ():
            base = base.rstrip("/")
            if base in self._down:
                continue
            host = urlsplit(base).netloc
            out.append(_Endpoint(base, host, _lookup(cfg.credentials, host), mirror=True))
        host = ref.api_host
        plain = is_loopback(host) or _lookup(dict.fromkeys(cfg.insecure, True), ref.registry)
        scheme = "http" if plain else "https"
        creds = _lookup(cfg.credentials, ref.registry) or _lookup(cfg.credentials, host)
        out.append(_Endpoint(f"{scheme}://{host}", host, creds, mirror=False))
        return out

    async def _get(
        self, ref: ImageRef, path: str, headers: Mapping[str, str], what: str
    ) -> httpx.Response:
        """GET /v2/<repo>/<path> from the first endpoint that answers 2xx (open stream)."""
        endpoints = self._endpoints(ref)
        for ep in endpoints:
            try:
                return await self._request(ep, ref, path, headers, what)
            except RegistryError as e:
                if not ep.mirror:
                    raise
                if isinstance(e, RegistryUnavailable):
                    self._down.add(ep.base)
                log.warning(
                    "mirror %s failed for %s (%s); trying the next source", ep.base, what, e
                )
        raise AssertionError("unreachable: the origin is always the last endpoint")

    async def _request(
        self, ep: _Endpoint, ref: ImageRef, path: str, headers: Mapping[str, str], what: str
    ) -> httpx.Response:
        url = f"{ep.base}/v2/{ref.repository}/{path}"
        scope = f"repository:{ref.repository}:pull"
        retries = self._config.retry.retries(self._rng)
        started = trio.current_time()
        authenticated = False
        while True:
            h = dict(headers)
            auth = self._auth_header(ep, scope)
            if auth is not None:
                h["Authorization"] = auth
            wait: float | None = None
            try:
                resp = await self._http.send(
                    self._http.build_request("GET", url, headers=h), stream=True
                )
            except httpx.TransportError as e:
                problem = _describe(e)
            else:
                status = resp.status_code
                if 200 <= status < 300:
                    return resp
                if status == 401:
                    challenge = resp.headers.get("www-authenticate", "")
                    await resp.aclose()
                    if authenticated or (auth is not None and not challenge):
                        raise self._denied(ep, ref, what)
                    authenticated = True
                    await self._authenticate(ep, ref, challenge, scope, what)
                    continue
                if status == 429 or status >= 500:
                    problem = f"HTTP {status}"
                    wait = _retry_after(resp)
                    await resp.aclose()
                else:
                    try:
                        body = await _read_limited(resp, MAX_ERROR_BYTES, what)
                    except (httpx.TransportError, RegistryError):
                        body = b""
                    finally:
                        await resp.aclose()
                    raise self._http_error(ep, ref, status, body, what)
            delay = retries.failed(server_s=wait)
            if delay is None:
                elapsed = trio.current_time() - started
                raise RegistryUnavailable(
                    f"registry {ep.host} unavailable for {what}: {problem} "
                    f"({retries.failures} attempts over {elapsed:.1f}s)"
                )
            log.info("%s from %s: %s; retrying in %.1fs", what, ep.host, problem, delay)
            await trio.sleep(delay)

    def _auth_header(self, ep: _Endpoint, scope: str) -> str | None:
        token = self._tokens.get(ep.host, scope, now=trio.current_time())
        if token is not None:
            return f"Bearer {token}"
        return self._basic.get(ep.host)

    async def _authenticate(
        self, ep: _Endpoint, ref: ImageRef, header: str, scope: str, what: str
    ) -> None:
        try:
            challenge = oci.parse_www_authenticate(header)
        except ValueError:
            raise RegistryAuthError(
                f"registry {ep.host} asked for authentication with an unreadable challenge "
                f"{header!r}"
            ) from None
        if challenge.scheme == "basic":
            if ep.creds is None:
                raise RegistryAuthError(
                    f"registry {ep.host} requires a login for {what} and no credentials are "
                    "configured for it"
                )
            user, password = ep.creds
            raw = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._basic[ep.host] = f"Basic {raw}"
            return
        if challenge.scheme != "bearer" or not challenge.realm:
            raise RegistryAuthError(
                f"registry {ep.host} uses unsupported authentication {header!r}"
            )
        params = {"scope": challenge.scope or scope}
        if challenge.service:
            params["service"] = challenge.service
        auth = httpx.BasicAuth(*ep.creds) if ep.creds is not None else None
        retries = self._config.retry.retries(self._rng)
        while True:
            try:
                resp = await self._http.get(challenge.realm, params=params, auth=auth)
            except httpx.TransportError as e:
                problem = _describe(e)
            else:
                if resp.status_code in (401, 403):
                    if ep.creds is not None:
                        raise RegistryAuthError(
                            f"the credentials configured for {ep.host} were rejected by its "
                            f"token server {challenge.realm} (HTTP {resp.status_code})"
                        )
                    raise RegistryAuthError(
                        f"token server {challenge.realm} refused anonymous access to "
                        f"{ref.name}; configure credentials for {ep.host}"
                    )
                if resp.status_code < 300:
                    try:
                        token = oci.parse_token_response(resp.content, now=trio.current_time())
                    except ValueError as e:
                        raise RegistryAuthError(f"token server {challenge.realm}: {e}") from None
                    self._tokens.put(ep.host, scope, token)
                    return
                problem = f"HTTP {resp.status_code}"
                if resp.status_code < 500 and resp.status_code != 429:
                    raise RegistryAuthError(f"token server {challenge.realm} answered {problem}")
            delay = retries.failed()
            if delay is None:
                raise RegistryUnavailable(
                    f"token server {challenge.realm} for {ep.host} unavailable: {problem}"
                )
            await trio.sleep(delay)

    def _denied(self, ep: _Endpoint, ref: ImageRef, what: str) -> RegistryAuthError:
        if ep.creds is not None:
            return RegistryAuthError(
                f"registry {ep.host} rejected the configured credentials for {what} (wrong "
                "user or password, or no pull access)"
            )
        return RegistryAuthError(
            f"registry {ep.host} denied access to {ref.name}: the repository does not exist "
            "or needs credentials"
        )

    def _http_error(
        self, ep: _Endpoint, ref: ImageRef, status: int, body: bytes, what: str
    ) -> RegistryError:
        errs = oci.parse_errors(body)
        detail = "; ".join(f"{c}: {m}" if m else c for c, m in errs) or f"HTTP {status}"
        if status == 404:
            return ImageNotFound(f"{what} not found on {ep.host} ({detail})")
        if status == 403:
            return self._denied(ep, ref, what)
        return RegistryError(f"registry {ep.host} refused {what}: HTTP {status} ({detail})")

    async def _fetch_small(
        self, ref: ImageRef, path: str, accept: str, limit: int, what: str
    ) -> tuple[bytes, str]:
        """A whole small document (manifest, config) and its Content-Type."""
        retries = self._config.retry.retries(self._rng)
        while True:
            resp = await self._get(ref, path, {"Accept": accept}, what)
            try:
                body = await _read_limited(resp, limit, what)
                return body, resp.headers.get("content-type", "")
            except httpx.TransportError as e:
                delay = retries.failed()
                if delay is None:
                    raise RegistryUnavailable(
                        f"reading {what} kept failing: {_describe(e)} ({retries.failures} attempts)"
                    ) from None
            finally:
                await resp.aclose()
            await trio.sleep(delay)

    def _parse_manifest(self, raw: bytes, ctype: str, ref: ImageRef) -> Manifest | oci.Index:
        try:
            return oci.parse_manifest(raw, ctype)
        except (oci.BadManifest, oci.UnsupportedMediaType) as e:
            raise UnsupportedImage(f"{ref}: {e}") from None

    async def _run(self, fn: Callable[[bytes], _T], data: bytes) -> _T:
        if len(data) <= _INLINE_CPU_BYTES:
            return fn(data)
        return await trio.to_thread.run_sync(fn, data, limiter=self._cpu)

    async def _verify(self, data: bytes, digest: str, size: int | None, what: str) -> None:
        def check(raw: bytes) -> None:
            oci.verify_digest(raw, digest, size)

        try:
            await self._run(check, data)
        except oci.DigestError as e:
            raise DigestMismatch(f"{what}: {e}") from None


class _BlobReader:
    """The state of one blob download: offset, open response, verifier, retry budget."""

    def __init__(self, client: RegistryClient, ref: ImageRef, desc: BlobInfo) -> None:
        self._client = client
        self._ref = ref
        self._digest = desc.digest
        self._size = desc.size
        self._what = f"blob {desc.digest} of {ref.name}"
        try:
            self._verifier = oci.DigestVerifier(desc.digest, desc.size)
        except oci.DigestError as e:
            raise UnsupportedImage(f"{self._what}: {e}") from None
        self._resp: httpx.Response | None = None
        self._pieces: AsyncIterator[bytes] | None = None
        self._skip = 0  # bytes to drop when a server ignored our Range header
        self._retries = client._config.retry.retries(client._rng)
        self._done = False

    @property
    def offset(self) -> int:
        return self._verifier.seen

    async def next(self) -> bytes | None:
        """The next piece, or None once the whole blob was delivered and verified."""
        if self._done:
            return None
        if self._size == 0:
            self._finish_check()
            return None
        while True:
            if self._pieces is None:
                await self._open()
                assert self._pieces is not None
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                problem = f"connection closed at byte {self.offset} of {self._size}"
            except httpx.TransportError as e:
                problem = _describe(e)
            else:
                if self._skip:
                    drop = min(self._skip, len(piece))
                    self._skip -= drop
                    piece = piece[drop:]
                if piece:
                    return await self._accept(piece)
                continue
            await self._close_response()
            delay = self._retries.failed()
            if delay is None:
                raise RegistryUnavailable(
                    f"download of {self._what} kept failing: {problem} ({self.offset} of "
                    f"{self._size} bytes, {self._retries.failures} attempts without progress)"
                )
            log.info(
                "%s: %s; resuming at byte %d in %.1fs", self._what, problem, self.offset, delay
            )
            await trio.sleep(delay)

    async def _open(self) -> None:
        headers = {"Accept": "*/*", "Accept-Encoding": "identity"}
        offset = self.offset
        if offset:
            headers["Range"] = f"bytes={offset}-"
        resp = await self._client._get(self._ref, f"blobs/{self._digest}", headers, self._what)
        if offset and resp.status_code == 206:
            got = resp.headers.get("content-range", "")
            if not got.startswith(f"bytes {offset}-"):
                await resp.aclose()
                raise RegistryError(f"{self._what}: asked for bytes {offset}-, got {got!r}")
            self._skip = 0
        else:
            self._skip = offset  # a 200 restarts from byte 0
        self._resp = resp
        self._pieces = resp.aiter_raw()

    async def _accept(self, piece: bytes) -> bytes:
        self._retries.progressed()  # the retry budget is per stall, not per blob
        try:
            if len(piece) <= _INLINE_CPU_BYTES:
                self._verifier.update(piece)
            else:
                await trio.to_thread.run_sync(
                    self._verifier.update, piece, limiter=self._client._cpu
                )
        except oci.DigestError as e:
            await self.aclose()
            raise DigestMismatch(f"{self._what}: {e}") from None
        if self.offset == self._size:
            await self.aclose()
            self._finish_check()
        return piece

    def _finish_check(self) -> None:
        self._done = True
        try:
            self._verifier.check()
        except oci.DigestError as e:
            raise DigestMismatch(f"{self._what}: {e}") from None

    async def _close_response(self) -> None:
        pieces, resp = self._pieces, self._resp
        self._pieces = self._resp = None
        close = getattr(pieces, "aclose", None)
        if close is not None:
            with trio.CancelScope(shield=True):
                await close()
        if resp is not None:
            with trio.CancelScope(shield=True):
                await resp.aclose()

    async def aclose(self) -> None:
        await self._close_response()


@asynccontextmanager
async def open_registry_client(*, config: RegistryConfig) -> AsyncIterator[RegistryClient]:
    """A `RegistryClient` owning its HTTP connections for the duration of the block."""
    timeout = httpx.Timeout(
        connect=config.connect_timeout,
        read=config.read_timeout,
        write=config.read_timeout,
        pool=config.connect_timeout,
    )
    async with httpx.AsyncClient(
        timeout=timeout,
        follow_redirects=True,
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        headers={"User-Agent": "aenv"},
    ) as http:
        yield RegistryClient(http, config)
