"""Root filesystem builders for the default templates.

`base` is a real Debian userland bootstrapped from Debian's archive with
`debootstrap --variant=minbase` (bash, python3, curl, git, sudo, ...), with a
passwordless-sudo user `user` (uid 1000) as E2B templates have, and without
apt lists, docs, man pages or translations. `busybox` is a tiny test template
made of Debian's static busybox alone: no libc, no bash. `code-interpreter-v1`
(the template the code-interpreter SDKs default to) is `base` plus Jupyter
kernels (IPython, bash) and the data stack (`INTERP_PACKAGES`, installed with pip from
PyPI in a chroot of a copy of `base`); its start command runs aenv's code-execution
server (aenv.interp.server, from the envd bundle) on port 49999, so the node
captures it with a warm kernel (aenv.node.warm). All are built in a
hidden directory next to their destination and renamed into place, so a
half-built root filesystem is never installed. Building needs root and (for
`base`) the Debian mirror; `python -m aenv.storage.rootfs --home DIR` installs
both into `DIR/templates` if they are missing. With `--from-store URL`, a
template the object store holds (shared by a node of the same `recipe`:
aenv.storage.snapstore.defaults) is fetched from it instead of built, and
only one the store lacks is built. Building or fetching holds the
templates' build lock (`build_lock`), also taken by a node fetching one.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from aenv.storage.bundle import interp_server_path
from aenv.storage.templates import TemplateNotFound, TemplateStore

Progress = Callable[[str], None]
# What the fetch hook of `ensure_default_templates` returns for a template it
# installed from the store into the given directory: (cpu_count, memory_mb,
# index digest); None when the store has no build of it.
Fetched = tuple[int, int, str]

BASE_PACKAGES: tuple[str, ...] = (
    "bash",
    "coreutils",
    "python3",
    "python3-pip",
    "python3-venv",
    "curl",
    "wget",
    "git",
    "procps",
    "busybox",
    "sudo",
    "ca-certificates",
    "netbase",
    "iproute2",
    "iputils-ping",
    "less",
    "vim-tiny",
    "xz-utils",
    "unzip",
    "openssh-client",
)
# The code interpreter's additions to `base`: a Jupyter kernel and the data stack,
# from PyPI (self-contained wheels: Debian's packages of them pull in compilers,
# scipy, sympy and gdb, 1 GiB more).
INTERP_PACKAGES: tuple[str, ...] = (
    "ipykernel==6.29.5",
    "jupyter_client==8.6.3",
    "numpy==2.2.6",
    "pandas==2.2.3",
    "matplotlib==3.10.3",
    "bash_kernel==0.10.0",
)
INTERP_TEMPLATE = "code-interpreter-v1"
INTERP_PORT = 49999
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
USER_NAME = "user"
USER_UID = 1000
HOSTNAME = "sandbox"
DEFAULT_NAMESERVERS = ("8.8.8.8", "1.1.1.1")
# Trimmed from the image, and kept out by dpkg when a sandbox installs packages.
_DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
"""
# Directories emptied after the build (their own directory stays).
_STRIP = (
    "var/lib/apt/lists",
    "var/cache/apt",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
)
_BUILD_PREFIX = ".build-"
_BUILD_LOCK = ".build.lock"
_BUILD_CA = "tmp/.aenv-build-ca.pem"  # the host's CA certificates while pip runs
_RECIPE_FILE = "recipe"  # in a template's directory: the recipe it was built by
# Bumped whenever a builder below changes what it makes: nodes then stop taking
# builds of the old recipe from the store (`recipe`).
RECIPE_VERSION = 2  # 2: /etc/profile without `id -u` for bash
RESOURCES = {  # cpu_count, memory_mb
    "base": (2, 512),
    "busybox": (1, 256),
    INTERP_TEMPLATE: (2, 1024),
}
# Default templates rebuilt by `ensure_default_templates` when their recipe
# changed (quick to build; `base` is kept: a debootstrap takes minutes).
REBUILT_WHEN_CHANGED = frozenset({INTERP_TEMPLATE})
# Start and ready commands of the default templates that run a server: the
# node captures their sandboxes once it answers (aenv.node.warm).
START_COMMANDS: dict[str, tuple[str, str]] = {
    INTERP_TEMPLATE: (
        f"exec /usr/bin/python3 {interp_server_path()} --port {INTERP_PORT}",
        f"curl -sf -o /dev/null http://127.0.0.1:{INTERP_PORT}/health",
    ),
}


