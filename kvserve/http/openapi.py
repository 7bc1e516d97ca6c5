"""What the OpenAPI schema says of each endpoint, declared once for the replica
(``kvserve.server.api``) and the router in front of replicas (``kvserve.router.app``): the same
request models, response models and error statuses, so that a client (or a fuzzer) reading
either schema sends the same requests and expects the same answers.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kvserve.http.protocol import ErrorResponse

# 400 a bad request, 401 no or a wrong API key, 404 no such thing, 413 a body over
# --max-body-bytes, 429 admission full, 500 a bug, 503 draining or nothing to serve it
ERROR_STATUSES = (400, 401, 404, 413, 429, 500, 503)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse}
                                           for code in ERROR_STATUSES}
# 200 is JSON, or with "stream": true server-sent events (data: {chunk} ... data: [DONE]).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}, **ERRORS}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format",
          "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}

_SHADOW = "/kvserve-shadow"  # where a body's validating twin route sits while the schema is made


def _validating(model: type[BaseModel]) -> Any:
    """An endpoint taking a ``model`` body: FastAPI makes its schema as for any route."""

    async def endpoint(body: Any) -> None:  # never served: only its signature is read
        raise AssertionError("a shadow route is never mounted")

    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=model)])
    return endpoint


def publish(app: FastAPI, bodies: Mapping[str, type[BaseModel]] | None = None) -> None:
    """Make ``app.openapi()`` say what the app answers: without FastAPI's automatic 422 (a
    request that fails validation gets 400, ``errors.validation_error_handler``), and with
    ``bodies`` (path -> request model) as the request bodies of POST routes that read their
    body themselves (the router forwards the bytes untouched; a replica validates them). Each
    body is made by FastAPI from a twin route that validates it, in the same pass as the app's
    own routes, so its schema (component names included) is what a replica publishes."""
    bodies = dict(bodies or {})

    def openapi() -> dict[str, Any]:
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
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
