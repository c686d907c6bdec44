"""Stand-ins for modules envd's libraries import but envd does not use.

Every module envd imports is heap held in every sandbox's memory (each
restore gets a private copy of the template's memory image). Some are
imported by trio and Hypercorn at import time only for features envd never
uses, and cost ≈ 2 MiB per sandbox (measured with the bundle's Python,
docs/performance.md, Density):

| module | imported by | for |
|---|---|---|
| `ctypes.util` (shutil, tempfile, bz2, lzma, ...) | trio's thread cache | `find_library("pthread")`, to name worker threads |
| `multiprocessing.synchronize` (the multiprocessing package) | Hypercorn | the type of a worker's shutdown event |
| `logging.config` (socketserver, logging.handlers, pickle, ...) | Hypercorn | `logconfig` settings |
| `tomllib` | Hypercorn | `Config.from_toml` |

`install()` puts a `StandIn` in `sys.modules` under each name (and on its
parent package) before those libraries are imported. A stand-in holds the
few names its importers take at import time; any other attribute imports
the real module in its place and is taken from it, so a use envd does not
make today still works, only later. `find_library` answers for the C
library and pthreads (in glibc's `libc.so.6`, which the bundle carries and
envd has loaded) without running `ldconfig` as the real one does; other
names go to the real one. Envd's entry point (`aenv.envd.__main__`) installs
them, in the guest only.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["STAND_INS", "StandIn", "install"]


class StandIn(types.ModuleType):
    """Module `name` until one of its other attributes is used, then the real one."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            # (probes of the import system and of tools: no reason to load it)
            raise AttributeError(attr)
        return getattr(real(self.__name__), attr)


def real(name: str) -> types.ModuleType:
    """The real module `name`, imported now in place of its stand-in."""
    if isinstance(sys.modules.get(name), StandIn):
        del sys.modules[name]
    module = importlib.import_module(name)  # (also sets it on its parent package)
    return module


def _forward(module: str, name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(real(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _find_library(name: str) -> str | None:
    if name in ("c", "pthread"):
        return "libc.so.6"
    found: str | None = real("ctypes.util").find_library(name)
    return found


class _Event:
    """`multiprocessing.synchronize.Event` where Hypercorn names it in type
    hints; making one makes a real one."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return real("multiprocessing.synchronize").Event(*args, **kwargs)


# name -> (what its importers take from it at import time, whether its
# importers use it as an attribute of its package after `import a.b`: the
# package is then imported to hold it; multiprocessing is not, it is the cost)
STAND_INS: dict[str, tuple[dict[str, Any], bool]] = {
    "ctypes.util": ({"find_library": _find_library}, True),
    "multiprocessing.synchronize": ({"Event": _Event}, False),
    "logging.config": (
        {
            "dictConfig": _forward("logging.config", "dictConfig"),
            "fileConfig": _forward("logging.config", "fileConfig"),
        },
        True,
    ),
    "tomllib": ({}, False),
}


def install() -> None:
    """Stand in for each module of STAND_INS not imported yet.

    A submodule's stand-in is set on its parent package where its importers
    write `import a.b` then use `a.b.x` (the package is imported for that,
    as they would import it).
    """
    for name, (names, on_parent) in STAND_INS.items():
        if name in sys.modules:
            continue
        stand_in = StandIn(name)
        stand_in.__dict__.update(names)
        if on_parent:
            parent, _, child = name.rpartition(".")
            setattr(importlib.import_module(parent), child, stand_in)
        sys.modules[name] = stand_in
