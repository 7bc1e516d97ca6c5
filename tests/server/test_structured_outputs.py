"""Structured outputs and tool calling through a real ``kvserve serve`` with the openai client
(the demo model: word salad, so every structure below comes from the grammar alone)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, ServerProcess, demo_model

USER = [{"role": "user", "content": "Describe the user as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "role", "code", "address", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(demo_model(), "--chat-template", "hermes_tools",
                        "--tool-call-parser", "hermes")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _json_schema(schema: dict, name: str = "record") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_chat_json_schema_outputs_validate(oai, temperature):
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=300,
                                        temperature=temperature, seed=seed, n=2,
                                        response_format=_json_schema(SCHEMA))
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_json_schema_and_json_object(oai):
    for seed in range(3):
        r = oai.completions.create(model=MODEL_NAME, prompt="Record:", max_tokens=300,
                                   seed=seed, extra_body={"response_format":
                                                          _json_schema(SCHEMA)})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = oai.completions.create(model=MODEL_NAME, prompt="Record:", max_tokens=40, seed=0,
                               extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b"]] = Field(max_length=3)


def test_parse_returns_the_pydantic_object(oai):
    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    for seed in range(3):
        r = parse(model=MODEL_NAME, messages=USER, max_tokens=200, seed=seed,
                  response_format=Person)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address)
        assert person == Person.model_validate_json(r.choices[0].message.content)


def test_structured_outputs_extras(oai):
    cases = [({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
             ({"grammar": 'root ::= "v" [0-9] "." [0-9]'}, lambda t: len(t) == 4),
             ({"json": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                        "required": ["k"], "additionalProperties": False}},
              lambda t: json.loads(t)["k"] in (1, 2))]
    for extra, ok in cases:
        for seed in range(2):
            r = oai.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=60,
                                       seed=seed, extra_body={"structured_outputs": extra})
            assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].text), extra
            c = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60,
                                            seed=seed,
                                            extra_body={"structured_outputs": extra})
            assert ok(c.choices[0].message.content), extra


def test_allow_everything_grammar_equals_unconstrained(oai):
    everything = {"grammar": "start: <[0-4095]>*"}  # the demo model's whole vocabulary
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        free = oai.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=24,
                                      **kw)
        same = oai.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=24,
                                      extra_body={"structured_outputs": everything}, **kw)
        assert same.choices[0].text == free.choices[0].text


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _check_calls(calls: list[tuple[str, dict]], names: set[str]) -> None:
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, PARAMS[name])


def test_named_and_required_tool_calls(oai):
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=200, seed=seed, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        _check_calls(_calls(choice.message), {"get_time"})
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        one = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=300,
                                          seed=seed, temperature=1.0, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False)
        assert one.choices[0].finish_reason == "tool_calls"
        assert len(one.choices[0].message.tool_calls) == 1
        _check_calls(_calls(one.choices[0].message), {"get_weather", "get_time"})
        # parallel: calls until the model stops (word salad may not: then cut by max_tokens,
        # and the complete calls before the cut are returned)
        r = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=120,
                                        seed=seed, temperature=1.0, tools=TOOLS,
                                        tool_choice="required")
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        _check_calls(_calls(r.choices[0].message), {"get_weather", "get_time"})


def _streamed(oai: OpenAI, **kw) -> tuple[str, list[tuple[str, dict]], str | None]:
    """A streamed answer as the openai client's deltas assemble it: content, calls, reason."""
    content, calls, reason = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        reason = ch.finish_reason or reason
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], \
        reason


def test_streamed_tool_calls_assemble_to_the_same_calls(oai):
    for seed, parallel in [(0, False), (1, False), (2, True), (3, True)]:
        kw = dict(model=MODEL_NAME, messages=USER, max_tokens=150, seed=seed, temperature=1.0,
                  tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        full = oai.chat.completions.create(**kw)
        _, streamed, reason = _streamed(oai, **kw)
        assert reason == full.choices[0].finish_reason
        assert reason == "tool_calls" or parallel
        assert streamed == _calls(full.choices[0].message)


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}},
                TOOLS[1]]  # get_weather strict, get_time not


def test_auto_with_a_strict_tool(oai):
    """auto + a strict tool: text with no call marker in it, or calls whose strict tool's
    arguments validate. (The demo model writes text; the grammar's calls are tested in
    test_tool_parsers.py.) Streamed answers assemble the same; response_format still wins."""
    for seed in range(4):
        kw = dict(model=MODEL_NAME, messages=USER, max_tokens=60, seed=seed, temperature=1.0,
                  tools=STRICT_TOOLS)
        for choice in oai.chat.completions.create(n=2, **kw).choices:
            msg = choice.message
            if msg.tool_calls:
                assert choice.finish_reason == "tool_calls"
                for name, args in _calls(msg):
                    assert name in PARAMS
                    if name == "get_weather":
                        jsonschema.validate(args, WEATHER)
            else:
                assert choice.finish_reason in ("stop", "length")
                assert msg.content and "<tool_call>" not in msg.content
        full = oai.chat.completions.create(**kw).choices[0]
        if not full.message.tool_calls:  # the same prompt without a grammar: the same text
            loose = oai.chat.completions.create(tool_choice="none", **kw).choices[0]
            assert loose.message.content == full.message.content
        content, calls, reason = _streamed(oai, **kw)
        assert (content, calls, reason) == (full.message.content or "",
                                            _calls(full.message) if full.message.tool_calls
                                            else [], full.finish_reason)
    r = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=300, seed=0,
                                    tools=STRICT_TOOLS, response_format=_json_schema(SCHEMA))
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_multi_turn_with_tool_results(oai):
    first = oai.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=200, seed=1, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}
          for c in msg.tool_calls),
    ]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=12,
                                    tools=TOOLS, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the results were rendered
    # without tools too, and with tool_choice none (tools rendered, no parsing)
    r = oai.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=8,
                                    tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_dead_end_finish_reason(oai):
    r = oai.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=10,
                               extra_body={"structured_outputs": {"choice": ["yes"]},
                                           "min_tokens": 5})
    assert r.choices[0].finish_reason == "grammar_dead_end"
    assert r.choices[0].text == "yes"


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD = [
    (CHAT, {"messages": [{"role": "tool"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id"),
    (CHAT, {"messages": USER, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": USER, "tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
        "tool_choice": "required"}, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True,
        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools"),
    (CHAT, {"messages": USER, "response_format": _json_schema(
        {"type": "object", "properties": {"a": {"type": "strnig"}}})},
     "response_format.json_schema.schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"},
            "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"grammar": "root ::= ("}},
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"json": "{nope"}},
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object"},
                   "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_without_a_parser_are_refused():
    from tests.server.conftest import InProcess

    srv = InProcess(demo_model(), {}, {})
    try:
        async def main():
            async with srv.client() as c:
                bad = await c.post(CHAT, json={"messages": USER, "tools": TOOLS})
                ok = await c.post(CHAT, json={"messages": USER, "tools": TOOLS,
                                              "tool_choice": "none", "max_tokens": 2})
                return bad, ok

        bad, ok = srv.run(main())
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
        assert ok.status_code == 200
    finally:
        srv.close()
