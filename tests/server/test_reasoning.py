"""``--reasoning-parser``: ``<think>...</think>`` becomes ``reasoning_content`` (messages and
streamed deltas), ``chat_template_kwargs`` reach the template, and a structured output's
grammar applies only after the reasoning. The tiny reasoning model (``reasoning_model.py``)
reads, as ``</think>``, the third token its greedy answer writes, so the answer reasons for
two tokens and then answers."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.server.reasoning import ReasoningParser, ReasoningStream
from tests.server.conftest import MODEL_NAME, InProcess
from tests.server.reasoning_model import (
    DEEPSEEK_TEMPLATE,
    QWEN3_TEMPLATE,
    THINK_ID,
    reasoning_model,
)

USER = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """(deepseek-style model, qwen3-style model, greedy answer ids, the </think> id)."""
    from kvserve import LLM
    from kvserve.sampling_params import SamplingParams

    probe = reasoning_model(tiny_llama, str(tmp_path_factory.mktemp("probe")), 510,
                            DEEPSEEK_TEMPLATE)
    llm = LLM(probe, progress=False, kv_cache_memory="8MiB")
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    llm.engine.shutdown()
    end = next(t for t in out[2:] if t not in (*prompt, THINK_ID, 2, 510) and t not in out[:2])
    k = out.index(end)
    deepseek = reasoning_model(tiny_llama, str(tmp_path_factory.mktemp("ds")), end,
                               DEEPSEEK_TEMPLATE)
    qwen3 = reasoning_model(tiny_llama, str(tmp_path_factory.mktemp("qw")), end, QWEN3_TEMPLATE)
    return deepseek, qwen3, list(out), k


def _serve(model: str, parser: str | None) -> InProcess:
    kw = {"reasoning_parser": parser} if parser else {}
    return InProcess(model, kw, {})


async def _chat(srv: InProcess, **body) -> dict:
    async with srv.client() as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER,
                                                        "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()


async def _stream(srv: InProcess, **body) -> tuple[str, str, str]:
    reasoning, content, finish = "", "", None
    async with srv.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": USER, "temperature": 0, "stream": True,
            **body}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])["choices"][0]
            reasoning += d["delta"].get("reasoning_content") or ""
            content += d["delta"].get("content") or ""
            finish = d["finish_reason"] or finish
    return reasoning, content, finish


def test_deepseek_r1_splits_reasoning(models):
    deepseek, _, out, k = models
    srv = _serve(deepseek, "deepseek_r1")
    try:
        tok = srv.state.tokenizer
        want_r, want_c = tok.decode(out[:k]), tok.decode(out[k + 1:]).lstrip()
        m = srv.run(_chat(srv, max_tokens=12))["choices"][0]["message"]
        assert (m["reasoning_content"], m["content"]) == (want_r, want_c)
        assert want_r and want_c
        assert srv.run(_stream(srv, max_tokens=12)) == (want_r, want_c, "length")
        # cut inside the reasoning: all of it is reasoning
        m = srv.run(_chat(srv, max_tokens=k))["choices"][0]["message"]
        assert (m["reasoning_content"], m["content"]) == (tok.decode(out[:k]), "")
    finally:
        srv.close()
    plain = _serve(deepseek, None)  # without the parser: all of it is content
    try:
        m = plain.run(_chat(plain, max_tokens=12))["choices"][0]["message"]
        assert m["content"] == plain.state.tokenizer.decode(out)
        assert m.get("reasoning_content") is None
    finally:
        plain.close()


def test_grammar_applies_after_the_reasoning(models):
    deepseek, qwen3, out, k = models
    choice = {"structured_outputs": {"choice": [" w5 w6"]}, "max_tokens": 12}
    srv = _serve(deepseek, "deepseek_r1")
    try:
        tok = srv.state.tokenizer
        m = srv.run(_chat(srv, **choice))["choices"][0]
        assert m["message"]["reasoning_content"] == tok.decode(out[:k])  # unconstrained
        assert m["message"]["content"] == "w5 w6" and m["finish_reason"] == "stop"
        assert srv.run(_stream(srv, **choice)) == (tok.decode(out[:k]), "w5 w6", "stop")
    finally:
        srv.close()
    srv = _serve(qwen3, "qwen3")
    try:  # thinking off: the template closes the reasoning, the grammar starts at once
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        r = srv.run(_chat(srv, **choice, **off))
        assert r["choices"][0]["message"]["content"] == "w5 w6"
        assert r["choices"][0]["message"].get("reasoning_content") is None
        plain = srv.run(_chat(srv, **choice))  # the kwargs changed the prompt
        assert r["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 2
    finally:
        srv.close()


def test_chat_template_kwargs_refuses_template_call_arguments(models):
    srv = _serve(models[1], "qwen3")
    try:
        async def go():
            async with srv.client() as c:
                return await c.post("/v1/chat/completions", json={
                    "model": MODEL_NAME, "messages": USER,
                    "chat_template_kwargs": {"tokenize": False}})
        r = srv.run(go())
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        srv.close()


@pytest.mark.parametrize("state", ["reasoning", "undecided", "content"])
def test_stream_split_equals_whole_split(state):
    parser = ReasoningParser("qwen3", None, None)
    texts = ["<think>\nplan <b> a</thi</think>\n\n answer </think> x", "  <thin", "plain text",
             "<think>only reasoning </thin", "\n\n<think></think>{\"a\": 1}", "</think>x"]
    rng = random.Random(0)
    for text in texts:
        whole = parser.split(text, state)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1)))
            s = ReasoningStream(state)
            r = c = ""
            for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
                dr, dc = s.feed(text[a:b])
                r, c = r + dr, c + dc
            dr, dc = s.finish()
            assert (r + dr if s.reasoned else None, c + dc) == whole, (text, cuts)


def test_split_cases():
    ds, qw = ReasoningParser("deepseek_r1", 1, 2), ReasoningParser("qwen3", 1, 2)
    assert ds.split("a b</think>\n\nc", "reasoning") == ("a b", "c")
    assert ds.split("<think>a</think>c", "reasoning") == ("a", "c")
    assert ds.split("a b", "reasoning") == ("a b", "")
    assert qw.split("<think>a</think> c", "undecided") == ("a", "c")
    assert qw.split("c </think> d", "undecided") == (None, "c </think> d")
    assert qw.split("c", "content") == (None, "c")
    # tool calls are parsed out of the content only
    from kvserve.server.tool_parsers import get_parser
    reasoning, content = qw.split('<think><tool_call>{"name": "f", "arguments": {}}'
                                  '</tool_call></think>no call', "undecided")
    assert get_parser("hermes").extract(content) == ("no call", [])
    assert "<tool_call>" in reasoning
    # where the answer starts, read from the prompt's last tag
    assert ds.initial_state([5, 1]) == "reasoning" and ds.initial_state([5]) == "reasoning"
    assert qw.initial_state([5]) == "undecided" and qw.initial_state([1, 2, 5]) == "content"
    assert qw.grammar_state("undecided") == "undecided"
    assert ReasoningParser("qwen3", None, 2).grammar_state("undecided") is None


def test_reasoning_parser_flag_is_validated():
    from kvserve.server.settings import ServerSettings

    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerSettings(reasoning_parser="r2")


def test_openai_client_reads_reasoning_content(models):
    """The docs/server.md snippet, through the openai client."""
    from openai import AsyncOpenAI

    deepseek, _, out, k = models
    srv = _serve(deepseek, "deepseek_r1")
    try:
        tok = srv.state.tokenizer

        async def go():
            client = AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0,
                                 http_client=srv.client())
            r = await client.chat.completions.create(
                model=MODEL_NAME, messages=USER, max_tokens=12, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
            reasoning, content = "", ""
            async for chunk in await client.chat.completions.create(
                    model=MODEL_NAME, messages=USER, max_tokens=12, temperature=0,
                    stream=True):
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
            return r.choices[0].message, reasoning, content
        message, reasoning, content = srv.run(go())
        assert message.reasoning_content == reasoning == tok.decode(out[:k])
        assert message.content == content == tok.decode(out[k + 1:]).lstrip()
    finally:
        srv.close()


def test_grammar_gate_states(models):
    """The engine's gate: reasoning lets every token through; undecided allows <think> or the
    grammar's first token; the grammar starts after </think>."""
    import numpy as np

    from kvserve.model.loader import load_tokenizer
    from kvserve.sampling_params import StructuredOutputsParams
    from kvserve.structured_output.compiler import GrammarCompiler

    deepseek, _, _, k = models
    tok = load_tokenizer(deepseek)
    end = tok.convert_tokens_to_ids("</think>")
    compiler = GrammarCompiler(tok, 512, (2,))

    def allowed(m) -> set[int]:
        words = np.zeros(compiler.num_words, np.int32)
        m.fill_bitmask(words)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    def matcher(state):
        return compiler.matcher(StructuredOutputsParams(
            choice=[" w5 w6"], reasoning_state=state, reasoning_start_token_id=THINK_ID,
            reasoning_end_token_id=end))
    w5, w6 = tok.encode(" w5 w6", add_special_tokens=False)
    m = matcher(None)
    assert allowed(m) == {w5} and not m.reasoning
    m = matcher("undecided")
    assert allowed(m) == {w5, THINK_ID} and m.reasoning
    assert not m.accept(w6)  # not <think>: the grammar's first token, which it refuses
    m = matcher("undecided")
    assert m.accept(THINK_ID) and len(allowed(m)) == 512
    assert m.accept(w6) and m.accept(end) and not m.reasoning
    assert allowed(m) == {w5} and m.accept(w5) and m.accept(w6) and m.is_terminated


