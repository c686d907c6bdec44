"""envd's stand-ins for modules its libraries import but it does not use (`aenv.envd.slim`).

Each case runs in a fresh interpreter, as envd's entry point starts: the
stand-ins change `sys.modules` for good.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import trio

import aenv
from aenv.envd.slim import STAND_INS


def run(code: str) -> str:
    # as in the bundle: no site, aenv and its packages on the path
    paths = [Path(aenv.__file__).parent.parent, Path(trio.__file__).parent.parent]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    return subprocess.run(
        [sys.executable, "-S", "-P", "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_envd_imports_without_the_modules_it_does_not_use() -> None:
    out = run(
        """
        import sys
        from aenv.envd import slim
        slim.install()
        import aenv.envd.server
        real = [m for m in ("multiprocessing", "logging.handlers", "socketserver", "tempfile")
                + tuple(slim.STAND_INS) if m in sys.modules
                and not isinstance(sys.modules[m], slim.StandIn)]
        print("real:", *real)
        import trio._core._thread_cache as cache
        print("names threads:", cache.set_os_thread_name is not None)
        """
    )
    assert out.splitlines() == ["real:", "names threads: True"]


def test_a_use_of_a_stand_in_imports_the_real_module() -> None:
    out = run(
        """
        import sys
        from aenv.envd import slim
        slim.install()
        import ctypes.util, logging, logging.config, tomllib
        from multiprocessing.synchronize import Event
        import multiprocessing
        print(tomllib.loads("a = 1"))
        logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}})
        print(logging.getLogger().level == logging.ERROR)
        event = Event(ctx=multiprocessing.get_context())
        print(type(event).__module__, event.is_set())
        print(ctypes.util.find_library("c"), ctypes.util.find_library("pthread"))
        print(ctypes.util.find_library("no-such-library-anywhere"))
        print(*[isinstance(sys.modules[m], slim.StandIn) for m in sorted(slim.STAND_INS)])
        """
    )
    assert out.splitlines() == [
        "{'a': 1}",
        "True",
        "multiprocessing.synchronize False",
        "libc.so.6 libc.so.6",
        "None",
        "False False False False",
    ]


def test_modules_already_imported_are_left_alone() -> None:
    out = run(
        """
        import sys, tomllib
        from aenv.envd import slim
        slim.install()
        print(sys.modules["tomllib"] is tomllib)
        """
    )
    assert out.split() == ["True"]
    assert "tomllib" in STAND_INS
