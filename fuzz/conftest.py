"""Collect the fuzz targets (`fuzz_*.py`) as pytest test modules.

pytest's default file pattern is `test_*.py`; the fuzzers keep their own
`fuzz_*.py` names so they read as fuzz targets (and run standalone with
`python fuzz/fuzz_x.py`). A file named on the command line is already
collected by pytest itself, so it is skipped here to avoid running it twice.
How long they run is chosen in each module: a short run by default, a long
one with `AENV_FUZZ_LONG=1` (`make fuzz`), an exact count with
`AENV_FUZZ_EXAMPLES=N`; those runs lift pytest-timeout's per-test limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if file_path.suffix != ".py" or not file_path.name.startswith("fuzz_"):
        return None
    if parent.session.isinitpath(file_path):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("AENV_FUZZ_LONG") != "1" and not os.environ.get("AENV_FUZZ_EXAMPLES"):
        return
    for item in items:
        if item.path.resolve().parent == HERE:
            item.add_marker(pytest.mark.timeout(0))
