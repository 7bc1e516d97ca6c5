"""The 16-bit-weight kernel (kvserve/csrc/w16_gemm.c) against its twin
(kvserve.kernels.reference.w16_linear), on the build this machine makes and every ISA variant
this CPU runs (AVX2, portable, AVX-512, AVX512-BF16; here with fp32 dot products -- the bf16
ones are tests/kernels/test_w16_bf16.py);
and the loader keeping a bf16 checkpoint's weights 16-bit when it computes in fp32."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import w16_gemm as w16_cpu
from kvserve.kernels.reference import w16_linear
from tests.conftest import ISA_VARIANTS, variant_library


@pytest.fixture(scope="module", params=ISA_VARIANTS)
def lib(request, tmp_path_factory):
    if request.param == "native":
        dll = w16_cpu.w16_library()
        if dll is None:
            pytest.skip("C kernel unavailable (no compiler, or KVSERVE_CPU_KERNEL=0)")
        return dll
    return w16_cpu.bind(variant_library("w16_gemm", request.param,
                                        str(tmp_path_factory.mktemp("w16"))))


def _case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, 64])
@pytest.mark.parametrize("n,k", [(4, 16), (7, 40), (33, 576), (130, 1000), (64, 8)])
def test_matches_twin(lib, dtype, m, n, k):
    x, w = _case(m, n, k, dtype, m * 1000 + n + k)
    y = w16_cpu.w16_gemm(lib, x, w)
    ref = (x.double() @ w.double().t()).float()  # exact products, one rounding
    assert y.shape == (m, n) and y.dtype == torch.float32
    # fp32 accumulation over k terms: error <= ~k * eps * sum |x w|
    bound = 4 * k * 2**-24 * (x.abs() @ w.float().abs().t()) + 1e-30
    assert ((y - ref).abs() <= bound).all()
    torch.testing.assert_close(y, w16_linear(x, w), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_threads(lib):
    x, w = _case(9, 50, 96, torch.bfloat16, 3)
    wide = torch.zeros(9, 200)
    wide[:, 10:106] = x
    view = wide[:, 10:106]  # row stride 200
    ref = w16_cpu.w16_gemm(lib, x, w)
    assert torch.equal(w16_cpu.w16_gemm(lib, view, w), ref)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(w16_cpu.w16_gemm(lib, x, w), ref)  # a row's sum order is fixed
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_invariant(lib, dtype):
    """A row's result is bit-identical whatever batch it is in (1, 3, 4, 5 or 64 rows: the
    register-converted and the scratch-converted paths)."""
    x, w = _case(64, 70, 200, dtype, 7)
    full = w16_cpu.w16_gemm(lib, x, w)
    for m in (1, 3, 4, 5, 17):
        assert torch.equal(w16_cpu.w16_gemm(lib, x[:m], w), full[:m]), m
    assert torch.equal(w16_cpu.w16_gemm(lib, x[40:41], w), full[40:41])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_sized_batch_is_chunked_without_changing_rows(lib, dtype):
    """K = 4,100 makes the kernel walk x in chunks of 12 rows (~256 KB each): 50 rows are 5
    chunks, the last one short; every row equals its single-row result and the twin's."""
    x, w = _case(50, 9, 4100, dtype, 11)
    full = w16_cpu.w16_gemm(lib, x, w)
    for i in (0, 11, 12, 13, 47, 49):
        assert torch.equal(w16_cpu.w16_gemm(lib, x[i:i + 1], w), full[i:i + 1]), i
    torch.testing.assert_close(full, w16_linear(x, w), rtol=1e-4, atol=1e-4)


def _packed(lib, w):
    """w packed in ``lib``'s tiles, as the loader holds it (a parameter with ``w16_tiles``)."""
    p = torch.nn.Parameter(w.clone(), requires_grad=False)
    w16_cpu.pack_weight(lib, p)
    return p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4, 16), (13, 64), (33, 576), (130, 1024)])
def test_packed_tiles_give_the_row_major_results_bit_for_bit(lib, dtype, n, k):
    """The packed layout only moves where each weight vector lives: every batch size (the
    register path, M <= MR, and the scratch path) returns exactly the row-major result, and a
    row still does not depend on its batch."""
    from kvserve.quant.w16 import unpack

    x, w = _case(64, n, k, dtype, n * 7 + k)
    p = _packed(lib, w)
    tiles = p.w16_tiles
    assert (tiles.tile_rows, tiles.tile_cols) == w16_cpu.packing(lib)
    assert p.shape == (tiles.num_tiles, tiles.tile_rows * k)  # no [n, k] reader accepts it
    assert torch.equal(unpack(p, tiles), w)
    full = w16_cpu.w16_gemm(lib, x, p)
    assert torch.equal(full, w16_cpu.w16_gemm(lib, x, w))
    for m in (1, 2, 3, 5, 17):
        assert torch.equal(w16_cpu.w16_gemm(lib, x[:m], p), full[:m]), m


def test_packing_refuses_what_it_cannot_hold():
    from kvserve.quant.w16 import can_pack, pack

    w = torch.zeros(8, 24, dtype=torch.bfloat16)
    assert can_pack(w, 8) and not can_pack(w, 16) and not can_pack(w.float(), 8)
    assert not can_pack(w.t(), 8)  # not contiguous
    with pytest.raises(ValueError, match="cannot pack"):
        pack(w, 4, 16)


