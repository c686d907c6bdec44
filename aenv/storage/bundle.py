"""The envd interpreter bundle: a self-contained CPython that runs on any guest.

Guest images need not contain Python (or even a libc), so the node builds one
directory holding a CPython interpreter, the shared libraries it and its
extension modules link against, the ELF loader, a trimmed stdlib and the
pure-Python packages envd needs (trio, hypercorn and their dependencies, plus
aenv's own `proto`, `kit` and `envd`). Runtimes expose it read-only at
`BUNDLE_MOUNT` and start envd through the bundled loader (`envd_command`), so
the guest's own `/lib` is never consulted. Building is synchronous, idempotent
(a `.complete` stamp records a hash of the inputs) and atomic (built in a
temporary sibling directory, then renamed into place); call it from a worker
thread.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from packaging.requirements import Requirement

__all__ = [
    "BUNDLE_MOUNT",
    "DEFAULT_DISTRIBUTIONS",
    "LOADER_NAME",
    "build_bundle",
    "envd_command",
    "interp_server_path",
    "python_command",
]

BUNDLE_MOUNT = "/opt/aenv"

# Bump when the layout or the selection logic changes: forces a rebuild.
_FORMAT = 2

# Root distributions envd imports; their requirements are followed.
DEFAULT_DISTRIBUTIONS: tuple[str, ...] = ("trio", "hypercorn", "h2", "wsproto", "h11")

# aenv subpackages envd may import (the layering forbids it anything else), and
# `interp`, the code interpreter's server, run by the guest's own Python.
_AENV_PARTS = ("__init__.py", "proto", "kit", "envd", "interp")

_LOADER_NAMES = {
    "x86_64": "ld-linux-x86-64.so.2",
    "aarch64": "ld-linux-aarch64.so.1",
}
LOADER_NAME = _LOADER_NAMES.get(platform.machine(), "ld-linux-x86-64.so.2")

_STDLIB_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "__pycache__",
        "site-packages",
        "dist-packages",
    }
)
_STDLIB_SKIP_FILES = frozenset({"sitecustomize.py", "EXTERNALLY-MANAGED", "turtle.py"})
# Extension modules that pull in large or guest-hostile libraries (ncurses,
# readline, Berkeley DB, NIS/Kerberos) or exist only for CPython's own tests.
_DYNLOAD_SKIP = re.compile(
    r"^(_test\w*|_ctypes_test|_xxtestfuzz|xxlimited\w*|_xxsubinterpreters|_curses\w*|"
    r"readline|_dbm|_gdbm|nis|ossaudiodev|_tkinter)\."
)

Progress = Callable[[str], None]

# Where the bundled packages live, relative to the bundle root.
_SITE_DIR = "lib/aenv-site"
# envd's entry point, as `python -c` runs it (aenv.envd.__main__).
ENVD_MAIN = "from aenv.envd.__main__ import main; main()"


def python_command() -> tuple[tuple[str, ...], dict[str, str]]:
    """Return (argv, env) starting the bundle's Python (without site) from BUNDLE_MOUNT.

    The interpreter is started through the bundled ELF loader with the
    bundle's library directory, so it never touches the guest's libc;
    append its own arguments (`-c CODE`, a script) to `argv`. `env` is
    the interpreter's complete environment.
    """
    root = BUNDLE_MOUNT
    argv = (
        f"{root}/lib/{LOADER_NAME}",
        "--library-path",
        f"{root}/lib",
        f"{root}/bin/python3",
        "-S",
    )
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "PYTHONHOME": root,
        "PYTHONPATH": f"{root}/{_SITE_DIR}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONUTF8": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return argv, env


def envd_command(port: int = 49983) -> tuple[tuple[str, ...], dict[str, str]]:
    """Return (argv, env) starting envd from the bundle mounted at BUNDLE_MOUNT.

    `python_command` with envd's entry point. `env` is the complete
    environment of envd; envd should not hand the PYTHON* variables on to
    the user's processes.
    """
    python, env = python_command()
    argv = (
        *python,
        # No script directory on sys.path, no docstrings or asserts (the
        # bundle holds their .opt-2.pyc: ≈ 1.4 MiB less heap), and no `-m`:
        # runpy would be imported before the spawner is forked, so held
        # twice (aenv.envd.spawnd).
        "-P",
        "-OO",
        "-c",
        ENVD_MAIN,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        # pid 1 of a sandbox: guard its memory and processes (aenv.envd.guard)
        "--guard",
    )
    return argv, env


def interp_server_path() -> str:
    """Where the guest sees the code interpreter's server script (aenv.interp.server),
    run as a script by the guest's own Python so that the bundle's packages never
    shadow the guest's."""
    return f"{BUNDLE_MOUNT}/{_SITE_DIR}/aenv/interp/server.py"


