"""The OCI / Docker distribution formats a registry client reads, sans-IO.

Media types, and parsers that validate what a registry sends before anything
trusts it: `parse_manifest` (an image manifest or an index / manifest list),
`select_platform` (pick the manifest for an OS/architecture out of an index,
with Docker's architecture and variant normalisation), `parse_image_config`
(the runtime bits of an image config: env, workdir, user, entrypoint, cmd,
diff IDs), `parse_www_authenticate` (a registry's auth challenge),
`parse_token_response` and `TokenCache` (bearer tokens and their expiry),
`parse_errors` (the distribution error body), and `Digest` /
`DigestVerifier` (content addressing: parse, format, and verify a stream
incrementally). Every parser raises a `ValueError` subclass whose message
says what is wrong. Nothing here does IO; the registry client in
`aenv.images.registry` drives these.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACCEPT",
    "DOCKER_CONFIG",
    "DOCKER_LAYER",
    "DOCKER_LAYER_FOREIGN",
    "DOCKER_LAYER_GZIP",
    "DOCKER_MANIFEST",
    "DOCKER_MANIFEST_LIST",
    "INDEX_TYPES",
    "MANIFEST_TYPES",
    "OCI_CONFIG",
    "OCI_INDEX",
    "OCI_LAYER",
    "OCI_LAYER_GZIP",
    "OCI_LAYER_NONDIST",
    "OCI_LAYER_NONDIST_GZIP",
    "OCI_LAYER_NONDIST_ZSTD",
    "OCI_LAYER_ZSTD",
    "OCI_MANIFEST",
    "BadManifest",
    "Challenge",
    "Compression",
    "Descriptor",
    "Digest",
    "DigestError",
    "DigestVerifier",
    "ImageConfig",
    "Index",
    "Manifest",
    "NoMatchingPlatform",
    "Platform",
    "Token",
    "TokenCache",
    "UnsupportedMediaType",
    "layer_compression",
    "parse_errors",
    "parse_image_config",
    "parse_manifest",
    "parse_token_response",
    "parse_www_authenticate",
    "platform_matches",
    "select_platform",
    "verify_digest",
]

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST_V1 = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_MANIFEST_V1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
# Layers a registry is not expected to serve (fetched from `urls`): refused.
DOCKER_LAYER_FOREIGN = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
OCI_LAYER_NONDIST = "application/vnd.oci.image.layer.nondistributable.v1.tar"
OCI_LAYER_NONDIST_GZIP = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
OCI_LAYER_NONDIST_ZSTD = "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"

MANIFEST_TYPES = frozenset({DOCKER_MANIFEST, OCI_MANIFEST})
INDEX_TYPES = frozenset({DOCKER_MANIFEST_LIST, OCI_INDEX})
# The Accept header for manifest requests: indexes first so multi-arch images resolve.
ACCEPT = ", ".join([OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST])


class BadManifest(ValueError):
    """A manifest, index or image config that is malformed."""


class UnsupportedMediaType(ValueError):
    """A well-formed document or layer of a kind aenv does not handle."""


class NoMatchingPlatform(LookupError):
    """An index has no manifest for the requested platform; the message lists what it has."""


class DigestError(ValueError):
    """Content does not match its digest or size."""


# --- digests -----------------------------------------------------------------------------

_HEX_LEN = {"sha256": 64, "sha512": 128}


@dataclass(frozen=True, slots=True)
class Digest:
    """A content digest such as `sha256:<64 hex>` (sha256 and sha512 are supported)."""

    algorithm: str
    hex: str

    @classmethod
    def parse(cls, text: str) -> Digest:
        algo, sep, hexpart = text.partition(":")
        if not sep:
            raise DigestError(f"digest {text!r} is not of the form algorithm:hex")
        want = _HEX_LEN.get(algo)
        if want is None:
            raise DigestError(f"digest {text!r}: unsupported algorithm {algo!r}")
        if len(hexpart) != want or re.fullmatch(r"[0-9a-f]+", hexpart) is None:
            raise DigestError(f"digest {text!r}: expected {want} lowercase hex characters")
        return cls(algo, hexpart)

    @classmethod
    def of(cls, data: bytes, algorithm: str = "sha256") -> Digest:
        return cls(algorithm, hashlib.new(algorithm, data).hexdigest())

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hex}"


class DigestVerifier:
    """Checks a byte stream, fed in pieces, against an expected digest and size."""

    def __init__(self, expected: Digest | str, size: int | None = None) -> None:
        self.expected = expected if isinstance(expected, Digest) else Digest.parse(expected)
        self.size = size
        self.seen = 0
        self._hash = hashlib.new(self.expected.algorithm)

    def update(self, data: bytes) -> None:
        """Hash more bytes; raise `DigestError` as soon as more than `size` bytes arrived."""
        self.seen += len(data)
        if self.size is not None and self.seen > self.size:
            raise DigestError(
                f"content of {self.expected} is longer than the expected {self.size} bytes"
            )
        self._hash.update(data)

    def actual(self) -> Digest:
        return Digest(self.expected.algorithm, self._hash.hexdigest())

    def check(self) -> None:
        """Raise `DigestError` unless everything fed so far is exactly the expected content."""
        if self.size is not None and self.seen != self.size:
            raise DigestError(
                f"content of {self.expected} is {self.seen} bytes, expected {self.size}"
            )
        got = self.actual()
        if got != self.expected:
            raise DigestError(f"content digest mismatch: expected {self.expected}, got {got}")


def verify_digest(data: bytes, expected: Digest | str, size: int | None = None) -> None:
    """One-shot `DigestVerifier` for small documents (manifests, configs)."""
    v = DigestVerifier(expected, size)
    v.update(data)
    v.check()


# --- manifests ---------------------------------------------------------------------------

_ARCH_ALIASES = {
    "x86_64": "amd64",
    "x86-64": "amd64",
    "aarch64": "arm64",
    "armhf": "arm",
    "armel": "arm",
    "i386": "386",
}
_DEFAULT_VARIANT = {"arm64": "v8", "arm": "v7"}


def _norm_platform(os_: str, arch: str, variant: str | None) -> tuple[str, str, str]:
    os_ = os_.lower()
    raw = arch.lower()
    arch = _ARCH_ALIASES.get(raw, raw)
    var = (variant or "").lower()
    if raw == "armel" and not var:
        var = "v6"
    if var and var.isdigit():
        var = f"v{var}"
    if arch == "arm64" and var in ("", "v8"):
        var = "v8"
    return os_, arch, var


@dataclass(frozen=True, slots=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        base = f"{self.os}/{self.architecture}"
        return f"{base}/{self.variant}" if self.variant else base


@dataclass(frozen=True, slots=True)
class Descriptor:
    media_type: str
    digest: str  # validated "algo:hex"
    size: int
    platform: Platform | None = None
    urls: tuple[str, ...] = ()
    # (key, value) pairs of the descriptor's string annotations, sorted; e.g. the
    # TOC digest of an eStargz or zstd:chunked layer (aenv.images.toc)
    annotations: tuple[tuple[str, str], ...] = ()

    def annotation(self, key: str) -> str | None:
        return next((v for k, v in self.annotations if k == key), None)


@dataclass(frozen=True, slots=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True, slots=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadManifest(f"{what} must be a JSON object")
    return value


def _str(value: Any, what: str, *, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise BadManifest(f"{what} must be a string")
    return value


def _descriptor(value: Any, what: str) -> Descriptor:
    d = _obj(value, what)
    media_type = _str(d.get("mediaType"), f"{what}.mediaType")
    try:
        digest = str(Digest.parse(_str(d.get("digest"), f"{what}.digest")))
    except DigestError as e:
        raise BadManifest(f"{what}: {e}") from None
    size = d.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadManifest(f"{what}.size must be a non-negative integer")
    platform = None
    if d.get("platform") is not None:
        p = _obj(d["platform"], f"{what}.platform")
        platform = Platform(
            _str(p.get("os"), f"{what}.platform.os"),
            _str(p.get("architecture"), f"{what}.platform.architecture"),
            _str(p.get("variant"), f"{what}.platform.variant", optional=True) or None,
        )
    urls = d.get("urls") or []
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise BadManifest(f"{what}.urls must be a list of strings")
    raw = d.get("annotations") or {}
    if not isinstance(raw, dict):
        raise BadManifest(f"{what}.annotations must be a JSON object")
    # non-string values are not OCI annotations: ignored rather than refused
    notes = tuple(sorted((k, v) for k, v in raw.items() if isinstance(v, str)))
    return Descriptor(media_type, digest, size, platform, tuple(urls), notes)


def _bare_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def parse_manifest(raw: bytes, media_type: str) -> Manifest | Index:
    """Parse a manifest or index; `media_type` is the response's Content-Type.

    The document's own `mediaType` field wins when present; without it the
    Content-Type decides, and a generic type (`application/json`) falls back
    to the document's shape.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadManifest(f"manifest is not valid JSON: {e}") from None
    doc = _obj(doc, "manifest")
    if doc.get("schemaVersion") == 1 or _bare_type(media_type) in (
        DOCKER_MANIFEST_V1,
        DOCKER_MANIFEST_V1_SIGNED,
    ):
        raise UnsupportedMediaType(
            "Docker image manifest schema 1 is not supported (deprecated); re-push the image "
            "with a current client"
        )
    if doc.get("schemaVersion") != 2:
        raise BadManifest(f"unsupported manifest schemaVersion {doc.get('schemaVersion')!r}")
    kind = doc.get("mediaType") or _bare_type(media_type)
    if kind not in MANIFEST_TYPES | INDEX_TYPES:
        if "manifests" in doc and "layers" not in doc:
            kind = OCI_INDEX
        elif "layers" in doc:
            kind = OCI_MANIFEST
        else:
            raise UnsupportedMediaType(f"unsupported manifest media type {kind!r}")
    if kind in INDEX_TYPES:
        items = doc.get("manifests")
        if not isinstance(items, list):
            raise BadManifest("index.manifests must be a list")
        return Index(kind, tuple(_descriptor(m, f"manifests[{i}]") for i, m in enumerate(items)))
    config = _descriptor(doc.get("config"), "config")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise BadManifest("manifest.layers must be a list")
    return Manifest(
        kind, config, tuple(_descriptor(x, f"layers[{i}]") for i, x in enumerate(layers))
    )