def recipe(template_id: str) -> str:
    """What this version of the builder makes for a default template on this
    machine's architecture: a build in the store is taken only by nodes whose
    recipe is the same (`aenv.storage.snapstore.defaults`)."""
    what: dict[str, object] = {"version": RECIPE_VERSION, "template": template_id}
    if template_id in ("base", INTERP_TEMPLATE):
        what.update(suite=DEFAULT_SUITE, packages=sorted(BASE_PACKAGES), user=USER_NAME)
    if template_id == INTERP_TEMPLATE:
        what.update(interp=sorted(INTERP_PACKAGES), start=START_COMMANDS[template_id])
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    arch = platform.machine().lower() or "unknown"
    return f"{arch}-{digest[:16]}"


def _say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line)


def _staging_next_to(dest: Path) -> Path:
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.with_name(f".{dest.name}.tmp-{secrets.token_hex(4)}")


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point.startswith(prefix) or mount_point == prefix[:-1]:
                found.append(mount_point)
    return found


def _remove_tree(path: Path) -> None:
    """rmtree that refuses to descend into anything still mounted below `path`."""
    if not path.exists():
        return
    for mount_point in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], check=False)
    if _mounts_under(path):
        raise RuntimeError(f"refusing to remove {path}: mounts remain under it")
    shutil.rmtree(path)


def _host_resolv_conf() -> str:
    """The host's nameservers that a sandbox can reach, else public resolvers.

    Sandboxes never reach the host or private ranges (see aenv.proto.netpolicy),
    so loopback, private and link-local resolvers are useless to them.
    """
    servers: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                try:
                    addr = ipaddress.ip_address(parts[1])
                except ValueError:
                    continue
                if addr.version == 4 and addr.is_global:
                    servers.append(parts[1])
    return "".join(f"nameserver {s}\n" for s in (servers or DEFAULT_NAMESERVERS))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    if path.is_symlink():
        path.unlink()  # e.g. resolv.conf -> /run/...: never write through a link
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)


def _write_network_files(root: Path) -> None:
    _write(root / "etc/hostname", f"{HOSTNAME}\n")
    _write(
        root / "etc/hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )
    _write(root / "etc/resolv.conf", _host_resolv_conf())


def _run_streamed(
    argv: Sequence[str], progress: Progress | None, *, env: dict[str, str] | None = None
) -> None:
    """Run `argv`, passing each output line to `progress`; raise with the tail on failure."""
    tail: list[str] = []
    with subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            tail = [*tail[-19:], line]
            _say(progress, line)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(argv), "\n".join(tail))


def _configure_debian(root: Path, suite: str, mirror: str) -> None:
    def chroot(*argv: str) -> None:
        subprocess.run(["chroot", str(root), *argv], check=True, env=_CHROOT_ENV)

    chroot(
        "useradd",
        "--create-home",
        "--home-dir",
        f"/home/{USER_NAME}",
        "--uid",
        str(USER_UID),
        "--user-group",
        "--groups",
        "sudo",
        "--shell",
        "/bin/bash",
        USER_NAME,
    )
    _write(
        root / f"etc/sudoers.d/{USER_NAME}",
        f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n",
        0o440,
    )
    _write_network_files(root)
    _write(root / "etc/machine-id", "")
    sources = f"deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\n"
    if mirror == DEFAULT_MIRROR:
        sources += f"deb {SECURITY_MIRROR} {suite}-security main\n"
    _write(root / "etc/apt/sources.list", sources)
    _write(root / "etc/dpkg/dpkg.cfg.d/aenv-nodoc", _DPKG_EXCLUDES)
    # A sandbox is disposable: let `pip install` work without a venv, as on E2B.
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    fast_login_profile(root / "etc/profile")
    _trim(root)


