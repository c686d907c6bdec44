"""Default templates and the object store: shared by the nodes that have them,
fetched by the nodes that lack them.

`base` and `busybox` are built on a machine by `aenv.storage.rootfs`. A node
whose store is shared (`Config.shares_default_templates`) puts the builds
it has in the store at start, in the background, content-addressed
(`aenv.storage.snapstore.defaults`: the first build shared for a recipe is
the one the store names; a node whose own build differs keeps it). A node
whose home lacks one takes it from the store instead: at start, a
background job per missing template looks it up and fetches it (into a
staging directory under the templates' build lock, installed only once
whole); meanwhile a create of that template answers 503 with Retry-After
(`TemplateFetching`), so no create waits for a 262 MB download inside its
request. A template missing when asked for and not being fetched is looked
up in the store once more (a node may have shared it since), and fetched
if there. Store failures are retried with capped backoff for as long as
the node lives; a build the store cannot give whole is given up on until
the next create asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from aenv.config import Config
from aenv.kit.retry import Backoff
from aenv.kit.supervisor import ChildHandle, RestartPolicy, StopToken, Strategy, Supervisor
from aenv.storage.objstore import ObjectStore, StoreError
from aenv.storage.rootfs import (
    START_COMMANDS,
    build_lock,
    recipe,
    remove_leftover_builds,
    staging_dir,
)
from aenv.storage.snapstore import SnapshotUnavailable
from aenv.storage.snapstore.defaults import (
    StoredRootfs,
    fetch_rootfs,
    find_rootfs,
    rootfs_index,
    share_rootfs,
)
from aenv.storage.templates import (
    DEFAULT_TEMPLATE_IDS,
    Template,
    TemplateConflict,
    TemplateNotFound,
    TemplateStore,
)

log = logging.getLogger("aenv.templates")

FETCH_RETRY_S = 5.0  # the Retry-After of a create while its template is fetched
RETRY = Backoff(base_s=0.5, max_s=10.0)
JOB_RESTARTS = RestartPolicy(max_restarts=3, window_s=600.0, backoff_base_s=1.0)
ORDER = ("busybox", "base")  # the small one first: it is usable within a second


class TemplateFetching(Exception):
    """The template is being fetched from the object store; retry after `retry_after` s."""

    def __init__(self, template_id: str, size_mb: int | None, retry_after: float) -> None:
        size = f" ({size_mb} MiB)" if size_mb is not None else ""
        super().__init__(
            f"template {template_id!r} is being fetched from the object store{size}; retry shortly"
        )
        self.template_id = template_id
        self.retry_after = retry_after


class DefaultTemplates:
    def __init__(
        self,
        *,
        config: Config,
        templates: TemplateStore,
        store: ObjectStore | None,
        services: Supervisor,
    ) -> None:
        self._config = config
        self._templates = templates
        self._store = store
        self._services = services
        self._fetches: dict[str, ChildHandle[None]] = {}
        self._sizes: dict[str, int] = {}  # MiB of the builds being fetched

    def _present(self, template_id: str) -> bool:
        try:
            return self._templates.resolve(template_id).template_id == template_id
        except TemplateNotFound:
            return False

    async def start(self) -> None:
        """At the node's start: share the default templates this node has, fetch
        those it lacks (both in the background)."""
        if self._store is None:
            return
        for template_id in ORDER:
            if await trio.to_thread.run_sync(self._present, template_id):
                if self._config.shares_default_templates:
                    self._services.start_soon(
                        f"share template {template_id}",
                        functools.partial(self._share, template_id),
                        policy=JOB_RESTARTS,
                        give_up=Strategy.FAIL,
                        grace_s=0.0,
                    )
            else:
                self._start_fetch(template_id, None)

    def fetching(self, template_id: str) -> bool:
        job = self._fetches.get(template_id)
        return job is not None and not job.done

    async def lookup(self, name: str) -> Template | None:
        """For a template this node did not have: raise `TemplateFetching` if `name`
        is a default template being fetched, or one the store holds (whose fetch
        this starts); the template if it arrived meanwhile; None otherwise."""
        if name not in DEFAULT_TEMPLATE_IDS or self._store is None:
            return None
        if not self.fetching(name):
            with contextlib.suppress(TemplateNotFound):
                return await trio.to_thread.run_sync(self._templates.resolve, name)
            try:
                found = await find_rootfs(self._store, name, recipe(name))
            except (StoreError, SnapshotUnavailable) as exc:
                log.warning("cannot look up template %s in the object store: %s", name, exc)
                return None
            if found is None:
                return None
            self._start_fetch(name, found)
        raise TemplateFetching(name, self._sizes.get(name), FETCH_RETRY_S)

    # -- jobs ------------------------------------------------------------------------

    def _start_fetch(self, template_id: str, found: StoredRootfs | None) -> None:
        if found is not None:
            self._sizes[template_id] = found.disk_size_mb
        self._fetches[template_id] = self._services.start_soon(
            f"fetch template {template_id}",
            functools.partial(self._fetch, template_id, found),
            policy=JOB_RESTARTS,
            give_up=Strategy.FAIL,
            grace_s=0.0,
        )

    async def _fetch(self, template_id: str, found: StoredRootfs | None, _stop: StopToken) -> None:
        """Look the template up (unless `found`) and install it from the store,
        retrying store failures."""
        assert self._store is not None
        delays = RETRY.delays()
        while True:
            try:
                if found is None:
                    found = await find_rootfs(self._store, template_id, recipe(template_id))
                    if found is None:
                        log.info(
                            "template %s is neither on this node nor in the object store: "
                            "build it with `python -m aenv.storage.rootfs --home %s`",
                            template_id,
                            self._config.home,
                        )
                        return
                    self._sizes[template_id] = found.disk_size_mb
                await self._install(found)
                return
            except StoreError as exc:
                delay = next(delays)
                log.warning(
                    "fetching template %s failed, retrying in %.1fs: %s", template_id, delay, exc
                )
                await trio.sleep(delay)
            except SnapshotUnavailable as exc:
                log.error(
                    "template %s cannot be fetched from the object store: %s", template_id, exc
                )
                return

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """The templates' build lock (`aenv.storage.rootfs.build_lock`), taken in a thread."""
        lock = build_lock(self._templates)
        await trio.to_thread.run_sync(lock.__enter__)
        try:
            yield
        finally:
            lock.__exit__(None, None, None)

    async def _install(self, found: StoredRootfs) -> None:
        assert self._store is not None
        template_id = found.template_id
        templates = self._templates
        started = trio.current_time()
        async with self._locked():
            if await trio.to_thread.run_sync(self._present, template_id):
                return  # built or fetched meanwhile (`make serve`, another job)
            # a fetch this node's earlier process did not finish (nobody else builds now)
            await trio.to_thread.run_sync(remove_leftover_builds, templates)
            staging: Path = await trio.to_thread.run_sync(staging_dir, templates, template_id)
            try:
                await fetch_rootfs(self._store, found, staging / "rootfs")
                try:
                    await trio.to_thread.run_sync(
                        functools.partial(
                            templates.add,
                            template_id=template_id,
                            rootfs_dir=staging / "rootfs",
                            aliases=(template_id,),
                            cpu_count=found.cpu_count,
                            memory_mb=found.memory_mb,
                            start_cmd=START_COMMANDS.get(template_id, (None, None))[0],
                            ready_cmd=START_COMMANDS.get(template_id, (None, None))[1],
                        )
                    )
                except TemplateConflict:
                    return  # added meanwhile
                await trio.to_thread.run_sync(
                    templates.record_rootfs_index, template_id, found.index
                )
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        functools.partial(shutil.rmtree, staging, ignore_errors=True)
                    )
        log.info(
            "template %s taken from the object store (build shared by %s), not built: "
            "ready in %.1f s",
            template_id,
            found.shared_by,
            trio.current_time() - started,
        )

    async def _share(self, template_id: str, _stop: StopToken) -> None:
        """Put this node's build in the store unless the store names one, retrying
        store failures."""
        delays = RETRY.delays()
        while True:
            try:
                await self._share_once(template_id)
                return
            except StoreError as exc:
                delay = next(delays)
                log.warning(
                    "sharing template %s failed, retrying in %.1fs: %s", template_id, delay, exc
                )
                await trio.sleep(delay)

    async def _share_once(self, template_id: str) -> None:
        assert self._store is not None
        templates = self._templates
        try:
            template = await trio.to_thread.run_sync(templates.resolve, template_id)
        except TemplateNotFound:
            return
        known = await trio.to_thread.run_sync(templates.rootfs_index, template_id)
        wanted = recipe(template_id)
        try:
            named = await find_rootfs(self._store, template_id, wanted)
        except SnapshotUnavailable as exc:
            log.warning("template %s: the store's build is unreadable: %s", template_id, exc)
            named = None
        if named is not None and (known is None or known == named.index):
            # nothing to upload whichever build this node has (no need to read it all)
            same = "this build" if known == named.index else "a build"
            log.info(
                "template %s: the object store holds %s of it (shared by %s)",
                template_id,
                same,
                named.shared_by,
            )
            return
        if named is not None:
            log.info(
                "template %s: the object store holds another build (shared by %s); "
                "this node keeps its own, nodes that fetch it take the store's",
                template_id,
                named.shared_by,
            )
            return
        raw, digest = await trio.to_thread.run_sync(rootfs_index, template.rootfs)
        if known != digest:
            await trio.to_thread.run_sync(templates.record_rootfs_index, template_id, digest)
        build = StoredRootfs(
            template_id=template_id,
            recipe=wanted,
            index=digest,
            cpu_count=template.cpu_count,
            memory_mb=template.memory_mb,
            disk_size_mb=template.disk_size_mb,
            shared_at=time.time(),
            shared_by=self._config.effective_node_id,
        )
        grace = self._config.store_gc_grace_s
        outcome = await share_rootfs(
            self._store,
            build=build,
            tree=template.rootfs,
            index_raw=raw,
            refresh_after_s=grace / 2 if grace > 0 else None,
        )
        log.info(
            "template %s: %s",
            template_id,
            {
                "shared": "put in the object store for nodes that lack it",
                "present": "the object store holds this build already",
                "other": "another node shared a build first; this node keeps its own",
            }[outcome],
        )
