"""Identifiers: sandbox IDs that route to their node, and safe names.

A sandbox ID is `<16 random base36 chars><node tag>` joined by nothing but
always lowercase alphanumerics, so it is a valid DNS label for host routing
(`{port}-{id}.{domain}`) and can never escape a directory. The last
`NODE_TAG_LEN` characters name the node that owns the sandbox, which is how a
cluster routes a request for it.
"""

from __future__ import annotations

import re
import secrets

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
RANDOM_LEN = 16
NODE_TAG_LEN = 4
SANDBOX_ID_RE = re.compile(rf"^[a-z0-9]{{{RANDOM_LEN + NODE_TAG_LEN}}}$")
# Template names/aliases/IDs: what E2B accepts, minus anything path-like.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


class InvalidName(ValueError):
    """A name or ID that is malformed or could escape a directory."""


def node_tag(tag: str) -> str:
    """Normalise a node tag to exactly NODE_TAG_LEN lowercase alphanumerics."""
    clean = re.sub(r"[^a-z0-9]", "", tag.lower())
    return (clean + "0" * NODE_TAG_LEN)[:NODE_TAG_LEN]


def new_sandbox_id(tag: str) -> str:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(RANDOM_LEN))
    return body + node_tag(tag)


def is_sandbox_id(value: str) -> bool:
    return SANDBOX_ID_RE.fullmatch(value) is not None


def owner_tag(sandbox_id: str) -> str:
    """The node tag embedded in a sandbox ID (raises InvalidName if malformed)."""
    if not is_sandbox_id(sandbox_id):
        raise InvalidName(f"invalid sandbox ID {sandbox_id!r}")
    return sandbox_id[RANDOM_LEN:]


def check_name(value: str, what: str = "name") -> str:
    """Return `value` if it is a safe template/snapshot name, else raise InvalidName."""
    if not isinstance(value, str) or NAME_RE.fullmatch(value) is None or ".." in value:
        raise InvalidName(
            f"invalid {what} {value!r}: use 1-128 lowercase letters, digits, '.', '_' or '-'"
        )
    return value
