"""Decode CUDA-graph bookkeeping on CPU: buckets, and the padded decode batch that a graph
replays (padding rows must not change live rows and must touch only the null block).

Graph capture/replay itself needs CUDA (scripts/gpu_check.sh); the static-buffer forward that
a graph replays runs on CPU under the Triton interpreter in tests/kernels/test_triton_backend.py.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.cuda_graphs import (
    PAD_TOKEN_ID,
    batch_buckets,
    clear_scratch_block,
    is_decode_only,
    pad_decode_batch,
    select_bucket,
)

# slow: padded decode graphs checked through whole engines
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("max_num_seqs", "want"), [
    (1, (1,)),
    (2, (1, 2)),
    (3, (1, 2, 3)),
    (4, (1, 2, 4)),
    (5, (1, 2, 4, 5)),
    (8, (1, 2, 4, 8)),
    (20, (1, 2, 4, 8, 16, 20)),
    (32, (1, 2, 4, 8, 16, 24, 32)),
    (33, (1, 2, 4, 8, 16, 24, 32, 33)),
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
])
def test_batch_buckets(max_num_seqs, want):
    assert batch_buckets(max_num_seqs) == want


def test_batch_buckets_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


@pytest.mark.parametrize(("n", "want"), [
    (0, None), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 20), (20, 20),
    (21, None),
])
def test_select_bucket(n, want):
    assert select_bucket((1, 2, 4, 8, 16, 20), n) == want


def _run_with_spy(llm, n_live: int, check) -> list:
    """Generate from n_live prompts; on the first decode-only step with n_live sequences, call
    ``check(engine, batch)`` right after the live forward (cache state of that step)."""
    eng = llm.engine
    fwd = eng.runner.executor.driver.model_runner  # rank 0's ModelRunner: the forward of each step
    orig = fwd.forward
    results: list = []

    def spy(batch):
        hidden = orig(batch)
        if not results and is_decode_only(batch.meta) and batch.meta.num_seqs == n_live:
            results.append(check(eng, batch, hidden))
        return hidden

    fwd.forward = spy
    prompts = [{"prompt_token_ids": [1] + [(5 * i + j) % 400 + 3 for j in range(ln)]}
               for i, ln in enumerate([4, 21, 9, 35, 16, 2, 50][:n_live])]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert results, "no decode-only step with every request running"
    return results


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize(("n_live", "bucket"), [(3, 4), (5, 8), (1, 2)])
def test_padded_decode_equals_unpadded(tiny_llama, make_llm, kv, c_kernel, n_live, bucket):
    llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, enable_prefix_caching=False)
    backend = llm.engine.runner.backend
    if not c_kernel:
        backend.use_kernel = False  # the pure-torch decode path

    def check(eng, batch, hidden):
        kv_cache, model = eng.kv_cache, eng.model
        null, bs = kv_cache.null_block, kv_cache.block_size
        assert bucket >= n_live
        data0 = kv_cache.data.clone()  # includes this step's live writes
        scales0 = None if kv_cache.scales is None else kv_cache.scales.clone()
        assert not data0[:, null].any()  # the null block starts zero

        padded = pad_decode_batch(batch, bucket, null, bs, eng.runner.components)
        m = padded.meta
        assert m.num_seqs == m.num_tokens == bucket and m.query_lens == [1] * bucket
        assert m.seq_lens[n_live:] == [1] * (bucket - n_live)
        assert m.block_tables[n_live:] == [[null]] * (bucket - n_live)
        assert padded.input_ids[n_live:].tolist() == [PAD_TOKEN_ID] * (bucket - n_live)
        assert padded.positions[n_live:].tolist() == [0] * (bucket - n_live)
        assert m.slot_mapping[n_live:].tolist() == [null * bs] * (bucket - n_live)
        assert torch.equal(padded.input_ids[:n_live], batch.input_ids)

        hp = model(padded)
        assert hp.shape[0] == bucket
        want = model.compute_logits(hidden).float()
        got = model.compute_logits(hp[:n_live]).float()
        # CPU fp32 GEMMs are not batch invariant (the kernel blocking depends on M: ~1e-5
        # here), so padded vs unpadded agree to rounding, not bit for bit ...
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if bucket > n_live:
            # ... but at equal M, what the padding rows hold never reaches a live row: exact.
            other = pad_decode_batch(batch, bucket, null, bs, eng.runner.components)
            other.input_ids[n_live:] = torch.arange(7, 7 + bucket - n_live)
            ho = model(other)
            assert not torch.equal(ho[n_live:], hp[n_live:])  # the padding did differ
            assert torch.equal(model.compute_logits(ho[:n_live]).float(), got)
            assert not kv_cache.data[:, null, :, 1:].any()  # still only slot 0 of null
        # Which (block, offset) slots changed: live rows rewrote their own slot (same values
        # up to GEMM rounding); padding rows may only have written slot 0 of the null block.
        live = {(int(x) // bs, int(x) % bs) for x in batch.meta.slot_mapping}
        changed = (kv_cache.data != data0).flatten(4).any(-1).any(2).any(0)  # [NB+1, bs]
        if scales0 is not None:
            changed |= (kv_cache.scales != scales0).any(-1).any(2).any(0)
        touched = {(int(b), int(o)) for b, o in changed.nonzero()}
        assert touched - live <= {(null, 0)}
        assert ((null, 0) in touched) == (bucket > n_live)
        for b, o in live if scales0 is None else ():  # live rewrites ~ the unpadded write
            torch.testing.assert_close(kv_cache.data[:, b, :, o].float(),
                                       data0[:, b, :, o].float(), rtol=0.07, atol=1e-3)
        clear_scratch_block(kv_cache)
        assert not kv_cache.data[:, null].any()
        assert scales0 is None or not kv_cache.scales[:, null].any()
        return True

    assert _run_with_spy(llm, n_live, check) == [True]


def test_pad_decode_batch_rejects_bad_input(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")

    def check(eng, batch, hidden):
        null, bs = eng.kv_cache.null_block, eng.kv_cache.block_size
        with pytest.raises(ValueError, match="bucket"):
            pad_decode_batch(batch, 1, null, bs, 2)
        assert pad_decode_batch(batch, 2, null, bs, 2) is batch  # nothing to pad
        return True

    assert _run_with_spy(llm, 2, check) == [True]


def test_cpu_engine_has_no_graphs(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    assert llm.engine.runner.graphs is None
