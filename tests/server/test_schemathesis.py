"""Property-based fuzzing of the served OpenAPI schema (schemathesis 4, in-process ASGI):
schema-valid and schema-violating requests alike must never produce a 5xx.

Drives schemathesis' per-operation Hypothesis strategies directly (its lazy pytest loader does
not support this pytest version), ~30 examples per operation and mode.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from tests.server.conftest import InProcess

# slow: property-based fuzzing of every endpoint
pytestmark = pytest.mark.slow

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/ready"),
              ("GET", "/version"), ("GET", "/metrics"), ("GET", "/kv_events"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}")]
MAX_EXAMPLES = {"POST": 30, "GET": 5, "DELETE": 5}


@pytest.fixture(scope="module")
def fuzz_app(tiny_llama):
    # A short context and deadline keep every generated request quick.
    srv = InProcess(tiny_llama, {"request_timeout": 2.0, "max_n": 4}, {"max_model_len": 48})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app.app)


def test_schema_lists_every_operation(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


def test_metrics_content_type_is_declared(fuzz_app):
    async def main():
        async with fuzz_app.client() as c:
            return (await c.get("/openapi.json")).json(), await c.get("/metrics")

    schema, metrics = fuzz_app.run(main())
    content = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == [metrics.headers["content-type"]]
    assert content[metrics.headers["content-type"]]["schema"] == {"type": "string"}
    assert metrics.headers["content-type"].startswith("text/plain")


CASES = [(m, p, mode) for m, p in OPERATIONS
         for mode in ((GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if m == "POST"
                      else (GenerationMode.POSITIVE,))]


@pytest.mark.parametrize(("method", "path", "mode"), CASES,
                         ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_no_server_errors(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES[method], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        assert response.status_code < 500, (case.body, response.text)
        declared = case.operation.definition.raw["responses"].get(str(response.status_code))
        if declared and declared.get("content"):  # the answer's type is the declared one
            ctype = response.headers["content-type"]
            media = (ctype[0] if isinstance(ctype, list) else ctype).split(";")[0]
            assert any(t.split(";")[0] == media for t in declared["content"]), (
                ctype, list(declared["content"]))
        if response.status_code >= 400:  # OpenAI's error shape
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


def test_fuzzing_left_the_engine_idle(fuzz_app):
    deadline = time.monotonic() + 10
    while fuzz_app.engine.snapshot().num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = fuzz_app.engine.snapshot()
    assert snap.num_unfinished_requests == 0 and snap.num_blocks_used == 0
    assert fuzz_app.state.inflight == 0
