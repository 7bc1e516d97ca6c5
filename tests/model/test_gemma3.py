"""Gemma 3 (text) against transformers' fp32 Gemma3ForCausalLM on a random tiny folder whose
local layers have a window of 8 (prompts up to 40 tokens), then the engine features that touch
windows: chunked prefill across the window boundary, prefix-cache hits, preemption, FP8 KV."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.model.gemma3 import Gemma3ForCausalLM
from tests.model.parity import assert_greedy_equal, assert_logits_close

WINDOW = 8
GEMMA3 = dict(
    head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
    num_hidden_layers=4, max_position_embeddings=256,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention"],
    # local and global layers rotate differently (and the global one is scaled)
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                        "factor": 2.0}},
)
PROMPTS = [
    list(range(1, 41)),  # 40 tokens: 5 windows
    [1, 17, 33, 101, 5],  # inside one window
    [1] + [(13 * j) % 500 + 3 for j in range(22)],
    [1, 9],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3")), "gemma3", **GEMMA3)


@pytest.fixture(scope="module")
def hf_gemma3(tiny_gemma3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def _p(ids):
    return {"prompt_token_ids": ids}


def test_spec_has_the_local_layers_windows(hf_gemma3):
    spec = Gemma3ForCausalLM.spec_for(hf_gemma3.config)
    assert spec.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
    assert spec.scale == pytest.approx(24 ** -0.5)
    assert spec.context_len == 256  # the windows do not bound the context


def test_logits_and_greedy_match_transformers(tiny_gemma3, hf_gemma3, make_llm):
    llm = make_llm(tiny_gemma3, dtype="float32", block_size=4)
    assert_logits_close(llm, hf_gemma3, PROMPTS[:3], atol=2e-3, rtol=1e-3)
    assert_greedy_equal(llm, hf_gemma3, PROMPTS, max_tokens=16)


def test_window_matters(tiny_gemma3, hf_gemma3, make_llm):
    """transformers with full attention in every layer gives other logits past the window."""
    llm = make_llm(tiny_gemma3, dtype="float32")
    ours = llm.engine.prompt_logits(PROMPTS[0])
    from transformers import Gemma3ForCausalLM as HF

    cfg = hf_gemma3.config.to_dict()
    full = hf_gemma3.config.__class__(**{**cfg, "sliding_window": 64})
    hf_full = HF(full).eval()
    hf_full.load_state_dict(hf_gemma3.state_dict())
    with torch.no_grad():
        ref = hf_full(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(ours[:WINDOW], ref[:WINDOW], atol=2e-3, rtol=1e-3)
    assert not torch.allclose(ours[WINDOW:], ref[WINDOW:], atol=1e-2)


@pytest.fixture(scope="module")
def plain(tiny_gemma3):
    from kvserve import LLM

    llm = LLM(tiny_gemma3, dtype="float32", progress=False, kv_cache_memory="8MiB",
              enable_prefix_caching=False)
    return _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY))


@pytest.mark.slow  # engine runs compared pairwise (as tests/engine/test_equivalence.py)
@pytest.mark.parametrize("budget", [3, 8, 13])
def test_chunked_prefill_across_the_window_equals_unchunked(tiny_gemma3, make_llm, plain,
                                                            budget):
    llm = make_llm(tiny_gemma3, dtype="float32", max_num_batched_tokens=budget,
                   enable_prefix_caching=False, block_size=4)
    assert _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY)) == plain


@pytest.mark.slow  # engine runs compared pairwise (as tests/engine/test_equivalence.py)
def test_prefix_hit_with_windows_equals_cold(tiny_gemma3, make_llm, plain):
    llm = make_llm(tiny_gemma3, dtype="float32", block_size=4)
    llm.generate([_p(PROMPTS[0][:33] + [7, 7])], GREEDY)  # caches 32 tokens: 4 windows
    out = llm.generate([_p(PROMPTS[0])], GREEDY)[0]
    assert out.num_cached_tokens >= 32
    assert out.outputs[0].token_ids == plain[0]


@pytest.mark.slow  # engine runs compared pairwise (as tests/engine/test_equivalence.py)
def test_preemption_with_windows_equals_no_preemption(tiny_gemma3, make_llm, plain):
    llm = make_llm(tiny_gemma3, dtype="float32", block_size=4, num_blocks=18,
                   enable_prefix_caching=False)
    assert _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY)) == plain
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow  # engine runs compared pairwise (as tests/engine/test_equivalence.py)
@pytest.mark.parametrize("kv", ["fp8", "int8_plain"])
def test_8bit_kv_with_windows(tiny_gemma3, hf_gemma3, make_llm, kv):
    """8-bit KV: logits close to transformers' fp32 ones, and chunking / a prefix hit change
    nothing (a row's result does not depend on how its sequence was chunked)."""
    llm = make_llm(tiny_gemma3, dtype="float32", kv_cache_dtype=kv, block_size=4,
                   enable_prefix_caching=False)
    ours = llm.engine.prompt_logits(PROMPTS[0])
    with torch.no_grad():
        ref = hf_gemma3(torch.tensor([PROMPTS[0]])).logits[0]
    assert (ours - ref).abs().max() < 0.3  # e4m3 rounds K / V to 3 mantissa bits
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    base = _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY))
    chunked = make_llm(tiny_gemma3, dtype="float32", kv_cache_dtype=kv, block_size=4,
                       max_num_batched_tokens=5)
    chunked.generate([_p(PROMPTS[0][:30])], GREEDY)  # and a prefix hit for prompt 0
    assert _toks(chunked.generate([_p(p) for p in PROMPTS], GREEDY)) == base


@pytest.mark.slow  # engines recorded and replayed against eager ones
def test_decode_graph_records_and_equals_eager(tmp_path, make_llm):
    """bf16 weights on CPU: the Gemma 3 decode step (q / k norms, two ropes, GeGLU, the
    embedding scale, windowed attention) is recorded as C calls and replayed; its tokens and
    logprobs equal the eager forward's exactly."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path / "g3bf16"), "gemma3", save_dtype=torch.bfloat16,
                           **GEMMA3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    eager = make_llm(path, enforce_eager=True, block_size=4)
    fast = make_llm(path, block_size=4)
    g = fast.engine.runner.graphs
    assert g is not None and g.refused is None and len(g.tape) > 0
    assert g.tape.names.count("kvs_gelu_tanh_mul") == 4
    assert g.tape.names.count("kvs_head_rms_norm") == 8
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in eager.generate([_p(p) for p in PROMPTS], params)]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
           for o in fast.generate([_p(p) for p in PROMPTS], params)]
    assert got == want
    assert g.runs > 0


@pytest.mark.slow  # engine runs compared pairwise
def test_integrity_and_host_tier_with_windows(tiny_gemma3, make_llm, plain):
    """Paranoid integrity (every read block verified) and a host-memory KV tier under a pool
    too small to keep the prompts: same tokens as the plain engine."""
    llm = make_llm(tiny_gemma3, dtype="float32", block_size=4, num_blocks=24,
                   kv_integrity="paranoid", kv_offload_memory=0.01)
    first = _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY))
    again = _toks(llm.generate([_p(p) for p in PROMPTS], GREEDY))  # hits: pool or tier
    assert first == plain and again == plain
