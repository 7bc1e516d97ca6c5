"""The C paged-attention kernel (AVX-512, AVX2 and portable jobs) vs its pure-torch twin
(CpuAttentionBackend with use_kernel=False), over dtypes, shapes and decode / prefill /
extend rows. The native build runs the best job this CPU has; the ISA variants of the same
source (kvserve.cbuild.ISA_FLAGS: AVX2, portable, AVX-512, AVX512-BF16) cover the other jobs
wherever this CPU runs them."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_backend import CpuAttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels.cpu import paged_attention as cpu_kernel
from kvserve.quant import int8
from tests.conftest import variant_library

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")


ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.int8]
SHAPES = [(4, 4, 16, 4), (8, 2, 64, 16), (6, 1, 128, 8), (16, 2, 72, 16), (4, 2, 20, 16)]


def _filled_cache(dtype, hk, d, bs, nb=40):
    """A one-layer cache with every block written (values over 1e-2..1e2, so FP8 dynamic
    scales span a wide range) and a random block order."""
    kv = PagedKVCache(1, nb, bs, hk, d, 2, KVMode(dtype))
    rows = torch.arange(nb * 2 * bs).view(nb, 2, bs)[:, 0].reshape(-1)
    x = torch.randn(rows.numel(), hk, d) * torch.logspace(-2, 2, rows.numel()).view(-1, 1, 1)
    kv.write(0, rows, x, torch.randn_like(x))
    return kv, torch.randperm(nb).tolist()


def _meta(seq_lens, query_lens, perm, bs):
    tables, used = [], 0
    for n in seq_lens:
        k = -(-n // bs)
        tables.append(perm[used:used + k])
        used += k
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(num_tokens=qsl[-1], query_start_loc=qsl, query_lens=query_lens,
                             seq_lens=seq_lens, block_tables=tables,
                             write_rows=torch.empty(0, dtype=torch.int64),
                             slot_mapping=torch.empty(0, dtype=torch.int64))


def _kernel_vs_twin(dtype, hq, hk, d, bs, seq_lens, query_lens):
    torch.manual_seed(1)
    kv, perm = _filled_cache(dtype, hk, d, bs)
    meta = _meta(seq_lens, query_lens, perm, bs)
    q = torch.randn(meta.num_tokens, hq, d)
    fast = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 1024)
    twin = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 1024)
    twin.use_kernel = False
    assert fast.use_kernel
    empty = torch.empty(0, hk, d)
    a = fast.forward(0, q, empty, empty, meta)
    meta.cache.clear()
    b = twin.forward(0, q, empty, empty, meta)
    # fp32 reassociation (vectorized dots, online softmax) on scores up to ~1e3: relative 1e-3
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    # the portable job (the kernel's own fallback) agrees too
    meta.cache.clear()
    row_seq, tables, lens = fast._plan(meta).kernel
    c = cpu_kernel.paged_attention(kv.data[0], kv.scales[0] if kv.has_scales else None,
                                   q.float().contiguous(), tables, row_seq, lens, d**-0.5,
                                   torch.empty_like(a), force_scalar=True)
    torch.testing.assert_close(c, b, atol=1e-4, rtol=1e-3)
    return a


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), SHAPES)
def test_kernel_matches_twin_decode(dtype, hq, hk, d, bs):
    lens = [1, bs, bs + 3, 5 * bs - 1, 97]
    _kernel_vs_twin(dtype, hq, hk, d, bs, lens, [1] * len(lens))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), SHAPES)
def test_kernel_matches_twin_mixed_step(dtype, hq, hk, d, bs):
    """Prefill from scratch (37 rows: several 16-row tiles), an extend over a cached prefix
    (q 20 of 61), decodes, and a one-token prompt, in one step."""
    _kernel_vs_twin(dtype, hq, hk, d, bs, [37, 5, 61, 1, bs + 1], [37, 1, 20, 1, 1])


# the job each variant build runs (kvs_attention_simd)
# (the attention kernel has no BF16 / VNNI code: bf16_emu would repeat avx512_emu)
VARIANT_SIMD = {"avx2": 1, "portable": 0, "avx512": 2, "bf16": 2, "avx512_emu": 2}


@pytest.fixture(scope="module")
def _variant_dlls(tmp_path_factory):
    built = {}

    def get(isa):
        if isa not in built:
            built[isa] = cpu_kernel.bind(variant_library(
                "paged_attention", isa, str(tmp_path_factory.mktemp("pa"))))
        return built[isa]

    return get


@pytest.fixture
def use_build(monkeypatch, _variant_dlls):
    """``use_build(isa)``: every kernel call in the test goes to that variant build."""

    def use(isa):
        bound = _variant_dlls(isa)
        monkeypatch.setattr(cpu_kernel, "load", lambda: bound)
        assert cpu_kernel.simd_level() == VARIANT_SIMD[isa]
        return bound

    return use


def test_native_build_runs_the_best_job_of_this_cpu():
    """(Or, under KVSERVE_CPU_BUILD, the job of the build it names.)"""
    from kvserve.cbuild import EMULATED, kernel_build

    with open("/proc/cpuinfo") as f:
        flags = f.read()
    want = 2 if " avx512f" in flags and " avx512bw" in flags else 1 if " avx2" in flags else 0
    build = kernel_build()
    assert cpu_kernel.simd_level() == VARIANT_SIMD.get(EMULATED.get(build, build), want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(8, 2, 64, 16), (6, 1, 128, 8),
                                                   (16, 2, 72, 16)])
@pytest.mark.parametrize("isa", list(VARIANT_SIMD))
def test_variant_job_matches_twin(use_build, isa, dtype, hq, hk, d, bs):
    use_build(isa)
    _kernel_vs_twin(dtype, hq, hk, d, bs, [37, 5, 61, 1, bs + 1], [37, 1, 20, 1, 1])
    _kernel_vs_twin(dtype, hq, hk, d, bs, [1, bs + 3, 97], [1, 1, 1])


@pytest.mark.parametrize("isa", ["native", "avx2", "avx512", "avx512_emu"])
@pytest.mark.parametrize(("dtype", "hk", "g", "d"), [
    (torch.float8_e4m3fn, 2, 2, 64), (torch.bfloat16, 3, 3, 64), (torch.int8, 1, 4, 64),
    (torch.float32, 2, 1, 64), (torch.bfloat16, 2, 2, 128), (torch.float8_e5m2, 1, 5, 64)])
def test_row_results_do_not_depend_on_tiling(use_build, isa, dtype, hk, g, d):
    """A prefill row's output is the same whether it is computed in a 16-row tile, as part of
    a different chunk, or alone as a decode row (chunked == unchunked, exactly) — also where
    the AVX-512 job runs decode rows on its register path (head_dim 64, <= 4 query heads per KV
    head) and prefill tiles on its staging path."""
    if isa != "native":
        use_build(isa)
    if not cpu_kernel.simd():
        pytest.skip("portable build: rows are never tiled")
    torch.manual_seed(3)
    kv, perm = _filled_cache(dtype, hk, d, 16)
    meta = _meta([50], [50], perm, 16)
    q = torch.randn(50, hk * g, d)
    be = CpuAttentionBackend(kv, hk * g, hk, d, d**-0.5, 1024)
    empty = torch.empty(0, hk, d)
    whole = be.forward(0, q, empty, empty, meta)
    for start, stop in [(0, 7), (7, 30), (30, 49), (49, 50)]:
        m = _meta([stop], [stop - start], perm, 16)
        part = be.forward(0, q[start:stop].contiguous(), empty, empty, m)
        assert torch.equal(part, whole[start:stop]), (start, stop)
    # every row alone, as a decode row of its own sequence
    for row in (0, 15, 16, 33, 48):
        m = _meta([row + 1], [1], perm, 16)
        assert torch.equal(be.forward(0, q[row:row + 1].contiguous(), empty, empty, m),
                           whole[row:row + 1]), row


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_write_kernel_bit_exact_with_twin(dtype, static):
    torch.manual_seed(2)
    t, h, d = 37, 3, 64
    x = torch.randn(t, h, d) * torch.logspace(-8, 6, t).view(-1, 1, 1)
    x[0, 0, :5] = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30])
    x[1] = 0.0
    st = torch.tensor([[[0.5, 2.0, 1e-3]]]).expand(1, 2, 3) if static else None
    fast = PagedKVCache(1, 8, 8, h, d, 2, KVMode(dtype), static_scales=st)
    twin = PagedKVCache(1, 8, 8, h, d, 2, KVMode(dtype), static_scales=st,
                        writer="reference")
    assert fast.use_kernel and not twin.use_kernel
    rows = torch.randperm(8 * 2 * 8)[:t]
    rows = (rows // 16) * 16 + rows % 8  # component-0 rows
    fast.write(0, rows, x, -x)
    twin.write(0, rows, x, -x)
    assert torch.equal(fast.data.view(torch.uint8), twin.data.view(torch.uint8))
    assert torch.equal(fast.scales.view(torch.int16), twin.scales.view(torch.int16))


@pytest.mark.parametrize("t,h,d", [(37, 3, 64), (5, 1, 8), (19, 2, 128), (9, 4, 576),
                                   (3, 3, 6)])
def test_int8_write_kernel_bit_exact_with_twin(t, h, d):
    """kvs_write_int8 == ref.int8_compute_codes + quantize (RNE ties, zero rows, huge and tiny
    rows beyond the code range, amax exactly on a code's threshold), payload and 1-byte scale
    codes, over shapes."""
    torch.manual_seed(2 + d)
    x = torch.randn(t, h, d) * torch.logspace(-8, 6, t).view(-1, 1, 1)
    x[0, 0, :5] = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30])[: min(5, d)]
    x[1] = 0.0
    if t > 2:
        x[2, 0] = (torch.arange(d) - d / 2 + 0.5) * 0.37  # mixed values and ties
        thr = int8.SCALE_TABLE * 127  # amax exactly on / just past a code's threshold
        x[2, -1, 0], x[-1, -1, 0] = thr[131], torch.nextafter(thr[97], torch.tensor(1e9))
    bs = 8
    nb = -(-t // bs) * 2
    fast = PagedKVCache(1, nb, bs, h, d, 2, KVMode(torch.int8))
    twin = PagedKVCache(1, nb, bs, h, d, 2, KVMode(torch.int8), writer="reference")
    assert fast.use_kernel and fast.scales.dtype == torch.int8
    rows = torch.randperm(nb * 2 * bs)[:t]
    rows = (rows // 16) * 16 + rows % 8  # component-0 rows
    rows = torch.unique(rows)[:t]
    x = x[: rows.numel()]
    fast.write(0, rows, x, -x)
    twin.write(0, rows, x, -x)
    assert torch.equal(fast.data, twin.data)
    assert torch.equal(fast.scales, twin.scales)
    assert int(fast.data.min()) >= -127


def test_int8_scale_table_matches_twin():
    """The kernel's 256 scales 2^(e/8) are bit-identical to kvserve.quant.int8.SCALE_TABLE."""
    assert torch.equal(cpu_kernel.int8_scale_table(), int8.SCALE_TABLE)


@pytest.mark.parametrize("seed", [None, 0])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_rotated_backend_kernel_matches_twin(dtype, seed):
    """A rotated (or plain) 8-bit cache written and read through the backend: the C kernel
    path and the pure-torch twin give the same attention (writes are bit-exact, reads within
    fp32 reassociation)."""
    torch.manual_seed(5)
    hq, hk, d, bs = 6, 2, 64, 16
    outs = []
    for use_kernel in (True, False):
        kv = PagedKVCache(1, 12, bs, hk, d, 2, KVMode(dtype, rotate=seed is not None),
                          rotation_seed=seed,
                          writer="c" if use_kernel else "reference")
        be = CpuAttentionBackend(kv, hq, hk, d, d**-0.5, 1024)
        be.use_kernel = use_kernel
        perm = list(range(12))
        meta = _meta([40, 7], [40, 7], perm, bs)
        meta.write_rows = torch.tensor(
            [perm[p // bs] * 2 * bs + p % bs for p in range(40)]
            + [perm[3 + p // bs] * 2 * bs + p % bs for p in range(7)])
        g = torch.Generator().manual_seed(0)
        q = torch.randn(47, hq, d, generator=g)
        k = torch.randn(47, hk, d, generator=g) * 3
        v = torch.randn(47, hk, d, generator=g)
        outs.append((be.forward(0, q, k, v, meta), kv.data.clone()))
    assert torch.equal(outs[0][1].view(torch.uint8), outs[1][1].view(torch.uint8))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-3)


def test_decode_row_alone_equals_row_in_batch():
    """One decode row alone (a job per kv head) and in a batch of 8 (jobs with all kv heads)
    gives the same bits."""
    torch.manual_seed(4)
    kv, perm = _filled_cache(torch.bfloat16, 2, 64, 16)
    lens = [33, 5, 70, 16, 1, 47, 90, 12]
    meta = _meta(lens, [1] * len(lens), perm, 16)
    q = torch.randn(len(lens), 8, 64)
    be = CpuAttentionBackend(kv, 8, 2, 64, 0.125, 1024)
    empty = torch.empty(0, 2, 64)
    batch = be.forward(0, q, empty, empty, meta)
    for i in range(len(lens)):
        alone = _meta([lens[i]], [1], meta.block_tables[i], 16)  # the same blocks
        out = be.forward(0, q[i:i + 1].contiguous(), empty, empty, alone)
        assert torch.equal(out, batch[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                                   torch.int8])
def test_kv_writer_strided_rows_and_offset_match_the_twin(dtype):
    """kvs_write_kv reads token rows ldx apart (k / v are views of the fused qkv output) and
    writes rows + row_offset; bf16 rounds to nearest even (a NaN stays a NaN), as torch's cast.
    The C writer and its twin (reference.write_rows, the "reference" writer) agree bit for bit (NaN
    payloads aside)."""
    torch.manual_seed(3)
    T, H, D, W = 5, 2, 16, 80
    fused = torch.randn(T, W) * 3
    fused[1, 40] = float("nan")
    fused[2, 41] = float("inf")
    fused[3, 42] = -float("inf")
    fused[4, 32:64] = 1.00390625 + torch.arange(32) * 2.0**-9  # bf16 ties
    x = fused[:, 32:64].view(T, H, D)  # rows W floats apart
    assert not x.is_contiguous()
    rows = torch.tensor([3, 0, 9, 17, 26])  # component-0 rows: block * 2 * 4 + slot

    def cache(use_kernel: bool) -> PagedKVCache:
        kv = PagedKVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=H, head_dim=D,
                          components=2, mode=KVMode(dtype),
                          writer="c" if use_kernel else "reference")
        kv.write(0, rows, x, x * 0.5)  # component 1 = rows + block_size
        return kv

    fast, twin = cache(True), cache(False)
    if dtype in (torch.bfloat16, torch.float32):
        torch.testing.assert_close(fast.data, twin.data, rtol=0, atol=0, equal_nan=True)
        assert fast.data.isnan().sum() == 2 and fast.data.isinf().sum() == 4
    else:  # 8-bit: non-finite policies are tests/quant/test_kv_nonfinite.py's; finite rows here
        fin = [0, 4]
        rows_fin = rows[fin]
        for c in (0, 1):
            got = fast.layer_rows(0)[rows_fin + 4 * c].view(torch.uint8)
            want = twin.layer_rows(0)[rows_fin + 4 * c].view(torch.uint8)
            assert torch.equal(got, want)


# ---- the AMX-BF16 job (head_dim % 32 == 0; BF16 / FP8 / INT8 KV) where the CPU has it ----
AMX_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.fixture
def amx_on():
    """The native build with its AMX-BF16 job on for the test (skipped without AMX-BF16)."""
    dll = cpu_kernel.load()
    was = cpu_kernel.has_amx(dll)
    if not cpu_kernel.set_amx(dll, True):
        pytest.skip("no AMX-BF16 on this CPU (or in this build)")
    yield dll
    cpu_kernel.set_amx(dll, was)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("hq", "hk", "d", "bs"), [(8, 2, 64, 16), (6, 1, 128, 8),
                                                   (9, 3, 64, 16), (4, 4, 64, 32),
                                                   (10, 2, 64, 4), (4, 2, 96, 16)])
def test_amx_job_matches_twin(amx_on, dtype, hq, hk, d, bs):
    """Decode rows and a mixed step (prefill tiles, an extend, decodes) on the AMX job (FP32 /
    FP16 KV keep the AVX-512 job) against the twin; the rows differ from the AVX-512 job's by
    fp32 rounding only."""
    lens = [1, bs, bs + 3, 5 * bs - 1, 97] + ([130] if bs >= 8 else [])  # (40 blocks)
    a = _kernel_vs_twin(dtype, hq, hk, d, bs, lens, [1] * len(lens))
    _kernel_vs_twin(dtype, hq, hk, d, bs, [37, 5, 61, 1, bs + 1], [37, 1, 20, 1, 1])
    cpu_kernel.set_amx(amx_on, False)
    b = _kernel_vs_twin(dtype, hq, hk, d, bs, lens, [1] * len(lens))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(("dtype", "hk", "g", "d"), [
    (torch.bfloat16, 3, 3, 64), (torch.int8, 1, 4, 64), (torch.bfloat16, 2, 2, 128),
    (torch.float8_e5m2, 1, 5, 64), (torch.float8_e4m3fn, 2, 8, 64)])
def test_amx_row_results_do_not_depend_on_tiling(amx_on, dtype, hk, g, d):
    """On the AMX job a row's output is the same bits in a 16-row tile, in another chunk, alone
    as a decode row, and as one of R speculative verify rows (R consecutive rows of one
    sequence) for every R -- query chunks of 16 included (g = 5, 8: 80 / 128 queries a head)."""
    torch.manual_seed(3)
    kv, perm = _filled_cache(dtype, hk, d, 16)
    meta = _meta([150], [150], perm, 16)
    q = torch.randn(150, hk * g, d)
    be = CpuAttentionBackend(kv, hk * g, hk, d, d**-0.5, 1024)
    empty = torch.empty(0, hk, d)
    whole = be.forward(0, q, empty, empty, meta)
    for start, stop in [(0, 7), (7, 30), (30, 49), (49, 50), (50, 150)]:
        m = _meta([stop], [stop - start], perm, 16)
        part = be.forward(0, q[start:stop].contiguous(), empty, empty, m)
        assert torch.equal(part, whole[start:stop]), (start, stop)
    for rows in range(1, 10):  # verify tiles ending at row 140
        m = _meta([141], [rows], perm, 16)
        part = be.forward(0, q[141 - rows:141].contiguous(), empty, empty, m)
        assert torch.equal(part, whole[141 - rows:141]), rows
    for row in (0, 15, 16, 33, 63, 64, 127, 149):
        m = _meta([row + 1], [1], perm, 16)
        assert torch.equal(be.forward(0, q[row:row + 1].contiguous(), empty, empty, m),
                           whole[row:row + 1]), row


def test_amx_decode_row_alone_equals_row_in_batch(amx_on):
    """As test_decode_row_alone_equals_row_in_batch, on the AMX job: a job per kv head alone,
    jobs with all kv heads in a batch of 8, and the same rows as 3-row verify tiles."""
    torch.manual_seed(4)
    kv, perm = _filled_cache(torch.bfloat16, 3, 64, 16)
    lens = [33, 5, 70, 16, 1, 47, 90, 130]
    meta = _meta(lens, [1] * len(lens), perm, 16)
    q = torch.randn(len(lens), 9, 64)
    be = CpuAttentionBackend(kv, 9, 3, 64, 0.125, 1024)
    empty = torch.empty(0, 3, 64)
    batch = be.forward(0, q, empty, empty, meta)
    for i in range(len(lens)):
        alone = _meta([lens[i]], [1], meta.block_tables[i], 16)  # the same blocks
        out = be.forward(0, q[i:i + 1].contiguous(), empty, empty, alone)
        assert torch.equal(out, batch[i:i + 1])
        if lens[i] >= 3:  # the row last of a 3-row verify tile (other rows' q: anything)
            qq = torch.cat([torch.randn(2, 9, 64), q[i:i + 1]])
            tile = be.forward(0, qq, empty, empty, _meta([lens[i]], [3], meta.block_tables[i],
                                                         16))
            assert torch.equal(tile[2:], batch[i:i + 1])


def test_amx_setting(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_AMX_ATTN", "1")
    assert cpu_kernel.amx_setting() is True
    monkeypatch.setenv("KVSERVE_CPU_AMX_ATTN", "0")
    assert cpu_kernel.amx_setting() is False
    monkeypatch.setenv("KVSERVE_CPU_AMX_ATTN", "")
    assert cpu_kernel.amx_setting() is cpu_kernel.AMX_DEFAULT
    monkeypatch.setenv("KVSERVE_CPU_AMX_ATTN", "yes")
    with pytest.raises(ValueError, match="KVSERVE_CPU_AMX_ATTN"):
        cpu_kernel.amx_setting()


def test_amx_switch_off_in_builds_without_it(use_build):
    """The ISA variants have no AMX code: the switch stays off and they run their own jobs."""
    dll = use_build("bf16" if cpu_kernel.simd_level() == 2 else "avx2")
    assert cpu_kernel.set_amx(dll, True) is False


def test_amx_verify_rows_with_a_table_per_row_are_tiled_alike(amx_on):
    """The engine's speculative verify rows come without row_seq, the sequence's table repeated
    per row (padded where a row needs one block fewer); the AMX job tiles them like rows of one
    sequence (and not rows whose tables differ): every row the same bits as alone, and as in
    a tile with row_seq."""
    torch.manual_seed(5)
    kv, perm = _filled_cache(torch.bfloat16, 3, 64, 16)
    data = kv.data[0]
    blocks = torch.tensor(perm[:10], dtype=torch.int64)
    other = torch.tensor(perm[10:20], dtype=torch.int64)
    lens = torch.tensor([60, 61, 62, 63, 64, 65, 66, 67], dtype=torch.int64)  # crosses a block
    tables = blocks.repeat(8, 1)
    tables[:5, 4:] = 0  # rows of 60..64 tokens: 4 blocks, padded
    tables[6] = other  # a row of another sequence in the middle: not tiled with its neighbours
    q = torch.randn(8, 9, 64)
    out = cpu_kernel.paged_attention(data, None, q, tables, None, lens, 0.125, torch.empty_like(q))
    for r in range(8):
        one = cpu_kernel.paged_attention(data, None, q[r:r + 1].contiguous(), tables[r:r + 1],
                                         None, lens[r:r + 1], 0.125, torch.empty_like(q[:1]))
        assert torch.equal(one, out[r:r + 1]), r
    tile = cpu_kernel.paged_attention(data, None, q[:6].contiguous(), blocks.view(1, -1),
                                      torch.zeros(6, dtype=torch.int64), lens[:6], 0.125,
                                      torch.empty_like(q[:6]))
    assert torch.equal(tile, out[:6])
