"""A real ``kvserve serve`` subprocess driven by the official ``openai`` client."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.server.conftest import API_KEY, MODEL_NAME

MESSAGES = [{"role": "user", "content": "w5 w6 w7 w8"}]


@pytest.fixture(scope="module")
def oai(main_server) -> OpenAI:
    return OpenAI(base_url=f"{main_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_models_lists_the_served_model(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_chat_non_streaming_usage_matches_tokenizer(oai, tokenizer):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                    temperature=0, logprobs=True,
                                    extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert r.usage.prompt_tokens == len(_chat_ids(tokenizer, MESSAGES))
    assert r.usage.completion_tokens == 6 == len(choice.logprobs.content)
    # Words only (the vocabulary's specials are skipped when decoding): re-tokenizing agrees.
    words = choice.message.content.split()
    if all(w.startswith("w") for w in words) and len(words) == 6:
        assert len(tokenizer.encode(choice.message.content)) == r.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(oai):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True,
                                              stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == full.choices[0].message.content
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completions_streaming_and_not(oai, tokenizer):
    prompt = "w10 w11 w12"
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=7, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw)
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 7
    assert full.choices[0].finish_reason == "length"
    chunks = list(oai.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    echoed = oai.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == prompt + full.choices[0].text


def test_stop_sequences(oai):
    base = oai.completions.create(model=MODEL_NAME, prompt="w20 w21", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 6, text
    stop = words[4]
    expected = text[: text.find(stop)]
    for stops in (stop, [stop, "never-appears"]):
        r = oai.completions.create(model=MODEL_NAME, prompt="w20 w21", max_tokens=12,
                                   temperature=0, stop=stops, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == expected
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    ctext = chat.choices[0].message.content
    cstop = ctext.split()[3]
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12,
                                         temperature=0, stop=[cstop], stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        ctext[: ctext.find(cstop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_returns_two_indexed_choices(oai):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 16
    c = oai.completions.create(model=MODEL_NAME, prompt=["w1 w2", "w3 w4"], n=2, max_tokens=3,
                               temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    assert c.usage.completion_tokens == 12


def test_seed_reproducibility(oai):
    def sample(seed: int) -> str:
        r = oai.completions.create(model=MODEL_NAME, prompt="w30 w31 w32", max_tokens=10,
                                   temperature=1.0, seed=seed,
                                   extra_body={"ignore_eos": True})
        return r.choices[0].text

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c


def test_logprobs_shapes(oai):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for tok in content:
        assert len(tok.top_logprobs) == 3
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert tok.logprob <= lps[0] + 1e-6  # greedy: the sampled token is the top one
        assert abs(tok.logprob - lps[0]) < 1e-4
        assert bytes(tok.bytes).decode() == tok.token
    c = oai.completions.create(model=MODEL_NAME, prompt="w1 w2", max_tokens=4, temperature=0,
                               logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    e = oai.completions.create(model=MODEL_NAME, prompt="w1 w2", max_tokens=4, temperature=0,
                               logprobs=1, echo=True, extra_body={"ignore_eos": True})
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == 2 + 4 and elp.token_logprobs[0] is None
    assert elp.tokens[:2] == ["w1", "w2"]