def select_platform(
    index: Index, os: str = "linux", arch: str = "amd64", variant: str | None = None
) -> Descriptor:
    """The index entry for a platform; `NoMatchingPlatform` lists the ones available.

    Architectures are normalised as Docker does (`aarch64` is `arm64`, an
    arm64 entry without variant is `v8`). With `variant` None, an entry with
    the architecture's default variant is preferred, else the first match.
    """
    want_os, want_arch, want_var = _norm_platform(os, arch, variant)
    matches: list[tuple[str, Descriptor]] = []
    for d in index.manifests:
        if d.platform is None or d.media_type not in MANIFEST_TYPES | {""}:
            continue
        p_os, p_arch, p_var = _norm_platform(
            d.platform.os, d.platform.architecture, d.platform.variant
        )
        if p_os == want_os and p_arch == want_arch:
            matches.append((p_var, d))
    if variant is not None:
        for p_var, d in matches:
            if p_var == want_var:
                return d
    elif matches:
        default = _DEFAULT_VARIANT.get(want_arch, "")
        for p_var, d in matches:
            if p_var == default:
                return d
        return matches[0][1]
    asked = str(Platform(os, arch, variant))
    available = sorted({str(d.platform) for d in index.manifests if d.platform is not None})
    raise NoMatchingPlatform(
        f"no image for platform {asked}; available: {', '.join(available) or 'none'}"
    )


