"""Templates as snapshots: a memory snapshot of each template, booted once, restored after.

The first sandbox of a template boots it (and its envd) from scratch. At the
same time the `Warmer` boots one more sandbox of that template, hidden from
the API, waits for envd, captures it with its memory into a snapshot named
`~template/<template id>@<build id>`, and kills it. Every later sandbox of
that template is a restore of the snapshot (envd already running) rather
than a boot. A template rebuilt under the same ID has a new build ID, so its
old snapshot is never used; deleting a template deletes its snapshots.

A template with a start command (a default template that runs a server,
such as `code-interpreter-v1`) is captured once its start command runs and
its ready command passes (`aenv.node.guest`), so its sandboxes restore with
the server (and, for the code interpreter, a warm kernel) running; such a
template is always warmed, and a create waits for its snapshot
(`ready_snapshot`) rather than boot a sandbox without the server.

Names starting with `~` cannot be given by callers (they are not valid
names), so these snapshots never collide with a user's and are left out of
the snapshot listings. A warm-up is a job of the node's `services`
supervisor: one that fails is restarted with backoff (`WARM_RESTARTS`),
then given up on, logged, and tried again only `RETRY_AFTER_S` later;
sandboxes keep booting meanwhile.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from aenv.kit.supervisor import (
    ChildHandle,
    RestartPolicy,
    StopToken,
    Strategy,
    Supervisor,
)
from aenv.node.guest import start_and_wait
from aenv.node.snapshots import Snapshots, is_template_own, snapshot_name
from aenv.storage.templates import Template

if TYPE_CHECKING:
    from aenv.node.launcher import Launcher
    from aenv.node.sandbox import SandboxActor

log = logging.getLogger("aenv.warm")

RETRY_AFTER_S = 300.0
WARM_TIMEOUT_S = 600
CAPTURE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0  # a template's start command, until its ready command passes
# a failed warm-up is tried twice more, 10 and 20 s (less jitter) later
WARM_RESTARTS = RestartPolicy(max_restarts=2, window_s=600.0, backoff_base_s=10.0)


class Warmer:
    def __init__(
        self,
        snapshots: Snapshots,
        launcher: Launcher,
        services: Supervisor,
        *,
        enabled: bool = True,
    ) -> None:
        self._snapshots = snapshots
        self._launcher = launcher
        self.enabled = enabled
        self._services = services
        self._jobs: dict[str, ChildHandle[None]] = {}  # the latest warm-up of each name

    async def snapshot(self, template: Template) -> dict[str, Any] | None:
        """The template's snapshot if there is one; else start making it, and None."""
        if template.snapshot_id is not None:
            return None
        if not self.enabled and template.start_cmd is None:
            return None
        doc = await self._snapshots.resolve(snapshot_name(template))
        if doc is None:
            self._start(template)
        return doc

    async def ready_snapshot(self, template: Template) -> dict[str, Any] | None:
        """The template's snapshot, waiting for the warm-up that makes it; None if
        that failed (or failed lately)."""
        doc = await self.snapshot(template)
        if doc is not None or template.snapshot_id is not None:
            return doc
        job = self._jobs.get(snapshot_name(template))
        if job is not None:
            await job.wait()
        return await self._snapshots.resolve(snapshot_name(template))

    def _start(self, template: Template) -> None:
        name = snapshot_name(template)
        job = self._jobs.get(name)
        if job is not None and job.busy_or_resting(RETRY_AFTER_S):
            return  # warming up (or backing off), or given up on lately
        self._jobs[name] = self._services.start_soon(
            f"warm {name}",
            functools.partial(self._warm, template),
            policy=WARM_RESTARTS,
            give_up=Strategy.FAIL,
            grace_s=0.0,
        )

    async def _warm(self, template: Template, _stop: StopToken) -> None:
        name = snapshot_name(template)
        actor: SandboxActor | None = None
        started = time.monotonic()
        try:
            actor = await self._launcher.boot_hidden(template, timeout_s=WARM_TIMEOUT_S)
            if template.start_cmd is not None:
                await start_and_wait(actor, template, timeout_s=START_TIMEOUT_S)
            await self._launcher.snapshot(actor, name, memory=True, wait_s=CAPTURE_TIMEOUT_S)
            log.info(
                "template %s is now a snapshot (%.1fs); its sandboxes restore",
                template.template_id,
                time.monotonic() - started,
            )
        finally:
            if actor is not None:
                await actor.stop()

    async def forget(self, template_id: str) -> None:
        """Delete every snapshot a template's sandboxes were restored from."""
        for doc in await self._snapshots.of_template(template_id):
            if is_template_own(doc):
                await self._snapshots.delete(str(doc["snapshotID"]))
