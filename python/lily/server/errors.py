"""Errors with a fitting status, OpenAI-shaped ({"error": {"message", "type", "param", "code"}})
unless the route's family words them otherwise (ErrorStyle)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from .. import params
from .._lily import LilyError

log = logging.getLogger("lily.server")

_TYPES = {401: "authentication_error", 404: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def check_unicode(raw_body) -> None:
    """A 400 naming the field (as OpenAI names fields: 'input[0].content') whose text holds a lone
    surrogate: the tokenizer takes only Unicode."""
    found = params.lone_surrogate(raw_body)
    if found:
        raise bad_request(params.surrogate_message(*found), found[0])


def stream_error(e: Exception, count_failure) -> APIError:
    """What a stream's error event reports for `e`, raised after the stream began; an error that
    is not the request's fault is logged and counted by count_failure."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, LilyError):
        return bad_request(str(e))
    log.exception("generation failed")
    count_failure(e)
    return APIError(500, f"internal error: {type(e).__name__}")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_schema() -> dict:
    """The `responses` entry documenting errors in the OpenAPI schema."""
    described = {400: "invalid request (param names the field)", 401: "missing or wrong API key",
                 404: "unknown model", 413: "prompt longer than the context", 503: "queue full"}
    return {status: {"description": text, "model": ErrorResponse} for status, text in described.items()}


def drop_422(schema: dict) -> dict:
    """FastAPI documents 422 for every body; this server answers 400 instead."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(unused, None)
    return schema


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "any"}


def _param(error: dict) -> str | None:
    return param_of_location(error.get("loc", ()))


def param_of_location(loc) -> str | None:
    """The field of a validation error at ('body', 'messages', 0, 'role'): 'messages[0].role'; stops
    at a union member's tag (pydantic adds e.g. 'constrained-str' or 'list[TextPart]' to the location)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def _validation_message(errors: list[dict], param_of) -> tuple[str, str | None]:
    """One message for the first invalid parameter, listing what each accepted form wanted."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = param_of(first)
    if param is None:
        return f"the request body must be a JSON object ({first.get('msg', 'invalid')})", None
    if any(e.get("type") == "string_unicode" and param_of(e) == param for e in errors):
        return f"{param} holds a lone surrogate, which is not valid Unicode text (half a UTF-16 pair)", param
    wants = list(dict.fromkeys(e["msg"] for e in errors if param_of(e) == param))
    return f"{param}: {'; or '.join(wants[:4])}", param


def invalid_request(exc: RequestValidationError, request: Request, param_of=_param) -> APIError:
    """The 400 for a body that failed validation; `param_of(error)` names an error's field."""
    message, param = _validation_message(list(exc.errors()), param_of)
    if param is None and "json" not in request.headers.get("content-type", "json"):
        message += "; send it with 'Content-Type: application/json'"
    return bad_request(message, param)


@dataclass(frozen=True)
class ErrorStyle:
    """How a family of routes words its errors."""

    response: Callable[[APIError], JSONResponse]
    invalid: Callable[[RequestValidationError, Request], APIError] = invalid_request


OPENAI = ErrorStyle(APIError.response)


def install(app: FastAPI, count_failure, styles: dict[str, ErrorStyle] | None = None) -> None:
    """Error handlers: every error a body in the style of its route (`styles` by path prefix,
    else OpenAI's); an unexpected one a 500, logged and counted by `count_failure(exc)` (the
    /health failure counter)."""

    def style(request: Request) -> ErrorStyle:
        path = request.url.path
        return next((s for prefix, s in (styles or {}).items() if path.startswith(prefix)), OPENAI)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return style(request).response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        words = style(request)
        return words.response(words.invalid(exc, request))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        error = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return style(request).response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        count_failure(exc)
        return style(request).response(APIError(500, f"internal error: {type(exc).__name__}"))
