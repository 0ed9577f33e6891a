"""Every failure as OpenAI's error body, `{"error": {message, type, param, code}}`, with its status; and the
API key check."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from batchrun.serve import shapes

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.body = status, shapes.error_body(message, type, param, code)


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param="id")


def paged(items: list[dict[str, Any]], after: str | None, limit: int, kind: str) -> dict[str, Any]:
    try:
        return shapes.page(items, after, limit)
    except KeyError:
        raise APIError(400, f"after: no such {kind} object: {after}", param="after") from None


def install(app: FastAPI, api_key: str | None) -> None:
    """The key check (when `api_key` is set) and the handlers that turn every exception into an error body."""

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                message = ("You didn't provide an API key: pass it as 'Authorization: Bearer KEY'" if not given
                           else "Incorrect API key provided.")
                return JSONResponse(shapes.error_body(message, code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code in (404, 405):
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(e.detail)
        return JSONResponse(shapes.error_body(message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
        param = ".".join(where) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(shapes.error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error in %s %s", request.method, request.url.path)
        return JSONResponse(shapes.error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"),
                            status_code=500)
