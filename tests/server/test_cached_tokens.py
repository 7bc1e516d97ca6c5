"""``usage.prompt_tokens_details.cached_tokens`` (the engine's RequestOutput.num_cached_tokens)
through the official ``openai`` client: 0 on a prompt's first request, the prompt's whole
blocks on a repeat (the last prompt token is always computed), in chat and completions, in
non-streamed answers and a stream's usage chunk, summed over a batch of prompts."""

from __future__ import annotations

import random

import pytest
from openai import OpenAI

from kvserve.engine.arg_utils import EngineArgs
from tests.server.conftest import API_KEY, MODEL_NAME

BLOCK = EngineArgs().block_size  # the server runs the default block size


@pytest.fixture(scope="module")
def oai(main_server) -> OpenAI:
    return OpenAI(base_url=f"{main_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _words(seed: int, n: int) -> str:
    # a prompt no other test sends (the shared server's prefix cache outlives tests)
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10, 500)}" for _ in range(n))


def _whole_blocks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_completions_cached_tokens(oai):
    kw = dict(model=MODEL_NAME, prompt=_words(4201, 45), max_tokens=3, temperature=0)
    first = oai.completions.create(**kw)
    assert first.usage.prompt_tokens > 2 * BLOCK
    assert _cached(first.usage) == 0
    again = oai.completions.create(**kw)
    assert _cached(again.usage) == _whole_blocks(again.usage.prompt_tokens) > 0
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True},
                                         **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert _cached(chunks[-1].usage) == _cached(again.usage)
    # a batch: the prompts' counts add up (one seen, one new)
    batch = oai.completions.create(**{**kw, "prompt": [kw["prompt"], _words(4202, 40)]})
    assert _cached(batch.usage) == _cached(again.usage)


def test_chat_cached_tokens(oai):
    messages = [{"role": "system", "content": _words(4203, 40)},
                {"role": "user", "content": "w1 w2"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_completion_tokens=3, temperature=0)
    first = oai.chat.completions.create(**kw)
    assert _cached(first.usage) == 0
    chunks = list(oai.chat.completions.create(stream=True,
                                              stream_options={"include_usage": True}, **kw))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == first.usage.prompt_tokens
    assert _cached(usage) == _whole_blocks(usage.prompt_tokens) > 0
    # another user turn after the same system prompt: the shared blocks are hits
    other = oai.chat.completions.create(**{**kw, "messages": [
        messages[0], {"role": "user", "content": "w3 w4 w5 w6"}]})
    assert 0 < _cached(other.usage) <= _cached(usage)
