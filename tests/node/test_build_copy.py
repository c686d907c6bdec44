"""COPY, uploads, cache keys and tags of template builds, without a sandbox.

Rules: archives are made by the real e2b SDK's `tar_file_stream` from a real
directory; the placing script `aenv.node.buildcopy.script` writes is run by
the host's real `/bin/sh` over a staging directory laid out as envd would
lay it out, and the tree it leaves is checked; uploads go through a real
`BuildFiles` on disk; tags through a real `TagStore`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2b.template.utils import tar_file_stream

from aenv.api.builds import BadBuild, parse_build_start
from aenv.node.buildcache import chain, final_key
from aenv.node.buildcopy import CopyError, matches, read_members, script
from aenv.node.buildfiles import BadUpload, BuildFiles, ContentRange, parse_content_range
from aenv.node.buildtags import BadTag, TagNotFound, TagStore, check_tag
from aenv.storage.templates import Template


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "app" / "lib").mkdir(parents=True)
    (ctx / "app" / "run.sh").write_text("echo run\n")
    (ctx / "app" / "run.sh").chmod(0o750)
    (ctx / "app" / "lib" / "a.txt").write_text("a")
    (ctx / "app" / "empty").mkdir()
    (ctx / "app" / "link").symlink_to("run.sh")
    (ctx / "one.txt").write_text("one")
    (ctx / "two.txt").write_text("two")
    return ctx


def archive(context: Path, src: str, dest: Path) -> Path:
    f = tar_file_stream(src, str(context), [], False, True)
    dest.write_bytes(f.read())
    f.close()
    return dest


def place(tmp_path: Path, arch: Path, src: str, dest: str, **kw: object) -> Path:
    """Stage `arch` as envd would (regular files only), run the script; the root."""
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    staging = tmp_path / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(arch) as tar:
        for info in tar:
            if info.isreg():
                target = staging / info.name
                target.parent.mkdir(parents=True, exist_ok=True)
                f = tar.extractfile(info)
                assert f is not None
                target.write_bytes(f.read())
                target.chmod(0o644)  # what an upload through envd gives
    staging.mkdir(exist_ok=True)
    text = script(
        read_members(arch),
        src,
        dest,
        workdir=str(root / "work"),
        staging=str(staging),
        owner=kw.get("owner"),  # type: ignore[arg-type]
        mode=kw.get("mode"),  # type: ignore[arg-type]
    )
    subprocess.run(["/bin/sh", "-c", text], check=True)
    return root


def test_a_directory_copies_its_contents_with_modes_links_and_empty_dirs(
    tmp_path: Path, context: Path
) -> None:
    arch = archive(context, "app", tmp_path / "a.tar")
    root = place(tmp_path, arch, "app", str(tmp_path / "root" / "srv" / "app"))
    app = root / "srv" / "app"
    assert (app / "lib" / "a.txt").read_text() == "a"
    assert (app / "run.sh").stat().st_mode & 0o7777 == 0o750
    assert os.readlink(app / "link") == "run.sh"
    assert (app / "empty").is_dir()
    assert not (app / "app").exists()  # contents, not the directory itself


def test_a_file_goes_to_dest_or_into_a_directory(tmp_path: Path, context: Path) -> None:
    arch = archive(context, "one.txt", tmp_path / "o.tar")
    root = tmp_path / "root"
    place(tmp_path, arch, "one.txt", str(root / "etc") + "/")
    assert (root / "etc" / "one.txt").read_text() == "one"
    place(tmp_path, arch, "one.txt", "renamed.txt", mode=0o600)  # relative: under WORKDIR
    assert (root / "work" / "renamed.txt").read_text() == "one"
    assert (root / "work" / "renamed.txt").stat().st_mode & 0o7777 == 0o600
    (root / "existing").mkdir()
    place(tmp_path, arch, "one.txt", str(root / "existing"))  # an existing directory
    assert (root / "existing" / "one.txt").read_text() == "one"


def test_globs_match_several_files_into_a_directory(tmp_path: Path, context: Path) -> None:
    arch = archive(context, "*.txt", tmp_path / "g.tar")
    members = read_members(arch)
    assert [m.name for m in matches(members, "*.txt")] == ["one.txt", "two.txt"]
    root = place(tmp_path, arch, "*.txt", str(tmp_path / "root" / "texts"))
    assert sorted(p.name for p in (root / "texts").iterdir()) == ["one.txt", "two.txt"]
    with pytest.raises(CopyError, match="no files match"):
        script(members, "nope", "/x", workdir="/", staging="/s", owner=None, mode=None)


def test_owner_is_set_on_what_was_copied(tmp_path: Path, context: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    arch = archive(context, "app", tmp_path / "a.tar")
    root = place(tmp_path, arch, "app", str(tmp_path / "root" / "o"), owner="nobody")
    assert {(root / "o" / p).stat().st_uid for p in ("run.sh", "lib/a.txt")} == {65534}


def test_archives_leaving_the_context_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info)
    with pytest.raises(CopyError, match="leaves the build context"):
        read_members(bad)


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def test_uploads_are_signed_resumable_and_checked(tmp_path: Path, context: Path) -> None:
    files = BuildFiles(tmp_path / "files", b"key")
    data = archive(context, "app", tmp_path / "a.tar").read_bytes()
    h = hashlib.sha256(b"x").hexdigest()
    q = dict(kv.split("=") for kv in files.upload_query(h, now=1000.0).split("&"))
    files.check_signature(h, q["expires"], q["sig"], now=1000.0)
    with pytest.raises(BadUpload, match="invalid"):
        files.check_signature(hashlib.sha256(b"y").hexdigest(), q["expires"], q["sig"], now=1000)
    with pytest.raises(BadUpload, match="expired"):
        files.check_signature(h, q["expires"], q["sig"], now=1000.0 + 7200)
    half = len(data) // 2
    assert not await files.receive(h, chunks(data[:half]), ContentRange(0, half - 1, len(data)))
    assert files.received(h) == half and not files.present(h)
    with pytest.raises(BadUpload) as wrong:
        await files.receive(
            h, chunks(data[half:]), ContentRange(3, len(data) - half + 2, len(data))
        )
    assert wrong.value.status == 416
    rest = ContentRange(half, len(data) - 1, len(data))
    assert await files.receive(h, chunks(data[half:]), rest)
    assert files.present(h) and files.path(h).read_bytes() == data
    other = hashlib.sha256(b"z").hexdigest()
    with pytest.raises(BadUpload, match="not a tar"):
        await files.receive(other, chunks(b"garbage" * 100), None)
    assert not files.present(other) and files.received(other) == 0
    assert parse_content_range("bytes */10") == ContentRange(None, None, 10)
    with pytest.raises(BadUpload):
        parse_content_range("bytes 5-2/10")


def test_cache_keys_chain_every_input() -> None:
    base = chain("image", "sha256:abc")
    k = chain(base, "RUN", ("echo",), None)
    assert k == chain(base, "RUN", ("echo",), None)
    assert k != chain(base, "RUN", ("echo ",), None)
    assert chain(k, "COPY", ("a", "/b"), "h1") != chain(k, "COPY", ("a", "/b"), "h2")
    assert chain(chain("image", "sha256:abd"), "RUN", ("echo",), None) != k
    f = final_key(k, template_id="t", start_cmd=None, ready_cmd=None)
    assert f != final_key(k, template_id="t", start_cmd="srv", ready_cmd=None)
    assert f != final_key(k, template_id="t", start_cmd=None, ready_cmd=None, memory_mb=512)


def built(build_id: str, snap: str) -> Template:
    return Template(
        template_id="tpl",
        build_id=build_id,
        aliases=("app",),
        rootfs=Path("/r"),
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=1,
        created_at=1.0,
        updated_at=2.0,
        snapshot_id=snap,
        env=(f"B={build_id}",),
    )


def test_tags_move_resolve_and_release_builds(tmp_path: Path) -> None:
    tags = TagStore(tmp_path)
    b1, b2 = built("b1", "s1"), built("b2", "s2")
    assert tags.default_moves("tpl", ["v1"])  # no default yet: the first build is current
    assert tags.record(b1, ["v1"], current="b1") == []
    assert tags.record(b2, ["default"], current="b2") == []
    assert not tags.default_moves("tpl", ["v2"])  # default names b2: a v2 build is not current
    assert tags.resolve(b2, "v1").snapshot_id == "s1"
    assert tags.resolve(b2, "v1").env == ("B=b1",)
    assert tags.resolve(b2, "b1").build_id == "b1"  # by build ID
    assert tags.resolve(b2, "default").build_id == "b2"
    assert tags.assign("tpl", "v1", ["stable"], current="b2") == "b1"
    assert tags.remove("tpl", ["v1"], current="b2") == []  # stable still names b1
    assert tags.remove("tpl", ["stable"], current="b2") == ["s1"]  # now nothing does
    with pytest.raises(TagNotFound):
        tags.resolve(b2, "v1")
    with pytest.raises(TagNotFound):
        tags.remove("tpl", ["v1"], current="b2")
    assert check_tag("V1.0") == "v1.0"
    with pytest.raises(BadTag):
        check_tag("no spaces")
    assert tags.drop("tpl") == {"s2"}


def test_a_tagged_base_template_is_accepted() -> None:
    spec = parse_build_start({"fromTemplate": "app:v1", "steps": []})
    assert spec.from_template == "app:v1"
    with pytest.raises(BadBuild):
        parse_build_start({"fromTemplate": "app:bad tag", "steps": []})


def test_archives_beyond_the_bound_go_least_recently_used_first(tmp_path: Path) -> None:
    files = BuildFiles(tmp_path / "files", b"key")
    hashes = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
    for i, h in enumerate(hashes[:3]):
        files.path(h).write_bytes(b"x" * 100)
        os.utime(files.path(h), (1000 + i, 1000 + i))
    os.utime(files.path(hashes[0]), (2000, 2000))  # used lately (touch)
    (files.root / f"{hashes[3]}.part").write_bytes(b"y" * 1000)  # an upload under way
    gone = files.trim(250, keep=frozenset({hashes[1]}))
    assert gone == [hashes[2]]  # the oldest not kept; 300 -> 200 bytes
    assert files.present(hashes[0]) and files.present(hashes[1])
    assert files.received(hashes[3]) == 1000
