"""Templates as snapshots: a memory snapshot of each template, booted once, restored after.

The first sandbox of a template boots it (and its envd) from scratch. At the
same time the `Warmer` boots one more sandbox of that template, hidden from
the API, waits for envd, captures it with its memory into a snapshot named
`~template/<template id>@<build id>`, and kills it. Every later sandbox of
that template is a restore of the snapshot (envd already running) rather
than a boot. A template rebuilt under the same ID has a new build ID, so its
old snapshot is never used; deleting a template deletes its snapshots.

Names starting with `~` cannot be given by callers (they are not valid
names), so these snapshots never collide with a user's and are left out of
the snapshot listings. A warm-up that fails is logged and retried after a
while; sandboxes keep booting meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from aenv.node.sandbox import Snapshot
from aenv.node.snapshots import Snapshots, is_internal, snapshot_name
from aenv.storage.templates import Template

if TYPE_CHECKING:
    from aenv.node.launcher import Launcher
    from aenv.node.sandbox import SandboxActor

log = logging.getLogger("aenv.warm")

RETRY_AFTER_S = 300.0
WARM_TIMEOUT_S = 600
CAPTURE_TIMEOUT_S = 300.0


class Warmer:
    def __init__(
        self,
        snapshots: Snapshots,
        launcher: Launcher,
        nursery: trio.Nursery,
        *,
        enabled: bool = True,
    ) -> None:
        self._snapshots = snapshots
        self._launcher = launcher
        self.enabled = enabled
        self._nursery = nursery
        self._warming: set[str] = set()
        self._failed_at: dict[str, float] = {}

    async def snapshot(self, template: Template) -> dict[str, Any] | None:
        """The template's snapshot if there is one; else start making it, and None."""
        if not self.enabled or template.snapshot_id is not None:
            return None
        doc = await self._snapshots.resolve(snapshot_name(template))
        if doc is None:
            self._start(template)
        return doc

    def _start(self, template: Template) -> None:
        name = snapshot_name(template)
        failed = self._failed_at.get(name)
        if name in self._warming or (failed and time.monotonic() - failed < RETRY_AFTER_S):
            return
        self._warming.add(name)
        self._nursery.start_soon(self._warm, template)

    async def _warm(self, template: Template) -> None:
        name = snapshot_name(template)
        actor: SandboxActor | None = None
        started = time.monotonic()
        try:
            actor = await self._launcher.boot_hidden(template, timeout_s=WARM_TIMEOUT_S)
            await actor.mailbox.ask(Snapshot(name, memory=True), timeout=CAPTURE_TIMEOUT_S)
            log.info(
                "template %s is now a snapshot (%.1fs); its sandboxes restore",
                template.template_id,
                time.monotonic() - started,
            )
        except Exception as exc:
            self._failed_at[name] = time.monotonic()
            log.warning("making template %s a snapshot failed: %r", template.template_id, exc)
        finally:
            self._warming.discard(name)
            if actor is not None:
                await actor.stop()

    async def forget(self, template_id: str) -> None:
        """Delete every snapshot a template's sandboxes were restored from."""
        for doc in await self._snapshots.list():
            if is_internal(doc) and doc.get("templateID") == template_id:
                await self._snapshots.delete(str(doc["snapshotID"]))
