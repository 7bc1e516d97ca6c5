"""The grouped multi-LoRA GEMM: the C kernel (native build and every ISA variant this CPU runs)
and the Triton kernel (interpreter without CUDA) against the twin
``kvserve.kernels.reference.lora_delta``, over a shape sweep: slots used by several rows, rows
without an adapter, ranks padded with zeros, K / N / R not multiples of the vector width, fused
linears' shards (garbage outside the shards' blocks of B, which no kernel may read)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import lora_gemm as cl
from tests.conftest import ISA_VARIANTS, variant_library

SHAPES = [  # (T, K, N, R, S, shards): a fused linear's H shards split N and R
    (1, 64, 48, 8, 1, 1),
    (7, 72, 130, 16, 3, 1),  # K and N past a vector width, N past one 64-column block
    (16, 576, 192, 8, 4, 1),
    (5, 33, 17, 5, 2, 1),  # odd everything (masked AVX-512 tails)
    (12, 128, 64, 64, 5, 1),
    (16, 96, 160, 48, 4, 3),  # q/k/v: 3 shards, boundaries inside 64-column blocks
    (9, 40, 150, 10, 3, 2),  # gate/up: 2 shards of 75 columns, rank 5 each
    (12, 40, 1100, 14, 2, 2),  # shards wider than one 512-column streaming unit, rank 7
]


def _noff(n, h):
    """H shards: the first takes half of N, the others split the rest (q/k/v-like)."""
    if h == 1:
        return torch.tensor([0, n], dtype=torch.int64)
    first = n // 2
    rest = [(n - first) // (h - 1)] * (h - 1)
    rest[-1] += n - first - sum(rest)
    offs = [0, first]
    for w in rest:
        offs.append(offs[-1] + w)
    return torch.tensor(offs, dtype=torch.int64)


def _case(t, k, n, r, s, h, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    a = torch.randn(s, r, k, generator=g) * 0.1
    # bt outside each shard's block holds garbage: the kernels must not read it
    bt = torch.randn(s, r, n, generator=g) * 0.1
    rh = r // h
    if rh > 2:  # slot 0 has a smaller rank: its padding is zero
        for i in range(h):
            a[0, i * rh + rh - 2:(i + 1) * rh] = 0
            bt[0, i * rh + rh - 2:(i + 1) * rh] = 0
    noff = _noff(n, h)
    idx = torch.randint(-1, s, (t,), generator=g)
    idx[0] = s - 1  # at least one row with an adapter
    scale = torch.rand(s, generator=g) + 0.5
    y = torch.randn(t, n, generator=g)
    return [v.to(device) for v in (y, x, a, bt, idx, scale, noff)]


def _masked(bt, noff):
    """bt with its entries outside the shards' blocks zeroed (what the full product needs)."""
    offs = noff.tolist()
    h = len(offs) - 1
    rh = bt.shape[1] // h
    out = torch.zeros_like(bt)
    for i in range(h):
        rows, cols = slice(i * rh, (i + 1) * rh), slice(offs[i], offs[i + 1])
        out[:, rows, cols] = bt[:, rows, cols]
    return out


def test_twin_is_the_full_product_over_the_shard_blocks():
    """The twin's delta equals scale * (x A^T) B^T with B zero outside the shards' blocks (the
    layout LoRALinear keeps), computed densely per row."""
    y, x, a, bt, idx, scale, noff = _case(16, 96, 160, 48, 4, 3, seed=5)
    got = ref.lora_delta(x, a, bt, idx, scale, noff)
    dense = _masked(bt, noff)
    for t in range(x.shape[0]):
        s = int(idx[t])
        want = (torch.zeros(160) if s < 0
                else scale[s] * ((a[s] @ x[t]) @ dense[s]))
        assert torch.allclose(got[t], want, atol=1e-5, rtol=1e-5)


def _lib(isa, tmp_path):
    if isa == "native":
        lib = cl.load()
        if lib is None:
            pytest.skip("no C compiler")
        return lib
    return cl.bind(variant_library("lora_gemm", isa, str(tmp_path)))