# --- layers ------------------------------------------------------------------------------


class Compression(enum.Enum):
    NONE = "none"
    GZIP = "gzip"
    ZSTD = "zstd"


_LAYER_COMPRESSION = {
    OCI_LAYER: Compression.NONE,
    DOCKER_LAYER: Compression.NONE,
    OCI_LAYER_GZIP: Compression.GZIP,
    DOCKER_LAYER_GZIP: Compression.GZIP,
    OCI_LAYER_ZSTD: Compression.ZSTD,
}
_FOREIGN = frozenset(
    {DOCKER_LAYER_FOREIGN, OCI_LAYER_NONDIST, OCI_LAYER_NONDIST_GZIP, OCI_LAYER_NONDIST_ZSTD}
)


def layer_compression(media_type: str) -> Compression:
    """How a layer blob is compressed; `UnsupportedMediaType` for anything but a tar layer."""
    found = _LAYER_COMPRESSION.get(media_type)
    if found is not None:
        return found
    if media_type in _FOREIGN:
        raise UnsupportedMediaType(
            f"layer type {media_type} is foreign/non-distributable (its content lives outside "
            "the registry); such images (e.g. Windows base layers) are not supported"
        )
    raise UnsupportedMediaType(f"unsupported layer media type {media_type!r}")


# --- image config ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageConfig:
    """The parts of an image config a sandbox needs. Missing or null fields are empty."""

    architecture: str = ""
    os: str = ""
    variant: str = ""
    env: tuple[str, ...] = ()  # "KEY=value"
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    diff_ids: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


def _str_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadManifest(f"image config {what} must be a list of strings")
    return tuple(value)


