"""Template builds without sandboxes: the SDK's request bodies and built templates on disk.

Rules: request bodies come from the real e2b SDK's `Template` builder and its
generated model (`TemplateBuildStartV2`), exactly as `Template.build` sends
them; built templates are written and read back by a real `TemplateStore`
in a temp dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2b import Template as SdkBuilder
from e2b.api.client.models import TemplateBuildStartV2

from aenv.api.builds import BadBuild, parse_build_start
from aenv.node.builds import Step
from aenv.node.guest import Lines
from aenv.storage.templates import TemplateConflict, TemplateStore


def sdk_body(builder: object) -> object:
    """What `Template.build` posts to /v2/templates/{id}/builds/{build}."""
    t = builder._template  # type: ignore[attr-defined]
    serialized = t._serialize(t._instructions_with_hashes())
    return json.loads(json.dumps(TemplateBuildStartV2.from_dict(serialized).to_dict()))


def test_the_sdks_steps_are_understood_in_order() -> None:
    b = (
        SdkBuilder()
        .from_image("127.0.0.1:5000/busybox:latest")
        .set_envs({"A": "1", "B": "two words"})
        .run_cmd(["echo hi > /x", "true"], user="root")
        .set_workdir("/tmp")
        .set_user("app")
        .set_start_cmd("sleep 100", "test -e /x")
    )
    spec = parse_build_start(sdk_body(b))
    assert spec.from_image == "127.0.0.1:5000/busybox:latest" and spec.from_template is None
    assert spec.steps == (
        Step("ENV", ("A", "1", "B", "two words")),
        Step("RUN", ("echo hi > /x && true", "root")),
        Step("WORKDIR", ("/tmp",)),
        Step("USER", ("app",)),
    )
    assert (spec.start_cmd, spec.ready_cmd) == ("sleep 100", "test -e /x")
    derived = parse_build_start(sdk_body(SdkBuilder().from_template("my-base").run_cmd("ls")))
    assert derived.from_template == "my-base" and derived.from_image is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "JSON object"),
        ({}, "exactly one of"),
        ({"fromImage": "a", "fromTemplate": "b"}, "exactly one of"),
        ({"fromImage": "UPPER CASE/x"}, "fromImage"),
        ({"fromTemplate": "../etc"}, "invalid"),
        ({"fromImage": "busybox", "steps": {"type": "RUN"}}, "steps must be a list"),
        ({"fromImage": "busybox", "steps": [{"type": "ADD"}]}, "is not one of"),
        ({"fromImage": "busybox", "steps": [{"type": "RUN", "args": [1]}]}, "list of strings"),
        ({"fromImage": "busybox", "startCmd": 5}, "startCmd must be a string"),
        ({"fromImage": "busybox", "fromImageRegistry": {"type": "registry"}}, "auth file"),
    ],
)
def test_bad_bodies_are_refused_with_a_reason(body: object, message: str) -> None:
    with pytest.raises(BadBuild, match=message):
        parse_build_start(body)


def test_output_is_split_into_lines_per_stream() -> None:
    got: list[tuple[str, str]] = []
    lines = Lines(lambda s, line: got.append((s, line)))
    lines.feed("stdout", b"one\ntw")
    lines.feed("stderr", b"err\r\n")
    lines.feed("stdout", b"o\nthree")
    lines.flush()
    assert got == [("stdout", "one"), ("stderr", "err"), ("stdout", "two"), ("stdout", "three")]


def test_built_templates_persist_and_rebuild_in_place(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "templates", image_root=tmp_path / "images")
    image = store.add_image(
        template_id="img-base",
        image_key="ab" * 32,
        image_ref="r/busybox:1",
        size_bytes=3 << 20,
        env=["PATH=/bin", "X=image"],
    )
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    plain = store.add(template_id="plain", rootfs_dir=rootfs)

    built, replaced = store.put_built(
        template_id="t1",
        build_id="b1",
        aliases=["mine"],
        base=image,
        snapshot_id="snap-1",
        env=["PATH=/bin", "X=built"],
        workdir="/srv",
        user="app",
        cpu_count=1,
        memory_mb=256,
        start_cmd="sleep 9",
        sandbox_disk_mb=2048,
    )
    assert replaced is None
    from_dir, _ = store.put_built(
        template_id="t2", build_id="c1", aliases=["other"], base=plain, snapshot_id="snap-2"
    )
    again = TemplateStore(tmp_path / "templates", image_root=tmp_path / "images")
    t1 = again.resolve("mine")
    assert t1 == built
    assert (t1.snapshot_id, t1.image_key, t1.rootfs) == ("snap-1", image.image_key, image.rootfs)
    assert t1.env_map == {"PATH": "/bin", "X": "built"} and (t1.workdir, t1.user) == ("/srv", "app")
    t2 = again.resolve("other")
    assert t2 == from_dir and t2.rootfs == plain.rootfs and t2.image_key is None
    # a build's diskSizeMB is its sandboxes' disk size; without one, the node's
    assert (t1.sandbox_disk_mb, t2.sandbox_disk_mb) == (2048, None)

    rebuilt, replaced = again.put_built(
        template_id="t1", build_id="b2", aliases=["mine"], base=image, snapshot_id="snap-3"
    )
    assert replaced == "snap-1"
    assert (rebuilt.build_id, rebuilt.created_at, rebuilt.aliases) == (
        "b2",
        t1.created_at,
        ("mine",),
    )
    assert again.resolve("t1").snapshot_id == "snap-3"
    with pytest.raises(TemplateConflict):  # only builds rebuild
        again.put_built(template_id="plain", build_id="x", aliases=[], base=image, snapshot_id="s")
    with pytest.raises(TemplateConflict):  # a new template cannot take an alias
        again.put_built(
            template_id="t3", build_id="x", aliases=["mine"], base=image, snapshot_id="s"
        )
