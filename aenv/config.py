"""Node configuration: one frozen value built from the environment and flags.

Every setting has an environment variable (`AENV_*`); the CLI may override
them. Paths all hang off `home` so a test can run a whole node in a temp dir.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path


def _default_home() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/aenv")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "aenv"


@dataclass(frozen=True, kw_only=True)
class Config:
    home: Path = field(default_factory=_default_home)
    listen: str = "127.0.0.1:8000"
    api_key: str | None = None
    # Domain the SDK uses for host routing: `{port}-{sandboxID}.{domain}`.
    domain: str | None = None
    # The node serves TLS with this PEM certificate chain and key (AENV_TLS_CERT,
    # AENV_TLS_KEY; both or neither). Reloaded on SIGHUP.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # CA bundle other nodes' certificates chain to (AENV_TLS_CA); None: the
    # system's store. Read at start.
    tls_ca: Path | None = None
    runtime: str = "gvisor"
    runsc_platform: str = "ptrace"
    # Compression of memory images (AENV_CHECKPOINT_COMPRESSION): "none" is
    # fastest; "flate-best-speed" (runsc's default) writes about 4x less.
    checkpoint_compression: str = "none"
    runsc_binary: str = "runsc"
    # IPv4 range the network slots are carved from (one /30 per sandbox;
    # AENV_SLOT_CIDR). None: the node picks a free /16 at start
    # (`aenv.runtimes.hostclaim`, from `aenv.proto.netstate.AUTO_SLOT_CIDRS`).
    slot_cidr: str | None = None
    # Prefix of this node's netns and veth names, name of its nftables table and
    # cgroup parent (AENV_NET_PREFIX). None: derived from the node's identity
    # (`effective_net_prefix`), so two nodes on one host never share a name.
    net_prefix: str | None = None
    # The node's identity in a cluster (AENV_NODE_ID); None: the host name
    # (`effective_node_id`). Its net prefix derives from it when set, else
    # from the home's path.
    node_id: str | None = None
    # Base URLs of existing nodes to join (AENV_CLUSTER_PEERS, comma-separated);
    # empty: this node starts a cluster of its own (or runs alone).
    cluster_peers: tuple[str, ...] = ()
    # The secret every node of the cluster shares (AENV_CLUSTER_SECRET);
    # required with peers. None: no cluster (a single node).
    cluster_secret: str | None = None
    # The URL peers use for this node (AENV_ADVERTISE_URL); None: from `listen`.
    advertise_url: str | None = None
    # Where cluster links are accepted besides the API port (AENV_CLUSTER_LISTEN,
    # host:port); None: on the API port only.
    cluster_listen: str | None = None
    # How often the node checks its host network (nftables table, slots'
    # rules, netns and veths) and repairs it (AENV_NETWORK_CHECK_INTERVAL, s).
    network_check_s: float = 5.0
    # Network slots (with the default egress policy) and disks (of the default
    # size) made ahead, so a start (a fork's children above all) takes them
    # instead of making them (AENV_START_SPARES, of each; 0: none).
    start_spares: int = 20
    # Operator bound on every sandbox's egress (CIDRs); a sandbox's own allowOut
    # can never reach beyond it. Private ranges are refused regardless.
    egress_cap: tuple[str, ...] = ("0.0.0.0/0",)
    # DNS servers (host[:port]) the egress proxy asks to check that a host name
    # a sandbox's connection claims has the address it dialled (AENV_EGRESS_DNS);
    # empty: the host's own resolver (getaddrinfo).
    egress_dns: tuple[str, ...] = ()
    # Extra CAs (PEM file) the egress proxy trusts, besides /etc/ssl/certs, when
    # it re-encrypts an intercepted request to its host (AENV_EGRESS_CA_FILE).
    egress_ca_file: Path | None = None
    # The OIDC issuer URL of sandboxes' workload tokens (AENV_OIDC_ISSUER; relying
    # parties fetch `{issuer}/.well-known/jwks.json`); None: the advertised URL.
    oidc_issuer: str | None = None
    # How often the OIDC signing key is replaced (AENV_OIDC_ROTATE_S, seconds;
    # see `aenv.node.identity`).
    oidc_rotate_s: float = 7 * 24 * 3600.0
    # The egress proxy's port on the host (AENV_EGRESS_PORT); 0: one the kernel picks.
    egress_port: int = 0
    default_timeout_s: int = 300
    max_timeout_s: int = 24 * 3600
    # Sandboxes the node holds in memory at once (AENV_MAX_SANDBOXES): running,
    # or paused and not yet hibernated. Hibernated ones (paused, on disk) do not
    # count: they are bounded by disk. A create or a resume past it is refused
    # (503, retry), as is one while the host is below half its hibernation
    # mark (`hibernate_memory_low_pct`) with nothing paused left to hibernate.
    max_sandboxes: int = 1024
    default_cpu: int = 2
    default_memory_mb: int = 512
    # Processes (threads included) each user of a sandbox may run at once
    # (AENV_PROCESS_LIMIT): past it fork/clone fail with EAGAIN inside. None:
    # one per 4 MiB of the sandbox's memory, at least 128 (128 for 512 MiB).
    process_limit: int | None = None
    # Host tasks (threads of its runtime) a sandbox may hold (AENV_SANDBOX_HOST_TASKS,
    # pids.max). None: a quarter of the host's kernel.pid_max, at least 8 per
    # process of the process limit. envd ends the guest's largest process group
    # from half of it on (`aenv.runtimes.taskvalve`).
    host_tasks_limit: int | None = None
    # How far above its size a sandbox's host memory limit is (AENV_MEMORY_HEADROOM_MB;
    # at least an eighth of the size): the runtime's own memory and the room the
    # in-sandbox OOM killer acts in before the host would kill the whole sandbox.
    memory_headroom_mb: int = 256
    # Every sandbox's disk: what it may write (its writable layer and /tmp),
    # in MiB (AENV_SANDBOX_DISK_MB; 0: unbounded, the host's disk).
    sandbox_disk_mb: int = 10240
    # The last characters of this node's sandbox IDs (AENV_NODE_TAG), a hint of
    # where a sandbox runs; None: derived from the node's id (`effective_node_tag`).
    node_tag: str | None = None
    max_body_bytes: int = 1 << 20
    # Keep each template as a memory snapshot so its sandboxes restore, not boot.
    warm_templates: bool = True
    # A full pause freezes the sandbox in memory; after this long paused it is
    # written to disk and its memory released (AENV_HIBERNATE_AFTER, seconds).
    hibernate_after_s: float = 60.0
    # A sandbox frozen this long gets a write-behind copy on disk (memory image
    # and a layer of its files) while it stays frozen: a host reboot keeps it
    # (AENV_WRITE_BEHIND_AFTER, seconds; 0: off).
    write_behind_s: float = 30.0
    # ... or at once, longest paused first, while the host's available memory
    # is below this percentage of its total (AENV_HIBERNATE_MEMORY_LOW; 0: never).
    hibernate_memory_low_pct: float = 10.0
    # Volumes written or mounted since their last copy are copied to the object
    # store this often, only what changed (AENV_VOLUME_PERSIST_S, seconds; 0: never).
    volume_persist_s: float = 60.0
    # What a stopping node does with its sandboxes (AENV_ON_STOP): "keep" leaves
    # running ones running (and writes paused ones to disk) for the next node
    # process to take back, as containerd leaves containers; "stop" stops them.
    on_stop: str = "keep"
    # Restored sandboxes kept ready per recently used template: at least this
    # many while it is hot (AENV_POOL_SIZE; 0: no pool), more as its demand asks
    # (aenv.proto.poolsize), at most AENV_POOL_MAX; at most
    # AENV_POOL_REFILL_CONCURRENCY refill restores at once across templates.
    pool_size: int = 2
    pool_max: int = 32
    pool_refill_concurrency: int = 2
    # How fast a template's pool shrinks once its demand falls (AENV_POOL_HALF_LIFE,
    # seconds): a burst's size is held half this long, then halves every this long.
    pool_half_life_s: float = 120.0
    # Byte bound on the local chunk cache of image contents (AENV_CACHE_MAX_BYTES).
    cache_max_bytes: int = 32 << 30
    # Object store for durable snapshots (AENV_STORE_URL): file:///dir, s3://bucket/prefix,
    # gs://..., az://...; None: file://$AENV_HOME/store; "none" turns durable storage off.
    store_url: str | None = None
    # Whether the node puts its default templates (base, busybox) in the store for
    # nodes that join with an empty home (AENV_SHARE_DEFAULT_TEMPLATES): "auto"
    # does when AENV_STORE_URL names a store (not the default one in the home),
    # "on" always (with a store), "off" never. Fetching them does not depend on it.
    share_default_templates: str = "auto"
    # Store blobs no manifest references are deleted once older than this (seconds).
    store_gc_grace_s: float = 3600.0
    # A snapshot restored from the store starts with its layers served on demand
    # (AENV_LAZY_RESTORE); they are copied to disk in the background after
    # AENV_LAZY_MATERIALISE_AFTER seconds (not at once: the copy would compete
    # with the restore it follows for CPU and disk).
    lazy_restore: bool = True
    lazy_materialise_after_s: float = 5.0
    # Registries images may come from (None: any), registries reachable over
    # plain HTTP, and mirrors tried before a registry ({registry: (urls...)}).
    registry_allow: tuple[str, ...] | None = None
    registry_insecure: tuple[str, ...] = ()
    registry_mirrors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Docker-style credentials file ({"auths": {host: {"auth": b64(user:pass)}}}).
    registry_auth_file: Path | None = None
    # Longest silence from a registry before a request is retried (seconds).
    registry_timeout_s: float = 60.0

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @property
    def templates_dir(self) -> Path:
        return self.home / "templates"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    @property
    def bundle_dir(self) -> Path:
        return self.home / "bundle"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def images_dir(self) -> Path:
        return self.home / "images"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def effective_net_prefix(self) -> str:
        """`net_prefix` if set, else "aenv" and a stable hash of the node's identity
        (`node_id`, else the resolved home): 10 characters, so slot i's veth
        `{prefix}h{i}` fits an interface name (15) for up to 10000 slots."""
        if self.net_prefix:
            return self.net_prefix
        return derive_net_prefix(self.node_id or str(self.home.resolve()))

    @functools.cached_property
    def effective_node_id(self) -> str:
        """`node_id`, else this machine's host name."""
        return self.node_id or socket.gethostname().split(".")[0]

    @functools.cached_property
    def effective_node_tag(self) -> str:
        """`node_tag`, else 4 base-36 characters hashed from the node's id."""
        if self.node_tag:
            return self.node_tag
        n = int.from_bytes(hashlib.sha256(self.effective_node_id.encode()).digest()[:8])
        return "".join("0123456789abcdefghijklmnopqrstuvwxyz"[(n // 36**i) % 36] for i in range(4))

    @property
    def clustered(self) -> bool:
        """Whether this node takes part in a cluster (it has a cluster secret)."""
        return bool(self.cluster_secret)

    @property
    def effective_advertise_url(self) -> str:
        """The URL peers reach this node at: `advertise_url`, else from `listen`
        (a wildcard listen address advertises the host name)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host, _, port = self.listen.rpartition(":")
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        return f"{self.scheme}://{host}:{port}"

    @property
    def scheme(self) -> str:
        """The API's scheme: https when the node serves TLS."""
        return "https" if self.tls_cert is not None else "http"

    def process_limit_for(self, memory_mb: int) -> int:
        """The process limit of a sandbox of `memory_mb` (`process_limit`)."""
        return self.process_limit or max(128, memory_mb // 4)

    @property
    def effective_store_url(self) -> str | None:
        """The object store's URL, or None when durable storage is off."""
        if self.store_url is None:
            return f"file://{os.path.abspath(self.home / 'store')}"
        return None if self.store_url.lower() in ("none", "off") else self.store_url

    @property
    def shares_default_templates(self) -> bool:
        """Whether the node shares its default templates (`share_default_templates`)."""
        if self.effective_store_url is None or self.share_default_templates == "off":
            return False
        return self.share_default_templates == "on" or self.store_url is not None

    @property
    def auth_file(self) -> Path:
        return self.registry_auth_file or self.secrets_dir / "registries.json"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> Config:
        env = dict(os.environ if env is None else env)
        kw: dict[str, object] = {}
        if "AENV_HOME" in env:
            kw["home"] = Path(env["AENV_HOME"])
        if "AENV_LISTEN" in env:
            kw["listen"] = env["AENV_LISTEN"]
        if env.get("AENV_API_KEY"):
            kw["api_key"] = env["AENV_API_KEY"]
        if "AENV_DOMAIN" in env:
            kw["domain"] = env["AENV_DOMAIN"]
        for name, attr in (
            ("AENV_TLS_CERT", "tls_cert"),
            ("AENV_TLS_KEY", "tls_key"),
            ("AENV_TLS_CA", "tls_ca"),
        ):
            if env.get(name, "").strip():
                kw[attr] = Path(env[name].strip())
        if "AENV_RUNSC_PLATFORM" in env:
            kw["runsc_platform"] = env["AENV_RUNSC_PLATFORM"]
        if env.get("AENV_CHECKPOINT_COMPRESSION"):
            value = env["AENV_CHECKPOINT_COMPRESSION"]
            if value not in ("none", "flate-best-speed"):
                raise ValueError(
                    f"AENV_CHECKPOINT_COMPRESSION must be none or flate-best-speed, not {value!r}"
                )
            kw["checkpoint_compression"] = value
        if "AENV_RUNSC" in env:
            kw["runsc_binary"] = env["AENV_RUNSC"]
        if env.get("AENV_SLOT_CIDR"):
            kw["slot_cidr"] = env["AENV_SLOT_CIDR"].strip()
        if env.get("AENV_NET_PREFIX"):
            kw["net_prefix"] = env["AENV_NET_PREFIX"]
        if env.get("AENV_NODE_ID"):
            kw["node_id"] = env["AENV_NODE_ID"]
        if env.get("AENV_CLUSTER_PEERS"):
            kw["cluster_peers"] = tuple(p.rstrip("/") for p in _csv(env["AENV_CLUSTER_PEERS"]))
        if env.get("AENV_CLUSTER_SECRET"):
            kw["cluster_secret"] = env["AENV_CLUSTER_SECRET"]
        if env.get("AENV_ADVERTISE_URL"):
            kw["advertise_url"] = env["AENV_ADVERTISE_URL"].strip()
        if env.get("AENV_CLUSTER_LISTEN"):
            kw["cluster_listen"] = env["AENV_CLUSTER_LISTEN"].strip()
        if env.get("AENV_NETWORK_CHECK_INTERVAL"):
            every = float(env["AENV_NETWORK_CHECK_INTERVAL"])
            if not every > 0:
                raise ValueError(f"AENV_NETWORK_CHECK_INTERVAL must be positive, not {every:g}")
            kw["network_check_s"] = every
        if env.get("AENV_START_SPARES"):
            spares = int(env["AENV_START_SPARES"])
            if spares < 0:
                raise ValueError(f"AENV_START_SPARES must not be negative, not {spares}")
            kw["start_spares"] = spares
        if "AENV_EGRESS_CAP" in env:
            kw["egress_cap"] = tuple(
                c.strip() for c in env["AENV_EGRESS_CAP"].split(",") if c.strip()
            )
        if env.get("AENV_EGRESS_DNS"):
            kw["egress_dns"] = tuple(_csv(env["AENV_EGRESS_DNS"]))
        if env.get("AENV_OIDC_ISSUER"):
            kw["oidc_issuer"] = env["AENV_OIDC_ISSUER"].rstrip("/")
        if env.get("AENV_OIDC_ROTATE_S"):
            rotate = float(env["AENV_OIDC_ROTATE_S"])
            if not rotate >= 1:
                raise ValueError(f"AENV_OIDC_ROTATE_S must be at least 1 second, not {rotate:g}")
            kw["oidc_rotate_s"] = rotate
        if env.get("AENV_EGRESS_CA_FILE"):
            kw["egress_ca_file"] = Path(env["AENV_EGRESS_CA_FILE"])
        if env.get("AENV_EGRESS_PORT"):
            kw["egress_port"] = int(env["AENV_EGRESS_PORT"])
        if "AENV_NODE_TAG" in env:
            kw["node_tag"] = env["AENV_NODE_TAG"]
        if env.get("AENV_WARM_TEMPLATES"):
            kw["warm_templates"] = _flag(env["AENV_WARM_TEMPLATES"])
        if env.get("AENV_HIBERNATE_AFTER"):
            kw["hibernate_after_s"] = float(env["AENV_HIBERNATE_AFTER"])
        if env.get("AENV_VOLUME_PERSIST_S"):
            kw["volume_persist_s"] = float(env["AENV_VOLUME_PERSIST_S"])
        if env.get("AENV_WRITE_BEHIND_AFTER"):
            kw["write_behind_s"] = float(env["AENV_WRITE_BEHIND_AFTER"])
        if env.get("AENV_HIBERNATE_MEMORY_LOW"):
            pct = float(env["AENV_HIBERNATE_MEMORY_LOW"].rstrip("%"))
            if not 0 <= pct <= 100:
                raise ValueError(f"AENV_HIBERNATE_MEMORY_LOW must be 0..100 (percent), not {pct:g}")
            kw["hibernate_memory_low_pct"] = pct
        if env.get("AENV_ON_STOP"):
            value = env["AENV_ON_STOP"].strip().lower()
            if value not in ("keep", "stop"):
                raise ValueError(f"AENV_ON_STOP must be keep or stop, not {value!r}")
            kw["on_stop"] = value
        for name, attr, least in (
            ("AENV_PROCESS_LIMIT", "process_limit", 16),
            ("AENV_SANDBOX_HOST_TASKS", "host_tasks_limit", 256),
            ("AENV_MEMORY_HEADROOM_MB", "memory_headroom_mb", 64),
        ):
            if env.get(name):
                number = int(env[name])
                if number < least:
                    raise ValueError(f"{name} must be at least {least}, not {number}")
                kw[attr] = number
        if env.get("AENV_SANDBOX_DISK_MB"):
            disk = int(env["AENV_SANDBOX_DISK_MB"])
            if disk != 0 and disk < 64:
                raise ValueError(f"AENV_SANDBOX_DISK_MB must be 0 or at least 64, not {disk}")
            kw["sandbox_disk_mb"] = disk
        if env.get("AENV_MAX_SANDBOXES"):
            most = int(env["AENV_MAX_SANDBOXES"])
            if most < 1:
                raise ValueError(f"AENV_MAX_SANDBOXES must be at least 1, not {most}")
            kw["max_sandboxes"] = most
        if env.get("AENV_POOL_SIZE"):
            kw["pool_size"] = int(env["AENV_POOL_SIZE"])
        if env.get("AENV_POOL_MAX"):
            kw["pool_max"] = int(env["AENV_POOL_MAX"])
        if env.get("AENV_POOL_REFILL_CONCURRENCY"):
            refills = int(env["AENV_POOL_REFILL_CONCURRENCY"])
            if refills < 1:
                raise ValueError(f"AENV_POOL_REFILL_CONCURRENCY must be at least 1, not {refills}")
            kw["pool_refill_concurrency"] = refills
        if env.get("AENV_POOL_HALF_LIFE"):
            half_life = float(env["AENV_POOL_HALF_LIFE"])
            if half_life <= 0:
                raise ValueError(f"AENV_POOL_HALF_LIFE must be positive, not {half_life:g}")
            kw["pool_half_life_s"] = half_life
        if env.get("AENV_STORE_URL"):
            kw["store_url"] = env["AENV_STORE_URL"].strip()
        if env.get("AENV_SHARE_DEFAULT_TEMPLATES"):
            value = env["AENV_SHARE_DEFAULT_TEMPLATES"].strip().lower()
            if value not in ("auto", "on", "off"):
                raise ValueError(
                    f"AENV_SHARE_DEFAULT_TEMPLATES must be auto, on or off, not {value!r}"
                )
            kw["share_default_templates"] = value
        if env.get("AENV_STORE_GC_GRACE"):
            kw["store_gc_grace_s"] = float(env["AENV_STORE_GC_GRACE"])
        if env.get("AENV_LAZY_RESTORE"):
            kw["lazy_restore"] = _flag(env["AENV_LAZY_RESTORE"])
        if env.get("AENV_LAZY_MATERIALISE_AFTER"):
            kw["lazy_materialise_after_s"] = float(env["AENV_LAZY_MATERIALISE_AFTER"])
        if env.get("AENV_CACHE_MAX_BYTES"):
            kw["cache_max_bytes"] = parse_size(env["AENV_CACHE_MAX_BYTES"])
        if "AENV_REGISTRY_ALLOW" in env:
            kw["registry_allow"] = _csv(env["AENV_REGISTRY_ALLOW"])
        if "AENV_REGISTRY_INSECURE" in env:
            kw["registry_insecure"] = _csv(env["AENV_REGISTRY_INSECURE"])
        if env.get("AENV_REGISTRY_MIRRORS"):
            kw["registry_mirrors"] = parse_mirrors(env["AENV_REGISTRY_MIRRORS"])
        if env.get("AENV_REGISTRY_TIMEOUT"):
            kw["registry_timeout_s"] = float(env["AENV_REGISTRY_TIMEOUT"])
        if env.get("AENV_REGISTRY_AUTH_FILE"):
            kw["registry_auth_file"] = Path(env["AENV_REGISTRY_AUTH_FILE"])
        kw.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**kw)  # type: ignore[arg-type]
        config.check_tls()
        config.check_cluster()
        return config

    def check_tls(self) -> None:
        """Refuse half a TLS setting (the files themselves are read at start)."""
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("AENV_TLS_CERT", "AENV_TLS_KEY")
                if self.tls_cert is not None
                else ("AENV_TLS_KEY", "AENV_TLS_CERT")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: TLS needs both the certificate "
                "chain and its private key (PEM files), or neither"
            )

    def check_cluster(self) -> None:
        """Refuse cluster settings that cannot work, saying what to change."""
        if self.cluster_peers and not self.cluster_secret:
            raise ValueError(
                "AENV_CLUSTER_PEERS needs AENV_CLUSTER_SECRET (the same on every node)"
            )
        if self.cluster_secret and (
            self.store_url is None or self.store_url.lower() in ("none", "off")
        ):
            raise ValueError(
                "a cluster needs AENV_STORE_URL: one object store every node shares "
                "(s3://..., gs://..., az://... or a shared file:// directory)"
            )
        if self.cluster_secret and len(self.cluster_secret) < 16:
            raise ValueError("AENV_CLUSTER_SECRET must be at least 16 characters")
        if self.node_id is not None and not re.match(
            r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", self.node_id
        ):
            raise ValueError(
                f"AENV_NODE_ID {self.node_id!r} must be 1-63 letters, digits, '.', '_' or '-'"
            )
        for url in (*self.cluster_peers, *([self.advertise_url] if self.advertise_url else [])):
            if not re.match(r"^https?://[^/\s]+/?$", url):
                raise ValueError(
                    f"cluster URL {url!r} must be a base URL like http://10.0.0.2:8000"
                )


def derive_net_prefix(identity: str) -> str:
    """The network names prefix of the node known as `identity` (its ID or home)."""
    return "aenv" + hashlib.sha256(identity.encode()).hexdigest()[:6]


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "512M", "10GiB", "2g" (binary units)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    number = raw[: len(raw) - len(unit)].strip()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try 256M or 10G)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * _UNITS[unit])


def _flag(value: str) -> bool:
    """An on/off setting: 0, false, no and off (any case) are off; anything else on."""
    return value.strip().lower() not in ("0", "false", "no", "off")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_mirrors(text: str) -> dict[str, tuple[str, ...]]:
    """{registry: mirrors} from "docker.io=https://m1|https://m2,ghcr.io=http://m3"."""
    mirrors: dict[str, tuple[str, ...]] = {}
    for item in _csv(text):
        registry, sep, urls = item.partition("=")
        if not sep or not registry.strip() or not urls.strip():
            raise ValueError(f"mirror setting {item!r} is not REGISTRY=URL[|URL...]")
        mirrors[registry.strip()] = tuple(u.strip() for u in urls.split("|") if u.strip())
    return mirrors
