"""OpenAI-style errors: one body shape for every failure, whatever raised it.

Handlers raise APIError (or let an engine exception through); the exception handlers installed
here turn each into `{"error": {message, type, param, code}}` with the right status, so a client
never sees FastAPI's or Starlette's own error bodies.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpuserve.engine import EngineDeadError, InvalidRequest, RequestCancelled, RequestFailed

log = logging.getLogger(__name__)

# What an engine request can raise that is the request's (or the engine's) fault, not the server's.
ENGINE_ERRORS = (InvalidRequest, RequestFailed, RequestCancelled, EngineDeadError)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "BadRequestError",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param: str | None = None, code: Any = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


def api_error(exc: Exception) -> APIError:
    """The OpenAI-style error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, RequestFailed):
        return APIError(500, f"The request failed inside the engine: {exc}", "InternalServerError")
    if isinstance(exc, RequestCancelled):
        return APIError(503, f"The request was stopped: {exc}.", "ServiceUnavailableError", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The engine has stopped; the server is restarting.", "ServiceUnavailableError")
    return APIError(500, "Internal server error (logged).", "InternalServerError")


def install_error_handlers(app: FastAPI) -> None:
    """Every error path of the app answers with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
        if exc.status == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(RequestFailed)
    @app.exception_handler(RequestCancelled)
    @app.exception_handler(EngineDeadError)
    async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        return error_response(err.status, err.message, err.type, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
        return error_response(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "Internal server error (logged).", "InternalServerError")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character position, not a parameter
            at = next((p for p in first.get("loc", []) if isinstance(p, int)), None)
            where = f" at character {at}" if at is not None else ""
            return error_response(
                400, f"The request body is not valid JSON ({first.get('msg')}{where})", "BadRequestError"
            )
        # pydantic names the member of a union it tried ("stop.str", "messages.0.content.list[...]"):
        # the parameter is the field, as OpenAI names it
        loc = [str(p) for p in first.get("loc", []) if p != "body" and not _union_member(p)]
        param = ".".join(loc) or None
        return error_response(
            400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", "BadRequestError", param
        )


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|(list|dict|tuple|set|literal|nullable|function-\w+)\[.*\])")


def _union_member(part: object) -> bool:
    """Whether a validation error's location part is pydantic's tag for a union member tried (a type
    such as `str` or `list[str]`), not a field name or an index."""
    return isinstance(part, str) and _TYPE_TAG.fullmatch(part) is not None
