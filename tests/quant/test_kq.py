"""GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K kept packed: the parts read from random blocks
dequantize exactly as gguf.quants does, the tile layout round-trips, and the integer-dot kernel
(kvserve/csrc/kq_gemm.c) matches its twin (kvserve.kernels.reference.kq_matmul) on the build
this machine makes and every ISA variant this CPU runs (AVX2, portable, AVX-512, VNNI, and the
VNNI path emulated on AVX2 through SIMDe: bf16_emu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import kq_gemm as kq_cpu
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import kq
from tests.conftest import isa_variants, variant_library

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes] of a GGUF tensor of type ``name``: gguf.quants.quantize where the
    library can (Q5_0, Q5_1), else random bytes with sane fp16 scales (K-quants)."""
    rng = np.random.default_rng(seed)
    qt = T[name]
    if name in ("Q5_0", "Q5_1"):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :32] = 0.0  # an all-zero block (d = 0)
        return gguf.quants.quantize(w, qt)
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    nb = n * k // block
    b = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    half = lambda lo, hi: rng.uniform(lo, hi, nb).astype(np.float16).view(np.uint8)  # noqa: E731
    if name in ("Q4_K", "Q5_K"):
        b[:, 0:2] = half(1e-4, 2e-3).reshape(nb, 2)  # d
        b[:, 2:4] = half(1e-4, 2e-3).reshape(nb, 2)  # dmin
    else:
        b[:, 208:210] = half(-2e-3, 2e-3).reshape(nb, 2)  # d (sign in d, scales int8)
    return b.reshape(n, -1)


def parts_of(name: str, n: int, k: int, seed: int = 0) -> tuple[kq.KqParts, np.ndarray]:
    raw = random_blocks(name, n, k, seed)
    return kq.from_blocks(name, torch.from_numpy(raw.copy()), (n, k)), raw


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_gguf_exactly(name):
    p, raw = parts_of(name, 5, 512)
    want = gguf.quants.dequantize(raw, T[name])
    got = ref.kq_dequantize(p)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", [16, 21, 3])
