"""Sealing from the checksum state the Triton write kernel accumulates equals sealing by
recomputing the sums from the bytes: direct cache writes over several chunks, block reuse
(the state is reset on allocation), and the engine on the Triton backends with preemption,
block reuse and a rollback repair. On CPU under the Triton interpreter (tiny shapes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvserve import SamplingParams  # noqa: E402
from kvserve.attention import get_backend, kv_writer  # noqa: E402
from kvserve.cache.block_pool import BlockPool  # noqa: E402
from kvserve.cache.integrity import IntegrityChecker, block_sums  # noqa: E402
from kvserve.cache.kv_cache import PagedKVCache  # noqa: E402
from kvserve.config import KVMode  # noqa: E402
from kvserve.kernels.triton import cache as tc  # noqa: E402

# slow: Triton write kernel in the interpreter, whole engines
pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp32": torch.float32}
BS = 8


def _setup(kv_dtype: torch.dtype, components: int, integrity: bool = True):
    heads, dim = (2, 16) if components == 2 else (1, 48)  # GQA K/V, or an MLA 32 + 16 row
    kv = PagedKVCache(2, 6, BS, heads, dim, components, KVMode(kv_dtype), DEVICE,
                      checksums=integrity,
                      writer="triton")
    pool = BlockPool(6)
    checker = IntegrityChecker(kv, pool, b"test-fingerprint", "on") if integrity else None
    backend = get_backend("triton", kv, 4, heads, dim, 0.25, 64)  # triton / mla_triton
    return kv, pool, checker, backend


def _write(kv: PagedKVCache, slots: list[int], gen: torch.Generator) -> None:
    """One step's rows for every layer through the fused kernel (as the backends call it)."""
    t = len(slots)
    s = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    for layer in range(kv.num_layers):
        shape = (t, kv.num_kv_heads, kv.head_dim)
        k = (torch.randn(shape, generator=gen) * 3).to(DEVICE)
        v = torch.randn(shape, generator=gen).to(DEVICE) if kv.components == 2 else None
        tc.write_kv(kv.data, kv.scales, layer, s, k, v, kv.csum_state)


def _fill(kv: PagedKVCache, blocks: list[int], chunks: list[int], gen: torch.Generator) -> None:
    """Write every slot of ``blocks`` once, in steps of ``chunks`` tokens (straddling blocks),
    in a shuffled order (pages are not filled front to back by every scheduler)."""
    slots = [b * BS + o for b in blocks for o in range(BS)]
    i = 0
    for n in chunks:
        _write(kv, slots[i:i + n], gen)
        i += n
    assert i == len(slots)


def _assert_seals_match_bytes(checker: IntegrityChecker, kv: PagedKVCache, blocks: list[int]):
    recomputed = block_sums(kv, blocks)  # [n, L, 4] from the bytes
    for i, b in enumerate(blocks):
        assert np.array_equal(checker.seals[b].sums, recomputed[i]), f"block {b}"
    assert checker.verify(blocks, "test") == []  # digest of the recomputed sums == the seal


@pytest.mark.parametrize("components", [2, 1], ids=["kv", "mla"])
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_seal_from_write_state_equals_recompute(kv_dtype, components):
    kv, pool, checker, backend = _setup(KV_DTYPES[kv_dtype], components)
    assert kv.csum_state is not None  # allocated by the cache, built with the Triton writer
    assert kv.csum_state.shape == (2, 7, 4)  # [L, num_blocks + 1 (null block), 4]
    gen = torch.Generator().manual_seed(components)
    blocks = pool.allocate(3)
    checker.on_allocate(blocks)
    _fill(kv, blocks, [5, 7, 1, 11], gen)  # 24 slots in 4 steps
    checker.seal(blocks, [bytes([b]) * 16 for b in blocks])
    assert checker.seal_sources == {"write_state": 3}
    _assert_seals_match_bytes(checker, kv, blocks)

    # Reuse: free one block and allocate it again (new generation: seal dropped, state reset),
    # rewrite it with other values in other chunks; its seal again equals the recomputed sums.
    old_state = kv.csum_state[:, blocks[1]].clone()
    checker.on_allocate(pool.allocate(3))  # the rest of the pool: the next one is a reuse
    pool.free([blocks[1]])
    again = pool.allocate(1)
    assert again == [blocks[1]]
    checker.on_allocate(again)
    assert not checker.is_sealed(blocks[1])
    assert kv.csum_state[:, blocks[1]].abs().sum() == 0
    _fill(kv, again, [3, 5], gen)
    checker.seal(again, [b"\x07" * 16])
    _assert_seals_match_bytes(checker, kv, blocks)
    assert not torch.equal(kv.csum_state[:, blocks[1]], old_state)


