"""The router publishes the replicas' API (issue 41): its ``/openapi.json`` declares
completions and chat completions with the replica's request and response models and error
statuses, and schemathesis, fuzzing the router in front of a real (in-process) replica, sees
schema-valid requests go through (never "not a valid JSON object") and only declared statuses.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from kvserve.http.openapi import LIMITS_KEY, RequestLimits
from kvserve.router.app import RouterState, build_router_app
from kvserve.router.settings import RouterSettings
from tests.server.conftest import InProcess

PROXIED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
           ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def replica(tiny_llama):
    # a short context and deadline keep every generated request quick
    srv = InProcess(tiny_llama, {"request_timeout": 2.0, "max_n": 4}, {"max_model_len": 48})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def router(replica):
    """The router app over the one in-process replica (its ASGI app behind the router's
    client); no processes, no lifespan: the replica is marked healthy by hand."""
    state = RouterState(RouterSettings(replicas=("http://replica-a",)), None, None)
    state.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=replica.app),
                                     timeout=60)
    limits = RequestLimits.from_dict(replica.app.openapi()["info"][LIMITS_KEY])
    assert limits is not None and limits.max_model_len == 48
    for r in state.pool.replicas.values():
        r.limits = limits  # as the pool reads them from the replica's /openapi.json on join
        r.healthy = True
        r.down = asyncio.Event()
        state.ring.add(r.name)

    async def nothing() -> None:  # the lifespan (run per fuzzed call) would dial replica-a
        return None

    state.start = state.stop = nothing  # type: ignore[method-assign]
    return build_router_app(state, api_key=None, access_log=False)


def _resolve(node: Any, schema: dict) -> Any:
    """``node`` with every ``$ref`` replaced by what it names (component names differ between
    FastAPI's input / output naming and the router's; the shapes must not)."""
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return _resolve(schema["components"]["schemas"][name], schema)
        return {k: _resolve(v, schema) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [_resolve(v, schema) for v in node]
    return node


@pytest.mark.parametrize(("method", "path"), PROXIED)
def test_router_declares_what_a_replica_declares(replica, router, method, path):
    ours = router.openapi()
    theirs = replica.app.openapi()
    mine, want = ours["paths"][path][method.lower()], theirs["paths"][path][method.lower()]
    assert sorted(mine["responses"]) == sorted(want["responses"])
    for status in want["responses"]:
        assert _resolve(mine["responses"][status], ours) == _resolve(
            want["responses"][status], theirs), status
    if method == "POST":
        for code in ("400", "401", "413", "429", "503"):
            assert code in mine["responses"]
        body = _resolve(mine["requestBody"], ours)
        assert body == _resolve(want["requestBody"], theirs)
        assert body["required"] and body["content"]["application/json"]["schema"]["properties"]
        props = body["content"]["application/json"]["schema"]["properties"]
        assert props["n"]["maximum"] == 4  # the replica's limits (--max-n), stated by both


@pytest.fixture(scope="module")
def router_schema(router):
    return schemathesis.openapi.from_asgi("/openapi.json", router)


CASES = [(m, p, mode) for m, p in PROXIED
         for mode in ((GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if m == "POST"
                      else (GenerationMode.POSITIVE,))]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), CASES,
                         ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_fuzzing_the_router(router_schema, method, path, mode):
    operation = router_schema[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20 if method == "POST" else 3, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        statuses.append(response.status_code)
        declared = case.operation.definition.raw["responses"]
        assert str(response.status_code) in declared, (case.body, response.text)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:  # OpenAI's error shape, from the replica's models
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if mode is GenerationMode.POSITIVE:  # a body that fits the schema is a body
                assert "not a valid JSON object" not in error["message"], case.body

    check()
    if mode is GenerationMode.POSITIVE:
        assert 200 in statuses  # schema-valid requests were served, not all turned away
