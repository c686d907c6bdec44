"""The API key check shared by the REST routes and the exec WebSocket.

The key comes in `X-API-Key` (what the E2B SDKs send) or as
`Authorization: Bearer <key>`, and is compared in constant time.
"""

from __future__ import annotations

import hmac


def api_key_refusal(x_api_key: str, authorization: str, key: bytes) -> str | None:
    """None when the request's `X-API-Key` or `Authorization` header carries `key`,
    else the message of the 401 to answer."""
    given = x_api_key
    if not given:
        auth = authorization
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
    if hmac.compare_digest(given.encode(), key):
        return None
    return "Invalid API key" if given else "Missing X-API-Key header"
