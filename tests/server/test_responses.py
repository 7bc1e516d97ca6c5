"""``/v1/responses`` with the real openai client (in process): create, stream (the documented
event sequence), retrieve, delete, continuations that hit the prefix cache, tools and
``text.format`` through the chat endpoint's parsers and grammars, errors in OpenAI's shape,
and the bounded store."""

from __future__ import annotations

import json

import openai
import pytest
from openai import AsyncOpenAI

from kvserve.server.response_store import ResponseStore
from tests.server.conftest import MODEL_NAME, InProcess, demo_model

LONG = " ".join(f"w{i}" for i in range(1, 60))  # > 3 blocks of prompt


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    srv = InProcess(tiny_llama, {"responses_max_stored": 8}, {})
    yield srv
    srv.close()


def _run(srv: InProcess, fn):
    async def go():
        async with srv.client() as http:
            client = AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0,
                                 http_client=http)
            return await fn(client)
    return srv.run(go())


def test_create_retrieve_delete(tiny):
    async def fn(client):
        r = await client.responses.create(model=MODEL_NAME, input="w1 w2 w3",
                                          instructions="w9 w8", max_output_tokens=5,
                                          temperature=0)
        got = await client.responses.retrieve(r.id)
        deleted = await client.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(r.id)
        return r, got, deleted, missing.value
    r, got, deleted, missing = _run(tiny, fn)
    assert r.object == "response" and r.id.startswith("resp-")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text and r.instructions == "w9 w8"
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert got.model_dump() == r.model_dump()
    assert deleted is None or getattr(deleted, "deleted", True)
    assert missing.status_code == 404 and missing.body["code"] == "response_not_found"


def test_stream_events_and_final_response(tiny):
    async def fn(client):
        kinds, deltas = [], ""
        async with client.responses.stream(model=MODEL_NAME, input="w1 w2 w3",
                                           max_output_tokens=6, temperature=0) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas += event.delta
            # cut by max_output_tokens: response.incomplete (get_final_response() wants
            # response.completed, which test_text_format_json_schema_streamed gets)
            final = event.response
        plain = await client.responses.create(model=MODEL_NAME, input="w1 w2 w3",
                                              max_output_tokens=6, temperature=0)
        return kinds, deltas, final, await client.responses.retrieve(final.id), plain
    kinds, deltas, final, stored, plain = _run(tiny, fn)
    want = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done"]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [*want, "response.incomplete"]  # cut by max_output_tokens
    assert deltas == final.output_text == plain.output_text
    assert stored.output_text == final.output_text and stored.id == final.id
    assert final.usage.output_tokens == 6


def test_continuation_reuses_the_prefix_cache(tiny):
    async def fn(client):
        first = await client.responses.create(model=MODEL_NAME, input=LONG,
                                              max_output_tokens=4, temperature=0)
        second = await client.responses.create(model=MODEL_NAME, input="w7 w8",
                                               previous_response_id=first.id,
                                               max_output_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.create(model=MODEL_NAME, input="w1",
                                          previous_response_id="resp-nope")
        unstored = await client.responses.create(model=MODEL_NAME, input="w1", store=False,
                                                 max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        return first, second, unknown.value
    first, second, unknown = _run(tiny, fn)
    # the second prompt is the first turn (prompt + answer) followed by the new input
    assert second.usage.input_tokens >= first.usage.total_tokens + 2
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 16  # all but the last partial block
    assert second.previous_response_id == first.id
    assert unknown.status_code == 404 and unknown.body["param"] == "previous_response_id"


def test_input_items_and_errors(tiny):
    async def fn(client):
        r = await client.responses.create(model=MODEL_NAME, max_output_tokens=3, input=[
            {"role": "developer", "content": "w5"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "w1 w2"}]}])
        errors = []
        for bad in ([{"role": "user", "content": [{"type": "input_image",
                                                   "image_url": "x"}]}],
                    [{"type": "web_search_call"}], []):
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model=MODEL_NAME, input=bad)
            errors.append(e.value.body)
        with pytest.raises(openai.NotFoundError) as wrong_model:
            await client.responses.create(model="other", input="w1")
        return r, errors, wrong_model.value.body
    r, errors, wrong_model = _run(tiny, fn)
    assert r.usage.output_tokens == 3
    assert errors[0]["param"] == "input[0].content[0]"
    assert errors[0]["code"] == "unsupported_content_type"
    for body in errors:
        assert set(body) >= {"message", "type", "param", "code"}
        assert body["param"].startswith("input")
    assert wrong_model["code"] == "model_not_found"


