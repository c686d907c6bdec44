"""Secrets (`Secret` in the E2B SDKs): create, list, get, update, delete.

Values are write-only: `POST /secrets` and `POST /secrets/{id}` accept one,
no answer ever carries it, and it is never logged (request bodies are not
logged by the node; errors name the field, never echo its value). A secret
is addressed by its ID (`sec_...`) or its name. The store is the node's own,
or in a cluster with a store the cluster's (`aenv.storage.secrets`); blocking
store calls run in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio
from quart import Blueprint, Response, request

from aenv.api import views
from aenv.api.common import (
    V2_PAGE_DEFAULT,
    V2_PAGE_MAX,
    ApiError,
    deps,
    json_response,
    no_content,
    read_body,
)
from aenv.storage.objstore import StoreError
from aenv.storage.secrets import SecretError, SecretExists, SecretInfo, SecretNotFound
from aenv.storage.shareddoc import Contended

bp = Blueprint("secrets", __name__)
T = TypeVar("T")


def _view(s: SecretInfo) -> dict[str, Any]:
    return {
        "secretID": s.secret_id,
        "name": s.name,
        "currentVersion": s.version,
        "metadata": dict(s.metadata),
        "createdAt": views.iso(s.created_at),
        "updatedAt": views.iso(s.updated_at),
    }


async def _call(fn: Callable[..., T], *args: Any) -> T:
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except SecretExists as e:
        raise ApiError(409, str(e)) from None
    except SecretError as e:
        raise ApiError(400, str(e)) from None
    except SecretNotFound:
        raise ApiError(404, "secret not found") from None
    except (Contended, StoreError) as e:
        # a cluster's secrets live in its store: retryable
        raise ApiError(503, f"the secrets store is unavailable: {type(e).__name__}") from None


async def _body() -> dict[str, Any]:
    body = await read_body()
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


@bp.post("/secrets")
async def secret_create() -> Response:
    b = await _body()
    store = deps().node.secrets
    info = await _call(store.create, b.get("name"), b.get("value"), b.get("metadata"))
    return json_response(_view(info), status=201)


@bp.get("/secrets")
async def secret_list() -> Response:
    try:
        limit = int(request.args.get("limit") or V2_PAGE_DEFAULT)
        start = int(request.args.get("nextToken") or 0)
    except ValueError:
        raise ApiError(400, "limit and nextToken must be integers") from None
    if not 1 <= limit <= V2_PAGE_MAX or start < 0:
        raise ApiError(400, f"limit must be 1..{V2_PAGE_MAX}")
    items = await _call(deps().node.secrets.list)
    page = items[start : start + limit]
    resp = json_response([_view(s) for s in page])
    if start + limit < len(items):
        resp.headers["x-next-token"] = str(start + limit)
    return resp


@bp.get("/secrets/<secret_id>")
async def secret_get(secret_id: str) -> Response:
    return json_response(_view(await _call(deps().node.secrets.get, secret_id)))


@bp.post("/secrets/<secret_id>")
async def secret_update(secret_id: str) -> Response:
    b = await _body()
    store = deps().node.secrets
    info = await _call(store.update, secret_id, b.get("value"), b.get("metadata"))
    return json_response(_view(info))


@bp.delete("/secrets/<secret_id>")
async def secret_delete(secret_id: str) -> Response:
    if not await _call(deps().node.secrets.delete, secret_id):
        raise ApiError(404, "secret not found")
    return no_content()
