"""Errors in the OpenAI shape, and the app's exception handlers.

A real fault is a 500 naming only the exception's type; the traceback goes to the log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error answered in the OpenAI shape.

    Args:
        status: the HTTP status code.
        message: what went wrong and what to do about it.
        type_: the OpenAI error type ("invalid_request_error", "rate_limit_error", ...).
        param: the request field at fault, if one is.
        code: a machine-readable code ("model_not_found", "queue_full", ...).
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    """Returns the OpenAI error body `{"error": {"message", "type", "param", "code"}}`.

    Args:
        message: the human-readable message.
        type_: the OpenAI error type.
        param: the request field at fault, or None.
        code: a machine-readable code, or None.
    """
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _api_error(request: Request, e: APIError):
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _field_path(loc) -> list[str]:
    """A validation error's location as field names and indices: without the "body" prefix and the labels pydantic
    gives the members of a union ("str", "list[...]", "function-after[...]")."""
    return [str(x) for x in loc if x != "body" and not (isinstance(x, str) and (
        "[" in x or x in ("str", "int", "float", "bool", "dict", "list", "none")))]


async def _validation_error(request: Request, e: RequestValidationError):
    # One error is enough to act on: the one deepest in the body (a union's members each report one, and the
    # deepest names the field at fault); `param` names the field as a dotted path.
    errors = e.errors()
    first = max(errors, key=lambda err: len(_field_path(err.get("loc", ()))), default=None) if errors else None
    first = first or {"msg": "invalid request", "loc": ()}
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = f"the body is not valid JSON: {first.get('msg')}"
    elif not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        message = "the body must be a JSON object"
    else:
        message = f"{param or 'body'}: {first.get('msg')}"
    return JSONResponse(error_body(message, "invalid_request_error", param, kind or None), status_code=400)


async def _http_error(request: Request, e: StarletteHTTPException):
    return JSONResponse(error_body(str(e.detail), _TYPES.get(e.status_code, "invalid_request_error")),
                        status_code=e.status_code, headers=getattr(e, "headers", None))


async def _server_error(request: Request, e: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"), status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Makes every error `app` answers take the OpenAI shape.

    Args:
        app: the FastAPI app.
    """
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
