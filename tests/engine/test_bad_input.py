"""Bad input raises ValueError naming the parameter, and the engine keeps serving."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", OK, "prompt"),
        ({"prompt_token_ids": []}, OK, "prompt"),
        ({"prompt_token_ids": [1, 99999]}, OK, "vocabulary"),
        ({"prompt_token_ids": list(range(1, 400)) * 2}, OK, "max_model_len"),
        ({"nothing": 1}, OK, "prompt"),
        (3.5, OK, "prompt"),
    ],
)
def test_bad_prompt(tiny_llama, make_llm, prompt, params, match):
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], OK)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": 100}, "logprobs"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_bad_engine_args(tiny_llama):
    from kvserve import LLM

    for kw, name in [({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
                     ({"block_size": 0}, "block_size"),
                     ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
                     ({"kv_integrity": "maybe"}, "kv_integrity"),
                     ({"max_num_seqs": 0}, "max_num_seqs"),
                     ({"dtype": "int8"}, "dtype"),
                     ({"max_model_len": 10**6}, "max_model_len")]:
        with pytest.raises(ValueError, match=name):
            LLM(tiny_llama, progress=False, **kw)


def test_engine_args_settled_before_any_worker(tiny_llama, monkeypatch):
    """``settle`` decides max_model_len, the KV mode and the model's shape from config.json:
    a bad value fails before any worker loads a weight, and a good one is settled in full."""
    from kvserve import LLM
    from kvserve.engine import worker
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.builder import settle

    def no_worker(*a, **k):
        raise AssertionError("a worker started before the arguments were settled")

    monkeypatch.setattr(worker.Worker, "__init__", no_worker)
    with pytest.raises(ValueError, match="max_model_len 1000000 exceeds"):
        LLM(tiny_llama, progress=False, max_model_len=10**6)
    s = settle(EngineArgs(model=tiny_llama, max_model_len=64, kv_cache_dtype="int8"))
    assert s.model.max_model_len == 64 and s.context_len >= 64
    assert s.scheduler.max_model_len == 64 and s.kv_mode.rotate
    assert s.rotation_seed == s.cache.kv_rotation_seed
    assert s.args.attention_backend != "auto" and s.model.architecture == "LlamaForCausalLM"
    full = settle(EngineArgs(model=tiny_llama))
    assert full.model.max_model_len == full.context_len and full.rotation_seed is None


def test_duplicate_request_id_rejected(tiny_llama, make_llm):
    eng = make_llm(tiny_llama).engine
    eng.add_request("a", {"prompt_token_ids": [1, 2]}, OK)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("a", {"prompt_token_ids": [1, 2]}, OK)
    while eng.has_unfinished_requests():
        eng.step()


def test_abort_frees_blocks(tiny_llama, make_llm):
    eng = make_llm(tiny_llama).engine
    free0 = eng.num_free_blocks()
    eng.add_request("a", {"prompt_token_ids": list(range(1, 60))}, OK)
    eng.step()
    assert eng.num_free_blocks() < free0
    eng.abort_request("a")
    assert eng.num_free_blocks() == free0
    assert not eng.has_unfinished_requests()