@pytest.mark.parametrize("isa", ISA_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_c_kernel_matches_twin(isa, shape, wdtype, tmp_path):
    """fp32 or bf16 adapter weights (--lora-dtype), fp32 activations."""
    lib = _lib(isa, tmp_path)
    y, x, a, bt, idx, scale, noff = _case(*shape, seed=sum(shape))
    a, bt = a.to(wdtype), bt.to(wdtype)
    want = y.double() + ref.lora_delta(x, a, bt, idx, scale, noff).double()
    got = cl.lora_gemm_(lib, y.clone(), x, a, bt, idx, scale, noff)
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    none = idx < 0  # rows without an adapter are left exactly as they were
    assert torch.equal(got[none], y[none])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("used", [1, 3, 4])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [16, 160])
def test_c_kernel_thread_splits(threads, used, wdtype, t):
    """q/k/v of SmolLM2 (K 576, shards 576 / 192 / 192, rank 16): a decode-sized call (16 rows)
    runs on one thread whatever the threads; a prefill-sized one (160 rows, over PAR_MACS)
    runs in parallel: the used slots split evenly over the threads (each thread shrinks and
    expands its own slots), or not (one barrier between the phases), or one slot's ranks and
    columns are shared out; every split equals the twin."""
    lib = _lib("native", None)
    g = torch.Generator().manual_seed(used * 10 + threads)
    k, r, s = 576, 48, 4
    noff = torch.tensor([0, 576, 768, 960], dtype=torch.int64)
    x = torch.randn(t, k, generator=g)
    a = (torch.randn(s, r, k, generator=g) * 0.1).to(wdtype)
    bt = (torch.randn(s, r, 960, generator=g) * 0.1).to(wdtype)
    idx = torch.arange(t, dtype=torch.int64) % used
    idx[5] = -1
    scale = torch.rand(s, generator=g) + 0.5
    y = torch.randn(t, 960, generator=g)
    want = y.double() + ref.lora_delta(x, a, bt, idx, scale, noff).double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cl.lora_gemm_(lib, y.clone(), x, a, bt, idx, scale, noff)
    finally:
        torch.set_num_threads(before)
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.equal(got[5], y[5])


def test_c_kernel_paths(tmp_path):
    """The native build on this CPU takes its widest path; a row's slot out of range is
    refused, not read."""
    from kvserve.cbuild import cpu_kind

    lib = _lib("native", tmp_path)
    kind = cpu_kind()
    assert lib.kvs_lora_simd() == {"portable": 0, "avx2": 1}.get(kind, 2)
    y, x, a, bt, idx, scale, noff = _case(3, 64, 16, 4, 2, 1, seed=1)
    idx[1] = 2
    with pytest.raises(AssertionError, match="out of range"):
        cl.lora_gemm_(lib, y, x, a, bt, idx, scale, noff)


def test_no_adapter_rows_cost_nothing():
    lib = _lib("native", None)
    y, x, a, bt, _, scale, noff = _case(4, 64, 16, 4, 2, 1, seed=2)
    idx = torch.full((4,), -1, dtype=torch.int64)
    assert torch.equal(cl.lora_gemm_(lib, y.clone(), x, a, bt, idx, scale, noff), y)


@pytest.mark.slow  # Triton interpreter
@pytest.mark.parametrize("shape", [*SHAPES[:4], SHAPES[5]])
def test_triton_kernel_matches_twin(shape):
    pytest.importorskip("triton")
    from kvserve.kernels.triton.lora import lora_gemm_

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    y, x, a, bt, idx, scale, noff = _case(*shape, seed=sum(shape), device=dev)
    want = y.double() + ref.lora_delta(x, a, bt, idx, scale, noff).double()
    got = lora_gemm_(y.clone(), x, a, bt, idx, scale, noff)
    assert (got.double() - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    none = idx < 0
    assert torch.equal(got[none], y[none])
