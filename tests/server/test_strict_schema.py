"""``strict: true`` closes every object of a schema (``strict_schema``); without it JSON Schema's
default (extra keys allowed) stands. Checked on the grammar itself (llguidance accepts or
refuses an instance with an extra key) and end to end with pydantic models' schemas, whose
objects leave ``additionalProperties`` unset, on the demo model (word salad: every key comes
from the grammar alone)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from kvserve.model.loader import load_tokenizer
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler
from kvserve.structured_output.schema import strict_schema
from tests.server.conftest import MODEL_NAME, ServerProcess, demo_model


class Address(BaseModel):
    street: str = Field(max_length=16)
    city: str = Field(max_length=12)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: Address
    nicknames: list[str] = Field(max_length=2)


def _declared(schema: dict, node: dict) -> set[str]:
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return set(node.get("properties", {}))


def test_strict_schema_closes_every_object():
    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)  # pydantic leaves it unset
    closed = strict_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert schema["$defs"]["Address"].get("additionalProperties") is None  # not mutated
    loose = {"type": "object", "additionalProperties": True, "unevaluatedProperties": True,
             "properties": {"tags": {"type": "array", "items": {
                 "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"type": "null"}]}},
                 "map": {"type": "object", "additionalProperties": {"type": "string"}}}}
    out = strict_schema(loose)
    assert out["additionalProperties"] is False and "unevaluatedProperties" not in out
    assert out["properties"]["tags"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["anyOf"][1] == {"type": "null"}
    assert out["properties"]["map"]["additionalProperties"] is False
    assert strict_schema({"type": "string"}) == {"type": "string"}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = load_tokenizer(demo_model())
    return GrammarCompiler(tok, len(tok), (tok.eos_token_id,))


def _accepts(compiler: GrammarCompiler, schema: dict, text: str) -> bool:
    m = compiler.matcher(StructuredOutputsParams(json=schema))
    ids = compiler._hf_tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept(t) for t in ids) and m._m.is_accepting()


def test_grammar_refuses_undeclared_keys_only_when_strict(compiler):
    schema = Person.model_json_schema()
    ok = {"name": "Ann", "age": 30, "address": {"street": "Main", "city": "Oslo"},
          "nicknames": []}
    nested_extra = {**ok, "address": {**ok["address"], "en_US": "x"}}
    top_extra = {**ok, "description": "x"}
    for instance, extra in ((ok, False), (nested_extra, True), (top_extra, True)):
        text = json.dumps(instance)
        assert _accepts(compiler, schema, text)  # JSON Schema's default: extra keys allowed
        assert _accepts(compiler, strict_schema(schema), text) is not extra


@pytest.fixture(scope="module")
def oai():
    srv = ServerProcess(demo_model())
    try:
        srv.wait_healthy()
        yield OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        srv.stop()


def test_strict_pydantic_schema_holds_at_high_temperature(oai):
    schema = Person.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema,
                                                  "strict": True}}
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format=fmt, temperature=0.9, seed=1, n=6, max_tokens=400)
    # a random string value may run past max_tokens (a cut answer is tested below); the
    # finished ones must hold
    finished = [c for c in r.choices if c.finish_reason != "length"]
    assert len(finished) >= 4, r.choices
    for choice in finished:
        assert choice.finish_reason == "stop", choice
        data = json.loads(choice.message.content)
        Person.model_validate(data)
        assert set(data) <= _declared(schema, schema)
        assert set(data["address"]) <= _declared(schema, schema["properties"]["address"])
    # the openai client's parse() sends strict: true with the pydantic schema as well
    parsed = oai.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format=Person, temperature=0.9, seed=2, max_tokens=400)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_strict_cut_by_max_tokens_is_length(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "strict": True,
                                                  "schema": Person.model_json_schema()}}
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format=fmt, temperature=0.9, seed=1, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
