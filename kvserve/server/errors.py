"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID = "invalid_request_error"
# pydantic puts union-branch tags into error locations ("str", "list[int]", ...): not params.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param,
                              code=self.code, headers=self.headers)


def error_body(message: str, *, type: str = INVALID, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, *, type: str = INVALID, param: str | None = None,
                   code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, param=param, code=code),
                        status_code=status, headers=dict(headers or {}))


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def loc_to_param(loc: Sequence[str | int]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in _TYPE_TAGS or not p.replace("_", "").isalnum():
            continue
        else:
            out += f".{p}" if out else p
    return out or None


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending parameter."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    if first.get("type") in ("json_invalid", "model_attributes_type") or \
            tuple(first.get("loc", ())) in (("body",), ()):
        msg = "request body is not a valid JSON object"
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error")
            msg = f"malformed JSON in the request body: {detail or first.get('msg')}"
        return error_response(400, msg, code="invalid_json")
    param = loc_to_param(first.get("loc", ()))
    return error_response(400, f"{param}: {first.get('msg')}" if param else first.get("msg", ""),
                          param=param, code="invalid_value")


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Starlette/FastAPI ``HTTPException`` (unknown route, wrong method, unreadable body)."""
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    kind = INVALID if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, message, type=kind,
                          headers=getattr(exc, "headers", None))


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()
