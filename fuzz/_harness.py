"""Shared settings and the standalone runner of the fuzz targets.

Each `fuzz_*.py` is a set of Hypothesis tests: short under `make test`
(200 examples each), long under `make fuzz` (`AENV_FUZZ_LONG=1`, 50,000), or
`AENV_FUZZ_EXAMPLES=N`. Run standalone (`python fuzz/fuzz_x.py`), a target
uses atheris when it is importable, else loops Hypothesis rounds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, settings


def examples() -> int:
    raw = os.environ.get("AENV_FUZZ_EXAMPLES")
    if raw:
        return int(raw)
    return 50_000 if os.environ.get("AENV_FUZZ_LONG") == "1" else 200


FUZZ = settings(
    max_examples=examples(),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


def main(tests: Sequence[Callable[[], None]], doc: str, argv: list[str] | None = None) -> int:
    """Fuzz until stopped: atheris when importable, else `--rounds` hypothesis rounds."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="hypothesis rounds (no atheris)")
    args, rest = parser.parse_known_args(argv)
    try:
        atheris = importlib.import_module("atheris")
    except ImportError:
        atheris = None
    if atheris is not None:

        def one_input(data: bytes) -> None:
            if data:
                target = tests[data[0] % len(tests)]
                target.hypothesis.fuzz_one_input(data[1:])  # type: ignore[attr-defined]

        atheris.instrument_all()
        atheris.Setup([sys.argv[0], *rest], one_input)
        atheris.Fuzz()
        return 0
    for n in range(1, args.rounds + 1):
        t0 = time.monotonic()
        for t in tests:
            t()
        print(
            f"round {n}/{args.rounds}: {len(tests)} targets x {examples()} examples "
            f"in {time.monotonic() - t0:.1f}s",
            flush=True,
        )
    return 0