def test_store_evicts_by_count_and_bytes():
    store = ResponseStore(max_items=3, max_bytes=10_000)
    for i in range(5):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # read: now the most recent
    store.put("r5", {"id": "r5"}, [])
    assert store.get("r3") is None and store.get("r2") is not None
    assert not store.put("big", {"id": "big", "x": "y" * 20_000}, [])
    small = ResponseStore(max_items=100, max_bytes=300)
    for i in range(10):
        small.put(f"r{i}", {"id": f"r{i}", "pad": "z" * 80}, [])
    assert small.nbytes <= 300 and 1 <= len(small) < 10 and small.get("r9") is not None
    assert small.delete("r9") and not small.delete("r9")


@pytest.fixture(scope="module")
def demo():
    srv = InProcess(demo_model(), {"chat_template": "hermes_tools",
                                   "tool_call_parser": "hermes"}, {})
    yield srv
    srv.close()


WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 12}},
                          "required": ["city"]}}


def test_function_tools_and_outputs(demo):
    async def fn(client):
        r = await client.responses.create(
            model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],
            tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
            temperature=0.7, extra_body={"seed": 1})
        call = r.output[-1]
        follow = await client.responses.create(
            model=MODEL_NAME, previous_response_id=r.id, max_output_tokens=8,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": json.dumps({"temp": 21})}])
        events = []
        async with client.responses.stream(
                model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],
                tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                temperature=0.7, extra_body={"seed": 1}) as stream:
            async for event in stream:
                events.append(event.type)
            final = await stream.get_final_response()
        return r, follow, events, final
    r, follow, events, final = _run(demo, fn)
    call = r.output[-1]
    assert r.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    assert call.call_id.startswith("call_")
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert "response.function_call_arguments.done" in events
    assert events[-1] == "response.completed"
    assert [o.type for o in final.output] == [o.type for o in r.output]
    assert final.output[-1].arguments == call.arguments  # same seed, same answer


def test_text_format_json_schema(demo):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}},
              "required": ["name", "age"]}

    async def fn(client):
        return await client.responses.create(
            model=MODEL_NAME, input="A person as JSON.", max_output_tokens=80,
            temperature=0.9, extra_body={"seed": 3},
            text={"format": {"type": "json_schema", "name": "p", "schema": schema,
                             "strict": True}})
    r = _run(demo, fn)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert set(json.loads(r.output_text)) == {"name", "age"}  # strict: no other key


def test_text_format_json_schema_streamed(demo):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"]}

    async def fn(client):
        kinds = []
        async with client.responses.stream(
                model=MODEL_NAME, input="A city as JSON.", max_output_tokens=60,
                temperature=0.9, extra_body={"seed": 4}, text={"format": {
                    "type": "json_schema", "name": "c", "schema": schema,
                    "strict": True}}) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_response()
        return kinds, final, await client.responses.retrieve(final.id)
    kinds, final, stored = _run(demo, fn)
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == ["response.created", "response.in_progress",
                        "response.output_item.added", "response.content_part.added",
                        "response.output_text.delta", "response.output_text.done",
                        "response.content_part.done", "response.output_item.done",
                        "response.completed"]
    assert set(json.loads(final.output_text)) == {"city"}
    assert stored.output_text == final.output_text and stored.status == "completed"
