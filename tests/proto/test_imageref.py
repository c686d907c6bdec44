"""Image reference parsing and normalisation, as the Docker CLI does it."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from aenv.proto.imageref import ImageRef, InvalidReference, is_loopback, parse_reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ubuntu", ImageRef("docker.io", "library/ubuntu", "latest")),
        ("ubuntu:22.04", ImageRef("docker.io", "library/ubuntu", "22.04")),
        ("bitnami/redis:7", ImageRef("docker.io", "bitnami/redis", "7")),
        ("docker.io/ubuntu", ImageRef("docker.io", "library/ubuntu", "latest")),
        ("index.docker.io/library/ubuntu:1", ImageRef("docker.io", "library/ubuntu", "1")),
        (f"ghcr.io/o/r@{D}", ImageRef("ghcr.io", "o/r", None, D)),
        (f"ghcr.io/o/r:v1@{D}", ImageRef("ghcr.io", "o/r", "v1", D)),
        ("localhost:5000/x", ImageRef("localhost:5000", "x", "latest")),
        ("localhost/x:t", ImageRef("localhost", "x", "t")),
        ("127.0.0.1:5000/a/b:t", ImageRef("127.0.0.1:5000", "a/b", "t")),
        ("[::1]:5000/a:b", ImageRef("[::1]:5000", "a", "b")),
        ("quay.io/a/b/c/d:x_Y.1-z", ImageRef("quay.io", "a/b/c/d", "x_Y.1-z")),
        # no '.', ':' or 'localhost' in the first component: a Docker Hub namespace
        ("myhost/app", ImageRef("docker.io", "myhost/app", "latest")),
        ("a__b/c-d/e.f_g", ImageRef("docker.io", "a__b/c-d/e.f_g", "latest")),
    ],
)
def test_parse(text: str, expected: ImageRef) -> None:
    assert parse_reference(text) == expected


def test_canonical_form_and_api_host() -> None:
    ref = parse_reference("ubuntu:22.04")
    assert str(ref) == "docker.io/library/ubuntu:22.04"
    assert ref.api_host == "registry-1.docker.io"
    assert ref.reference == "22.04"
    both = parse_reference(f"ghcr.io/o/r:v1@{D}")
    assert str(both) == f"ghcr.io/o/r:v1@{D}"
    assert both.api_host == "ghcr.io"
    assert both.reference == D  # the digest wins for pulling


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("Ubuntu", "must be lowercase"),
        ("ghcr.io/Org/app", "must be lowercase"),
        ("ubuntu:", "invalid tag"),
        ("ubuntu:-x", "invalid tag"),
        ("ubuntu:" + "a" * 129, "invalid tag"),
        ("ubuntu@sha256:abc", "64 lowercase hex"),
        ("ubuntu@sha256:" + "AB" * 32, "64 lowercase hex"),
        ("ubuntu@md5:" + "a" * 32, "unsupported digest algorithm"),
        ("ubuntu@latest", "algorithm:hex"),
        ("a//b", "empty path component"),
        ("a/b/", "empty path component"),
        ("a b", "whitespace"),
        ("a/-b", "invalid repository path component"),
        ("a/b..c", "invalid repository path component"),
        ("bad_host.io/x", "invalid registry host"),
        ("-h.io/x", "invalid registry host"),
        ("h.io:port/x", "invalid registry host"),
        ("h.io/" + "a" * 260, "longer than 255"),
    ],
)
def test_invalid(text: str, reason: str) -> None:
    with pytest.raises(InvalidReference, match=reason):
        parse_reference(text)


@pytest.mark.parametrize(
    ("registry", "loop"),
    [
        ("localhost", True),
        ("localhost:5000", True),
        ("LOCALHOST:1", True),
        ("127.0.0.1", True),
        ("127.3.2.1:5000", True),
        ("[::1]:5000", True),
        ("::1", True),
        ("10.0.0.1:5000", False),
        ("docker.io", False),
        ("localhost.example.com", False),
        ("[::2]:5000", False),
    ],
)
def test_is_loopback(registry: str, loop: bool) -> None:
    assert is_loopback(registry) is loop


_comp = st.from_regex(r"[a-z0-9]{1,5}(?:(?:[._]|__|-{1,2})[a-z0-9]{1,5}){0,2}", fullmatch=True)
_domain = st.sampled_from(
    [
        "",
        "docker.io/",
        "ghcr.io/",
        "localhost/",
        "localhost:5000/",
        "127.0.0.1:5000/",
        "r.example.com:443/",
    ]
)
_tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
_digest = st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True)


@given(
    domain=_domain,
    path=st.lists(_comp, min_size=1, max_size=4),
    tag=st.none() | _tag,
    digest=st.none() | _digest,
)
def test_round_trip(domain: str, path: list[str], tag: str | None, digest: str | None) -> None:
    # without a registry, a first component with a '.' would be taken for one
    assume(domain or "." not in path[0] or len(path) == 1)
    text = domain + "/".join(path) + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse_reference(text)
    assert parse_reference(str(ref)) == ref
    assert str(parse_reference(str(ref))) == str(ref)
    assert ref.repository.endswith("/".join(path))
    assert ref.digest == digest
    assert ref.tag == (tag or (None if digest else "latest"))


@given(st.text(max_size=40))
def test_never_crashes_on_garbage(text: str) -> None:
    try:
        ref = parse_reference(text)
    except InvalidReference:
        return
    assert parse_reference(str(ref)) == ref
