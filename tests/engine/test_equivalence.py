"""Batching, prefix hits, chunked prefill and preemption never change the output."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.kernels import reference as ref

# slow: 65 engine runs compared pairwise
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _p(ids):
    return {"prompt_token_ids": ids}


def _prompts():
    return [[1] + [(7 * i + j) % 500 + 3 for j in range(n)] for i, n in
            enumerate([5, 40, 17, 3, 60, 33])]


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref_outputs(tiny_llama):
    from kvserve import LLM

    llm = LLM(tiny_llama, dtype="float32", progress=False, kv_cache_memory="8MiB",
              enable_prefix_caching=False)
    return [_toks(llm.generate([_p(p)], GREEDY))[0] for p in _prompts()]


def test_batched_equals_single(tiny_llama, make_llm, ref_outputs):
    llm = make_llm(tiny_llama, dtype="float32")
    assert _toks(llm.generate([_p(p) for p in _prompts()], GREEDY)) == ref_outputs


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8", "int8", "int8_plain", "fp8_rot",
                                "fp8_e5m2", "fp8_e5m2_rot"])
@pytest.mark.parametrize("extra", [-1, 0, 1, 16])  # prefix of b-1, b, b+1, 2b tokens (b=16)
def test_prefix_hit_equals_cold(tiny_llama, make_llm, kv, extra):
    b = 16
    prefix = [1] + list(range(100, 100 + b + extra - 1))
    cold = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False)
    warm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv)
    tails = [[], [5, 6, 7], list(range(300, 320))]
    expect = [_toks(cold.generate([_p(prefix + t)], GREEDY))[0] for t in tails]
    warm.generate([_p(prefix + [9, 9])], GREEDY)  # populate the cache
    got = []
    for t in tails:
        out = warm.generate([_p(prefix + t)], GREEDY)[0]
        got.append(out.outputs[0].token_ids)
        if len(prefix + t) > b:
            assert out.num_cached_tokens >= b * ((len(prefix) if t else len(prefix) - 1) // b)
    assert got == expect


def prompt_kv_rows(engine, ids):
    """Run one request until its prompt is computed; return its KV rows (all layers) as
    (bytes [P, ...] uint8, values [P, ...] fp32 dequantized) and its cached-prefix tokens."""
    engine.add_request("probe", _p(ids), SamplingParams(temperature=0, max_tokens=4))
    req = engine.output_processor.parents["probe"].children[0]
    while req.num_computed_tokens < len(ids):
        engine.step()
    kv = engine.kv_cache
    blocks = engine.kv_manager.get_block_ids(req)
    raw, vals = [], []
    for pos in range(len(ids)):
        blk, off = blocks[pos // kv.block_size], pos % kv.block_size
        data = kv.data[:, blk, :, off]  # [L, C, H, D]
        b = [data.contiguous().view(torch.uint8).flatten()]
        v = data.float()
        if kv.scales is not None:
            sc = kv.scales[:, blk, :, off]
            b.append(sc.contiguous().view(torch.uint8).flatten())
            # INT8: 1-byte log-domain scale codes
            v = ref.int8_dequantize(data, sc) if kv.is_int8 else v * sc.float().unsqueeze(-1)
        raw.append(torch.cat(b))
        vals.append(v)
    cached = req.metrics.num_cached_tokens
    engine.abort_request("probe")
    return torch.stack(raw), torch.stack(vals), cached


@pytest.mark.parametrize("kv", ["bf16", "fp8", "int8", "fp8_rot", "int8_plain", "fp8_e5m2_rot"])
@pytest.mark.parametrize("plen", [15, 16, 17, 32])
def test_prefix_hit_kv_bytes_equal_cold(tiny_llama, make_llm, kv, plen):
    """With integrity on, the KV a prefix-hit request ends up with equals the no-cache path's:
    byte for byte over the cached prefix; over the tokens both computed, up to one storage
    rounding step (fp32 GEMMs are not batch-size invariant: the warm request runs its tail as
    a 3-row GEMM, the cold one as part of a 35-row GEMM, so a value on a rounding boundary
    may land on either side)."""
    prefix = [1] + list(range(100, 100 + plen - 1))
    ids = prefix + [7, 8, 9]
    cold = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False)
    warm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, kv_integrity="on")
    warm.generate([_p(prefix + [42])], GREEDY)
    got, got_vals, hit = prompt_kv_rows(warm.engine, ids)
    assert warm.engine.kv_manager.num_hit_tokens >= 16 * (plen // 16)
    assert hit == 16 * (plen // 16)
    want, want_vals, _ = prompt_kv_rows(cold.engine, ids)
    assert got[:hit].equal(want[:hit])
    if kv.startswith("int8"):  # one step of the row's uniform grid (amax / 127, absolute)
        grid = want_vals[hit:].abs().amax(-1, keepdim=True) / 127 * 2 ** (1 / 8) * (1 + 2**-7)
        assert ((got_vals[hit:] - want_vals[hit:]).abs() <= grid + 1e-6).all()
        return
    # one relative rounding step of the storage (bf16: 7 mantissa bits, E4M3 3, E5M2 2)
    step = {"bf16": 2.0**-7, "fp8_e5m2_rot": 2.0**-2}.get(kv, 2.0**-3)
    torch.testing.assert_close(got_vals[hit:], want_vals[hit:], rtol=step, atol=1e-6)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunked_prefill_equals_unchunked(tiny_llama, make_llm, ref_outputs, budget):
    llm = make_llm(tiny_llama, dtype="float32", max_num_batched_tokens=budget,
                   enable_prefix_caching=False)
    assert _toks(llm.generate([_p(p) for p in _prompts()], GREEDY)) == ref_outputs


def test_preemption_equals_no_preemption(tiny_llama, make_llm, ref_outputs):
    # 12 blocks of 16 tokens cannot hold all six sequences at once: preemption must happen.
    llm = make_llm(tiny_llama, dtype="float32", num_blocks=12, enable_prefix_caching=False)
    outs = llm.generate([_p(p) for p in _prompts()], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _toks(outs) == ref_outputs


def test_preemption_with_seeded_sampling_is_reproducible(tiny_llama, make_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    calm = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    tight = make_llm(tiny_llama, dtype="float32", num_blocks=12)
    a = _toks(calm.generate([_p(p) for p in _prompts()], sp))
    b = _toks(tight.generate([_p(p) for p in _prompts()], sp))
    assert tight.engine.scheduler.num_preemptions > 0
    assert a == b


def test_seed_independent_of_batch(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    sp = SamplingParams(temperature=0.8, top_k=50, seed=123, max_tokens=16, ignore_eos=True)
    alone = _toks(llm.generate([_p(_prompts()[2])], sp))[0]
    for batch in (8, 32):
        others = [_p(p) for p in (_prompts() * 8)[:batch - 1]]
        mixed = llm.generate([_p(_prompts()[2])] + others,
                             [sp] + [SamplingParams(temperature=1.0, max_tokens=16)] * len(others))
        assert mixed[0].outputs[0].token_ids == alone


def test_n_shares_prompt_blocks(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    prompt = [1] + list(range(10, 60))  # 51 tokens: 3 full blocks
    out = llm.generate([_p(prompt)], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    assert len(out[0].outputs) == 3
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert llm.engine.kv_manager.num_hit_tokens >= 2 * 48


def test_priority_policy_orders_admission(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32", scheduling_policy="priority", max_num_seqs=1)
    eng = llm.engine
    eng.add_request("low", _p([1, 2, 3]), GREEDY, priority=5)
    eng.add_request("high", _p([1, 4, 5]), GREEDY, priority=-1)
    order = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["high", "low"]