def test_rewrite_without_reset_would_not_match():
    """The control: the state is additive, so rows rewritten without the reset on allocation
    give a state that no longer matches the bytes (what on_allocate's zeroing prevents), and
    a fault injected after the write but before sealing is caught (the seal is of what was
    written, not of what the bytes became)."""
    kv, pool, checker, _ = _setup(torch.float8_e4m3fn, 2)
    gen = torch.Generator().manual_seed(3)
    blocks = pool.allocate(2)
    checker.on_allocate(blocks)
    _fill(kv, blocks, [16], gen)
    _fill(kv, blocks[:1], [8], gen)  # rewrite block 0 in place, no reallocation
    state = kv.csum_state.permute(1, 0, 2)[blocks].cpu().numpy()
    sums = block_sums(kv, blocks)
    assert not np.array_equal(state[0], sums[0])
    assert np.array_equal(state[1], sums[1])
    # a fault between write and seal
    checker.inject(blocks[1], layer=1, kind="bitflip", index=5, bit=2)
    checker.seal(blocks[1:], [b"\x01" * 16])
    assert checker.verify(blocks[1:], "test") == [blocks[1]]


def test_no_state_without_integrity_or_on_the_torch_backend():
    kv, _, _, backend = _setup(torch.bfloat16, 2, integrity=False)
    assert kv.csum_state is None  # integrity off: no atomics
    assert kv_writer("torch", 2) == "c" and kv_writer("triton", 1) == "triton"
    kv = PagedKVCache(2, 6, BS, 2, 16, 2, KVMode(torch.bfloat16), DEVICE, checksums=True,
                      writer=kv_writer("torch", 2))
    checker = IntegrityChecker(kv, BlockPool(6), b"fp", "on")
    get_backend("torch", kv, 4, 2, 16, 0.25, 64)
    assert kv.csum_state is None  # the torch writer keeps no state: seal recomputes
    with pytest.raises(ValueError, match="writer='triton'"):
        get_backend("triton", kv, 4, 2, 16, 0.25, 64)  # the writer is chosen when built
    checker.seal([0], [b"\x00" * 16])
    assert checker.seal_sources == {"recompute": 1}


# ---- engine: Triton backends, integrity on, preemption, block reuse, a rollback repair ------
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1] + [(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([13, 22, 6])]


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_triton_seals_from_write_state(tiny_llama, make_llm, kv):
    """Paranoid mode verifies (recomputes) every sealed block every step a request reads it, so
    any seal taken from a wrong state fails. Few blocks force preemption and reuse; a fault
    injected into a running request's block is rolled back and recomputed into reallocated
    blocks; the output equals the torch backend's and exactly the one injected fault fails."""
    kw = dict(dtype="float32", kv_cache_dtype=kv, block_size=BS, max_model_len=64,
              enable_prefix_caching=False)
    want = _toks(make_llm(tiny_llama, num_blocks=32, kv_integrity="off", **kw)
                 .generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    llm = make_llm(tiny_llama, num_blocks=7, kv_integrity="paranoid",
                   attention_backend="triton", device=DEVICE, **kw)
    eng = llm.engine
    assert eng.runner.backend.name == "triton" and eng.kv_cache.csum_state is not None
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    eng.step()  # prefill chunk(s): the first full blocks are sealed from the state
    req = eng.output_processor.parents["r1"].children[0]
    victim = eng.kv_manager.get_block_ids(req)[1]
    assert eng.integrity.is_sealed(victim)
    eng.debug.inject_kv_fault(victim, 1, "bitflip", index=40, bit=6)
    final, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 100, f"no progress: {eng.integrity.stats()}"  # a bad seal loops
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert [final[f"r{i}"] for i in range(len(PROMPTS))] == want
    integ = eng.integrity
    assert eng.scheduler.num_preemptions > 0
    assert max(b.generation for b in eng.pool.blocks) >= 2  # blocks were reused
    assert integ.failures == {"paranoid": 1} and integ.repairs["rollback"] == 1
    assert integ.checks["paranoid"] > 0
    assert integ.seal_sources["write_state"] > 0 and not integ.seal_sources["recompute"]
    sealed = sorted(integ.seals)
    assert sealed and integ.verify(sealed, "final") == []


def test_engine_torch_backend_still_recomputes(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="bf16", block_size=BS,
                   num_blocks=16, max_model_len=64)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)
    integ = llm.engine.integrity
    assert llm.engine.kv_cache.csum_state is None
    assert integ.seal_sources["recompute"] > 0 and not integ.seal_sources["write_state"]
