"""JSON from untrusted peers, with its nesting bounded.

`json.loads` recurses once per level of nesting, so a body of 100,000 `[`
raises `RecursionError` (a 500) after a long walk. `loads` first measures
the nesting in one pass over the text (brackets inside strings do not
count) and refuses anything deeper than `MAX_DEPTH` with `JSONBodyError`, a
`ValueError`, before decoding; every other malformed body raises the same.
"""

from __future__ import annotations

import json
import re
from typing import Any

# No request aenv serves nests deeper than a few levels; 64 leaves room.
MAX_DEPTH = 64

# strings (with their escapes) and brackets: the only tokens that matter for depth
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


class JSONBodyError(ValueError):
    pass


def depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data` (0 for a scalar)."""
    level = deepest = 0
    for m in _TOKENS.finditer(data):
        tok = m.group()
        if tok in (b"[", b"{"):
            level += 1
            deepest = max(deepest, level)
        elif tok in (b"]", b"}"):
            level -= 1
    return deepest


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing documents nested deeper than `max_depth`."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if depth(raw) > max_depth:
        raise JSONBodyError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except RecursionError:  # (cannot happen within max_depth; kept as a guard)
        raise JSONBodyError(f"JSON nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONBodyError(str(e)) from None
