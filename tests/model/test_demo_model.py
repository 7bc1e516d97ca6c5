"""The shipped demo model through the engine: default model, clean deterministic text."""

from __future__ import annotations

import os

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import demo_model_path

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
    reason="demo model not present",
)

PROMPTS = ["The Python interpreter", "A list is", "To open a file"]


def _run() -> list[str]:
    llm = LLM("demo", kv_cache_memory="32MiB", progress=False)  # the built-in demo model
    assert llm.engine.model_config.path == demo_model_path()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=12))
    llm.engine.debug.check_no_leaks()
    return [o.outputs[0].text for o in outs]


def test_demo_model_generates_clean_deterministic_text():
    first = _run()
    for text in first:
        assert text.strip(), "empty generation"
        assert "\ufffd" not in text, "broken UTF-8 in the output"
        assert text.isprintable() or "\n" in text
    assert _run() == first


def test_demo_model_chat_template_works():
    llm = LLM("demo", kv_cache_memory="32MiB", progress=False)
    out = llm.chat([{"role": "user", "content": "What is a tuple?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert out[0].outputs[0].token_ids
    llm.engine.debug.check_no_leaks()
