"""What the node's own services need to start sandboxes of their own.

The pool (`aenv.node.pool`) keeps restored sandboxes ready and the warmer
(`aenv.node.warm`) boots one per template to capture it; both start hidden
sandboxes (not shown to callers, not journaled) and the warmer snapshots them
through a `Launcher`, which the node implements, instead of reaching into
the node's table.
"""

from __future__ import annotations

from typing import Any, Protocol

from aenv.node.sandbox import SandboxActor
from aenv.storage.templates import Template


class Launcher(Protocol):
    async def boot_hidden(self, template: Template, *, timeout_s: int) -> SandboxActor:
        """A hidden sandbox booted from `template`, ready (envd answering)."""
        ...

    async def restore_hidden(
        self, doc: dict[str, Any], template: Template, *, timeout_s: int, pooled: bool = False
    ) -> SandboxActor:
        """A hidden sandbox restored from snapshot `doc` of `template`, ready."""
        ...

    async def snapshot(
        self, source: SandboxActor, name: str | None, *, memory: bool, wait_s: float
    ) -> dict[str, Any]:
        """A snapshot of running sandbox `source`, recorded."""
        ...
