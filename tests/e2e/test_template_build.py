"""Template builds with the real e2b SDK's `Template` builder, a real registry and node.

Rules: the base image is busybox pushed by the test to the loopback registry;
builds go through the unmodified SDK (`Template.build`), sandboxes through
`Sandbox.create(name)`. Each test kills its sandboxes and deletes the
templates it built; which snapshots back a template is read from the REST
API (`GET /snapshots`), never from the node's internals.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException, SandboxException, TemplateException

from tests.conftest import NodeProc, requires_node
from tests.e2e.counter import COUNTER, counts_on
from tests.registry import LocalRegistry, push_busybox

pytestmark = [requires_node, pytest.mark.runsc]


def api(node: NodeProc) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, timeout=120)


def snapshot_ids(node: NodeProc) -> set[str]:
    with api(node) as c:
        return {d["snapshotID"] for d in c.get("/snapshots", params={"limit": 1000}).json()}


def delete_template(node: NodeProc, name: str) -> int:
    with api(node) as c:
        return c.delete(f"/templates/{name}").status_code


def test_build_from_an_image_with_steps_and_a_start_command(
    node: NodeProc, registry: LocalRegistry
) -> None:
    img = push_busybox(registry, "build-base", "1")
    template = (
        Template()
        .from_image(img.ref)
        .set_envs({"GREETING": "hello built"})
        .run_cmd("echo built > /made.txt && echo visible-in-logs")
        .set_workdir("/srv/app")
        .run_cmd("pwd > where.txt && echo $GREETING >> where.txt")
        .set_user("app")
        .run_cmd("whoami > /tmp/who.txt")
        .set_start_cmd(COUNTER, "test -s /tmp/counter")
    )
    logs: list[str] = []
    info = Template.build(
        template,
        "built-one",
        cpu_count=1,
        memory_mb=256,
        on_build_logs=lambda e: logs.append(e.message),
    )
    assert info.template_id and info.build_id
    assert "visible-in-logs" in logs
    s = Sandbox.create("built-one", timeout=120)
    try:
        assert s.get_info().template_id == info.template_id
        assert s.files.read("/made.txt") == "built\n"
        assert s.files.read("/srv/app/where.txt") == "/srv/app\nhello built\n"
        assert s.files.read("/tmp/who.txt") == "app\n"
        # env, workdir and user of the build are the sandbox's defaults
        assert s.commands.run("pwd; echo $GREETING; whoami").stdout == (
            "/srv/app\nhello built\napp\n"
        )
        # the start command's process came along in the snapshot and carries on
        assert counts_on(s) > 0
    finally:
        s.kill()
    assert delete_template(node, "built-one") == 204
    with pytest.raises(SandboxException):
        Sandbox.create("built-one", timeout=30)


def test_a_failing_step_fails_the_build_and_names_the_step(
    node: NodeProc, registry: LocalRegistry, tmp_path: Path
) -> None:
    img = push_busybox(registry, "build-fail", "1")
    before = snapshot_ids(node)
    failing = (
        Template()
        .from_image(img.ref)
        .run_cmd("true")
        .run_cmd("echo about to fail >&2; exit 3")
        .run_cmd("echo never")
    )
    with pytest.raises(BuildException) as err:
        Template.build(failing, "built-fail")
    assert "step 2" in str(err.value) and "exit code 3" in str(err.value)
    assert not Template.exists("built-fail")

    bad_start = Template().from_image(img.ref).set_start_cmd("exit 7", "false")
    with pytest.raises(BuildException, match="start command ended with exit code 7"):
        Template.build(bad_start, "built-bad-start")
    assert snapshot_ids(node) == before  # failed builds leave no snapshot behind


def test_rebuild_keeps_the_id_and_deleting_removes_its_snapshots(
    node: NodeProc, registry: LocalRegistry
) -> None:
    img = push_busybox(registry, "build-again", "1")
    before = snapshot_ids(node)
    first = Template.build(Template().from_image(img.ref).run_cmd("echo v1 > /v.txt"), "built-two")
    snap1 = snapshot_ids(node) - before
    assert len(snap1) == 1
    with api(node) as c:
        refused = c.delete(f"/snapshots/{next(iter(snap1))}")
        assert refused.status_code == 409, refused.text
    old = Sandbox.create("built-two", timeout=120)
    new: Sandbox | None = None
    try:
        assert old.files.read("/v.txt") == "v1\n"
        # a template built from a built one
        derived = Template.build(
            Template().from_template("built-two").run_cmd("cat /v.txt > /w.txt"), "built-derived"
        )
        assert derived.template_id != first.template_id
        second = Template.build(
            Template().from_image(img.ref).run_cmd("echo v2 > /v.txt"), "built-two"
        )
        assert second.template_id == first.template_id
        assert second.build_id != first.build_id
        new = Sandbox.create("built-two", timeout=120)
        assert new.files.read("/v.txt") == "v2\n"
        assert old.files.read("/v.txt") == "v1\n"  # a running sandbox keeps its build
        d = Sandbox.create("built-derived", timeout=60)
        try:
            assert d.files.read("/w.txt") == "v1\n"
        finally:
            d.kill()
    finally:
        old.kill()
        if new is not None:
            new.kill()
    assert snapshot_ids(node) - before - snap1, "the rebuild has its own snapshot"
    assert not snap1 & snapshot_ids(node), "the first build's snapshot went with the rebuild"
    assert delete_template(node, "built-two") == 409  # the derived template is built on it
    assert delete_template(node, "built-derived") == 204
    assert delete_template(node, "built-two") == 204
    assert snapshot_ids(node) == before


def test_bad_requests_are_refused_clearly(node: NodeProc) -> None:
    with api(node) as c:
        r = c.post("/v3/templates", json={"name": "Bad Name"})
        assert r.status_code == 400
        r = c.post("/v3/templates", json={"name": "base"})
        assert r.status_code == 409  # a template no build made
        r = c.post("/v3/templates", json={"name": "built-req", "cpuCount": 0})
        assert r.status_code == 400
        r = c.post("/v3/templates", json={"name": "built-req"})
        assert r.status_code == 202, r.text
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        url = f"/v2/templates/{tid}/builds/{bid}"
        assert c.post(url, json={"steps": []}).status_code == 400  # no base
        r = c.post(
            url,
            json={
                "fromImage": "busybox",
                "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"},
            },
        )
        assert r.status_code == 400 and "fromImageRegistry" in r.json()["message"]
        r = c.post(url, json={"fromTemplate": "base", "steps": [{"type": "ADD", "args": []}]})
        assert r.status_code == 400
        assert c.post(f"/v2/templates/{tid}/builds/nope", json={}).status_code == 404
        assert c.get(f"/templates/{tid}/builds/nope/status").status_code == 404
        status = c.get(f"/templates/{tid}/builds/{bid}/status")
        assert status.status_code == 200 and status.json()["status"] == "waiting"


def test_build_from_a_directory_template(node: NodeProc) -> None:
    info = Template.build(
        Template().from_template("base").run_cmd("echo from-base > /home/user/b.txt"), "built-dir"
    )
    s = Sandbox.create("built-dir", timeout=60)
    try:
        assert s.get_info().template_id == info.template_id
        # the base template's defaults carry over: user "user" in /home/user
        assert s.commands.run("cat b.txt; whoami; pwd").stdout == "from-base\nuser\n/home/user\n"
    finally:
        s.kill()
    assert delete_template(node, "built-dir") == 204


def test_copy_of_local_files_and_dirs(
    node: NodeProc, registry: LocalRegistry, tmp_path: Path
) -> None:
    img = push_busybox(registry, "build-copy", "1")
    (tmp_path / "app" / "lib").mkdir(parents=True)
    (tmp_path / "app" / "main.sh").write_text("#!/bin/sh\necho main ran\n")
    (tmp_path / "app" / "main.sh").chmod(0o755)
    (tmp_path / "app" / "lib" / "data.txt").write_text("deep data")
    (tmp_path / "one.txt").write_text("single file")
    template = (
        Template(file_context_path=tmp_path)
        .from_image(img.ref)
        .copy("app", "/srv/app")
        .copy("one.txt", "/etc/")
        .set_workdir("/work")
        .copy("one.txt", "renamed.txt", user="app", mode=0o600)
    )
    logs: list[str] = []
    Template.build(template, "built-copy", on_build_logs=lambda e: logs.append(e.message))
    s = Sandbox.create("built-copy", timeout=60)
    try:
        assert s.commands.run("/srv/app/main.sh").stdout == "main ran\n"  # mode kept
        assert s.files.read("/srv/app/lib/data.txt") == "deep data"
        assert s.files.read("/etc/one.txt") == "single file"
        out = s.commands.run("stat -c '%U %a' /work/renamed.txt", user="root").stdout
        assert out == "app 600\n"
    finally:
        s.kill()
    # the same files again: nothing to upload, every step cached
    logs.clear()
    Template.build(template, "built-copy", on_build_logs=lambda e: logs.append(e.message))
    assert sum("already cached" in m for m in logs) == 3, logs
    assert sum("CACHED COPY" in m for m in logs) == 3
    assert delete_template(node, "built-copy") == 204


def test_upload_is_resumable_and_signed(node: NodeProc, tmp_path: Path) -> None:
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"x" * 50_000
        info = tarfile.TarInfo("f.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    archive = buf.getvalue()
    digest = hashlib.sha256(archive + b"resumable").hexdigest()
    with api(node) as c:
        r = c.post("/v3/templates", json={"name": "built-upload"})
        tid = r.json()["templateID"]
        answer = c.get(f"/templates/{tid}/files/{digest}").json()
    assert answer["present"] is False
    url = answer["url"]
    with httpx.Client(timeout=30) as up:  # no API key: the URL is signed
        assert up.put(url.split("?")[0], content=archive).status_code == 403
        half = len(archive) // 2
        r = up.put(
            url,
            content=archive[:half],
            headers={"Content-Range": f"bytes 0-{half - 1}/{len(archive)}"},
        )
        assert r.status_code == 308 and r.headers["Range"] == f"bytes=0-{half - 1}"
        r = up.put(url, headers={"Content-Range": f"bytes */{len(archive)}"})
        assert r.status_code == 308 and r.headers["Range"] == f"bytes=0-{half - 1}"
        wrong = up.put(
            url,
            content=archive[half:],
            headers={"Content-Range": f"bytes 10-{len(archive) - half + 9}/{len(archive)}"},
        )
        assert wrong.status_code == 416
        r = up.put(
            url,
            content=archive[half:],
            headers={"Content-Range": f"bytes {half}-{len(archive) - 1}/{len(archive)}"},
        )
        assert r.status_code == 200, r.text
    with api(node) as c:
        assert c.get(f"/templates/{tid}/files/{digest}").json() == {"present": True}
        bad = hashlib.sha256(b"not a tar").hexdigest()
        url = c.get(f"/templates/{tid}/files/{bad}").json()["url"]
    with httpx.Client(timeout=30) as up:
        assert up.put(url, content=b"not a tar archive at all").status_code == 400


def test_dockerfile_with_copy_and_from_a_template(node: NodeProc, tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.ini").write_text("[app]\nname=demo\n")
    (tmp_path / "run.sh").write_text("echo run\n")
    dockerfile = (
        "FROM base\n"
        "ENV MODE=prod\n"
        "COPY conf /opt/conf\n"
        "ADD run.sh /opt/\n"
        "RUN cat /opt/conf/app.ini | grep name= > /opt/name.txt\n"
        "WORKDIR /opt\n"
    )
    template = Template(file_context_path=tmp_path).from_dockerfile(dockerfile)
    info = Template.build(template, "built-docker")
    s = Sandbox.create("built-docker", timeout=60)
    try:
        assert s.get_info().template_id == info.template_id
        assert s.commands.run("cat name.txt; sh run.sh; echo $MODE").stdout == (
            "name=demo\nrun\nprod\n"
        )
        # built on the base template: its user and files are there
        assert s.commands.run("id -un", user="user").stdout == "user\n"
    finally:
        s.kill()
    assert delete_template(node, "built-docker") == 204


def test_unchanged_steps_are_cached(node: NodeProc, registry: LocalRegistry) -> None:
    img = push_busybox(registry, "build-cache", "1")

    def template(last: str) -> Template:
        return (
            Template()
            .from_image(img.ref)
            .run_cmd("od -An -N8 -tx8 /dev/urandom > /a.txt")
            .set_envs({"K": "v"})
            .run_cmd("od -An -N8 -tx8 /dev/urandom > /b.txt")
            .run_cmd(last)
        )

    def build(t: Template) -> list[str]:
        logs: list[str] = []
        Template.build(t, "built-cache", on_build_logs=lambda e: logs.append(e.message))
        return logs

    def read(path: str) -> str:
        s = Sandbox.create("built-cache", timeout=60)
        try:
            return s.files.read(path)
        finally:
            s.kill()

    first = build(template("echo one > /c.txt"))
    assert not any("CACHED" in m for m in first)
    a, b = read("/a.txt"), read("/b.txt")
    again = build(template("echo one > /c.txt"))
    assert [m for m in again if "CACHED" in m] == [
        "[1] CACHED RUN od -An -N8 -tx8 /dev/urandom > /a.txt",
        "[2] CACHED ENV K v",
        "[3] CACHED RUN od -An -N8 -tx8 /dev/urandom > /b.txt",
        "[4] CACHED RUN echo one > /c.txt",
        "[finalize] CACHED",
    ]
    assert not any("starting a build sandbox" in m for m in again)
    assert (read("/a.txt"), read("/b.txt")) == (a, b)
    # a changed last step: the ones before it are reused, it runs
    changed = build(template("echo two > /c.txt"))
    assert sum("CACHED RUN" in m for m in changed) == 2
    assert read("/c.txt") == "two\n" and read("/b.txt") == b
    # skip_cache runs everything again
    t = template("echo two > /c.txt")
    forced: list[str] = []
    Template.build(
        t, "built-cache", skip_cache=True, on_build_logs=lambda e: forced.append(e.message)
    )
    assert not any("CACHED" in m for m in forced)
    assert read("/a.txt") != a
    assert delete_template(node, "built-cache") == 204


def test_tags_name_builds_and_sandboxes_start_from_them(
    node: NodeProc, registry: LocalRegistry
) -> None:
    img = push_busybox(registry, "build-tags", "1")

    def version(v: str) -> Template:
        return Template().from_image(img.ref).run_cmd(f"echo {v} > /v.txt")

    def started(name: str) -> str:
        s = Sandbox.create(name, timeout=60)
        try:
            return s.files.read("/v.txt").strip()
        finally:
            s.kill()

    first = Template.build(version("one"), "built-tags:v1")
    assert first.tags == ["v1"]
    second = Template.build(version("two"), "built-tags", tags=["v2", "default"])
    assert sorted(second.tags) == ["default", "v2"]
    third = Template.build(version("three"), "built-tags:canary")
    assert started("built-tags") == "two"  # the bare name is the default tag
    assert started("built-tags:default") == "two"
    assert started("built-tags:v1") == "one"
    assert started("built-tags:canary") == "three"
    assert started(f"built-tags:{third.build_id}") == "three"  # a build by its ID

    derived = Template().from_dockerfile("FROM built-tags:v1\nRUN cat /v.txt > /w.txt")
    Template.build(derived, "built-tags-derived")
    s = Sandbox.create("built-tags-derived", timeout=60)
    try:
        assert s.files.read("/w.txt") == "one\n"  # built on the v1 build
        # a Dockerfile ends as E2B's user, made for an image that lacks it
        assert s.commands.run("whoami; pwd").stdout == "user\n/home/user\n"
    finally:
        s.kill()
    assert delete_template(node, "built-tags-derived") == 204

    info = Template.assign_tags("built-tags:v1", ["stable", "prod"])
    assert info.build_id == first.build_id and sorted(info.tags) == ["prod", "stable"]
    assert started("built-tags:stable") == "one"
    Template.assign_tags("built-tags:canary", "stable")  # a tag moves
    assert started("built-tags:stable") == "three"
    by_tag = {t.tag: t.build_id for t in Template.get_tags("built-tags")}
    assert by_tag == {
        "canary": third.build_id,
        "default": second.build_id,
        "prod": first.build_id,
        "stable": third.build_id,
        "v1": first.build_id,
        "v2": second.build_id,
    }
    Template.remove_tags("built-tags", ["v1", "prod"])
    with pytest.raises(SandboxException):
        Sandbox.create("built-tags:v1", timeout=30)
    with pytest.raises(TemplateException):
        Template.remove_tags("built-tags", "nope")
    with api(node) as c:
        tid = first.template_id
        assert c.get(f"/templates/{tid}/tags/count").json() == {"total": 4}
        assert c.get(f"/templates/{tid}/tags/exists", params={"tag": "STABLE"}).json() == {
            "exists": True,
            "normalizedTag": "stable",
        }
        groups = c.get(f"/templates/{tid}/tags/groups").json()["tags"]
        stable = next(g for g in groups if g["tag"] == "stable")
        assert [a["buildID"] for a in stable["assignments"]] == [
            third.build_id,
            first.build_id,
        ]
        hist = c.get(f"/templates/{tid}/tags/stable/assignments").json()
        assert hist["data"][0]["buildID"] == third.build_id and hist["nextCursor"] is None
    # the first build is named by no tag any more: its snapshot went
    assert delete_template(node, "built-tags") == 204
    with pytest.raises(SandboxException):
        Sandbox.create("built-tags:canary", timeout=30)


def test_patch_default_templates_and_snapshots_list(node: NodeProc) -> None:
    info = Template.build(Template().from_template("base").run_cmd("true"), "built-patch")
    with api(node) as c:
        r = c.patch(f"/templates/{info.template_id}", json={"public": False})
        assert r.status_code == 200
        assert c.get(f"/templates/{info.template_id}").json()["public"] is False
        r = c.patch("/v2/templates/built-patch", json={"public": True})
        assert r.status_code == 200 and r.json() == {"names": ["built-patch"]}
        assert c.get("/templates/aliases/built-patch").json()["public"] is True
        assert c.patch("/v2/templates/nope", json={"public": True}).status_code == 404
        assert c.patch("/templates/built-patch", json={"public": "no"}).status_code == 400
        defaults = c.get("/default-templates").json()
        assert {"base", "busybox"} <= {t["templateID"] for t in defaults}
        assert all(t["isDefault"] for t in defaults)
        # cached build steps and templates' own snapshots are not the user's
        listed = c.get("/snapshots").json()
        assert all(not any(n.startswith("~") for n in d.get("names", [])) for d in listed)
    assert delete_template(node, "built-patch") == 204
