"""The test registry and image builder themselves: images they make are what skopeo/umoci see.

Every image here is pushed to a real `docker-registry`, read back by skopeo
and unpacked by umoci, so a test using these helpers can trust that the
image it pushed holds what it asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

import tests.registry as reg_mod
from tests.registry import (
    BUSYBOX,
    Layer,
    LocalRegistry,
    busybox_layer,
    chardev,
    compare_trees,
    directory,
    fifo,
    file,
    hardlink,
    opaque,
    push_big_image,
    push_busybox,
    push_image,
    push_index,
    push_rootfs_dir,
    random_bytes,
    random_file,
    reference_unpack,
    symlink,
    whiteout,
)

pytestmark = [
    pytest.mark.skipif(shutil.which("skopeo") is None, reason="needs skopeo"),
    pytest.mark.skipif(shutil.which("umoci") is None, reason="needs umoci"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (umoci keeps owners)"),
]


def skopeo(*args: str, creds: tuple[str, str] | None = None, check: bool = True) -> Any:
    auth = [f"--creds={creds[0]}:{creds[1]}"] if creds else ["--no-creds"]
    cmd = ["skopeo", *args[:-1], "--tls-verify=false", *auth, args[-1]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if not check:
        return p
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_registry_answers_and_auth_registry_demands_credentials(
    registry: LocalRegistry, registry_auth: LocalRegistry
) -> None:
    assert httpx.get(f"{registry.url}/v2/").status_code == 200
    r = httpx.get(f"{registry_auth.url}/v2/")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].lower().startswith("basic")
    assert registry_auth.credentials is not None
    assert httpx.get(f"{registry_auth.url}/v2/", auth=registry_auth.credentials).status_code == 200
    assert httpx.get(f"{registry_auth.url}/v2/", auth=("aenv", "wrong")).status_code == 401


def test_restart_keeps_port_and_storage_then_context_exit_leaves_nothing() -> None:
    with LocalRegistry() as r:
        img = push_image(r, "keep", "t", [Layer.build([file("f", "kept\n")])])
        manifest_url = f"{r.url}/v2/keep/manifests/t"
        accept = {"accept": img.manifest_media_type}
        assert httpx.get(manifest_url, headers=accept).status_code == 200
        r.stop()
        with pytest.raises(httpx.TransportError):
            httpx.get(manifest_url, timeout=1)
        r.start(keep_port=True)
        got = httpx.get(manifest_url, headers=accept)
        assert got.status_code == 200 and got.content == img.manifest
        assert r.proc is not None
        pid, workdir = r.proc.pid, r.workdir
    assert not Path(f"/proc/{pid}").exists()
    assert not workdir.exists()
    with pytest.raises(httpx.TransportError):
        httpx.get(manifest_url, timeout=1)


@pytest.mark.parametrize(
    ("compression", "docker"),
    [("gzip", False), ("zstd", False), ("none", False), ("gzip", True)],
)
def test_busybox_pushes_and_unpacks(
    registry: LocalRegistry, tmp_path: Path, compression: Any, docker: bool
) -> None:
    config = {
        "Env": ["PATH=/bin", "GREETING=hello world"],
        "WorkingDir": "/home/app",
        "User": "1000:1000",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["echo hi"],
    }
    kind = "docker" if docker else "oci"  # repository names are lower case
    img = push_busybox(
        registry,
        repo=f"busybox-{compression}-{kind}",
        compression=compression,
        config=config,
        docker_media_types=docker,
    )
    assert img.ref == f"{registry.host}/busybox-{compression}-{kind}:latest"

    info = skopeo("inspect", f"docker://{img.ref}")
    assert info["Digest"] == img.manifest_digest
    assert info["Env"] == config["Env"]
    assert info["Layers"] == img.layer_digests
    full = skopeo("inspect", "--config", f"docker://{img.ref}")
    for key, value in config.items():
        assert full["config"][key] == value
    assert full["rootfs"] == {"type": "layers", "diff_ids": img.diff_ids}
    raw = skopeo("inspect", "--raw", f"docker://{img.ref}")
    want = {
        ("gzip", False): "application/vnd.oci.image.layer.v1.tar+gzip",
        ("zstd", False): "application/vnd.oci.image.layer.v1.tar+zstd",
        ("none", False): "application/vnd.oci.image.layer.v1.tar",
        ("gzip", True): "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }[(compression, docker)]
    assert [layer["mediaType"] for layer in raw["layers"]] == [want]
    assert raw["mediaType"] == img.manifest_media_type

    root = reference_unpack(registry, img, tmp_path / "unpack")
    assert sha256(root / "bin/busybox") == sha256(BUSYBOX)
    assert os.readlink(root / "bin/sh") == "busybox"
    assert os.readlink(root / "bin/cat") == "busybox"
    assert stat.S_IMODE(os.lstat(root / "tmp").st_mode) == 0o1777
    assert stat.S_IMODE(os.lstat(root / "root").st_mode) == 0o700
    home = os.lstat(root / "home/app")
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert "app:x:1000:1000:" in (root / "etc/passwd").read_text()
    out = subprocess.run(
        ["chroot", str(root), "/bin/sh", "-c", "cat /etc/hostname; id -u app"],
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["busybox", "1000"], out.stderr


def _two_layers(compression: Any) -> tuple[Layer, Layer]:
    long_dir = "deep/" + "d" * 120
    lower = Layer.build(
        [
            directory("etc"),
            file("etc/gone", "to be whited out\n"),
            file("etc/kept", "kept\n", mode=0o600, uid=1000, gid=1000),
            directory("opt"),
            directory("opt/dir", mode=0o750),
            file("opt/dir/a", "a\n"),
            directory("opt/dir/sub"),
            file("opt/dir/sub/c", "c\n"),
            directory("data"),
            file("data/orig", "shared bytes\n", mode=0o755),
            hardlink("data/link", "data/orig"),
            file("data/xattr", "x\n", xattrs={"user.note": "hi", "user.bin": b"\x00\xff"}),
            file("data/suid", "s\n", mode=0o4755),
            file("data/\u00e9t\u00e9.txt", "summer\n"),
            fifo("data/pipe", mode=0o600),
            chardev("data/null", 1, 3),
            symlink("data/abs", "/etc/kept"),
            directory("var"),
            directory("var/cache"),
            file("var/cache/junk", "junk\n"),
            directory("deep"),
            directory(long_dir),
            file(f"{long_dir}/f", "long path\n"),
            random_file("data/random.bin", 3 * (1 << 20) + 17, seed=7),
        ],
        compression=compression,
    )
    upper = Layer.build(
        [
            whiteout("etc/gone"),
            opaque("opt/dir"),
            file("opt/dir/new", "new\n"),
            whiteout("var/cache"),
            file("etc/kept", "changed\n", mode=0o640, uid=1000, gid=1000),
            hardlink("data/link2", "data/orig"),
        ],
        compression=compression,
    )
    return lower, upper


def _expected_tree(dest: Path) -> None:
    """By hand, what `_two_layers` merges to."""

    def mk(rel: str, content: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        p = dest / rel
        p.write_bytes(content)
        os.chown(p, uid, gid)
        os.chmod(p, mode)
        os.utime(p, (reg_mod.MTIME, reg_mod.MTIME))

    def md(rel: str, mode: int = 0o755) -> None:
        (dest / rel).mkdir()
        os.chmod(dest / rel, mode)

    dest.mkdir()
    for d in ("etc", "opt", "data", "var", "deep", "deep/" + "d" * 120):
        md(d)
    md("opt/dir", 0o750)
    mk("etc/kept", b"changed\n", 0o640, 1000, 1000)
    mk("opt/dir/new", b"new\n")
    mk("data/orig", b"shared bytes\n", 0o755)
    os.link(dest / "data/orig", dest / "data/link")
    os.link(dest / "data/orig", dest / "data/link2")
    mk("data/xattr", b"x\n")
    os.setxattr(dest / "data/xattr", "user.note", b"hi")
    os.setxattr(dest / "data/xattr", "user.bin", b"\x00\xff")
    mk("data/suid", b"s\n", 0o4755)
    mk("data/\u00e9t\u00e9.txt", b"summer\n")
    os.mkfifo(dest / "data/pipe", 0o600)
    os.utime(dest / "data/pipe", (reg_mod.MTIME, reg_mod.MTIME))
    os.mknod(dest / "data/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.chmod(dest / "data/null", 0o666)
    os.utime(dest / "data/null", (reg_mod.MTIME, reg_mod.MTIME))
    os.symlink("/etc/kept", dest / "data/abs")
    os.utime(dest / "data/abs", (reg_mod.MTIME, reg_mod.MTIME), follow_symlinks=False)
    mk("deep/" + "d" * 120 + "/f", b"long path\n")
    mk("data/random.bin", random_bytes(3 * (1 << 20) + 17, seed=7))


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_whiteouts_opaque_hardlinks_xattrs_devices_as_umoci_applies_them(
    registry: LocalRegistry, tmp_path: Path, compression: Any
) -> None:
    lower, upper = _two_layers(compression)
    img = push_image(registry, f"layered-{compression}", "v1", [lower, upper])
    assert img.contents == {
        "data/random.bin": hashlib.sha256(random_bytes(3 * (1 << 20) + 17, seed=7)).hexdigest()
    }
    root = reference_unpack(registry, img, tmp_path / "unpack")
    expected = tmp_path / "expected"
    _expected_tree(expected)

    assert compare_trees(root, expected, ignore=["/"]) == []

    # and compare_trees does see each kind of difference
    os.chmod(expected / "data/suid", 0o755)
    os.unlink(expected / "data/link2")
    shutil.copy2(expected / "data/orig", expected / "data/link2")
    os.removexattr(expected / "data/xattr", "user.bin")
    (expected / "opt/dir/a").write_text("a\n")
    os.chown(expected / "etc/kept", 0, 1000)
    with (expected / "data/random.bin").open("r+b") as f:
        f.seek(1 << 20)
        f.write(b"?")
    os.utime(expected / "data/random.bin", (reg_mod.MTIME, reg_mod.MTIME))
    diffs = compare_trees(root, expected, ignore=["/"])
    text = "\n".join(diffs)
    assert "data/suid: mode '0o4755' != '0o755'" in text
    assert "data/link2: hardlinks" in text
    assert "data/xattr: xattrs" in text
    assert "opt/dir/a: only in b" in text
    assert "etc/kept: uid 1000 != 0" in text
    assert "data/random.bin: sha256" in text
    assert len(diffs) == 8, text  # data/orig, data/link also lose their third link


def test_layers_are_reproducible() -> None:
    a, b = _two_layers("gzip"), _two_layers("gzip")
    assert [x.digest for x in a] == [x.digest for x in b]
    assert a[0].diff_id != a[0].digest
    assert hashlib.sha256(a[0].tar_bytes()).hexdigest() == a[0].diff_id.removeprefix("sha256:")


def test_multi_arch_index(registry: LocalRegistry, tmp_path: Path) -> None:
    images = {}
    for platform, arch, variant in (
        ("linux/amd64", "amd64", None),
        ("linux/arm64/v8", "arm64", "v8"),
    ):
        marker = Layer.build([directory("etc"), file("etc/arch", arch + "\n")])
        images[platform] = push_busybox(
            registry, "multi", None, extra_layers=[marker], arch=arch, variant=variant
        )
    index = push_index(registry, "multi", "latest", images)

    raw = skopeo("inspect", "--raw", f"docker://{index.ref}")
    assert raw["mediaType"] == "application/vnd.oci.image.index.v1+json"
    platforms = {m["digest"]: m["platform"] for m in raw["manifests"]}
    assert platforms == {
        images["linux/amd64"].manifest_digest: {"os": "linux", "architecture": "amd64"},
        images["linux/arm64/v8"].manifest_digest: {
            "os": "linux",
            "architecture": "arm64",
            "variant": "v8",
        },
    }
    arm = skopeo("--override-arch", "arm64", "inspect", f"docker://{index.ref}")
    assert arm["Architecture"] == "arm64"
    assert arm["Digest"] == index.digest  # skopeo names what the tag points at
    assert arm["Layers"] == images["linux/arm64/v8"].layer_digests
    amd = skopeo("--override-arch", "amd64", "inspect", f"docker://{index.ref}")
    assert amd["Layers"] == images["linux/amd64"].layer_digests
    root = reference_unpack(registry, index, tmp_path / "arm", arch="arm64", variant="v8")
    assert (root / "etc/arch").read_text() == "arm64\n"
    root = reference_unpack(registry, index, tmp_path / "amd", arch="amd64")
    assert (root / "etc/arch").read_text() == "amd64\n"


def test_auth_registry_refuses_anonymous_and_accepts_credentials(
    registry_auth: LocalRegistry, tmp_path: Path
) -> None:
    for auth in (False, ("aenv", "wrong")):
        with pytest.raises(httpx.HTTPStatusError) as err:
            push_busybox(registry_auth, "private", auth=auth)
        assert err.value.response.status_code == 401
    img = push_busybox(registry_auth, "private")  # the registry's own credentials
    assert registry_auth.credentials is not None
    refused = skopeo("inspect", f"docker://{img.ref}", check=False)
    assert refused.returncode != 0
    assert "unauthorized" in refused.stderr.lower() or "401" in refused.stderr
    assert httpx.get(f"{registry_auth.url}/v2/private/manifests/latest").status_code == 401
    info = skopeo("inspect", f"docker://{img.ref}", creds=registry_auth.credentials)
    assert info["Digest"] == img.manifest_digest
    root = reference_unpack(registry_auth, img, tmp_path / "unpack")
    assert (root / "bin/busybox").is_file()


def test_big_image_chunked_upload(
    registry: LocalRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # force the PATCH path (normally for blobs > 64 MiB) on a small image
    monkeypatch.setattr(reg_mod, "CHUNKED_UPLOAD_OVER", 1 << 20)
    monkeypatch.setattr(reg_mod, "UPLOAD_CHUNK", 300_000)
    img = push_big_image(
        registry, "big", "t", total_mb=4, files=5, layers=2, compression="none", seed=3
    )
    assert len(img.layers) == 2 and all(layer.size > 1 << 20 for layer in img.layers)
    assert len(img.contents) == 5
    assert sum(int(x.size) for x in img.layers) > 4 << 20
    root = reference_unpack(registry, img, tmp_path / "unpack")
    got = {
        str(p.relative_to(root)): sha256(p) for p in (root / "big").rglob("*.bin") if p.is_file()
    }
    assert got == img.contents
    assert len({os.path.getsize(root / p) for p in got}) == 5  # varied sizes


def test_rootfs_dir_round_trips(registry: LocalRegistry, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "usr/bin").mkdir(parents=True)
    (src / "usr/bin/tool").write_bytes(os.urandom(5000))
    os.chmod(src / "usr/bin/tool", 0o755)
    os.link(src / "usr/bin/tool", src / "usr/bin/tool-alias")
    os.symlink("tool", src / "usr/bin/t")
    (src / "home/u").mkdir(parents=True)
    os.chown(src / "home/u", 1000, 1000)
    (src / "home/u/.profile").write_text("export A=1\n")
    os.chown(src / "home/u/.profile", 1000, 1000)
    os.setxattr(src / "home/u/.profile", "user.tag", b"v")
    os.mkfifo(src / "home/u/pipe")
    (src / "empty").mkdir(mode=0o711)
    os.chmod(src / "empty", 0o711)

    img = push_rootfs_dir(registry, "rootfs", "t", src)
    root = reference_unpack(registry, img, tmp_path / "unpack")
    assert compare_trees(src, root, ignore=["/"]) == []


@pytest.mark.skipif(
    not os.environ.get("AENV_TEST_HOME")
    or not Path(os.environ.get("AENV_TEST_HOME", "/"), "templates/base/rootfs").is_dir(),
    reason="needs AENV_TEST_HOME with templates/base/rootfs (make test)",
)
@pytest.mark.slow
def test_debian_rootfs_round_trips(registry: LocalRegistry, tmp_path: Path) -> None:
    src = Path(os.environ["AENV_TEST_HOME"], "templates/base/rootfs")
    img = push_rootfs_dir(registry, "debian", "t", src)
    root = reference_unpack(registry, img, tmp_path / "unpack")
    assert compare_trees(src, root, ignore=["/"]) == []


def test_busybox_layer_is_cached_per_compression() -> None:
    assert busybox_layer() is busybox_layer()
    assert busybox_layer().digest != busybox_layer(compression="zstd").digest
