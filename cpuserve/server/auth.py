"""The bearer key check: compared in constant time, so response timing does not leak the key."""

from __future__ import annotations

import hmac

from fastapi import Request

from cpuserve.server.errors import APIError


def check_auth(request: Request, api_key: str | None) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <api_key>` (no key: all pass)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "Invalid or missing API key.", "AuthenticationError", code="invalid_api_key")
