"""The 8-bit KV modes (int8 rotated / plain, fp8 rotated) through the engine, against a BF16 KV
cache of the same fp32 model: teacher-forced agreement and KL on HF-reference tiny models, the
fingerprint (prefix-cache salt) per mode and rotation seed, and the modes' user errors.

Agreement thresholds are those of the FP8 latent-cache test (tests/model/test_moe_mla.py): the
random tiny models are nearly flat, so teacher-forced top-1 >= 0.8 overall and >= 0.95 where
BF16 is decisive (top-2 margin > 0.1 nats), mean KL < 0.02.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from tests.model.parity import teacher_forced_stats

# slow: every 8-bit KV mode through engines on HF-reference models
pytestmark = pytest.mark.slow

MODES = ["int8", "int8_plain", "fp8_rot", "fp8_e5m2_rot"]
ARCHS = {"llama": ("llama", {}), "qwen3_hd32": ("qwen3", dict(head_dim=32)),
         "llama_hd24": ("llama", dict(head_dim=24))}  # 24: non-power-of-two rotation
PROMPTS = [[1, 17, 33, 101, 5] + list(range(200, 230)), [1, 9, 44], list(range(1, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def bf16_refs(model_factory):
    """Per arch: (path, BF16-KV engine, its greedy tokens) built once."""
    from kvserve import LLM

    refs = {}
    for name, (arch, kw) in ARCHS.items():
        path = model_factory(arch, **kw)
        llm = LLM(path, dtype="float32", kv_cache_dtype="bf16", block_size=16, progress=False,
                  kv_cache_memory="8MiB")
        refs[name] = (path, llm, _greedy(llm, PROMPTS))
    return refs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ARCHS))
def test_mode_agrees_with_bf16_kv(name, mode, bf16_refs, make_llm):
    path, bf16, ref_tokens = bf16_refs[name]
    llm = make_llm(path, dtype="float32", kv_cache_dtype=mode, block_size=16)
    kv = llm.engine.kv_cache
    assert kv.has_scales and (kv.rotation is not None) == (mode != "int8_plain")
    _greedy(llm, PROMPTS)  # decode path through the mode (C kernel, batched)
    mean_kl, hits, n, dec_hits, dec_n = teacher_forced_stats(bf16, llm, PROMPTS, ref_tokens)
    print(f"\n{name} {mode} vs bf16 KV: KL {mean_kl:.2e}, top-1 {hits / n:.3f}, "
          f"decisive {dec_hits}/{dec_n}")
    assert mean_kl < 0.02
    assert hits / n >= 0.8
    assert dec_n == 0 or dec_hits / dec_n >= 0.95


def test_fingerprint_binds_mode_and_rotation_seed(tiny_llama, make_llm):
    """Prefix-cache salt / integrity identity differ across modes and rotation seeds (a block
    written under one can never serve another), and are stable for the same configuration."""
    fps = {}
    for mode, seed in [("int8", 0), ("int8", 1), ("int8_plain", 0), ("fp8", 0),
                       ("fp8_rot", 0), ("bf16", 0)]:
        llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=mode, kv_rotation_seed=seed)
        fps[(mode, seed)] = llm.engine.fingerprint
        assert llm.engine.kv_mode == {"fp8": "fp8_e4m3_plain", "fp8_rot": "fp8_e4m3_rot",
                                      "int8": "int8_rot"}.get(mode, mode)
    assert len(set(fps.values())) == len(fps)
    again = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="int8", kv_rotation_seed=1)
    assert again.engine.fingerprint == fps[("int8", 1)]


def test_rotated_output_independent_of_seed_up_to_quantization(tiny_llama, make_llm):
    """Two rotation seeds store different bytes but compute nearly the same logits."""
    a = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="int8", kv_rotation_seed=0)
    b = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="int8", kv_rotation_seed=7)
    la, lb = (x.engine.prompt_logits(PROMPTS[0]) for x in (a, b))
    assert not torch.equal(la, lb)
    torch.testing.assert_close(la, lb, atol=0.05, rtol=0)



@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption_equal_plain_run(tiny_llama, make_llm, mode):
    """A rotated 8-bit cache written in prefill chunks of 7 / 33 tokens, or rebuilt after
    preemption (12 blocks of 16 cannot hold all six sequences), gives the tokens of a run
    with neither: quantization is per row, the kernel's rows do not depend on chunking."""
    prompts = [[1] + [(7 * i + j) % 500 + 3 for j in range(n)] for i, n in
               enumerate([5, 40, 17, 3, 60, 33])]
    kw = dict(dtype="float32", kv_cache_dtype=mode, enable_prefix_caching=False)
    want = _greedy(make_llm(tiny_llama, **kw), prompts)
    for budget in (7, 33):
        got = _greedy(make_llm(tiny_llama, max_num_batched_tokens=budget, **kw), prompts)
        assert got == want, budget
    tight = make_llm(tiny_llama, num_blocks=12, **kw)
    assert _greedy(tight, prompts) == want
    assert tight.engine.scheduler.num_preemptions > 0