def fast_login_profile(profile: Path) -> bool:
    """Let bash read `profile` (Debian's /etc/profile) without starting a process.

    Every `commands.run` of the E2B SDKs is a login shell (`bash -l -c`), and
    Debian's /etc/profile asks `$(id -u)` who runs it: a fork and an exec,
    about half of the shell's start under gVisor. bash knows the answer
    (`$EUID`, read-only, never taken from the environment), so the test
    becomes `${EUID:-$(id -u)}`: the same for bash, and other shells (dash's
    `sh -l`) still ask `id`. True if the file was changed.
    """
    try:
        text = profile.read_text()
    except FileNotFoundError:
        return False
    fast = text.replace('"$(id -u)"', '"${EUID:-$(id -u)}"')
    if fast == text:
        return False
    profile.write_text(fast)
    return True


def _trim(root: Path) -> None:
    for rel in _STRIP:
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
            target.mkdir(mode=0o755)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    # Docs go, except each package's copyright notice.
    for dirpath, _dirs, files in os.walk(root / "usr/share/doc"):
        for name in files:
            if name != "copyright":
                os.unlink(os.path.join(dirpath, name))
    # Logs of the build go; the directories that apt and dpkg log into stay.
    for dirpath, _dirs, files in os.walk(root / "var/log"):
        for name in files:
            os.unlink(os.path.join(dirpath, name))
    for old in root.glob("var/cache/debconf/*-old"):
        old.unlink()


_CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}


def build_debian_rootfs(
    dest: Path,
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    packages: Sequence[str] = BASE_PACKAGES,
    progress: Progress | None = None,
) -> None:
    """Bootstrap a Debian root filesystem into `dest` (which must not exist). Needs root."""
    staging = _staging_next_to(dest)
    try:
        _say(progress, f"debootstrap {suite} from {mirror} into {staging}")
        # A private mount namespace: debootstrap's /proc and /sys mounts in the
        # target vanish with it, even if it dies half-way.
        _run_streamed(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "debootstrap",
                "--variant=minbase",
                "--merged-usr",
                f"--include={','.join(packages)}",
                suite,
                str(staging),
                mirror,
            ],
            progress,
        )
        _say(progress, "configuring user, sudo, network files; trimming")
        _configure_debian(staging, suite, mirror)
        os.rename(staging, dest)
    except BaseException:
        _remove_tree(staging)
        raise
    _say(progress, f"built {dest}")


def build_interp_rootfs(
    dest: Path,
    *,
    base: Path,
    packages: Sequence[str] = INTERP_PACKAGES,
    progress: Progress | None = None,
) -> None:
    """The code interpreter's root filesystem into `dest` (which must not exist): a
    copy of `base`'s root filesystem with `packages` installed by pip in a chroot
    (into /usr/local, as `pip install` in a sandbox does). Needs root and PyPI
    (or the index PIP_INDEX_URL names)."""
    staging = _staging_next_to(dest)
    try:
        _say(progress, f"copying {base} into {staging}")
        subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(staging)], check=True)
        # pip runs with the host's resolver and CA certificates (a TLS-inspecting
        # proxy's CA included); the sandbox's own resolv.conf is written back below
        _write(staging / "etc/resolv.conf", Path("/etc/resolv.conf").read_text(encoding="utf-8"))
        env = {**_CHROOT_ENV, "PATH": os.environ.get("PATH", _CHROOT_ENV["PATH"])}
        if os.environ.get("PIP_INDEX_URL"):
            env["PIP_INDEX_URL"] = os.environ["PIP_INDEX_URL"]
        host_ca = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
        if host_ca.is_file():
            shutil.copyfile(host_ca, staging / _BUILD_CA)
            env["PIP_CERT"] = f"/{_BUILD_CA}"
        root = shlex.quote(str(staging))
        install = " ".join(shlex.quote(p) for p in packages)
        script = (
            f"set -e; mount -t proc proc {root}/proc; "
            f"chroot {root} python3 -m pip install -q --no-cache-dir --progress-bar off "
            f"--root-user-action=ignore --disable-pip-version-check {install}; "
            f"chroot {root} python3 -m bash_kernel.install --sys-prefix"
        )
        _say(progress, f"pip install {install}")
        # a private mount namespace: the chroot's /proc vanishes with it
        _run_streamed(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            progress,
            env=env,
        )
        (staging / _BUILD_CA).unlink(missing_ok=True)
        _write_network_files(staging)
        _trim(staging)
        os.rename(staging, dest)
    except BaseException:
        _remove_tree(staging)
        raise
    _say(progress, f"built {dest}")