def parse_image_config(raw: bytes) -> ImageConfig:
    """Parse an image config blob, tolerating nulls and absent sections."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadManifest(f"image config is not valid JSON: {e}") from None
    doc = _obj(doc, "image config")
    cfg = doc.get("config") or {}
    cfg = _obj(cfg, "image config .config")
    rootfs = _obj(doc.get("rootfs") or {}, "image config .rootfs")
    diff_ids = _str_list(rootfs.get("diff_ids"), "rootfs.diff_ids")
    for d in diff_ids:
        try:
            Digest.parse(d)
        except DigestError as e:
            raise BadManifest(f"image config rootfs.diff_ids: {e}") from None
    labels = cfg.get("Labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise BadManifest("image config Labels must map strings to strings")
    return ImageConfig(
        architecture=_str(doc.get("architecture"), "architecture", optional=True),
        os=_str(doc.get("os"), "os", optional=True),
        variant=_str(doc.get("variant"), "variant", optional=True),
        env=_str_list(cfg.get("Env"), "Env"),
        working_dir=_str(cfg.get("WorkingDir"), "WorkingDir", optional=True),
        user=_str(cfg.get("User"), "User", optional=True),
        entrypoint=_str_list(cfg.get("Entrypoint"), "Entrypoint"),
        cmd=_str_list(cfg.get("Cmd"), "Cmd"),
        diff_ids=diff_ids,
        labels=dict(labels),
    )


def platform_matches(config: ImageConfig, os: str, arch: str, variant: str | None) -> bool:
    """Whether a single-platform image's config fits the platform (unknown fields fit)."""
    if not config.os or not config.architecture:
        return True
    got = _norm_platform(config.os, config.architecture, config.variant or None)
    want = _norm_platform(os, arch, variant)
    return got[:2] == want[:2] and (variant is None or not config.variant or got[2] == want[2])


# --- auth --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Challenge:
    """A `WWW-Authenticate` challenge: scheme lowercased ("bearer", "basic"), params by key."""

    scheme: str
    params: Mapping[str, str]

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")

    @property
    def service(self) -> str:
        return self.params.get("service", "")

    @property
    def scope(self) -> str:
        return self.params.get("scope", "")


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_SCHEME_RE = re.compile(rf"\s*({_TOKEN})(?:\s+|$)")
_PARAM_RE = re.compile(rf"\s*({_TOKEN})\s*=\s*")
_QUOTED_RE = re.compile(r'"((?:[^"\\]|\\.)*)"')
_BARE_RE = re.compile(rf"{_TOKEN}")


def parse_www_authenticate(header: str) -> Challenge:
    """Parse the first challenge of a `WWW-Authenticate` header (RFC 9110 auth-params)."""
    m = _SCHEME_RE.match(header)
    if m is None:
        raise ValueError(f"malformed WWW-Authenticate header {header!r}")
    scheme = m.group(1).lower()
    pos = m.end()
    params: dict[str, str] = {}
    while pos < len(header):
        while pos < len(header) and header[pos] in " \t,":
            pos += 1
        if pos >= len(header):
            break
        pm = _PARAM_RE.match(header, pos)
        if pm is None:
            break  # the start of a second challenge, or a token68: stop
        key = pm.group(1).lower()
        pos = pm.end()
        qm = _QUOTED_RE.match(header, pos)
        if qm is not None:
            value = re.sub(r"\\(.)", r"\1", qm.group(1))
            pos = qm.end()
        else:
            bm = _BARE_RE.match(header, pos)
            if bm is None:
                raise ValueError(f"malformed value for {key!r} in WWW-Authenticate {header!r}")
            value = bm.group(0)
            pos = bm.end()
        params.setdefault(key, value)
    return Challenge(scheme, params)


DEFAULT_TOKEN_LIFETIME = 60.0  # seconds, per the distribution token spec


@dataclass(frozen=True, slots=True)
class Token:
    value: str
    expires_at: float  # on the caller's clock


def parse_token_response(raw: bytes, *, now: float) -> Token:
    """Parse a token server's JSON answer (`token` or `access_token`, `expires_in`)."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("token server answer is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("token server answer is not a JSON object")
    value = doc.get("token") or doc.get("access_token")
    if not isinstance(value, str) or not value:
        raise ValueError("token server answer has no token")
    lifetime = doc.get("expires_in")
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_TOKEN_LIFETIME
    return Token(value, now + float(lifetime))


class TokenCache:
    """Bearer tokens by (registry, scope); a token is dropped `margin` seconds before expiry."""

    def __init__(self, *, margin: float = 10.0) -> None:
        self.margin = margin
        self._tokens: dict[tuple[str, str], Token] = {}

    def get(self, registry: str, scope: str, *, now: float) -> str | None:
        tok = self._tokens.get((registry, scope))
        if tok is None:
            return None
        if now >= tok.expires_at - self.margin:
            del self._tokens[(registry, scope)]
            return None
        return tok.value

    def put(self, registry: str, scope: str, token: Token) -> None:
        self._tokens[(registry, scope)] = token

    def drop(self, registry: str, scope: str) -> None:
        self._tokens.pop((registry, scope), None)


def parse_errors(raw: bytes) -> list[tuple[str, str]]:
    """The (code, message) pairs of a distribution error body; [] if it is not one."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return []
    errs = doc.get("errors") if isinstance(doc, dict) else None
    if not isinstance(errs, Sequence) or isinstance(errs, str):
        return []
    out = []
    for e in errs:
        if isinstance(e, dict):
            out.append((str(e.get("code", "")), str(e.get("message", ""))))
    return out
