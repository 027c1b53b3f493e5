"""Who may call what on the gateway: the client key and the admin key, compared in constant time.

- `/health`, `/livez` and `/metrics` are open (probes and Prometheus).
- Changing the worker set (`POST` / `DELETE /workers`) needs the admin key. Without an admin key
  configured it is refused to everyone: the client key never changes the worker set, in static
  mode or with discovery.
- Everything else (the routed endpoints, `/v1/models`, `GET /workers`) needs the client key when
  one is configured; `GET /workers` also accepts the admin key.

The keys come from the environment or files (`api_keys.py`).
"""

from __future__ import annotations

import hmac

from radixpool.gateway.api_keys import ADMIN_KEY_ENV

OPEN_PATHS = ("/health", "/livez", "/metrics")
READ_METHODS = ("GET", "HEAD")

Denial = tuple[int, str, str]   # status, message, error code


def is_admin_path(path: str) -> bool:
    return path == "/workers" or path.startswith("/workers/")


def presented_key(authorization: bytes, api_key_header: bytes = b"") -> bytes:
    """The key a client presents, read as the workers read it: `Authorization: Bearer KEY`
    (the scheme in any case, spaces around the key ignored), else an `X-API-Key` header."""
    scheme, _, key = authorization.strip().partition(b" ")
    if scheme.lower() == b"bearer" and key.strip():
        return key.strip()
    return api_key_header.strip()


class AccessPolicy:
    def __init__(self, client_key: str | None, admin_key: str | None) -> None:
        self._client = client_key.encode() if client_key else None
        self._admin = admin_key.encode() if admin_key else None

    def check(self, path: str, method: str, authorization: bytes) -> Denial | None:
        """None when the request may proceed, else what to answer. `authorization`: the key
        presented (`presented_key`)."""
        if path in OPEN_PATHS:
            return None
        admin = self._admin is not None and hmac.compare_digest(authorization, self._admin)
        if is_admin_path(path) and method not in READ_METHODS:
            if admin:
                return None
            if self._admin is None:
                return (403, "changing the worker set needs the admin key; start the gateway "
                             f"with ${ADMIN_KEY_ENV} (or --admin-api-key-file)", "admin_disabled")
            if self._client is not None and hmac.compare_digest(authorization, self._client):
                return 403, "the client API key cannot change the worker set", "admin_key_required"
            return 401, "missing or wrong admin key (Authorization: Bearer)", "invalid_api_key"
        if self._client is None or hmac.compare_digest(authorization, self._client):
            return None
        if admin and is_admin_path(path):
            return None
        return 401, "missing or wrong API key (Authorization: Bearer)", "invalid_api_key"
