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
