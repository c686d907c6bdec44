"""Image references (`ubuntu:22.04`, `ghcr.io/o/r@sha256:...`), parsed as Docker does, sans-IO.

`parse_reference` splits a reference into registry, repository, tag and
digest and normalises it the way the Docker CLI does: a first path component
is a registry only if it contains `.` or `:` or is `localhost`; otherwise the
registry is `docker.io`, and a one-component Docker Hub name gets the
`library/` prefix. A reference with neither tag nor digest gets the tag
`latest`; one with both keeps both, and the digest is what gets pulled.
Components are validated against the distribution reference grammar
(lowercase path components, tag `[\\w][\\w.-]{0,127}`, digest `algo:hex`), and
anything else is rejected with `InvalidReference` naming the problem.
`str(ref)` is the canonical, fully qualified form and parses back to itself.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = [
    "DOCKER_HUB",
    "DOCKER_HUB_API",
    "ImageRef",
    "InvalidReference",
    "is_loopback",
    "parse_reference",
]

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
MAX_NAME_LEN = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"^(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?$"
)
_PATH_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$", re.ASCII)
_DIGEST_RE = re.compile(r"^([a-z0-9]+(?:[.+_-][a-z0-9]+)*):([a-zA-Z0-9=_-]+)$")
_HEX_LEN = {"sha256": 64, "sha384": 96, "sha512": 128}


class InvalidReference(ValueError):
    """A string that is not a valid image reference; the message says why."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A normalised image reference. `tag` is None only when pulled by digest alone."""

    registry: str  # "docker.io", "ghcr.io", "localhost:5000", "127.0.0.1:5000"
    repository: str  # "library/ubuntu", "o/r"
    tag: str | None = "latest"
    digest: str | None = None  # "sha256:<64 hex>"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    @property
    def api_host(self) -> str:
        """The host (and port) serving the registry API (`registry-1.docker.io` for Docker Hub)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def reference(self) -> str:
        """What to ask the manifest endpoint for: the digest if there is one, else the tag."""
        if self.digest is not None:
            return self.digest
        assert self.tag is not None
        return self.tag

    @property
    def name(self) -> str:
        """`registry/repository`, without tag or digest."""
        return f"{self.registry}/{self.repository}"


def _check_digest(text: str, whole: str) -> str:
    m = _DIGEST_RE.fullmatch(text)
    if m is None:
        raise InvalidReference(f"{whole!r}: digest {text!r} is not of the form algorithm:hex")
    algo, hexpart = m.groups()
    want = _HEX_LEN.get(algo)
    if want is None:
        raise InvalidReference(f"{whole!r}: unsupported digest algorithm {algo!r}")
    if len(hexpart) != want or re.fullmatch(r"[0-9a-f]+", hexpart) is None:
        raise InvalidReference(
            f"{whole!r}: {algo} digest must be {want} lowercase hex characters, got {hexpart!r}"
        )
    return text


def _split_domain(name: str) -> tuple[str | None, str]:
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return None, name


def parse_reference(text: str) -> ImageRef:
    """Parse and normalise an image reference; raise `InvalidReference` with the reason."""
    if not isinstance(text, str) or not text:
        raise InvalidReference("empty image reference")
    if text != text.strip() or any(c.isspace() for c in text):
        raise InvalidReference(f"{text!r}: image reference contains whitespace")
    rest, at, digest = text.partition("@")
    if at:
        _check_digest(digest, text)
    tag: str | None = None
    # A tag follows the last ':' only if no '/' comes after it (else it is a port).
    colon = rest.rfind(":")
    if colon > rest.rfind("/"):
        rest, tag = rest[:colon], rest[colon + 1 :]
        if _TAG_RE.fullmatch(tag) is None:
            raise InvalidReference(
                f"{text!r}: invalid tag {tag!r} (letters, digits, '_', '.', '-'; at most 128, "
                "not starting with '.' or '-')"
            )
    if not rest:
        raise InvalidReference(f"{text!r}: missing repository name")
    explicit, path = _split_domain(rest)
    if explicit is not None and _DOMAIN_RE.fullmatch(explicit) is None:
        raise InvalidReference(f"{text!r}: invalid registry host {explicit!r}")
    registry = explicit or DOCKER_HUB
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
    if not path:
        raise InvalidReference(f"{text!r}: missing repository name")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    for comp in path.split("/"):
        if not comp:
            raise InvalidReference(f"{text!r}: empty path component in repository {path!r}")
        if _PATH_COMPONENT_RE.fullmatch(comp) is None:
            if _PATH_COMPONENT_RE.fullmatch(comp.lower()) is not None:
                raise InvalidReference(f"{text!r}: repository name must be lowercase")
            raise InvalidReference(
                f"{text!r}: invalid repository path component {comp!r} (lowercase letters, "
                "digits and single '.', '_', '__' or '-' separators)"
            )
    if len(registry) + 1 + len(path) > MAX_NAME_LEN:
        raise InvalidReference(f"{text!r}: repository name longer than {MAX_NAME_LEN} characters")
    if tag is None and not at:
        tag = "latest"
    return ImageRef(registry, path, tag, digest if at else None)


def is_loopback(registry: str) -> bool:
    """Whether a registry host (`localhost:5000`, `127.0.0.1`, `[::1]:5000`) is on loopback."""
    host = registry
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
