"""What the OpenAPI schema says of each endpoint, declared once for the replica
(``kvserve.server.api``) and the router in front of replicas (``kvserve.router.app``): the same
request models, response models and error statuses, so that a client (or a fuzzer) reading
either schema sends the same requests and expects the same answers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kvserve.http.protocol import ErrorResponse
from kvserve.version import __version__

# 400 a bad request, 401 no or a wrong API key, 404 no such thing, 413 a body over
# --max-body-bytes, 429 admission full, 500 a bug, 503 draining or nothing to serve it
ERROR_STATUSES = (400, 401, 404, 413, 429, 500, 503)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse}
                                           for code in ERROR_STATUSES}
# One server-sent event (OpenAPI 3.2's itemSchema shape; before 3.2 a text/event-stream
# schema describes each event): data is a chunk's JSON, then [DONE].
SSE_EVENT: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}
# 200 is JSON, or with "stream": true server-sent events (data: {chunk} ... data: [DONE]).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format",
          "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}

LIMITS_KEY = "x-kvserve-limits"  # in the schema's info: the RequestLimits it states


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a replica allows beyond the request models' own bounds (its model's and settings'
    limits, checked when serving): stated in the schema too, so that a request the schema
    calls valid is not refused for them. The one limit a schema cannot state is a prompt's
    length in tokens (``context_length_exceeded``): the text is tokenized first."""

    vocab_size: int
    max_model_len: int
    max_prompt_chars: int
    max_n: int
    max_prompts: int
    tool_calls: bool  # a --tool-call-parser reads tool calls (else tools need tool_choice none)

    @classmethod
    def from_dict(cls, value: Any) -> RequestLimits | None:
        """From a schema's ``info[LIMITS_KEY]``; None when it is not a valid one."""
        if not isinstance(value, dict):
            return None
        try:
            out = cls(**{f: value[f] for f in cls.__slots__})  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return None
        ints = [getattr(out, f) for f in cls.__slots__ if f != "tool_calls"]
        ok = all(type(v) is int and v >= 1 for v in ints) and type(out.tool_calls) is bool
        return out if ok and out.max_model_len >= 2 else None


def _integer(node: dict[str, Any]) -> dict[str, Any]:
    """The integer branch of ``int | None`` (or ``node`` itself)."""
    return next((b for b in node.get("anyOf", ()) if b.get("type") == "integer"), node)


# without a tool-call parser, tools come with tool_choice "none" (kvserve/server/structured.py)
_NO_TOOL_CALLS = {"if": {"required": ["tools"],
                         "properties": {"tools": {"type": "array", "minItems": 1}}},
                  "then": {"required": ["tool_choice"],
                           "properties": {"tool_choice": {"const": "none"}}}}


def _state_limits(schema: dict[str, Any], lim: RequestLimits) -> None:
    """Put ``lim`` into the request bodies' component schemas, exactly as the server checks
    them (kvserve/server/prompts.py): ``n``, the token budget, a completion's prompt
    (characters, token ids in the vocabulary, token-id prompts shorter than the context,
    prompts per batch), and tools without a tool-call parser."""
    schema.setdefault("info", {})[LIMITS_KEY] = {f: getattr(lim, f) for f in lim.__slots__}
    components = schema.get("components", {}).get("schemas", {})
    new_tokens = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        component = components.get(name, {})
        props = component.get("properties", {})
        if "tools" in props and not lim.tool_calls:  # tools are only shown to the template
            component.setdefault("allOf", []).append(_NO_TOOL_CALLS)
        if "n" in props:
            props["n"]["maximum"] = lim.max_n
        for field in new_tokens:  # the prompt takes at least one token of the context
            if field in props:
                _integer(props[field])["maximum"] = lim.max_model_len - 1
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    ids = {"minItems": 1, "maxItems": lim.max_model_len - 1, "type": "array",
           "items": {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1}}
    for branch in prompt.get("anyOf", ()):
        items = branch.get("items", {})
        if branch.get("type") == "string":
            branch["maxLength"] = lim.max_prompt_chars
        elif items.get("type") == "string":
            branch["maxItems"] = lim.max_prompts
            items["maxLength"] = lim.max_prompt_chars
        elif items.get("type") == "integer":
            branch.update(ids)
        elif items.get("type") == "array":
            branch["maxItems"] = lim.max_prompts
            branch["items"] = dict(ids)


_SHADOW = "/kvserve-shadow"  # where a body's validating twin route sits while the schema is made


def _validating(model: type[BaseModel]) -> Any:
    """An endpoint taking a ``model`` body: FastAPI makes its schema as for any route."""

    async def endpoint(body: Any) -> None:  # never served: only its signature is read
        raise AssertionError("a shadow route is never mounted")

    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=model)])
    return endpoint


def publish(app: FastAPI, bodies: Mapping[str, type[BaseModel]] | None = None,
            limits: Callable[[], RequestLimits | None] = lambda: None) -> None:
    """Make ``app.openapi()`` say what the app answers: without FastAPI's automatic 422 (a
    request that fails validation gets 400, ``errors.validation_error_handler``), with
    ``bodies`` (path -> request model) as the request bodies of POST routes that read their
    body themselves (the router forwards the bytes untouched; a replica validates them), and
    with the ``limits`` the replicas serve with (when known: a router learns them from a
    replica's schema). Each body is made by FastAPI from a twin route that validates it, in
    the same pass as the app's own routes, so its schema (component names included) is what a
    replica publishes."""
    bodies = dict(bodies or {})
    stated: list[RequestLimits | None] = [None]  # the limits app.openapi_schema states

    def openapi() -> dict[str, Any]:
        lim = limits()
        if lim != stated[0]:
            app.openapi_schema, stated[0] = None, lim
        if app.openapi_schema is None:
            twins = APIRouter()
            for path, model in bodies.items():
                twins.add_api_route(_SHADOW + path, _validating(model), methods=["POST"])
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description,
                                 routes=[*app.routes, *twins.routes])
            paths = schema["paths"]
            for path in bodies:
                twin = paths.pop(_SHADOW + path)["post"]
                paths[path]["post"]["requestBody"] = twin["requestBody"]
            for item in paths.values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            if lim is not None:
                _state_limits(schema, lim)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_metrics_and_version(app: FastAPI, render: Callable[[], tuple[bytes, str]]) -> None:
    """``GET /metrics`` (``render``: the Prometheus text and its content type) and ``GET
    /version``, as every kvserve app serves them."""

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        body, content_type = render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}