def test_pack_round_trips_and_bytes_match_the_file(name, n):
    p, _ = parts_of(name, n, 512, seed=n)
    t = kq.type_id(name)
    packed = kq.pack(p)
    assert packed.numel() == kq.packed_bytes(t, n, 512)
    back = kq.unpack(t, packed, n, 512)
    for f in ("u", "d", "dm", "sc", "mn"):
        a, b = getattr(p, f), getattr(back, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f
    # per 16 rows the layout holds the file's bytes (K-quants: within 3%)
    ratio = kq.packed_bytes(t, 16, 4096) / kq.file_bytes(t, 16, 4096)
    assert 1.0 <= ratio <= 1.03


# (its AVX-512 code is the VNNI path only: avx512_emu would repeat the AVX2 build)
@pytest.fixture(scope="module", params=isa_variants("avx512_emu"))
def lib(request, tmp_path_factory):
    if request.param == "native":
        dll = kq_cpu.kq_library()
        if dll is None:
            pytest.skip("C kernel unavailable")
        return dll
    return kq_cpu.bind(variant_library("kq_gemm", request.param,
                                       str(tmp_path_factory.mktemp("kq"))))


def _run(lib, x, parts, terms):
    packed = [kq.pack(p) for p in parts]
    table = kq_cpu.shard_table([(p.qtype, p.shape[0], w)
                                for p, w in zip(parts, packed, strict=True)])
    return kq_cpu.kq_linear(lib, x, table, sum(p.shape[0] for p in parts), terms)


def _close(got, want, x, parts, terms):
    """Within fp32 rounding of the sums: relative to sum |x^| |w| per output."""
    w = torch.cat([ref.kq_dequantize(p) for p in parts])
    scale = x.abs() @ w.abs().t() + 1e-30
    err = ((got - want).abs() / scale).max().item()
    assert err < 2e-5, err


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m,n,k", [(1, 16, 256), (2, 40, 512), (5, 70, 768), (9, 33, 256)])
def test_gemm_matches_twin(lib, name, m, n, k):
    p, _ = parts_of(name, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    for terms in (1, 2):
        got = _run(lib, x, [p], terms)
        _close(got, ref.kq_matmul(x, [p], terms), x, [p], terms)


def test_fused_shards_of_different_types(lib):
    """One call over q / k / v of three types: each shard's columns equal its own GEMM."""
    k = 512
    parts = [parts_of("Q4_K", 48, k, 1)[0], parts_of("Q6_K", 20, k, 2)[0],
             parts_of("Q5_0", 16, k, 3)[0]]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    got = _run(lib, x, parts, 2)
    _close(got, ref.kq_matmul(x, parts, 2), x, parts, 2)
    assert torch.equal(got[:, 48:68], _run(lib, x, parts[1:2], 2))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_1"])
def test_rows_are_batch_invariant(lib, name):
    """A row's result is bit for bit the same alone or in a batch of 7."""
    p, _ = parts_of(name, 40, 512, 5)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(6))
    full = _run(lib, x, [p], 1)
    for i in (0, 3, 6):
        assert torch.equal(full[i:i + 1], _run(lib, x[i:i + 1].contiguous(), [p], 1))


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", TYPES)
def test_wide_pass_rows_are_batch_invariant(lib, name):
    """AVX-512 VNNI: GEMMs of 1-4 rows run one 4-tile pass, 5-24 the wide pass (one weight tile
    x chunks of <= 8 rows, as even as they come), more the passes of 4 (AMX off here; the tiles
    against both: test_kq_amx.py). Each row alone (1-2 GEMM rows) is bit for bit that row in
    calls of 2, 3, 5, 8 and 11 rows (one term: 4-tile 2, 3, then wide 5, 8, 6 + 5; two terms:
    4-tile 4, wide 6-22 GEMM rows: 8 + 7 + 7 at 22) and in a batch of 26 (passes of 4), for
    every type and ISA variant (the others run their own passes); and near the twin."""
    p, _ = parts_of(name, 40, 512, 7)  # three tiles, the last one partial
    x = torch.randn(26, 512, generator=torch.Generator().manual_seed(8))
    x[4, :32] = 0.0  # a zero block: dx = 0
    x[9] *= 1e-3
    rows = wq_cpu.amx_rows(lib)
    wq_cpu.set_amx(lib, False)
    try:
        for terms in (1, 2):
            alone = torch.cat([_run(lib, x[i:i + 1].contiguous(), [p], terms)
                               for i in range(26)])
            full = _run(lib, x, [p], terms)
            assert torch.equal(_bits(full), _bits(alone)), terms
            for take in (2, 3, 5, 8, 11):
                for s in {0, 26 - take, 3}:
                    part = _run(lib, x[s:s + take].contiguous(), [p], terms)
                    assert torch.equal(_bits(part), _bits(alone[s:s + take])), (terms, take, s)
            _close(full, ref.kq_matmul(x, [p], terms), x, [p], terms)
    finally:
        wq_cpu.set_amx(lib, bool(rows), rows)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_threads_share_tiles_bit_for_bit(lib, name):
    """Tiles handed out in dynamic chunks (kvs_sched.h): 1, 2 or 3 threads (more than this
    host's cores) give the same bits, on the few-row, VNNI and AMX paths alike."""
    p, _ = parts_of(name, 16 * 21, 512, 9)
    g = torch.Generator().manual_seed(10)
    prev = torch.get_num_threads()
    try:
        for m in (1, 5, 20):
            x = torch.randn(m, 512, generator=g)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(_run(lib, x, [p], 2))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), m
    finally:
        torch.set_num_threads(prev)


def test_kernel_refuses_a_k_the_type_cannot_hold(lib):
    p, _ = parts_of("Q4_K", 16, 256)
    packed = kq.pack(p)
    table = kq_cpu.shard_table([(12, 16, packed)])
    with pytest.raises(ValueError, match="in_features"):
        kq_cpu.kq_linear(lib, torch.randn(1, 288), table, 16, 1)


def test_parts_errors():
    with pytest.raises(ValueError, match="multiple of 256"):
        kq.from_blocks("Q4_K", torch.zeros(144, dtype=torch.uint8), (1, 288))
    with pytest.raises(ValueError, match="qtype"):
        kq.type_id("Q4_0")
    with pytest.raises(ValueError, match="bytes"):
        kq.from_blocks("Q6_K", torch.zeros(100, dtype=torch.uint8), (1, 256))


@pytest.mark.parametrize("name", TYPES)
def test_c_dequantize_equals_gguf_exactly(lib, name):
    """kvs_kq_dequant (fp32 activations, dequantize()): gguf.quants' values bit for bit, on
    any 16-aligned row range."""
    n, k = 40, 512
    p, raw = parts_of(name, n, k, 9)
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[name]))
    packed = kq.pack(p)
    t = kq.type_id(name)
    assert torch.equal(kq_cpu.kq_dequant(lib, t, packed, n, k, 0, n), want)
    assert torch.equal(kq_cpu.kq_dequant(lib, t, packed, n, k, 16, 37), want[16:37])
    with pytest.raises(ValueError, match="rows"):
        kq_cpu.kq_dequant(lib, t, packed, n, k, 8, 20)