def test_responses_reasoning_item(models):
    """/v1/responses: the reasoning is a reasoning item before the message (whole and
    streamed), and its tokens are counted in output_tokens_details.reasoning_tokens."""
    from openai import AsyncOpenAI

    deepseek, _, out, k = models
    srv = _serve(deepseek, "deepseek_r1")
    try:
        tok = srv.state.tokenizer

        async def go():
            async with srv.client() as http:
                client = AsyncOpenAI(base_url="http://test/v1", api_key="none",
                                     max_retries=0, http_client=http)
                r = await client.responses.create(model=MODEL_NAME, input="w1 w2 w3",
                                                  max_output_tokens=12, temperature=0)
                kinds, reasoning = [], ""
                async with client.responses.stream(model=MODEL_NAME, input="w1 w2 w3",
                                                   max_output_tokens=12,
                                                   temperature=0) as stream:
                    async for event in stream:
                        kinds.append(event.type)
                        if event.type == "response.reasoning_text.delta":
                            reasoning += event.delta
                return r, kinds, reasoning, event.response
        r, kinds, reasoning, streamed = srv.run(go())
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == reasoning == tok.decode(out[:k])
        assert r.output_text == streamed.output_text == tok.decode(out[k + 1:]).lstrip()
        assert r.usage.output_tokens_details.reasoning_tokens == k + 1
        assert [o.type for o in streamed.output] == ["reasoning", "message"]
        assert kinds.index("response.reasoning_text.done") < \
            kinds.index("response.content_part.added")
    finally:
        srv.close()