def build_busybox_rootfs(dest: Path, *, busybox: Path = Path("/bin/busybox")) -> None:
    """A root filesystem of one static busybox (Debian's busybox-static) and its applets."""
    staging = _staging_next_to(dest)
    try:
        _build_busybox(staging, busybox)
        os.rename(staging, dest)
    except BaseException:
        _remove_tree(staging)
        raise


def _build_busybox(root: Path, busybox: Path) -> None:
    applets = subprocess.run(
        [str(busybox), "--list-full"], check=True, capture_output=True, text=True
    ).stdout.split()
    if not applets:
        raise RuntimeError(f"{busybox} lists no applets")
    root.mkdir(mode=0o755)
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "run", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for d in ("tmp", "var/tmp"):
        (root / d).mkdir(parents=True)
        os.chmod(root / d, 0o1777)
    os.chmod(root / "root", 0o700)
    (root / "var/log").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin/busybox")
    os.chmod(root / "bin/busybox", 0o755)
    for applet in applets:
        link = root / applet
        if link.name == "busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / "bin/busybox", link.parent))
    _write(
        root / "etc/passwd",
        "root:x:0:0:root:/root:/bin/sh\n"
        f"{USER_NAME}:x:{USER_UID}:{USER_UID}:{USER_NAME}:/home/{USER_NAME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    )
    _write(
        root / "etc/group",
        f"root:x:0:\n{USER_NAME}:x:{USER_UID}:\nnogroup:x:65534:\n",
    )
    _write(root / "etc/shadow", f"root:*:19000::::::\n{USER_NAME}:*:19000::::::\n", 0o640)
    _write_network_files(root)
    home = root / "home" / USER_NAME
    home.mkdir(parents=True)
    os.chmod(home, 0o755)
    os.chown(home, USER_UID, USER_UID)


@contextlib.contextmanager
def build_lock(store: TemplateStore) -> Iterator[None]:
    """Held while a default template is built or fetched into `store` (blocking)."""
    fd = os.open(store.root / _BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _built_by(store: TemplateStore, template_id: str) -> str | None:
    """The recipe an installed default template was built by, if recorded."""
    try:
        return (store.root / template_id / _RECIPE_FILE).read_text().strip()
    except OSError:
        return None


def _has(store: TemplateStore, template_id: str) -> bool:
    try:
        return store.resolve(template_id).template_id == template_id
    except TemplateNotFound:
        return False


def remove_leftover_builds(store: TemplateStore, progress: Progress | None = None) -> None:
    """Remove what a build or fetch that stopped half-way left (hold `build_lock`)."""
    for leftover in store.root.glob(f"{_BUILD_PREFIX}*"):
        _say(progress, f"removing leftover build {leftover}")
        _remove_tree(leftover)


def staging_dir(store: TemplateStore, template_id: str) -> Path:
    """A new directory to build or fetch a template in (hold `build_lock`): removed
    as a leftover by the next `ensure_default_templates` if left behind."""
    staging = store.root / f"{_BUILD_PREFIX}{template_id}-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    return staging


def ensure_default_templates(
    store: TemplateStore,
    *,
    progress: Progress | None = None,
    with_base: bool = True,
    with_interp: bool = True,
    fetch: Callable[[str, Path], Fetched | None] | None = None,
) -> None:
    """Install the `busybox` test template and (unless told not to) `base` and
    `code-interpreter-v1` (which needs `base`), if absent.

    With `fetch`, each absent template is first asked of it (the object
    store: `fetch(template_id, dest)` fills the new directory `dest`, or
    returns None when the store has no build); only one it cannot give is
    built.
    """
    with build_lock(store):
        remove_leftover_builds(store, progress)
        wanted: list[tuple[str, Callable[[Path], None]]] = [
            ("busybox", build_busybox_rootfs),
        ]
        if with_base:
            wanted.append(("base", lambda dest: build_debian_rootfs(dest, progress=progress)))
            if with_interp:
                wanted.append(
                    (
                        INTERP_TEMPLATE,
                        lambda dest: build_interp_rootfs(
                            dest, base=store.resolve("base").rootfs, progress=progress
                        ),
                    )
                )
        for template_id, build in wanted:
            if _has(store, template_id):
                if template_id not in REBUILT_WHEN_CHANGED or _built_by(
                    store, template_id
                ) == recipe(template_id):
                    _say(progress, f"template {template_id!r} present")
                    continue
                _say(progress, f"template {template_id!r} is of an older recipe: rebuilding it")
                store.delete(template_id)
            staging = staging_dir(store, template_id)
            try:
                started = time.monotonic()
                cpu_count, memory_mb = RESOURCES[template_id]
                fetched = None
                if fetch is not None:
                    _say(progress, f"looking for template {template_id!r} in the object store")
                    fetched = fetch(template_id, staging / "rootfs")
                if fetched is not None:
                    cpu_count, memory_mb, _digest = fetched
                    how = "fetched from the object store"
                else:
                    if (staging / "rootfs").exists():
                        _remove_tree(staging / "rootfs")
                    _say(progress, f"building template {template_id!r}")
                    build(staging / "rootfs")
                    how = "built"
                start_cmd, ready_cmd = START_COMMANDS.get(template_id, (None, None))
                template = store.add(
                    template_id=template_id,
                    rootfs_dir=staging / "rootfs",
                    aliases=(template_id,),
                    cpu_count=cpu_count,
                    memory_mb=memory_mb,
                    start_cmd=start_cmd,
                    ready_cmd=ready_cmd,
                )
                if fetched is not None:
                    store.record_rootfs_index(template_id, fetched[2])
                if template_id in REBUILT_WHEN_CHANGED:
                    (store.root / template_id / _RECIPE_FILE).write_text(recipe(template_id) + "\n")
                _say(
                    progress,
                    f"template {template_id!r} ready ({how}): {template.disk_size_mb} MiB "
                    f"in {time.monotonic() - started:.1f} s",
                )
            finally:
                _remove_tree(staging)


def store_fetcher(
    url: str, *, progress: Progress | None = None
) -> Callable[[str, Path], Fetched | None]:
    """The `fetch` hook of `ensure_default_templates` for the object store at `url`:
    a store that cannot be reached, or whose build cannot be fetched, is reported
    and the template built instead."""
    import trio

    from aenv.storage.objstore import StoreError, open_object_store
    from aenv.storage.snapstore import SnapshotUnavailable
    from aenv.storage.snapstore.defaults import fetch_rootfs, find_rootfs

    async def run(template_id: str, dest: Path) -> Fetched | None:
        store = open_object_store(url)
        found = await find_rootfs(store, template_id, recipe(template_id))
        if found is None:
            _say(progress, f"the object store has no build of template {template_id!r}")
            return None
        _say(
            progress,
            f"fetching template {template_id!r} ({found.disk_size_mb} MiB, shared by "
            f"{found.shared_by}) from the object store",
        )
        await fetch_rootfs(store, found, dest)
        return found.cpu_count, found.memory_mb, found.index

    def fetch(template_id: str, dest: Path) -> Fetched | None:
        try:
            return trio.run(run, template_id, dest)
        except (StoreError, SnapshotUnavailable, OSError, ValueError) as exc:
            _say(progress, f"cannot fetch template {template_id!r} from the object store: {exc}")
            return None

    return fetch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aenv.storage.rootfs",
        description="Install aenv's default templates (base, busybox, code-interpreter-v1) "
        "if missing.",
    )
    parser.add_argument("--home", type=Path, required=True, help="aenv home ($AENV_HOME)")
    parser.add_argument("--busybox-only", action="store_true", help="skip the Debian templates")
    parser.add_argument(
        "--without-interp", action="store_true", help="skip the `code-interpreter-v1` template"
    )
    parser.add_argument(
        "--from-store",
        metavar="URL",
        default="",
        help="fetch templates this object store holds (AENV_STORE_URL) instead of building "
        "them; build only those it lacks (empty, none or off: build)",
    )
    args = parser.parse_args(argv)
    store = TemplateStore(args.home / "templates")

    def progress(line: str) -> None:
        print(line, flush=True)

    url = args.from_store.strip()
    fetch = None
    if url and url.lower() not in ("none", "off"):
        fetch = store_fetcher(url, progress=progress)
    ensure_default_templates(
        store,
        progress=progress,
        with_base=not args.busybox_only,
        with_interp=not args.without_interp,
        fetch=fetch,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
