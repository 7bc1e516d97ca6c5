"""Structured outputs in the engine (llguidance): outputs match their grammar for many seeds and
temperatures, the mask changes nothing when the grammar allows every token, the grammar state
survives preemption and prefix hits, dead ends finish with their own reason, and bad grammars
are refused before the engine changes."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from kvserve.sampling_params import SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as SO
from kvserve.structured_output.compiler import GrammarCompiler
from tests.server.conftest import demo_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "code", "address", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["The record of the user is", "JSON:", "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    from kvserve import LLM

    engine = LLM(demo_model(), kv_cache_memory="16MiB", progress=False)
    yield engine
    engine.engine.debug.check_no_leaks()


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def _tokens(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_json_schema_outputs_validate(llm, temperature):
    so = SO(json=SCHEMA)
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=400, n=2,
                             structured_outputs=so) for s in range(4)]
    outs = llm.generate(PROMPTS[:1] * 4, params)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_choice_regex_and_grammars(llm):
    cases = [
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (SO(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (SO(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
        (SO(grammar='start: "ab" NUM\nNUM: /[0-9]{1,4}/'), lambda t: t.startswith("ab")),
        (SO(grammar='root ::= "x" [0-9] [0-9]'), lambda t: len(t) == 3 and t[0] == "x"),
    ]
    for so, ok in cases:
        for seed in range(2):
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=100,
                                structured_outputs=so)
            c = llm.generate(PROMPTS[1], sp)[0].outputs[0]
            if so.json_object and c.finish_reason == "length":  # unbounded strings: a prefix
                assert c.text.startswith("{"), c.text
                continue
            assert c.finish_reason == "stop" and ok(c.text), (so.kind, c.text)


def test_allow_everything_grammar_equals_unconstrained(llm):
    vocab = llm.engine.model_config.vocab_size
    everything = SO(grammar=f"start: <[0-{vocab - 1}]>*")
    g = llm.engine.grammars.matcher(everything)
    words = np.zeros(llm.engine.grammars.num_words, np.int32)
    assert g.fill_bitmask(words)
    assert np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].all()
    for base in (SamplingParams(temperature=0.0, max_tokens=24),
                 SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24)):
        free = llm.generate(PROMPTS, base)
        # constrained and free rows in one batch, as in serving
        mixed = llm.generate(PROMPTS * 2, [base.clone(structured_outputs=everything)] * 3
                             + [base] * 3)
        assert _tokens(mixed) == _tokens(free) * 2


@pytest.mark.slow
def test_grammar_survives_preemption_and_prefix_hits(make_llm):
    so = SO(json=SCHEMA)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=120, n=2, structured_outputs=so)
    calm = make_llm(demo_model(), enable_prefix_caching=False)
    want = _tokens(calm.generate(PROMPTS, sp))
    # 12 blocks of 16 tokens cannot hold six ~100-token sequences at once: preemption
    tight = make_llm(demo_model(), num_blocks=12, enable_prefix_caching=False)
    got = tight.generate(PROMPTS, sp)
    assert tight.engine.scheduler.num_preemptions > 0
    assert _tokens(got) == want
    for o in got:
        for c in o.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCHEMA)
    long = [p + " and the record of the user follows in JSON, the name first." * 4
            for p in PROMPTS[:2]]  # several full blocks to hit
    sp1 = sp.clone(n=1)
    want = _tokens(calm.generate(long, sp1))
    cached = make_llm(demo_model())
    first = cached.generate(long, sp1)
    again = cached.generate(long, sp1)  # prefix-cache hits on the same prompts
    assert cached.engine.kv_manager.hit_rate > 0
    assert _tokens(first) == _tokens(again) == want


def test_dead_end_finishes_with_its_reason(llm):
    # "yes" completes the grammar, so only EOS may follow; min_tokens bans EOS: no token left.
    sp = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5,
                        structured_outputs=SO(choice=["yes"]))
    c = llm.generate(PROMPTS[0], sp)[0].outputs[0]
    assert c.finish_reason == "grammar_dead_end"
    assert c.text == "yes"


def test_compiled_grammars_are_cached(llm):
    comp = llm.engine.grammars
    so = SO(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    comp.compile(so)
    hits = comp.hits
    comp.compile(SO(json=json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}})))
    assert comp.hits == hits + 1


@pytest.mark.parametrize("so, match", [
    (lambda: SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
    (lambda: SO(regex="(unclosed"), "regex"),
    (lambda: SO(grammar="start: missing_rule"), "grammar"),
    (lambda: SO(grammar="root ::= ("), "grammar"),
])
def test_bad_grammars_are_refused(llm, so, match):
    before = llm.engine.get_num_unfinished_requests()
    with pytest.raises(ValueError, match=match):
        llm.generate("x", SamplingParams(structured_outputs=so()))
    assert llm.engine.get_num_unfinished_requests() == before


@pytest.mark.parametrize("kw, match", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "choice"), ({"choice": ["a", ""]}, "choice"),
    ({"json": "{not json"}, "json"), ({"json": [1]}, "json"),
])
def test_structured_outputs_params_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        SO(**kw)


def test_compiler_on_a_plain_tokenizer():
    from kvserve.model.loader import load_tokenizer

    tok = load_tokenizer(demo_model())
    comp = GrammarCompiler(tok, len(tok), (tok.eos_token_id,))
    m = comp.matcher(SO(choice=["ab"]))
    ids = tok.encode("ab", add_special_tokens=False)
    assert all(m.accept(t) for t in ids)
    assert m.accept(tok.eos_token_id) and m.is_terminated