def test_packed_table_rows_and_c_gather():
    """An embedding reads rows of a packed table (a tied LM head's): the torch twin
    (``table_rows``) and the C gather give the row-major rows, and out-of-range ids raise."""
    from kvserve.kernels.cpu import cpu_ops
    from kvserve.quant.w16 import table_rows

    lib = w16_cpu.w16_library()
    if lib is None:
        pytest.skip("C kernel unavailable")
    for dtype in (torch.bfloat16, torch.float16):
        _, w = _case(1, 37, 96, dtype, 5)
        p = _packed(lib, w)
        ids = torch.tensor([0, 36, 5, 6, 11, 12, 30, 5])
        assert torch.equal(table_rows(p, ids), w[ids])
        assert torch.equal(table_rows(p, ids.view(2, 4)), w[ids].view(2, 4, 96))
        got = cpu_ops.gather_rows(p, ids)
        if got is not None:
            assert torch.equal(got, w[ids].float())
            with pytest.raises(IndexError):
                cpu_ops.gather_rows(p, torch.tensor([37]))
        with pytest.raises(IndexError):
            table_rows(p, torch.tensor([-1]))


def test_packed_weight_without_the_kernel_uses_the_twin(monkeypatch):
    lib = w16_cpu.w16_library()
    if lib is None:
        pytest.skip("C kernel unavailable")
    x, w = _case(3, 20, 64, torch.bfloat16, 2)
    p = _packed(lib, w)
    monkeypatch.setattr(w16_cpu, "w16_library", lambda: None)
    torch.testing.assert_close(w16_cpu.linear_w16(x, p), w16_linear(x, w), rtol=0, atol=0)


def test_leading_dims_and_bias():
    x, w = _case(6, 12, 32, torch.bfloat16, 1)
    b = torch.randn(12)
    y = w16_cpu.linear_w16(x.view(2, 3, 32), w, b)
    assert y.shape == (2, 3, 12)
    torch.testing.assert_close(y.view(6, 12), x @ w.float().t() + b, rtol=1e-5, atol=1e-5)
    assert w16_cpu.linear_w16(x[:0], w).shape == (0, 12)


def _bf16_checkpoint(path: str, **overrides) -> str:
    """A tiny Llama saved as bf16 (config dtype and tensors)."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(path, "llama", save_dtype=torch.bfloat16, **overrides)


@pytest.mark.parametrize("tied", [False, True])
def test_loader_keeps_bf16_weights_for_fp32_compute(tmp_path, monkeypatch, make_llm, tied):
    """``dtype=auto`` on CPU (any kind): fp32 compute with the dense weights
    (and a tied head's shared table) held in bf16, read by the kernel; with exact fp32 dots
    (``cpu_bf16_dot_rows=0``, pinned: auto is 1 on AVX512-BF16 / AMX CPUs) the same tokens and
    logprobs as holding fp32 copies (``dtype=float32``)."""
    from kvserve.layers.linear import Linear, MergedLinear
    from kvserve.layers.vocab_parallel import VocabParallelEmbedding
    from kvserve.model.loader import load_model, weight_bytes
    from kvserve.sampling_params import SamplingParams

    if w16_cpu.w16_library() is None:
        pytest.skip("C kernel unavailable: the loader keeps fp32 weights")
    path = _bf16_checkpoint(str(tmp_path / "m"), tie_word_embeddings=tied)

    loaded = load_model(path, "auto", progress=False)
    assert loaded.dtype == torch.float32
    model = loaded.model
    dense = [m for m in model.modules() if isinstance(m, (Linear, MergedLinear))]
    assert dense and all(m.weight.dtype == torch.bfloat16 for m in dense)
    emb = model.model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and emb.weight.dtype == torch.bfloat16
    # every table packed in the GEMM's tiles (its logical shape on ``w16_tiles``)
    for m in [*dense, emb]:
        tiles = m.weight.w16_tiles
        rows = (emb.per_rank if m is emb else m.out_features if isinstance(m, Linear)
                else sum(m.out_sizes))
        assert (tiles.rows, tiles.cols) == (rows, m.weight.shape[1] // tiles.tile_rows)
    assert emb(torch.tensor([3, 5])).dtype == torch.float32
    assert (model.lm_head.weight is emb.weight) == tied
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    fp32 = load_model(path, "float32", progress=False).model
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    # the bf16 figure counts the weights, not a packed table's padding rows
    assert weight_bytes(model)[1] == weight_bytes(fp32)[1]

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[5, 9, 17, 33], [100, 7, 250, 3, 8, 41]]
    outs = [make_llm(path, dtype=d, cpu_bf16_dot_rows=0).generate(prompts, sp)
            for d in ("auto", "float32")]
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(lp.values())) for lp in a.outputs[0].logprobs]
        lb = [next(iter(lp.values())) for lp in b.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-4, atol=1e-4)


def test_storage_dtype_decision():
    from kvserve.config import ModelDtypes
    from kvserve.model.loader import model_dtypes

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    kernel = w16_cpu.w16_library() is not None
    assert model_dtypes("auto", bf16, "cpu", 10) == ModelDtypes(fp32, bf16 if kernel else fp32)
    assert model_dtypes("auto", fp16, "cpu", 10) == ModelDtypes(fp32, fp16 if kernel else fp32)
    assert model_dtypes("float32", bf16, "cpu", 10) == ModelDtypes(fp32, fp32)  # fp32 copies
    assert model_dtypes("bfloat16", bf16, "cpu", 10) == ModelDtypes(bf16, bf16)  # asked for
    assert model_dtypes("auto", fp32, "cpu", 10) == ModelDtypes(fp32, fp32)
    big = 3 * 2**30  # params: an fp32 copy would be 12 GiB
    assert model_dtypes("auto", bf16, "cpu", big) == (
        ModelDtypes(fp32, bf16) if kernel else ModelDtypes(bf16, bf16))
