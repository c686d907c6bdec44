"""Exception groups: their leaves, and the one error that explains a failed nursery.

A trio nursery raises a (possibly nested) `BaseExceptionGroup` even when only
one child failed, usually along with `trio.Cancelled` for the siblings that
failure cancelled. Callers mostly want that one failure, as it is:
`leaves(exc)` flattens a group depth first; `first_leaf(exc, *kinds)` picks
the first leaf of the first kind that has one (kinds in order of
preference); `sole_leaf(exc)` is the leaf of a group of one; `one_error()`
lets the first failure out of a nursery on its own, dropping the
cancellations it caused (a group of nothing but cancellations passes
unchanged, so a cancel scope outside still catches it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

ExceptionKind = type[BaseException] | tuple[type[BaseException], ...]

__all__ = ["first_leaf", "leaves", "one_error", "sole_leaf"]


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside `exc`, depth first, nested groups flattened; `[exc]` if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


def first_leaf(exc: BaseException, *kinds: ExceptionKind) -> BaseException | None:
    """The first leaf that is a `kinds[0]`, else the first that is a `kinds[1]`, ...; None if
    no leaf is any of them. A tuple of classes counts as one kind (first of any of them)."""
    found = leaves(exc)
    for kind in kinds:
        for leaf in found:
            if isinstance(leaf, kind):
                return leaf
    return None


def sole_leaf(exc: BaseException) -> BaseException | None:
    """The one leaf of `exc` (`exc` itself if not a group); None if there are several."""
    found = leaves(exc)
    return found[0] if len(found) == 1 else None


@contextmanager
def one_error() -> Iterator[None]:
    """Let the first real failure of a nursery of parallel tasks out on its own.

    The first leaf of the group that is not a `trio.Cancelled` is raised
    (from None); a group of cancellations only is re-raised unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        real = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
        if not real:
            raise
        raise real[0] from None