def build_bundle(
    dest: Path,
    *,
    python: Path | None = None,
    progress: Progress | None = None,
    distributions: Sequence[str] = DEFAULT_DISTRIBUTIONS,
    aenv_source: Path | None = None,
) -> None:
    """Build the bundle into `dest` unless an identical one is already there.

    `python` is the interpreter to bundle (default: this venv's base
    interpreter, e.g. Debian's /usr/bin/python3.11); it must be the same
    Python version as the running one, whose installed `distributions` (and
    their requirements) are copied in. `aenv_source` is the `aenv` package
    directory whose proto/kit/envd are bundled (default: this one).
    """
    say = progress or (lambda _msg: None)
    python = Path(python or _base_interpreter()).resolve()
    info = _interpreter_info(python)
    if info["version"] != list(sys.version_info[:2]):
        raise ValueError(
            f"{python} is Python {info['version']}, but the packages come from "
            f"Python {sys.version_info[:2]}"
        )
    dists = _resolve_distributions(distributions)
    aenv_root = Path(aenv_source or Path(__file__).resolve().parents[1])
    stamp = _input_hash(python, info, dists, aenv_root)
    complete = dest / ".complete"
    if complete.is_file() and complete.read_text().strip() == stamp:
        say(f"bundle {dest} is up to date")
        return

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        say(f"bundling interpreter {python}")
        (tmp / "bin").mkdir()
        (tmp / "lib").mkdir()
        shutil.copy2(python, tmp / "bin" / "python3")

        stdlib = Path(str(info["stdlib"]))
        dynload = Path(str(info["dynload"]))
        pyver = "python{}.{}".format(*info["version"])
        say(f"copying stdlib from {stdlib}")
        _copy_stdlib(stdlib, tmp / "lib" / pyver)
        say(f"copying extension modules from {dynload}")
        modules = _copy_dynload(dynload, tmp / "lib" / pyver / "lib-dynload")

        say("copying shared libraries")
        nlibs = _copy_shared_libs([python, *modules], tmp / "lib")
        say(f"copied {nlibs} shared libraries and the loader")

        site = tmp / _SITE_DIR
        site.mkdir(parents=True)
        for dist in dists:
            say(f"copying {dist.metadata['Name']} {dist.version}")
            _copy_distribution(dist, site)
        say("copying aenv (proto, kit, envd, interp)")
        _copy_aenv(aenv_root, site / "aenv")

        say("precompiling bytecode")
        _compile(python, [tmp / "lib" / pyver, site])
        complete_tmp = tmp / ".complete"
        complete_tmp.write_text(stamp + "\n")
        _make_readable(tmp)

        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            os.rename(dest, old / "b")
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
        say(f"bundle ready at {dest}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _base_interpreter() -> Path:
    base = getattr(sys, "_base_executable", None) or sys.executable
    return Path(base)


def _interpreter_info(python: Path) -> dict[str, object]:
    script = (
        "import json, sys, sysconfig, _ssl, os\n"
        "print(json.dumps({'version': list(sys.version_info[:2]),"
        " 'stdlib': sysconfig.get_paths()['stdlib'],"
        " 'dynload': os.path.dirname(_ssl.__file__),"
        " 'magic': __import__('importlib.util').util.MAGIC_NUMBER.hex()}))"
    )
    out = subprocess.run(
        [str(python), "-S", "-I", "-c", script], check=True, capture_output=True, text=True
    ).stdout
    info: dict[str, object] = json.loads(out)
    return info


def _resolve_distributions(roots: Iterable[str]) -> list[importlib.metadata.Distribution]:
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [*roots]
    while todo:
        name = _canon(todo.pop())
        if name in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[name] = dist
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    return sorted(seen.values(), key=lambda d: _canon(d.metadata["Name"]))


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _input_hash(
    python: Path,
    info: dict[str, object],
    dists: Sequence[importlib.metadata.Distribution],
    aenv_root: Path,
) -> str:
    h = hashlib.sha256()
    st = python.stat()
    h.update(json.dumps([_FORMAT, str(python), st.st_size, st.st_mtime_ns, info]).encode())
    for dist in dists:
        h.update(f"{dist.metadata['Name']}=={dist.version}\n".encode())
    for path in sorted(_aenv_files(aenv_root)):
        h.update(str(path.relative_to(aenv_root)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _aenv_files(aenv_root: Path) -> list[Path]:
    files: list[Path] = []
    for part in _AENV_PARTS:
        src = aenv_root / part
        if src.is_file():
            files.append(src)
        elif src.is_dir():
            files.extend(
                p
                for p in src.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            )
    return files


def _copy_stdlib(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _STDLIB_SKIP_DIRS
            and not d.startswith("config-")
            and not (rel == Path(".") and d == "lib-dynload")
        ]
        (dst / rel).mkdir(exist_ok=True)
        for name in filenames:
            if name in _STDLIB_SKIP_FILES or name.endswith((".pyc", ".exe")):
                continue
            source = Path(dirpath) / name
            if not source.exists():  # dangling symlink
                continue
            shutil.copy2(source, dst / rel / name)


def _copy_dynload(src: Path, dst: Path) -> list[Path]:
    dst.mkdir(parents=True)
    copied: list[Path] = []
    for so in sorted(src.glob("*.so")):
        if _DYNLOAD_SKIP.match(so.name):
            continue
        shutil.copy2(so, dst / so.name)
        copied.append(so)
    return copied


_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-f]+\)\s*$")
_LDD_LOADER = re.compile(r"^\s*(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def _copy_shared_libs(objects: Sequence[Path], libdir: Path) -> int:
    libs: dict[str, Path] = {}
    loader: Path | None = None
    for obj in objects:
        out = subprocess.run(["ldd", str(obj)], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            if m := _LDD_LINE.match(line):
                libs.setdefault(m.group(1), Path(m.group(2)))
            elif m := _LDD_LOADER.match(line):
                loader = Path(m.group(1))
            elif "not found" in line:
                raise RuntimeError(f"{obj}: unresolved library: {line.strip()}")
    if loader is None:
        raise RuntimeError(f"ldd found no ELF loader for {objects[0]}")
    shutil.copy2(loader.resolve(), libdir / LOADER_NAME)
    for soname, path in libs.items():
        if soname == LOADER_NAME:
            continue
        shutil.copy2(path.resolve(), libdir / soname)
    return len(libs)


def _copy_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    for file in dist.files or ():
        parts = file.parts
        if not parts or parts[0] == ".." or "__pycache__" in parts or file.suffix == ".pyc":
            continue
        source = Path(str(dist.locate_file(file)))
        if not source.is_file():
            continue
        target = site.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _copy_aenv(aenv_root: Path, dst: Path) -> None:
    for path in _aenv_files(aenv_root):
        target = dst / path.relative_to(aenv_root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _compile(python: Path, dirs: Sequence[Path]) -> None:
    # Unchecked-hash pycs: the bundle is immutable and read-only in the
    # guest, so the interpreter need not stat sources to validate them.
    subprocess.run(
        [
            str(python),
            "-S",
            "-I",
            "-m",
            "compileall",
            "-q",
            "-j0",
            "--invalidation-mode",
            "unchecked-hash",
            # plain for the interpreter's other users, -OO for envd (envd_command)
            "-o",
            "0",
            "-o",
            "2",
            *map(str, dirs),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _make_readable(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            mode = os.stat(p).st_mode
            os.chmod(p, 0o755 if mode & 0o111 else 0o644)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m aenv.storage.bundle DEST [--python PATH]`: build with progress lines."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aenv.storage.bundle", description=__doc__)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--python", type=Path, default=None)
    args = parser.parse_args(argv)
    build_bundle(args.dest, python=args.python, progress=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
