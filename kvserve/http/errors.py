"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

INVALID = "invalid_request_error"
# pydantic puts union-branch tags into error locations ("str", "list[int]", ...): not params.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
# ... and the chat messages' discriminator values (messages.0.tool.tool_call_id): not params.
_ROLE_TAGS = frozenset({"system", "developer", "user", "assistant", "tool"})
_SURROGATES = re.compile("[\ud800-\udfff]")


def encode_json(content: Any) -> bytes:
    """Compact UTF-8 JSON that always encodes: lone surrogates (which a client can send as
    ``"\\ud800"`` and see echoed in a message) become U+FFFD."""
    text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text).encode("utf-8")


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return encode_json(content)


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
    return SafeJSONResponse(error_body(message, type=type, param=param, code=code),
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
        elif p in _TYPE_TAGS or not p.replace("_", "").isalnum() or p[0].isupper() or (
                p in _ROLE_TAGS and out.endswith("]")):  # union tags (class names, roles)
            continue
        else:
            out += f".{p}" if out else p
    return out or None


def _most_specific(errors: Sequence[dict]) -> dict:
    """Of the errors pydantic reports (one per union branch), the one that says most: a value
    check that failed (lone surrogate, bad role...), else the deepest location (``content[0]
    .type`` missing says more than "content should be a string"), else the first."""
    for e in errors:
        if e.get("type") == "value_error":
            return e
    deepest = max(len(e.get("loc", ())) for e in errors)
    return next(e for e in errors if len(e.get("loc", ())) == deepest)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending parameter."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = _most_specific(errors)
    if first.get("type") in ("json_invalid", "model_attributes_type") or \
            tuple(first.get("loc", ())) in (("body",), ()):
        msg = "request body is not a valid JSON object"
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error")
            msg = f"malformed JSON in the request body: {detail or first.get('msg')}"
        return error_response(400, msg, code="invalid_json")
    param = loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found",
                             "response_format_type") and param:
        # the discriminators: a message's role, a response format's type
        param += ".role" if param.startswith("messages") else ".type"
    elif param and (m := re.match(re.escape(param) + r"(\[\d+\])+ ", msg)):
        param = m.group(0)[:-1]  # a validator named the item ("prompt[1] must not be empty")
        return error_response(400, msg, param=param, code="invalid_value")
    return error_response(400, f"{param}: {msg}" if param else msg, param=param,
                          code="invalid_value")


def allowed_methods(request: Request) -> str:
    """Every method the app serves at the request's path (Starlette's 405 names only the first
    route's, where a path has one route per method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette/FastAPI ``HTTPException`` (unknown route, wrong method, unreadable body)."""
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    kind = INVALID if exc.status_code < 500 else "server_error"
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return error_response(exc.status_code, message, type=kind, headers=headers)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()
