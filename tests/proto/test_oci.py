"""OCI/Docker distribution documents: manifests, platform choice, configs, auth, digests."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto import oci

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
D3 = "sha256:" + "3" * 64


def _desc(digest: str, media_type: str, size: int = 10, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": size, **extra}


def _manifest(media_type: str = oci.DOCKER_MANIFEST, **over: Any) -> bytes:
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": media_type,
        "config": _desc(D1, oci.DOCKER_CONFIG),
        "layers": [_desc(D2, oci.DOCKER_LAYER_GZIP, 100), _desc(D3, oci.OCI_LAYER_ZSTD, 5)],
    }
    doc.update(over)
    return json.dumps(doc).encode()


def _index(*platforms: dict[str, str]) -> oci.Index:
    entries = [
        _desc("sha256:" + f"{i:x}" * 64, oci.OCI_MANIFEST, platform=p)
        for i, p in enumerate(platforms, 1)
    ]
    raw = json.dumps({"schemaVersion": 2, "mediaType": oci.OCI_INDEX, "manifests": entries})
    index = oci.parse_manifest(raw.encode(), oci.OCI_INDEX)
    assert isinstance(index, oci.Index)
    return index


def test_parse_docker_manifest() -> None:
    m = oci.parse_manifest(_manifest(), oci.DOCKER_MANIFEST)
    assert isinstance(m, oci.Manifest)
    assert m.config == oci.Descriptor(oci.DOCKER_CONFIG, D1, 10)
    assert [x.digest for x in m.layers] == [D2, D3]
    assert [oci.layer_compression(x.media_type) for x in m.layers] == [
        oci.Compression.GZIP,
        oci.Compression.ZSTD,
    ]


def test_media_type_from_header_or_shape() -> None:
    # OCI manifests may omit mediaType: the Content-Type header decides...
    doc = json.loads(_manifest())
    del doc["mediaType"]
    m = oci.parse_manifest(json.dumps(doc).encode(), oci.OCI_MANIFEST + "; charset=utf-8")
    assert isinstance(m, oci.Manifest) and m.media_type == oci.OCI_MANIFEST
    # ...and a generic header falls back to the document's shape
    idx = {"schemaVersion": 2, "manifests": [_desc(D1, oci.OCI_MANIFEST)]}
    parsed = oci.parse_manifest(json.dumps(idx).encode(), "application/json")
    assert isinstance(parsed, oci.Index)


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        (b"not json", oci.BadManifest, "not valid JSON"),
        (b"[]", oci.BadManifest, "JSON object"),
        (_manifest(schemaVersion=3), oci.BadManifest, "schemaVersion"),
        (_manifest(schemaVersion=1), oci.UnsupportedMediaType, "schema 1"),
        (_manifest(config=None), oci.BadManifest, "config must be"),
        (_manifest(layers={}), oci.BadManifest, "layers must be a list"),
        (
            _manifest(layers=[{"mediaType": "x", "size": 1}]),
            oci.BadManifest,
            r"layers\[0\]\.digest",
        ),
        (_manifest(layers=[_desc("sha256:zz", "x")]), oci.BadManifest, "lowercase hex"),
        (_manifest(layers=[_desc(D2, "x", -1)]), oci.BadManifest, "non-negative"),
        (_manifest(layers=[_desc(D2, "x", True)]), oci.BadManifest, "non-negative"),
        (
            json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.x"}).encode(),
            oci.UnsupportedMediaType,
            "application/vnd.x",
        ),
    ],
)
def test_bad_manifests(raw: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        oci.parse_manifest(raw, oci.DOCKER_MANIFEST)


@pytest.mark.parametrize(
    "media_type",
    [
        oci.DOCKER_LAYER_FOREIGN,
        oci.OCI_LAYER_NONDIST,
        oci.OCI_LAYER_NONDIST_GZIP,
        oci.OCI_LAYER_NONDIST_ZSTD,
    ],
)
def test_foreign_layers_are_refused(media_type: str) -> None:
    with pytest.raises(oci.UnsupportedMediaType, match="non-distributable"):
        oci.layer_compression(media_type)
    with pytest.raises(oci.UnsupportedMediaType, match="unsupported layer"):
        oci.layer_compression("application/vnd.cncf.helm.chart.content.v1.tar+gzip")


def test_select_platform() -> None:
    idx = _index(
        {"os": "linux", "architecture": "amd64"},
        {"os": "linux", "architecture": "arm", "variant": "v6"},
        {"os": "linux", "architecture": "arm", "variant": "v7"},
        {"os": "linux", "architecture": "arm64"},  # no variant means v8
        {"os": "unknown", "architecture": "unknown"},  # an attestation entry
    )
    pick = {d.digest: d for d in idx.manifests}
    assert oci.select_platform(idx).digest == idx.manifests[0].digest
    assert oci.select_platform(idx, arch="x86_64") == idx.manifests[0]
    assert oci.select_platform(idx, arch="arm64", variant="v8") == idx.manifests[3]
    assert oci.select_platform(idx, arch="aarch64", variant="8") == idx.manifests[3]
    assert oci.select_platform(idx, arch="arm64") == idx.manifests[3]
    assert oci.select_platform(idx, arch="arm") == idx.manifests[2]  # default variant v7
    assert oci.select_platform(idx, arch="arm", variant="v6") == idx.manifests[1]
    assert len(pick) == 5
    with pytest.raises(oci.NoMatchingPlatform) as e:
        oci.select_platform(idx, arch="s390x")
    assert str(e.value) == (
        "no image for platform linux/s390x; available: linux/amd64, linux/arm/v6, "
        "linux/arm/v7, linux/arm64, unknown/unknown"
    )
    with pytest.raises(oci.NoMatchingPlatform):
        oci.select_platform(idx, os="windows")
    arm64_v9 = _index({"os": "linux", "architecture": "arm64", "variant": "v9"})
    with pytest.raises(oci.NoMatchingPlatform):
        oci.select_platform(arm64_v9, arch="arm64", variant="v8")
    assert oci.select_platform(arm64_v9, arch="arm64") == arm64_v9.manifests[0]


def test_image_config() -> None:
    raw = json.dumps(
        {
            "architecture": "arm64",
            "os": "linux",
            "variant": "v8",
            "config": {
                "Env": ["PATH=/bin", "A=b=c"],
                "WorkingDir": "/app",
                "User": "1000:1000",
                "Entrypoint": ["/init"],
                "Cmd": ["serve", "--port", "80"],
                "Labels": {"k": "v"},
            },
            "rootfs": {"type": "layers", "diff_ids": [D1, D2]},
            "history": [{"created_by": "x"}],
        }
    ).encode()
    cfg = oci.parse_image_config(raw)
    assert cfg == oci.ImageConfig(
        architecture="arm64",
        os="linux",
        variant="v8",
        env=("PATH=/bin", "A=b=c"),
        working_dir="/app",
        user="1000:1000",
        entrypoint=("/init",),
        cmd=("serve", "--port", "80"),
        diff_ids=(D1, D2),
        labels={"k": "v"},
    )
    assert oci.platform_matches(cfg, "linux", "aarch64", None)
    assert not oci.platform_matches(cfg, "linux", "amd64", None)


def test_image_config_tolerates_nulls() -> None:
    raw = b'{"config": {"Env": null, "Cmd": null, "Entrypoint": null, "User": null,'
    raw += b' "WorkingDir": null, "Labels": null}, "rootfs": null}'
    assert oci.parse_image_config(raw) == oci.ImageConfig()
    assert oci.parse_image_config(b"{}") == oci.ImageConfig()
    with pytest.raises(oci.BadManifest, match="Env must be a list"):
        oci.parse_image_config(b'{"config": {"Env": "PATH=/bin"}}')
    with pytest.raises(oci.BadManifest, match="diff_ids"):
        oci.parse_image_config(b'{"rootfs": {"diff_ids": ["nope"]}}')


@pytest.mark.parametrize(
    ("header", "scheme", "params"),
    [
        (
            'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
            'scope="repository:library/ubuntu:pull"',
            "bearer",
            {
                "realm": "https://auth.docker.io/token",
                "service": "registry.docker.io",
                "scope": "repository:library/ubuntu:pull",
            },
        ),
        ('Basic realm="Registry Realm"', "basic", {"realm": "Registry Realm"}),
        (
            'bearer realm="https://x/t", scope="repository:a/b:pull,push repository:c:pull"',
            "bearer",
            {"realm": "https://x/t", "scope": "repository:a/b:pull,push repository:c:pull"},
        ),
        (
            'Bearer REALM = "a\\"b" , error=insufficient_scope',
            "bearer",
            {"realm": 'a"b', "error": "insufficient_scope"},
        ),
        ('Bearer realm="x", Basic realm="y"', "bearer", {"realm": "x"}),
        ("Basic", "basic", {}),
    ],
)
def test_www_authenticate(header: str, scheme: str, params: dict[str, str]) -> None:
    ch = oci.parse_www_authenticate(header)
    assert ch.scheme == scheme
    assert dict(ch.params) == params


_param_value = st.text(
    alphabet=st.characters(codec="ascii", exclude_characters="\x00\r\n"), max_size=30
)
_param_key = st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True)


@given(st.dictionaries(_param_key, _param_value, max_size=5), st.sampled_from(["Bearer", "Basic"]))
def test_www_authenticate_round_trip(params: dict[str, str], scheme: str) -> None:
    quoted = ", ".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"')) for k, v in params.items()
    )
    ch = oci.parse_www_authenticate(f"{scheme} {quoted}")
    assert ch.scheme == scheme.lower()
    assert dict(ch.params) == params


def test_token_response_and_cache() -> None:
    tok = oci.parse_token_response(b'{"token": "t1", "expires_in": 300}', now=1000.0)
    assert tok == oci.Token("t1", 1300.0)
    alt = oci.parse_token_response(b'{"access_token": "t2"}', now=0.0)
    assert alt == oci.Token("t2", oci.DEFAULT_TOKEN_LIFETIME)  # the spec's default
    with pytest.raises(ValueError, match="no token"):
        oci.parse_token_response(b'{"expires_in": 5}', now=0.0)
    with pytest.raises(ValueError, match="not JSON"):
        oci.parse_token_response(b"<html>", now=0.0)

    cache = oci.TokenCache(margin=10.0)
    cache.put("r.io", "repository:a:pull", tok)
    assert cache.get("r.io", "repository:a:pull", now=1200.0) == "t1"
    assert cache.get("r.io", "repository:b:pull", now=1200.0) is None  # per scope
    assert cache.get("other.io", "repository:a:pull", now=1200.0) is None  # per registry
    assert cache.get("r.io", "repository:a:pull", now=1291.0) is None  # expiring: dropped
    assert cache.get("r.io", "repository:a:pull", now=1200.0) is None


def test_parse_errors() -> None:
    body = b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown","detail":{}}]}'
    assert oci.parse_errors(body) == [("MANIFEST_UNKNOWN", "manifest unknown")]
    assert oci.parse_errors(b"404 page not found") == []
    assert oci.parse_errors(b'{"errors": "x"}') == []


def test_digest_parse_and_format() -> None:
    d = oci.Digest.parse(D1)
    assert (d.algorithm, str(d)) == ("sha256", D1)
    assert oci.Digest.of(b"abc") == oci.Digest("sha256", hashlib.sha256(b"abc").hexdigest())
    for bad in ["sha256", "sha256:" + "1" * 63, "md5:" + "1" * 32, "sha256:" + "G" * 64]:
        with pytest.raises(oci.DigestError):
            oci.Digest.parse(bad)


@given(st.lists(st.binary(max_size=200), max_size=8))
def test_verifier_incremental(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    good = "sha256:" + hashlib.sha256(whole).hexdigest()
    v = oci.DigestVerifier(good, len(whole))
    for p in pieces:
        v.update(p)
    v.check()
    assert str(v.actual()) == good
    oci.verify_digest(whole, good, len(whole))
    with pytest.raises(oci.DigestError, match="mismatch"):
        oci.verify_digest(whole + b"", "sha256:" + hashlib.sha256(whole + b"x").hexdigest())
    with pytest.raises(oci.DigestError, match="bytes"):
        oci.verify_digest(whole, good, len(whole) + 1)  # too short
    with pytest.raises(oci.DigestError, match="longer"):
        oci.DigestVerifier(good, len(whole)).update(whole + b"x")  # too long, caught early


def test_accept_lists_every_manifest_type() -> None:
    accepted = {t.strip() for t in oci.ACCEPT.split(",")}
    assert accepted == {
        oci.OCI_INDEX,
        oci.DOCKER_MANIFEST_LIST,
        oci.OCI_MANIFEST,
        oci.DOCKER_MANIFEST,
    }
