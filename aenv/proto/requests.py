"""Parsing and validation of E2B REST request bodies (sans-IO).

Each `parse_*` takes the decoded JSON value and returns a frozen request or
raises `BadRequest` with a message a user can act on. A field aenv knows but
cannot honour yet (e.g. `mcp`, an egress proxy) is refused here, never silently dropped. Unknown fields are
ignored, as E2B's API does, so newer SDKs keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aenv.proto.egressrules import parse_rules
from aenv.proto.identity import parse_iam
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.proto.netpolicy import EgressPolicy, PolicyError
from aenv.proto.volumes import VolumeMount, VolumeRequestError, parse_mounts

MAX_METADATA_ITEMS = 64
MAX_ENV_ITEMS = 512
MAX_KEY = 256
MAX_VALUE = 16 * 1024


class BadRequest(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_timeout_s: int = 24 * 3600
    default_timeout_s: int = 300
    max_cpu: int = 64
    max_memory_mb: int = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class NewSandbox:
    template: str
    timeout_s: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    env_vars: Mapping[str, str] = field(default_factory=dict)
    policy: EgressPolicy = field(default_factory=EgressPolicy)
    allow_internet_access: bool | None = None
    allow_public_traffic: bool = True
    auto_pause: bool = False
    # what an auto-pause saves: memory and filesystem (True) or the filesystem only
    auto_pause_memory: bool = True
    # traffic to the paused sandbox through the node's proxy resumes it
    auto_resume: bool = False
    # aenv extension: size this sandbox instead of using the template's default
    cpu_count: int | None = None
    memory_mb: int | None = None
    # volumes mounted read-write at their paths (`aenv.proto.volumes`)
    volume_mounts: tuple[VolumeMount, ...] = ()


def _obj(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadRequest(f"{what} must be a JSON object")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be a boolean")
    return v


def _str_map(value: object, what: str, max_items: int) -> dict[str, str]:
    if value is None:
        return {}
    m = _obj(value, what)
    if len(m) > max_items:
        raise BadRequest(f"{what} has more than {max_items} entries")
    out: dict[str, str] = {}
    for k, v in m.items():
        if not isinstance(v, str):
            raise BadRequest(f"{what}[{k!r}] must be a string")
        if not k or len(k) > MAX_KEY or len(v) > MAX_VALUE or "\0" in k or "\0" in v:
            raise BadRequest(f"{what}[{k!r}] is empty, too long or contains NUL")
        out[k] = v
    return out


def parse_timeout(value: object, limits: Limits, *, key: str = "timeout") -> int:
    if value is None:
        return limits.default_timeout_s
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer number of seconds")
    if value < 0:
        raise BadRequest(f"{key} must not be negative")
    if value > limits.max_timeout_s:
        raise BadRequest(f"{key} must be at most {limits.max_timeout_s} seconds")
    return value


def _bounded_int(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer")
    if not low <= v <= high:
        raise BadRequest(f"{key} must be between {low} and {high}")
    return v


def _auto_resume(raw: object) -> bool:
    if raw is None:
        return False
    enabled = _obj(raw, "autoResume").get("enabled", False)
    if not isinstance(enabled, bool):
        raise BadRequest("autoResume.enabled must be a boolean")
    return enabled


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("mcp") not in (None, {}):
        raise BadRequest("mcp is not supported by this node")


def _refuse_ingress_update(net: Mapping[str, Any]) -> None:
    """A network update carries no ingress settings (E2B's update body has none):
    the sandbox keeps those it was created with, so trying to change them is refused."""
    for key in ("maskRequestHost", "httpsPorts"):
        if net.get(key) is not None:
            raise BadRequest(f"network.{key} is set when the sandbox is created, not updated")


def _policy(
    allow_internet: bool | None,
    net: Mapping[str, Any] | None,
    *,
    iam: object = None,
    update: bool = False,
) -> EgressPolicy:
    """The egress policy of a create body (`iam` its workload tokens) or, with
    `update`, of a network update (which carries no `iam`: the sandbox keeps its own)."""
    try:
        policy = EgressPolicy.from_request(allow_internet_access=allow_internet, network=net)
        tokens = parse_iam(iam)
        names = None if update else [t.name for t in tokens]
        rules = parse_rules(None if net is None else net.get("rules"), iam_tokens=names)
        return dataclasses.replace(
            policy,
            rules=rules.rules,
            iam_tokens=tuple((t.name, t.audience, t.token_type) for t in tokens),
        )
    except PolicyError as e:
        raise BadRequest(str(e)) from None


def parse_new_sandbox(body: object, limits: Limits) -> NewSandbox:
    b = _obj(body, "request body")
    template = b.get("templateID")
    if not isinstance(template, str) or not template:
        raise BadRequest("templateID is required and must be a string")
    try:
        check_name(template, "templateID")
    except InvalidName as e:
        # aenv extension: an OCI image reference starts a sandbox from that image.
        try:
            parse_reference(template)
        except InvalidReference as ref_error:
            raise BadRequest(f"{e} (nor is it an image reference: {ref_error})") from None
    _refuse_unsupported(b)
    try:
        mounts = parse_mounts(b.get("volumeMounts"))
    except VolumeRequestError as e:
        raise BadRequest(str(e)) from None
    auto_pause = bool(_bool(b, "autoPause"))
    auto_resume = _auto_resume(b.get("autoResume"))
    if auto_resume and not auto_pause:
        raise BadRequest("autoResume needs autoPause (lifecycle onTimeout: pause)")
    if auto_resume and _bool(b, "autoPauseMemory") is False:
        raise BadRequest("autoResume cannot resume a filesystem-only pause")
    allow_internet = _bool(b, "allow_internet_access")
    net_raw = b.get("network")
    net = None if net_raw is None else _obj(net_raw, "network")
    allow_public = True
    if net is not None:
        v = net.get("allowPublicTraffic")
        if v is not None:
            if not isinstance(v, bool):
                raise BadRequest("network.allowPublicTraffic must be a boolean")
            allow_public = v
    return NewSandbox(
        template=template,
        timeout_s=parse_timeout(b.get("timeout"), limits),
        metadata=_str_map(b.get("metadata"), "metadata", MAX_METADATA_ITEMS),
        env_vars=_str_map(b.get("envVars"), "envVars", MAX_ENV_ITEMS),
        policy=_policy(allow_internet, net, iam=b.get("iam")),
        allow_internet_access=allow_internet,
        allow_public_traffic=allow_public,
        auto_pause=auto_pause,
        auto_resume=auto_resume,
        auto_pause_memory=_bool(b, "autoPauseMemory") is not False,
        cpu_count=_bounded_int(b, "cpuCount", 1, limits.max_cpu),
        memory_mb=_bounded_int(b, "memoryMB", 128, limits.max_memory_mb),
        volume_mounts=mounts,
    )


def parse_timeout_request(body: object, limits: Limits) -> int:
    b = _obj(body, "request body")
    if "timeout" not in b:
        raise BadRequest("timeout is required")
    return parse_timeout(b["timeout"], limits)


def parse_refresh(body: object, limits: Limits) -> int:
    if body is None:
        return limits.default_timeout_s
    b = _obj(body, "request body")
    return parse_timeout(b.get("duration"), limits, key="duration")


def parse_network_update(body: object) -> tuple[EgressPolicy, bool | None]:
    """PUT /sandboxes/{id}/network: omitted fields clear (E2B semantics)."""
    b = _obj(body, "request body")
    _refuse_ingress_update(b)
    allow_internet = _bool(b, "allow_internet_access")
    return _policy(allow_internet, b, update=True), allow_internet


def parse_connect(body: object, limits: Limits) -> int:
    """POST /sandboxes/{id}/connect and /resume: the timeout to run with afterwards."""
    if body is None:
        return limits.default_timeout_s
    b = _obj(body, "request body")
    if _bool(b, "memory") is False:
        raise BadRequest("memory: false (cold boot from disk) is not supported by this node yet")
    if b.get("autoPause") is not None:
        _bool(b, "autoPause")
    return parse_timeout(b.get("timeout"), limits)


def parse_pause(body: object) -> str:
    """POST /sandboxes/{id}/pause: 'full' (memory and filesystem) or 'filesystem'."""
    if body is None:
        return "full"
    b = _obj(body, "request body")
    return "filesystem" if _bool(b, "memory") is False else "full"


MAX_FORKS = 20


def parse_fork(body: object, limits: Limits) -> tuple[int, int]:
    """POST /sandboxes/{id}/fork: (count 1..20, timeout of the children)."""
    b = {} if body is None else _obj(body, "request body")
    count = _bounded_int(b, "count", 1, MAX_FORKS)
    return (1 if count is None else count), parse_timeout(b.get("timeout"), limits)


def parse_snapshot(body: object) -> tuple[str | None, bool]:
    """POST /sandboxes/{id}/snapshots: (name or None, with memory)."""
    b = {} if body is None else _obj(body, "request body")
    name = b.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise BadRequest("name must be a string")
        try:
            check_name(name, "snapshot name")
        except InvalidName as e:
            raise BadRequest(str(e)) from None
    return name, _bool(b, "memory") is not False
