"""The Node: owns the sandbox table, every sandbox actor and the node's services.

`open_node(config)` sets up the node-wide services on this machine (API key,
runsc, overlay roots, host network, images), reaps what an earlier crashed
process left behind, and yields a `Node` from `open_node_on(host, ...)`,
which runs a node on any `aenv.node.host.Host` (the in-process tests give
it scripted ones). The table is only mutated by this module, from
synchronous code, so trio's cooperative scheduling keeps it consistent.

Everything long-lived runs under one of the node's two supervisors
(`aenv.kit.supervisor`): `sandboxes` runs one child per sandbox actor (no
restart: an actor contains its own failures, marks its sandbox failed and
tears it down; the supervisor logs whatever still escapes), `services`
runs the rest, each with its own restart policy: the memory watcher and the
host network's watchdog, the pool fillers (`aenv.node.pool`), template
warm-ups (`aenv.node.warm`), builds (`aenv.node.builds`), uploads, template
shares, layer copies and the store's garbage collection
(`aenv.node.durable`), the default templates' shares and fetches
(`aenv.node.defaults`), and one-shot jobs: the second half of a fork
(`aenv.node.forks`) or a snapshot (`aenv.node.snapshots.record_capture`)
after the sandbox's own capture, and background calls (`start_background`).
None of them escalates: a child that keeps failing is given up on, logged,
and the node runs on. Leaving the block stops the services, then the
sandboxes, each on its stop ladder (every sandbox is cancelled at once and
tears itself down in its `finally`, as a node stop always did).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import datetime
import functools
import itertools
import logging
import math
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from aenv.config import Config
from aenv.images.service import Images, open_images
from aenv.images.store import ImageRecord
from aenv.kit.files import link_files
from aenv.kit.mailbox import Busy
from aenv.kit.metrics import Registry
from aenv.kit.supervisor import (
    ONE_SHOT,
    RestartPolicy,
    StopToken,
    Strategy,
    Supervisor,
    run_supervisor,
)
from aenv.node import forks, guest, pressure, primer
from aenv.node.builds import Builds
from aenv.node.defaults import DefaultTemplates
from aenv.node.durable import Durable
from aenv.node.egress import (
    EgressEvent,
    EgressProxy,
    Resolver,
    egress_entry,
    egress_metrics,
    listener_port,
    open_egress_listener,
)
from aenv.node.egresstls import NodeCA, interceptor, upstream_context
from aenv.node.host import Host, HttpEnvd, WritableRoots
from aenv.node.identity import Issuer, keep_keys, open_issuer
from aenv.node.pool import Pool
from aenv.node.sandbox import Fork, LiveCapture, Resume, SandboxActor, Snapshot, policy_of
from aenv.node.snapshots import (
    CorruptSnapshot,
    Snapshots,
    is_paused_copy,
    paused_copy_name,
    record_capture,
)
from aenv.node.warm import START_TIMEOUT_S, Warmer
from aenv.proto import ids
from aenv.proto import lifecycle as lc
from aenv.proto.egressrules import Placeholder
from aenv.proto.identity import TokenSpec
from aenv.proto.ids import InvalidName
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.poolsize import PoolLimits
from aenv.proto.requests import Limits, NewSandbox
from aenv.proto.volumes import VolumeMount
from aenv.runtimes.base import Runtime
from aenv.runtimes.gvisor import GVisorRuntime
from aenv.runtimes.hostclaim import claim_host
from aenv.runtimes.netns import NetSlot, network_metrics, open_host_network
from aenv.storage.layers import LayerStack, LayerStore
from aenv.storage.metadata import Metadata, MetadataStore
from aenv.storage.overlay import OverlayRoots
from aenv.storage.secrets import SecretNotFound, SecretStore
from aenv.storage.sparedisks import SpareDisks
from aenv.storage.templates import (
    Template,
    TemplateConflict,
    TemplateNotFound,
    TemplateStore,
    new_template_id,
)
from aenv.storage.volumes import Volumes

log = logging.getLogger("aenv.node")

LAYER_GC_MIN_AGE_S = 60.0
# The memory pressure watcher, restarted after 1, 2, 4, 8 and 16 s; a sixth failure
# within 5 minutes leaves the node without it (logged), running on. (One per
# node: no jitter, nothing to spread out.)
WATCHER_RESTARTS = RestartPolicy(
    max_restarts=5, window_s=300.0, backoff_base_s=1.0, backoff_max_s=30.0, jitter=0.0
)
# how long the node's services get, together, to stop when the node does
SERVICES_STOP_S = 10.0


class SandboxNotFound(LookupError):
    def __init__(self, sandbox_id: str, why: str | None = None) -> None:
        super().__init__(f"sandbox {sandbox_id!r} " + (why or "not found"))
        self.sandbox_id = sandbox_id


@dataclass(frozen=True)
class Died:
    """A sandbox whose runtime stopped by itself (a crash, the host's OOM killer),
    kept for a while so that calls for it say so instead of "not found"."""

    sandbox_id: str
    template_id: str
    metadata: dict[str, str]
    started_at: float
    died_at: float
    cause: str
    host_oom: bool
    # its size, for lists that show it (`aenv list --all`)
    alias: str | None = None
    cpu_count: int = 0
    memory_mb: int = 0
    disk_mb: int = 0

    def why(self) -> str:
        when = datetime.datetime.fromtimestamp(self.died_at, datetime.UTC)
        return f"died at {when.isoformat(timespec='seconds')}: {self.cause}"


# how many died sandboxes are remembered, and for how long
DIED_KEPT = 1000
DIED_KEPT_S = 3600.0


class SandboxConflict(Exception):
    """The sandbox is already on this node."""


class SandboxLost(Exception):
    """A journaled sandbox cannot be taken back after a restart (the message says why)."""


# sandboxes taken back at once after a restart (their steps mostly wait on runsc)
RECOVER_CONCURRENCY = 16
# how long a sandbox lost at a restart is still answered for with the reason
LOST_KEPT_S = 24 * 3600.0


def ensure_api_key(config: Config) -> str:
    """The configured key, else the one in secrets/api-key, else a new one written 0600."""
    if config.api_key:
        return config.api_key
    path = config.secrets_dir / "api-key"
    try:
        key = path.read_text().strip()
        if key:
            return key
    except FileNotFoundError:
        pass
    config.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "aenv_" + secrets.token_hex(20)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


class Node:
    def __init__(
        self,
        *,
        config: Config,
        host: Host,
        templates: TemplateStore,
        images: Images,
        services: Supervisor,
        sandboxes: Supervisor,
        api_key: str,
    ) -> None:
        self.config = config
        self.host = host
        self.runtime = host.runtime
        self.network = host.network
        self.templates = templates
        self.images = images
        self.layers = LayerStore(config.home / "layers")
        self.meta = Metadata(MetadataStore(config.home / "aenv.db"))
        self.snapshots = Snapshots(config.home / "snapshots", self.meta)
        # `/secrets`: write-only values, encrypted under the node's key
        self.secrets = SecretStore(config.secrets_dir / "values")
        # the egress CA sandboxes with `network.rules` trust (set by `open_node`)
        self.egress_ca_pem: str | None = None
        # the OIDC issuer of sandboxes' workload tokens (set by `open_node`)
        self.issuer: Issuer | None = None
        self.api_key = api_key
        self.limits = Limits(
            max_timeout_s=config.max_timeout_s,
            default_timeout_s=config.default_timeout_s,
            max_cpu=os.cpu_count() or 1,
            max_memory_mb=_host_memory_mb(),
        )
        # the node's long-lived tasks and jobs, and its sandbox actors (module docstring)
        self.services = services
        self.sandboxes = sandboxes
        self._jobs = itertools.count(1)  # numbers one-shot jobs' names
        self._sandboxes: dict[str, SandboxActor] = {}
        # sandboxes found dead at a restart: {id: what happened}, answered for a while
        self.lost: dict[str, str] = {}
        self.died: collections.OrderedDict[str, Died] = collections.OrderedDict()
        self.builds = Builds(self, services)  # template builds (aenv.node.builds)
        self.durable = Durable(  # object store uploads (aenv.node.durable)
            config=config,
            snapshots=self.snapshots,
            meta=self.meta,
            layers=self.layers,
            templates=templates,
            images=images,
            services=services,
        )
        self.volumes = Volumes(  # volumes on this node's disk (aenv.storage.volumes)
            config.home / "volumes",
            node_tag=config.effective_node_tag,
            users=self.volume_users,
            store=self.durable.store,
        )
        self.defaults = DefaultTemplates(  # base and busybox via the store
            config=config, templates=templates, store=self.durable.store, services=services
        )
        self.warmer = Warmer(self.snapshots, self, services, enabled=config.warm_templates)
        self.pool = Pool(
            self.snapshots,
            self,
            services,
            limits=PoolLimits(
                min_size=config.pool_size,
                max_size=config.pool_max,
                hold_s=config.pool_half_life_s / 2,
                half_life_s=config.pool_half_life_s,
            ),
            refill_concurrency=config.pool_refill_concurrency,
            # half the room left under the sandbox limit; what memory allows
            room=lambda: (config.max_sandboxes - self.in_memory()) // 2,
            meminfo=host.meminfo,
            memory_low_pct=config.hibernate_memory_low_pct,
        )
        self._verified: set[str] = set()  # snapshots whose images were checked
        # (MemAvailable, MemTotal) as the memory watcher last read them
        self.memory_seen: tuple[int, int] | None = None
        self.metrics = Registry()
        self.m_created = self.metrics.counter("aenv_sandboxes_created_total", "Sandboxes created")
        self.m_create_failed = self.metrics.counter(
            "aenv_sandbox_create_failures_total", "Sandbox creations that failed"
        )
        self.m_stopped = self.metrics.counter(
            "aenv_sandboxes_stopped_total", "Sandboxes stopped, by reason"
        )
        self.metrics.gauge(
            "aenv_sandboxes",
            "Sandboxes on this node, by state",
            callback=self._state_counts,
        )
        self.m_requests = self.metrics.counter(
            "aenv_http_requests_total", "REST API requests by route and status"
        )
        self.m_proxied = self.metrics.counter(
            "aenv_proxy_requests_total", "Requests proxied into sandboxes, by kind"
        )
        self.m_forwarded = self.metrics.counter(
            "aenv_cluster_forwarded_total",
            "Requests forwarded to the node that holds the sandbox, or placed on another, by kind",
        )
        self.m_taken_back = self.metrics.counter(
            "aenv_sandboxes_taken_back_total",
            "Sandboxes taken back after a node restart, by state (running, frozen, paused)",
        )
        self.m_died = self.metrics.counter(
            "aenv_sandboxes_died_total",
            "Sandboxes whose runtime stopped by itself, by cause (host_oom, exited)",
        )
        self.m_oom_kills = self.metrics.counter(
            "aenv_sandbox_oom_kills_total",
            "Processes killed inside sandboxes because the sandbox's memory was used up",
        )
        self.m_lost = self.metrics.counter(
            "aenv_sandboxes_lost_total",
            "Journaled sandboxes that could not be taken back after a node restart",
        )
        self._image_metrics()
        self.metrics.gauge(
            "aenv_pool_ready",
            "Restored sandboxes the pool holds ready, by template snapshot",
            callback=lambda: [
                ((("snapshot", k),), float(v)) for k, v in sorted(self.pool.statistics().items())
            ],
        )

    # -- the host network's watchdog (aenv.runtimes.netns.HostNetwork.guard) -----

    def network_lost(self, slot: NetSlot, why: str) -> None:
        """Stop the sandbox whose network slot is gone for good (`HostNetwork.guard`)."""
        from aenv.node.sandbox import Kill

        for actor in list(self._sandboxes.values()):
            if actor.sandbox_ip != slot.sandbox_ip:
                continue
            reason = f"was stopped: its network was removed from the host ({why})"
            log.error("sandbox %s %s", actor.sandbox_id, reason)
            self.lost[actor.sandbox_id] = reason
            kill = Kill(reason=lc.StopReason.NETWORK_LOST, why=f"its network is gone: {why}")
            self.start_background(
                functools.partial(actor.mailbox.ask, kill, timeout=120),
                f"stopping sandbox {actor.sandbox_id}",
            )

    async def reveal_placeholder(self, slot: int, policy: EgressPolicy, p: Placeholder) -> str:
        """A `network.rules` placeholder's value for the sandbox in `slot`, for
        the egress proxy only: a secret's value, or a freshly minted workload token."""
        if p.kind == "token":
            spec = next((TokenSpec(*t) for t in policy.iam_tokens if t[0] == p.name), None)
            owner = next((a for a in self._sandboxes.values() if a.slot_index == slot), None)
            if spec is None or owner is None or self.issuer is None:
                raise LookupError(f"workload token {p.name!r} is not in the sandbox's iam.tokens")
            return await trio.to_thread.run_sync(
                functools.partial(
                    self.issuer.mint,
                    spec,
                    sandbox_id=owner.sandbox_id,
                    template_id=owner.template.template_id,
                )
            )
        try:
            return await trio.to_thread.run_sync(self.secrets.reveal, p.name.lower())
        except SecretNotFound:
            raise LookupError(f"secret {p.name!r} not found") from None

    def egress_event(self, event: EgressEvent) -> None:
        """Put a connection the egress proxy decided in its sandbox's log."""
        for actor in self._sandboxes.values():
            if actor.sandbox_ip == event.sandbox_ip:
                message, level, fields = egress_entry(event)
                actor.note(message, level, **fields)
                return

    def _image_metrics(self) -> None:
        def cache(field: str) -> Any:
            return lambda: [((), float(getattr(self.images.cache.statistics(), field)))]

        def fs(field: str) -> Any:
            return lambda: [((), float(getattr(self.images.mount.fs.statistics(), field)))]

        m = self.metrics
        m.gauge("aenv_image_cache_bytes", "Bytes in the local chunk cache", cache("bytes"))
        m.gauge("aenv_image_cache_max_bytes", "Limit of the chunk cache", cache("max_bytes"))
        m.gauge("aenv_image_cache_chunks", "Chunks in the local chunk cache", cache("chunks"))
        m.counter("aenv_image_cache_hits_total", "Chunk reads served by the cache", cache("hits"))
        m.counter("aenv_image_cache_misses_total", "Chunk reads that missed", cache("misses"))
        m.counter(
            "aenv_image_cache_fetched_bytes_total",
            "Bytes of chunks fetched again after a miss",
            cache("bytes_fetched"),
        )
        m.counter("aenv_image_cache_evictions_total", "Chunks evicted", cache("evictions"))
        m.counter("aenv_image_cache_evicted_bytes_total", "Bytes evicted", cache("bytes_evicted"))
        m.counter(
            "aenv_image_fs_read_bytes_total",
            "File content bytes sandboxes read from image trees",
            fs("bytes_served"),
        )
        m.counter(
            "aenv_image_fs_read_errors_total", "Image reads that failed (EIO)", fs("read_errors")
        )
        m.counter(
            "aenv_image_registry_bytes_total",
            "Blob bytes downloaded from registries (pulls and re-fetches)",
            lambda: [((), float(self.images.store.bytes_downloaded))],
        )
        m.counter(
            "aenv_image_store_fetched_bytes_total",
            "Chunk bytes fetched from the object store",
            lambda: [((), float(self.images.store.bytes_from_store))],
        )

        def toc(field: str) -> Any:  # read at each scrape, as the others
            return lambda: [((), float(getattr(self.images.store.toc_layers, field)))]

        m.counter(
            "aenv_image_toc_layers_total",
            "Layers indexed from their table of contents (eStargz, zstd:chunked)",
            toc("layers_indexed"),
        )
        m.counter(
            "aenv_image_toc_fallbacks_total",
            "TOC-annotated layers that took the full download instead",
            toc("fallbacks"),
        )
        m.counter(
            "aenv_image_toc_prefetched_bytes_total",
            "Chunk bytes of TOC layers fetched ahead of reads (eStargz prefetch landmark)",
            toc("prefetched_bytes"),
        )

    def _state_counts(self) -> list[tuple[tuple[tuple[str, str], ...], float]]:
        counts: dict[str, int] = {}
        for a in self._sandboxes.values():
            counts[a.state.value] = counts.get(a.state.value, 0) + 1
        return [((("state", k),), float(v)) for k, v in sorted(counts.items())]

    def statistics(self) -> dict[str, int]:
        """Sandboxes on this node (the node's own included), how many of the
        callers' run (or are paused in memory), and how many were lost at start."""
        actors = list(self._sandboxes.values())
        running = sum(
            not a.hidden and (a.state is lc.State.RUNNING or a.frozen_pause) for a in actors
        )
        return {"sandboxes": len(actors), "running": running, "lost": len(self.lost)}

    # -- table ---------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxActor:
        actor = self._sandboxes.get(sandbox_id)
        if actor is None or actor.hidden:
            raise SandboxNotFound(sandbox_id, self.why_gone(sandbox_id))
        return actor

    def list(self) -> list[SandboxActor]:
        """The sandboxes callers see (not the node's own, such as template warm-ups)."""
        shown = [a for a in self._sandboxes.values() if not a.hidden]
        return sorted(shown, key=lambda a: (a.started_at, a.sandbox_id))

    def forget(self, actor: SandboxActor, *, keep_files: bool = False) -> None:
        """Take `actor` out of the table as its task ends (`SandboxHost`)."""
        if self._sandboxes.get(actor.sandbox_id) is actor:
            del self._sandboxes[actor.sandbox_id]
            if not keep_files:
                reason = (
                    actor.lifecycle.reason.name.lower() if actor.lifecycle.reason else "unknown"
                )
                self.m_stopped.inc(reason=reason)
                if actor.lifecycle.reason in (lc.StopReason.EXITED, lc.StopReason.CRASHED):
                    self._record_died(actor)
        if not keep_files:
            shutil.rmtree(actor.workdir, ignore_errors=True)

    def _record_died(self, actor: SandboxActor) -> None:
        if actor.hidden or not actor.was_started:
            return
        cause = actor.exit_cause or f"its runtime failed ({actor.lifecycle.reason})"
        died = Died(
            sandbox_id=actor.sandbox_id,
            template_id=actor.template.template_id,
            metadata=dict(actor.metadata),
            started_at=actor.started_at,
            died_at=time.time(),
            cause=cause,
            host_oom=actor.host_oom_killed,
            alias=actor.template.aliases[0] if actor.template.aliases else None,
            cpu_count=actor.cpu_count,
            memory_mb=actor.memory_mb,
            disk_mb=actor.disk_mb or actor.template.disk_size_mb,
        )
        log.error("sandbox %s %s", actor.sandbox_id, died.why())
        self.m_died.inc(cause="host_oom" if died.host_oom else "exited")
        self.died[actor.sandbox_id] = died
        while len(self.died) > DIED_KEPT:
            self.died.popitem(last=False)

    def died_recently(self) -> builtins.list[Died]:
        """The sandboxes that died within `DIED_KEPT_S`, oldest first."""
        cutoff = time.time() - DIED_KEPT_S
        while self.died and next(iter(self.died.values())).died_at < cutoff:
            self.died.popitem(last=False)
        return list(self.died.values())

    def why_gone(self, sandbox_id: str) -> str | None:
        died = self.died.get(sandbox_id)
        if died is not None and died.died_at >= time.time() - DIED_KEPT_S:
            return died.why()
        return self.lost.get(sandbox_id)

    async def collect_layers(self) -> None:
        """Remove frozen layers no sandbox uses (young ones stay: one may be mid-freeze)."""
        live = {lid for a in self._sandboxes.values() for lid in a.layer_ids()}
        try:
            live |= await self.snapshots.layer_ids()
            live |= await self.journaled_layer_ids()
            removed = await self.layers.gc(live, min_age_s=LAYER_GC_MIN_AGE_S)
        except Exception:
            log.exception("layer garbage collection failed")
            return
        if removed:
            log.info("removed %d unused layers", len(removed))

    async def journaled_layer_ids(self) -> set[str]:
        """Layers that journaled sandboxes stand on (kept across restarts)."""
        docs = await self.meta.run(self.meta.store.list_sandboxes)
        return {lid for d in docs for k in ("layers", "durableLayers") for lid in d.get(k) or ()}

    async def recover(self) -> None:
        """Take back the sandboxes an earlier node process journaled.

        Running and frozen ones are adopted with their runtime, mount and
        network slot (their processes and memory untouched); paused ones come
        back paused, from their image. One that cannot be taken back (its
        runtime exited while no node watched it, its layers or image are
        gone) is recorded lost, with the reason, which the API answers for
        that sandbox for a day; its files go, its snapshots stay.
        """
        t0 = trio.current_time()
        docs = await self.meta.run(self.meta.store.list_sandboxes)
        limiter = trio.CapacityLimiter(RECOVER_CONCURRENCY)

        async def one(doc: dict[str, Any]) -> None:
            async with limiter:
                await self._take_back(doc)

        async with trio.open_nursery() as nursery:
            for doc in docs:
                nursery.start_soon(one, doc)
        await self.host.network.release_unadopted()
        if docs:
            log.info(
                "took back %d of %d journaled sandboxes in %.2f s",
                len(self._sandboxes),
                len(docs),
                trio.current_time() - t0,
            )

    async def _take_back(self, doc: dict[str, Any]) -> None:
        """`recover` one journal record."""
        sandbox_id = str(doc.get("sandboxID"))
        state = str(doc.get("state") or "paused")  # records before the journal: paused
        if state == "lost":
            if time.time() - float(doc.get("lostAt") or 0) < LOST_KEPT_S:
                self.lost[sandbox_id] = str(doc.get("why") or "was lost")
            else:
                await self.meta.run(self.meta.store.delete_sandbox, sandbox_id)
            return
        # a frozen one with a copy on disk comes back paused from it if need be
        durable = state == "frozen" and bool(doc.get("durableImage"))
        try:
            template = await self.resolve_template(str(doc["templateID"]))
            actor = SandboxActor.from_journal(self, template, doc)
            missing = await trio.to_thread.run_sync(_missing_parts, actor)
            if missing:
                raise FileNotFoundError(missing)
            if state != "paused" and await trio.to_thread.run_sync(actor.on_node_served_fs):
                raise SandboxLost(
                    "its root file system was served by the node process that stopped "
                    "(an image template's layers)"
                )
            actor.keep_files = durable
            await self._launch(actor)
            actor.keep_files = False
            self.m_taken_back.inc(state=state)
            log.info("took back %s sandbox %s", state, sandbox_id)
            if actor.resume_at_start:  # paused by the node's stop, not by its user
                self.start_background(
                    functools.partial(
                        actor.mailbox.ask, Resume(max(1, math.ceil(doc.get("remaining") or 0)))
                    ),
                    f"resuming sandbox {sandbox_id} after the restart",
                )
        except Exception as exc:
            if durable:
                log.warning(
                    "sandbox %s paused in memory is gone (%s): taking it back from its "
                    "copy on disk",
                    sandbox_id,
                    exc,
                )
                await self._cleanup_runtime(sandbox_id)
                keep: dict[str, str | None] = {sandbox_id: str(doc["durableImage"])}
                await trio.to_thread.run_sync(_clear_dir, self.config.sandboxes_dir, keep, True)
                paused = {
                    **doc,
                    "state": "paused",
                    "image": doc["durableImage"],
                    "layers": doc["durableLayers"],
                }
                await self.meta.run(
                    self.meta.store.put_sandbox, sandbox_id, "paused", paused, time.time()
                )
                return await self._take_back(paused)
            why = (
                f"stopped while the node was down ({exc})"
                if state in ("running", "frozen")
                else f"could not be recovered after a node restart ({exc})"
            )
            log.error("sandbox %s %s", sandbox_id, why)
            if state in ("running", "frozen"):  # what is left of it goes
                await self._cleanup_runtime(sandbox_id)
            self.m_lost.inc()
            self.lost[sandbox_id] = why
            lost = {"sandboxID": sandbox_id, "state": "lost", "why": why, "lostAt": time.time()}
            await self.meta.run(self.meta.store.put_sandbox, sandbox_id, "lost", lost, time.time())
            await trio.to_thread.run_sync(
                functools.partial(
                    shutil.rmtree, self.config.sandboxes_dir / sandbox_id, ignore_errors=True
                )
            )

    async def _cleanup_runtime(self, sandbox_id: str) -> None:
        """What is left of a sandbox that could not be taken back: its runtime, mounts."""
        with trio.CancelScope(shield=True):
            await self.host.runtime.remove(sandbox_id)
        await self.host.roots.reap(self.config.sandboxes_dir / sandbox_id)

    # -- operations ----------------------------------------------------------

    async def resolve_template(self, name: str) -> Template:
        """The template `name` names; else, if it is an image reference, that image's.

        An image reference must have a tag, digest or path (`ubuntu:22.04`,
        `library/ubuntu`): a bare word is only ever a template name.

        An image is pulled if this node has not pulled that reference yet, and
        gets a template of its own (`img-` and its digest) so sandboxes started
        from it can be paused, snapshotted and forked like any other.
        """
        tagged = await self.builds.tagged(name) if ":" in name else None
        if tagged is not None:  # `name:tag` of a built template (aenv.node.buildtags)
            if tagged.image_key is not None:
                await self.images.prepare(tagged.image_key)
            return tagged
        try:
            # (the answer of the last resolve of this name when its files did not change)
            known = self.templates.resolve_known(name)
            template = (
                known
                if known is not None
                else await trio.to_thread.run_sync(self.templates.resolve, name)
            )
        except (TemplateNotFound, InvalidName) as not_template:
            # A bare word is a template name (a typo must be "not found", not a
            # Docker Hub lookup): here, else one another node put in the object
            # store. An image reference has a tag, digest or path.
            if not any(c in name for c in "/:@"):
                # a default template: fetched meanwhile, or being fetched (503)?
                shared = await self.defaults.lookup(name) or await self.durable.find_template(name)
                if shared is None:
                    raise
                template = shared
            else:
                try:
                    parse_reference(name)
                except InvalidReference:
                    raise not_template from None
                record = await self.images.pull(name, missing_only=True)
                template = await trio.to_thread.run_sync(self.image_template, record)
        template = await self.durable.fresh_template(template)
        if template.image_key is not None:
            await self.images.prepare(template.image_key)
        return template

    def image_template(
        self,
        record: ImageRecord,
        name: str | None = None,
        *,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
    ) -> Template:
        """A template for pulled image `record` (blocking).

        Without `name`, the image's own template (`img-` and its digest),
        made on first use; with `name`, a new template of that name.
        """
        template_id = new_template_id() if name else f"img-{record.key[:20]}"
        aliases = (name,) if name else ()
        if not name:
            with contextlib.suppress(TemplateNotFound):
                return self.templates.resolve(template_id)
        try:
            return self.templates.add_image(
                template_id=template_id,
                image_key=record.key,
                image_ref=record.reference,
                size_bytes=record.content_bytes,
                aliases=aliases,
                env=record.config.env,
                workdir=record.config.workdir,
                user=record.config.user,
                cpu_count=cpu_count or self.config.default_cpu,
                memory_mb=memory_mb or self.config.default_memory_mb,
            )
        except TemplateConflict:
            if name:
                raise
            return self.templates.resolve(template_id)  # a concurrent create made it first

    async def find_snapshot(self, name_or_id: str) -> dict[str, Any] | None:
        """A snapshot's record: this node's, else one only the object store holds."""
        return await self.snapshots.resolve(name_or_id) or await self.durable.locate(name_or_id)

    def volume_users(self, volume_id: str) -> builtins.list[str]:
        """The sandboxes (paused ones too) that mount volume `volume_id`."""
        return [
            a.sandbox_id
            for a in self._sandboxes.values()
            if any(m.volume_id == volume_id for m in a.volume_mounts)
        ]

    async def _with_volumes(self, req: NewSandbox) -> NewSandbox:
        if not req.volume_mounts:
            return req
        return dataclasses.replace(req, volume_mounts=await self.volumes.resolve(req.volume_mounts))

    async def create(self, req: NewSandbox) -> SandboxActor:
        template = await self.resolve_template(req.template)
        req = await self._with_volumes(req)
        if template.snapshot_id is not None:  # a built template: restore its snapshot
            doc = await self.find_snapshot(template.snapshot_id)
            if doc is None:
                raise CorruptSnapshot(f"snapshot {template.snapshot_id} is missing")
            return await self.create_from_snapshot(doc, req, template=template)
        sized = req.cpu_count in (None, template.cpu_count) and req.memory_mb in (
            None,
            template.memory_mb,
        )
        warm = await self.warmer.snapshot(template) if sized else None
        if warm is None and sized and template.start_cmd is not None:
            # a template that runs a server starts from its capture, made now
            warm = await self.warmer.ready_snapshot(template)
        if warm is not None:  # the template as a snapshot: restore, do not boot
            # (a pooled sandbox runs already: it cannot gain mounts)
            with self.pool.serving():  # the pool's refills wait for it
                pooled = None if req.volume_mounts else self.pool.take(template)
                if pooled is not None:
                    try:
                        return await pooled.adopt(req)
                    except Exception as exc:
                        log.warning("adopting pooled sandbox %s failed: %r", pooled.sandbox_id, exc)
                        await pooled.stop()  # (its journal record, if any, goes with it)
                    finally:
                        self.pool.replenish(template)
                try:
                    return await self.create_from_snapshot(warm, req, template=template)
                except CorruptSnapshot as exc:
                    log.warning("template %s snapshot unusable (%s)", template.template_id, exc)
                    await self.snapshots.delete(str(warm["snapshotID"]))
        self._check_capacity()
        sandbox_id = ids.new_sandbox_id(self.config.effective_node_tag)
        actor = await self._launch(SandboxActor(self, sandbox_id, template, req))
        if template.start_cmd is not None:  # booted without its capture: start it here
            try:
                await guest.start_and_wait(actor, template, timeout_s=START_TIMEOUT_S)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await actor.stop()
                raise
        return actor

    def in_memory(self) -> int:
        """Sandboxes holding host memory: running, or paused and not yet on disk
        (hibernated ones hold none and do not count against `max_sandboxes`)."""
        return sum(1 for a in self._sandboxes.values() if not _hibernated(a))

    def _check_capacity(self) -> None:
        """Room for one more sandbox in memory, or `Busy`: under the sandbox limit,
        and the host not below half its hibernation mark with nothing paused
        left to hibernate (the pressure watcher frees memory by hibernating
        frozen sandboxes)."""
        if self.in_memory() >= self.config.max_sandboxes:
            raise Busy(
                f"node (sandbox limit reached: {self.config.max_sandboxes} in memory)",
                retry_after=5.0,
            )
        # refused below half the hibernation mark: between the two, creates go on
        # (the mark is where paused sandboxes go to disk, not where work stops)
        refuse_pct = self.config.hibernate_memory_low_pct / 2
        if self.memory_seen is not None and not any(
            a.frozen_pause for a in self._sandboxes.values()
        ):
            available, total = self.memory_seen
            if pressure.short(available, total, refuse_pct):
                raise Busy(
                    f"node (host memory low: {available >> 20} MiB available of "
                    f"{total >> 20} MiB, nothing paused to hibernate)",
                    retry_after=5.0,
                )

    def check_room_to_resume(self, actor: SandboxActor) -> None:
        """`Busy` if resuming `actor` (hibernated: it would take memory again)
        finds no room; a sandbox already in memory always resumes."""
        if _hibernated(actor):
            self._check_capacity()

    async def boot_hidden(self, template: Template, *, timeout_s: int) -> SandboxActor:
        """A hidden sandbox of the node's own booted from `template` (`Launcher`)."""
        req = NewSandbox(template=template.template_id, timeout_s=timeout_s)
        actor = SandboxActor(
            self, ids.new_sandbox_id(self.config.effective_node_tag), template, req
        )
        actor.hidden = True
        return await self._launch(actor)

    async def restore_hidden(
        self, doc: dict[str, Any], template: Template, *, timeout_s: int, pooled: bool = False
    ) -> SandboxActor:
        """A hidden sandbox of the node's own restored from `doc` (`Launcher`)."""
        req = NewSandbox(template=template.template_id, timeout_s=timeout_s)
        actor = await self.restorer(doc, req, template=template)
        actor.hidden = True
        actor.pooled = pooled
        return await self._launch(actor)

    async def _launch(self, actor: SandboxActor) -> SandboxActor:
        """Register `actor` and start it under the `sandboxes` supervisor; returns
        once it is ready (its failure before that is raised here)."""
        self._sandboxes[actor.sandbox_id] = actor
        try:
            await self.sandboxes.start(
                actor.sandbox_id,
                functools.partial(self._run_actor, actor),
                policy=ONE_SHOT,
                strategy=Strategy.FAIL,
                give_up=Strategy.FAIL,
                grace_s=0.0,  # a stop cancels it: its teardown runs in its `finally`
            )
        except BaseException:
            self._sandboxes.pop(actor.sandbox_id, None)
            self.m_create_failed.inc()
            raise
        self.m_created.inc()
        return actor

    @staticmethod
    async def _run_actor(
        actor: SandboxActor, _stop: StopToken, *, task_status: trio.TaskStatus[SandboxActor]
    ) -> None:
        # Before `started` an error reaches the creator; after it, the actor has
        # recorded and torn down its sandbox, and the supervisor logs the error.
        await actor.run(task_status=task_status)

    def _reserve_id(self) -> str:
        """A new sandbox's ID, if the node has room for one (`Busy` if not)."""
        self._check_capacity()
        return ids.new_sandbox_id(self.config.effective_node_tag)

    async def fork(
        self, parent: SandboxActor, count: int, timeout_s: int, *, wait_s: float
    ) -> builtins.list[SandboxActor | Exception]:
        """`count` children of running sandbox `parent`, one result per child:
        the parent's actor captures it (held for that only, within `wait_s`),
        then a supervised job starts the children from the capture."""
        capture: LiveCapture = await parent.mailbox.ask(Fork(count), timeout=wait_s)
        return await self.services.run(
            f"fork {parent.sandbox_id} #{next(self._jobs)}",
            lambda _stop: forks.start_children(
                parent,
                capture,
                count=count,
                timeout_s=timeout_s,
                reserve=self._reserve_id,
                launch=self._launch,
            ),
            grace_s=0.0,
        )

    async def snapshot(
        self, source: SandboxActor, name: str | None, *, memory: bool, wait_s: float
    ) -> dict[str, Any]:
        """A snapshot of running sandbox `source`, recorded (and its upload
        started): its actor captures it (within `wait_s`), then a supervised job
        records the capture."""
        capture: LiveCapture = await source.mailbox.ask(Snapshot(memory), timeout=wait_s)
        doc: dict[str, Any] = {
            "name": name,
            "names": [name] if name else [],
            "sourceSandboxID": source.sandbox_id,
            "templateID": source.template.template_id,
            "layers": list(capture.stack.ids()),
            "memory": memory,
            "cpuCount": source.cpu_count,
            "memoryMB": source.memory_mb,
            "diskMB": source.disk_mb,
            "envdToken": source.envd_access_token,
            # what its memory image has mounted: a restore mounts them again
            "volumeMounts": [m.to_doc() for m in source.volume_mounts],
        }
        return await self.services.run(
            f"snapshot {source.sandbox_id} #{next(self._jobs)}",
            lambda _stop: record_capture(
                self.snapshots, doc, capture.image, then=self.durable.spawn
            ),
            grace_s=0.0,
        )

    async def create_from_snapshot(
        self, doc: dict[str, Any], req: NewSandbox, *, template: Template | None = None
    ) -> SandboxActor:
        return await self._launch(await self.restorer(doc, req, template=template))

    async def restorer(
        self, doc: dict[str, Any], req: NewSandbox, *, template: Template | None = None
    ) -> SandboxActor:
        """A sandbox (not started yet) that restores snapshot `doc`."""
        template = template or await self.resolve_template(doc["templateID"])
        local = await self.durable.ensure_local(doc, template)  # fetched from the store if missing
        snapshot_id = str(local.get("snapshotID"))
        if local is not doc:
            self._verified.add(snapshot_id)  # its image was checked as it came from the store
        doc = local
        if doc.get("image") is not None and snapshot_id in self._verified:
            image: Path | None = Path(doc["image"])  # immutable, checked once per process
        else:
            try:
                image = await self.snapshots.verified_image(doc)
            except CorruptSnapshot:
                if doc.get("storage") != "durable" or self.durable.store is None:
                    raise
                # a copy from the store (not flushed) torn by a crash: fetch it again
                doc = await self.durable.ensure_local(doc, template, torn=True)
                image = Path(doc["image"])
            self._verified.add(snapshot_id)
        layers = doc.get("layers") or []
        stack = self.layers.chain(layers[0]) if layers else LayerStack.of_base([template.rootfs])
        if doc.get("volumeMounts") and not req.volume_mounts:
            mounts = tuple(VolumeMount.from_doc(m) for m in doc["volumeMounts"])
            req = dataclasses.replace(req, volume_mounts=mounts)
        req = await self._with_volumes(req)
        self._check_capacity()
        sandbox_id = ids.new_sandbox_id(self.config.effective_node_tag)
        return SandboxActor.from_snapshot(
            self,
            sandbox_id,
            template,
            req,
            stack=stack,
            image=image,
            prior_token=str(doc.get("envdToken") or ""),
            cpu_count=int(doc.get("cpuCount") or template.cpu_count),
            memory_mb=int(doc.get("memoryMB") or template.memory_mb),
            disk_mb=None if doc.get("diskMB") is None else int(doc["diskMB"]),
        )

    # -- moving paused sandboxes between nodes (a cluster's) ---------------------

    async def paused_copy(self, sandbox_id: str) -> dict[str, Any]:
        """A durable copy of paused sandbox `sandbox_id` (on disk, not frozen): an
        internal snapshot of its memory image and layers whose record holds the
        sandbox's own (`paused_record`, under "sandbox"), uploaded to the object
        store. Returns the snapshot's record once the upload is over (its
        `storage` says whether it is durable)."""
        from aenv.node.sandbox import CopyPaused, PausedCopy

        actor = self.get(sandbox_id)
        for old in await self.snapshots.taken_from(sandbox_id):  # this pause's copy, made earlier
            if is_paused_copy(old) and old.get("pausedKey") == actor.paused_key():
                if old.get("storage") == "uploading":
                    self.durable.spawn(old)
                return await self.durable.wait_durable(str(old["snapshotID"]))
        key = actor.paused_key()
        copy: PausedCopy = await actor.mailbox.ask(CopyPaused(), timeout=60)
        doc: dict[str, Any] = {
            "name": None,
            "names": [paused_copy_name(sandbox_id)],
            "sourceSandboxID": sandbox_id,
            "templateID": actor.template.template_id,
            "layers": list(copy.stack.ids()),
            "memory": copy.image is not None,
            "cpuCount": actor.cpu_count,
            "memoryMB": actor.memory_mb,
            "diskMB": actor.disk_mb,
            "envdToken": actor.envd_access_token,
            "pausedKey": key,
            "sandbox": copy.record,
        }
        recorded = await self.services.run(
            f"copy paused {sandbox_id} #{next(self._jobs)}",
            lambda _stop: record_capture(self.snapshots, doc, copy.image, then=self.durable.spawn),
            grace_s=0.0,
        )
        return await self.durable.wait_durable(str(recorded["snapshotID"]))

    async def adopt_paused(self, doc: dict[str, Any]) -> SandboxActor:
        """Take up, paused, a sandbox another node paused: `doc` is its durable copy
        (`paused_copy`, found in the object store), restored here and journaled; the
        sandbox keeps its ID, tokens, metadata, env, settings and time left."""
        record = dict(doc["sandbox"])
        sandbox_id = str(record["sandboxID"])
        if sandbox_id in self._sandboxes:
            raise SandboxConflict(f"sandbox {sandbox_id} is already on this node")
        template = await self.resolve_template(str(record["templateID"]))
        local = await self.durable.ensure_local(doc, template)
        self._check_capacity()
        workdir = self.config.sandboxes_dir / sandbox_id
        captures = int(record.get("captures") or 0) + 1
        image: str | None = None
        if local.get("image") is not None:
            source = await self.snapshots.verified_image(local)
            assert source is not None
            image = f"image{captures}"

            def place() -> None:
                shutil.rmtree(workdir, ignore_errors=True)
                workdir.mkdir(parents=True)
                link_files(source, workdir / str(image))

            await trio.to_thread.run_sync(place)
        else:
            await trio.to_thread.run_sync(lambda: workdir.mkdir(parents=True, exist_ok=True))
        paused = {
            **record,
            "state": "paused",
            "image": image,
            "layers": list(local.get("layers") or ()),
            "captures": captures,
            "resumeAtStart": False,
        }
        actor = SandboxActor.from_journal(self, template, paused)
        await actor.journal_paused()
        try:
            return await self._launch(actor)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.meta.run(self.meta.store.delete_sandbox, sandbox_id)
            raise

    def start_background(self, afn: Callable[[], Awaitable[object]], what: str) -> None:
        """Run `afn` as a one-shot job of the `services` supervisor; its failure is
        logged, never raised; a node stop cancels it."""

        async def run(_stop: StopToken) -> None:
            await afn()

        self.services.start_soon(
            f"{what} #{next(self._jobs)}",
            run,
            policy=ONE_SHOT,
            strategy=Strategy.FAIL,
            give_up=Strategy.FAIL,
            grace_s=0.0,
        )

    async def park_node_served(self, *, within_s: float = 60.0) -> None:
        """Pause (to disk, with memory) the running sandboxes whose root this node
        process serves, before it stops without stopping sandboxes: they could
        not run on without it. The next node process resumes them at start."""
        from aenv.node.sandbox import Pause

        served = [
            a
            for a in self._sandboxes.values()
            if not a.hidden
            and a.state is lc.State.RUNNING
            and await trio.to_thread.run_sync(a.on_node_served_fs)
        ]
        if not served:
            return
        log.info("pausing %d sandboxes on image layers this node serves", len(served))
        with trio.move_on_after(within_s):
            for actor in served:
                try:
                    actor.resume_at_start = True
                    await actor.mailbox.ask(Pause("full"), timeout=within_s)
                except Exception as exc:
                    actor.resume_at_start = False
                    log.warning("pausing sandbox %s failed: %r", actor.sandbox_id, exc)

    async def write_behind_paused(self, *, within_s: float = 60.0) -> None:
        """Give every sandbox paused in memory its copy on disk (before a stop
        that leaves them frozen to the next node process: a reboot keeps them)."""
        from aenv.node.sandbox import WriteBehind

        frozen = [a for a in self._sandboxes.values() if a.frozen_pause and not a.hidden]
        if not frozen:
            return
        log.info("writing a copy of %d paused sandboxes to disk", len(frozen))

        async def one(actor: SandboxActor) -> None:
            with contextlib.suppress(Exception):
                await actor.mailbox.ask(WriteBehind(), timeout=within_s)

        with trio.move_on_after(within_s):
            async with trio.open_nursery() as n:
                for actor in frozen:
                    n.start_soon(one, actor)

    async def hibernate_paused(self, *, within_s: float = 60.0) -> None:
        """Write every sandbox paused in memory to disk (before a clean shutdown),
        so it survives the restart like any other paused sandbox."""
        await self._hibernate([a for a in self._sandboxes.values() if a.frozen_pause], within_s)

    async def persist_volumes(self, _stop: StopToken) -> None:
        """Copy volumes that changed or were mounted to the object store, every
        `volume_persist_s` (only the chunks the store lacks go up); one that is
        mounted now, every tenth time."""
        every = self.config.volume_persist_s
        while True:
            await trio.sleep(every)
            await self.volumes.persist_due(in_use_every_s=10 * every)

    async def watch_memory(self, stop: StopToken) -> None:
        """Hibernate sandboxes paused in memory while the host runs short of it
        (`aenv.node.pressure`), until stopped."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    pressure.watch,
                    self.config.hibernate_memory_low_pct,
                    self.frozen_sandboxes,
                    self.hibernate_these,
                    meminfo=self._read_meminfo,
                )
            )
            await stop.wait()
            nursery.cancel_scope.cancel()

    def _read_meminfo(self) -> tuple[int, int]:
        """The host's memory, for the pressure watcher; what it read last is
        what `_check_capacity` goes by (None while it reads nothing)."""
        try:
            self.memory_seen = self.host.meminfo()
        except BaseException:
            self.memory_seen = None
            raise
        return self.memory_seen

    async def frozen_sandboxes(self) -> Sequence[pressure.Frozen]:
        """The sandboxes paused in memory, with the memory each holds (for `pressure`)."""
        from aenv.node.sandbox import GetUsage

        found: builtins.list[pressure.Frozen] = []
        for actor in [a for a in self._sandboxes.values() if a.frozen_pause]:
            try:
                usage = await actor.mailbox.ask(GetUsage(), timeout=10)
            except Exception:
                continue  # resumed or gone meanwhile
            found.append(
                pressure.Frozen(actor.sandbox_id, actor.paused_at or 0.0, usage.mem_used_bytes)
            )
        return found

    async def hibernate_these(self, sandbox_ids: Sequence[str]) -> None:
        """Write these sandboxes, if still paused in memory, to disk; wait for it."""
        chosen = [self._sandboxes.get(i) for i in sandbox_ids]
        await self._hibernate([a for a in chosen if a is not None and a.frozen_pause], 60.0)

    async def _hibernate(self, frozen: Sequence[SandboxActor], within_s: float) -> None:
        from aenv.node.sandbox import Hibernate

        if not frozen:
            return
        log.info("writing %d paused sandboxes to disk", len(frozen))
        with trio.move_on_after(within_s):
            for actor in frozen:
                with contextlib.suppress(Exception):
                    await actor.mailbox.ask(Hibernate(), timeout=within_s)
            for actor in frozen:
                await actor.unfrozen.wait()

    async def kill(self, sandbox_id: str) -> None:
        from aenv.node.sandbox import Kill

        actor = self.get(sandbox_id)
        await actor.mailbox.ask(Kill(), timeout=120)
        await actor.stopped.wait()


@asynccontextmanager
async def open_node(config: Config) -> AsyncIterator[Node]:
    """A node on this machine: runsc, overlay mounts, network namespaces, images.
    Its names, home and address range are its own while it runs."""
    async with (
        claim_host(
            prefix=config.effective_net_prefix, home=config.home, cidr=config.slot_cidr
        ) as claim,
        _open_node(config, prefix=claim.prefix, slot_cidr=claim.cidr) as node,
    ):
        yield node


@asynccontextmanager
async def _open_node(config: Config, *, prefix: str, slot_cidr: str) -> AsyncIterator[Node]:
    for d in (config.home, config.sandboxes_dir, config.run_dir):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(config.home, 0o711)
    api_key = ensure_api_key(config)
    runtime = GVisorRuntime(
        runsc=config.runsc_binary,
        platform=config.runsc_platform,
        compression=config.checkpoint_compression,
        state_root=config.run_dir / "runsc",
        cgroup_parent=prefix,
        memory_headroom_mb=config.memory_headroom_mb,
        process_limit=config.process_limit_for,
        tasks_limit=config.host_tasks_limit,
    )
    spares = SpareDisks(
        config.sandboxes_dir / ".spare-disks",
        size_bytes=config.sandbox_disk_mb << 20,
        count=config.start_spares if config.sandbox_disk_mb > 0 else 0,
    )
    roots = OverlayRoots(spares)
    try:
        async with _node_on_runtime(config, runtime, roots, prefix, slot_cidr, api_key) as node:
            yield node
    finally:
        await trio.to_thread.run_sync(runtime.release_parent)


@asynccontextmanager
async def _node_on_runtime(
    config: Config,
    runtime: GVisorRuntime,
    roots: OverlayRoots,
    prefix: str,
    slot_cidr: str,
    api_key: str,
) -> AsyncIterator[Node]:
    live = await reap_leftovers(config, runtime=runtime, roots=roots)
    async with (
        open_images(config) as images,
        await open_egress_listener(port=config.egress_port) as egress_listener,
        open_host_network(
            cidr=slot_cidr,
            prefix=prefix,
            table=prefix,
            egress_cap=config.egress_cap,
            adopt=adoptable_slots(live),
            proxy_port=listener_port(egress_listener),
        ) as network,
    ):
        host = Host(runtime=runtime, network=network, roots=roots, envd=HttpEnvd())
        async with open_node_on(host, config, images=images, api_key=api_key) as node:

            async def guard(_stop: StopToken) -> None:
                await network.guard(every_s=config.network_check_s, on_lost=node.network_lost)

            async def spares(_stop: StopToken) -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(network.keep_spares, config.start_spares)
                    if roots.spares is not None:
                        nursery.start_soon(roots.spares.keep)

            ca = await trio.to_thread.run_sync(NodeCA, config.home / "egress-ca")
            node.egress_ca_pem = ca.cert_pem
            node.issuer = await trio.to_thread.run_sync(open_issuer, config, node.durable.store)
            if node.durable.store is not None and config.cluster_secret:
                # the cluster's secrets, shared by every node through the store
                node.secrets = SecretStore.shared(node.durable.store, config.cluster_secret)
            proxy = EgressProxy(
                policies=network,
                resolver=Resolver(config.egress_dns),
                on_event=node.egress_event,
                intercept=interceptor(
                    ca, upstream_context(config.egress_ca_file), node.reveal_placeholder
                ),
            )

            async def egress(_stop: StopToken) -> None:
                await proxy.serve(egress_listener)

            network_metrics(node.metrics, network)
            egress_metrics(node.metrics, proxy)
            node.services.start_soon(
                "network-guard", guard, policy=WATCHER_RESTARTS, give_up=Strategy.FAIL
            )
            node.services.start_soon(
                "network-spares", spares, policy=WATCHER_RESTARTS, give_up=Strategy.FAIL
            )
            node.services.start_soon(
                "egress-proxy", egress, policy=WATCHER_RESTARTS, give_up=Strategy.FAIL
            )
            node.services.start_soon(
                "oidc-keys",
                functools.partial(keep_keys, node.issuer),
                policy=WATCHER_RESTARTS,
                give_up=Strategy.FAIL,
            )
            # once-per-process work: before /health answers, not on the first create
            await primer.prime(runtime)
            if node.durable.store is not None:
                store = node.durable.store
                node.services.start_soon(
                    "store-warm-up",
                    lambda _stop: primer.warm_store(store),
                    policy=ONE_SHOT,
                    give_up=Strategy.FAIL,
                    grace_s=0.0,
                )
            yield node


async def reap_leftovers(
    config: Config, *, runtime: Runtime, roots: WritableRoots
) -> dict[str, dict[str, Any]]:
    """Remove what an earlier node process left behind but what its journal says
    runs (taken back by `Node.recover`): runtime sandboxes, roots, files.
    Returns {sandbox ID: record} of those journaled running or frozen."""
    live = await trio.to_thread.run_sync(_journaled_live, config)
    reaped = await runtime.reap_stale(keep=live.keys())
    if reaped:
        log.warning("reaped %d runtime sandboxes no journal record names", len(reaped))
    mounts = [config.sandboxes_dir / i / f"disk{d['period']}" / "merged" for i, d in live.items()]
    await roots.reap(config.sandboxes_dir, mounts)
    keep = await trio.to_thread.run_sync(_journaled_dirs, config)
    await trio.to_thread.run_sync(_clear_dir, config.sandboxes_dir, keep)
    return live


def adoptable_slots(live: dict[str, dict[str, Any]]) -> dict[int, EgressPolicy]:
    """The network slots of the sandboxes `reap_leftovers` kept, with their policies."""
    return {int(d["slot"]): policy_of(d) for d in live.values()}


@asynccontextmanager
async def open_node_on(
    host: Host, config: Config, *, images: Images, api_key: str
) -> AsyncIterator[Node]:
    """A node whose sandboxes run on `host`: it takes back what the journal
    holds, resumes unfinished uploads and watches memory pressure (supervised);
    leaving the block stops the services within `SERVICES_STOP_S`, then
    cancels every sandbox (each tears itself down)."""
    templates = TemplateStore(config.templates_dir, image_root=config.run_dir / "images")
    async with trio.open_nursery() as nursery:
        # cancelled at a stop unless a child asks for a grace period of its own
        sandboxes: Supervisor = await nursery.start(
            functools.partial(run_supervisor, "sandboxes", grace_s=0.0)
        )
        services: Supervisor = await nursery.start(
            functools.partial(run_supervisor, "node", grace_s=0.0)
        )
        node = Node(
            config=config,
            host=host,
            templates=templates,
            images=images,
            services=services,
            sandboxes=sandboxes,
            api_key=api_key,
        )
        # snapshots and journaled sandboxes survive a restart: other layers are garbage
        await node.layers.gc(await node.snapshots.layer_ids() | await node.journaled_layer_ids())
        images.attach_store(node.durable.store)  # image layers shared via the store
        await node.durable.serve_lazy_layers()  # before anything mounts them
        await node.volumes.load()  # before the sandboxes that mount them
        await node.recover()
        await node.durable.resume()  # unfinished snapshot uploads
        await node.defaults.start()  # default templates shared, or fetched if missing
        if config.volume_persist_s > 0 and node.volumes.store is not None:
            services.start_soon(
                "volume-persister",
                node.persist_volumes,
                policy=WATCHER_RESTARTS,
                give_up=Strategy.FAIL,
                grace_s=1.0,
            )
        if config.hibernate_memory_low_pct > 0:
            services.start_soon(
                "memory-pressure",
                node.watch_memory,
                policy=WATCHER_RESTARTS,
                give_up=Strategy.FAIL,
                grace_s=1.0,
            )
        try:
            yield node
            with trio.move_on_after(SERVICES_STOP_S):
                await services.aclose("the node is stopping")
            await services.aclose("the node is stopping", grace_s=0.0)  # what is left
            await sandboxes.aclose("the node is stopping")
            if node.volumes.store is not None:
                with trio.move_on_after(SERVICES_STOP_S):
                    await node.volumes.persist_due()  # what changed since the last copy
            await node.volumes.close()  # no sandbox runs on: nothing holds them
        finally:
            nursery.cancel_scope.cancel()


def _hibernated(actor: SandboxActor) -> bool:
    """Paused on disk (`on_disk` stays set after a resume until the record changes)."""
    return actor.on_disk and actor.state is lc.State.PAUSED


def _host_memory_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1024


def _clear_dir(path: Path, keep: dict[str, str | None], only: bool = False) -> None:
    """Empty the sandboxes directory but for what journaled sandboxes need
    (with `only`, just the directories of the sandboxes in `keep`).

    `keep` maps a journaled sandbox's ID to "*" (running or frozen: all of
    its directory), else to its memory image's directory name (paused; None:
    filesystem-only pause): everything else of a paused one's (old period
    disks, runtime bundles) goes too.
    """
    for child in path.iterdir():
        if child.name not in keep:
            if not only:
                shutil.rmtree(child, ignore_errors=True)
            continue
        if keep[child.name] == "*":
            continue
        for part in child.iterdir():
            if part.name != keep[child.name]:
                if part.is_dir() and not part.is_symlink():
                    shutil.rmtree(part, ignore_errors=True)
                else:
                    part.unlink(missing_ok=True)


def _journal(config: Config) -> list[dict[str, Any]]:
    """Every journal record (blocking; before the node's own store is open)."""
    store = MetadataStore(config.home / "aenv.db")
    try:
        return store.list_sandboxes()
    finally:
        store.close()


def _journaled_live(config: Config) -> dict[str, dict[str, Any]]:
    """{sandbox ID: record} of the sandboxes journaled running or frozen."""
    return {
        str(d["sandboxID"]): d
        for d in _journal(config)
        if d.get("state") in ("running", "frozen") and d.get("slot") is not None
    }


def _journaled_dirs(config: Config) -> dict[str, str | None]:
    """What `_clear_dir` keeps of each journaled sandbox's directory."""
    keep: dict[str, str | None] = {}
    for d in _journal(config):
        state = d.get("state") or "paused"
        if state in ("running", "frozen"):
            keep[str(d["sandboxID"])] = "*"
        elif state == "paused":
            keep[str(d["sandboxID"])] = d.get("image")
    return keep


def _missing_parts(actor: SandboxActor) -> str:
    """What a recovered sandbox lacks on disk, or "" (blocking)."""
    gaps = [str(p) for p in actor.stack.lowers() if not p.is_dir()]
    image = actor._resume_image
    if image is not None and not image.is_dir():
        gaps.append(str(image))
    return ", ".join(gaps)
