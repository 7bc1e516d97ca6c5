"""kvserve/csrc/cpu_ops.c against the torch code it replaces (the twins), on the build this
machine makes and every ISA variant this CPU runs (AVX2, portable, AVX-512, AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import cpu_ops
from kvserve.layers.rotary import RotaryEmbedding
from tests.conftest import isa_variants, variant_library


class _Cfg:
    rope_theta = 10000.0
    rope_scaling = None
    rope_parameters = None


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory):
    """``isa -> the cpu_ops library built for it``, each compiled once per module."""
    built: dict = {}

    def get(isa: str):
        if isa not in built:
            built[isa] = variant_library("cpu_ops", isa, str(tmp_path_factory.mktemp("ops")))
        return built[isa]

    return get


@pytest.fixture(params=isa_variants("avx512_emu", "bf16_emu"))  # (no AVX-512 code)
def lib(request, variant_builds, monkeypatch):
    if request.param == "native":
        if cpu_ops.ops_library() is None:
            pytest.skip("C kernels unavailable")
        yield cpu_ops.ops_library()
        return
    dll = variant_builds(request.param)
    cpu_ops.ops_library.cache_clear()
    real = cpu_ops.build_library
    monkeypatch.setattr(cpu_ops, "build_library", lambda name: dll if name == "cpu_ops"
                        else real(name))
    yield cpu_ops.ops_library()
    cpu_ops.ops_library.cache_clear()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("t,h,hk,d,rd", [(1, 9, 3, 64, 64), (5, 4, 2, 32, 16), (17, 2, 1, 128, 64)])
def test_rope_in_place_matches_twin(lib, interleaved, t, h, hk, d, rd):
    rot = RotaryEmbedding(_Cfg(), rd, 512, interleaved=interleaved)
    qkv = torch.randn(t, (h + 2 * hk) * d)
    pos = torch.randint(0, 512, (t,))
    want = rot(pos, qkv[:, :(h + hk) * d].view(t, h + hk, d).clone())
    got = qkv.clone()
    assert rot.rotate_qk_(pos, got, h + hk, d)
    torch.testing.assert_close(got[:, :(h + hk) * d].view(t, h + hk, d), want, rtol=1e-6,
                               atol=1e-6)
    assert torch.equal(got[:, (h + hk) * d:], qkv[:, (h + hk) * d:])  # v untouched


def test_rope_declines_what_it_does_not_take(lib):
    rot = RotaryEmbedding(_Cfg(), 64, 64)
    pos = torch.zeros(2, dtype=torch.int64)
    assert not rot.rotate_qk_(pos, torch.randn(2, 128).bfloat16(), 2, 64)  # not fp32
    assert not rot.rotate_qk_(pos.int(), torch.randn(2, 128), 2, 64)  # int32 positions


@pytest.mark.parametrize("t,i", [(1, 1536), (7, 37), (64, 256)])
def test_silu_mul_matches_twin(lib, t, i):
    gu = torch.randn(t, 2 * i) * 6  # both signs, past exp's easy range
    gu[0, 0], gu[0, 1] = -100.0, 100.0
    got = cpu_ops.silu_mul(gu)
    torch.testing.assert_close(got, F.silu(gu[:, :i]) * gu[:, i:], rtol=1e-5, atol=1e-6)
    assert cpu_ops.silu_mul(gu.bfloat16()) is None


@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_matches_twin(lib, with_x):
    x, res, w = torch.randn(6, 576), torch.randn(6, 576), torch.randn(576)
    new_res = res + x if with_x else res.clone()
    want = F.rms_norm(new_res, (576,), w, 1e-5)
    r = res.clone()
    got = cpu_ops.add_rms_norm(x if with_x else None, r, w, 1e-5)
    torch.testing.assert_close(r, new_res, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,h,d", [(1, 1, 7), (3, 9, 64), (5, 2, 40), (2, 3, 24), (17, 4, 128)])
def test_rotate_heads_matches_twin_and_is_batch_invariant(lib, t, h, d):
    """kvs_rotate_heads against its twin (x @ R per head), on q as it sits inside a fused qkv
    row (row stride past the heads); each row's result alone equals its result in the batch."""
    from kvserve.kernels import reference
    from kvserve.quant.rotation import rotation_matrix

    r = rotation_matrix(d, 3).contiguous()
    qkv = torch.randn(t, (h + 2) * d)
    q = qkv[:, : h * d].view(t, h, d)  # strides (qkv width, d, 1)
    got = cpu_ops.rotate_heads(q, r)
    assert got is not None and got.is_contiguous() and got.shape == (t, h, d)
    torch.testing.assert_close(got, reference.rotate_heads(q, r), rtol=1e-5, atol=1e-5)
    for i in range(t):
        assert torch.equal(cpu_ops.rotate_heads(q[i:i + 1], r)[0], got[i])
    back = cpu_ops.rotate_heads(got, r.t().contiguous())  # R^T undoes R
    torch.testing.assert_close(back, q, rtol=1e-5, atol=1e-5)
    # what it does not take: bf16, a head stride other than d, a non-square R
    assert cpu_ops.rotate_heads(q.bfloat16(), r) is None
    assert cpu_ops.rotate_heads(qkv.view(t, h + 2, d)[:, ::2], r) is None
    assert cpu_ops.rotate_heads(q, torch.randn(d, d + 1)) is None


@pytest.mark.parametrize("t,i", [(1, 2048), (7, 37), (64, 256)])
def test_gelu_tanh_mul_matches_twin(lib, t, i):
    gu = torch.randn(t, 2 * i) * 4  # both signs, the cubic term large
    gu[0, 0], gu[0, 1] = -100.0, 100.0
    got = cpu_ops.gelu_tanh_mul(gu)
    want = F.gelu(gu[:, :i], approximate="tanh") * gu[:, i:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cpu_ops.gelu_tanh_mul(gu.bfloat16()) is None


@pytest.mark.parametrize("t,h,hk,d", [(1, 4, 1, 256), (5, 8, 2, 64), (3, 2, 2, 20)])
def test_head_rms_norm_in_place_matches_twin(lib, t, h, hk, d):
    """q's heads and then k's, in place inside a fused qkv row; v untouched."""
    qkv = torch.randn(t, (h + 2 * hk) * d) * 3
    wq, wk = torch.randn(d), torch.randn(d)
    want_q = F.rms_norm(qkv[:, : h * d].view(t, h, d), (d,), wq, 1e-6)
    want_k = F.rms_norm(qkv[:, h * d : (h + hk) * d].view(t, hk, d), (d,), wk, 1e-6)
    got = qkv.clone()
    assert cpu_ops.head_rms_norm_applies(got, wq)
    cpu_ops.head_rms_norm_(got, 0, h, d, wq, 1e-6)
    cpu_ops.head_rms_norm_(got, h, hk, d, wk, 1e-6)
    torch.testing.assert_close(got[:, : h * d].view(t, h, d), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, h * d : (h + hk) * d].view(t, hk, d), want_k, rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(got[:, (h + hk) * d :], qkv[:, (h + hk) * d :])
    assert not cpu_ops.head_rms_norm_applies(qkv.bfloat16(), wq)


def test_scale_in_place_matches_twin(lib):
    x = torch.randn(5, 640)
    want = x * torch.tensor(640**0.5)
    assert cpu_ops.scale_(x, 640**0.5)
    torch.testing.assert_close(x, want, rtol=1e-7, atol=0)
    assert not cpu_ops.scale_(x.bfloat16(), 2.0)


@pytest.mark.parametrize("t,ns", [(1, (32, 16)), (5, (64, 8, 24)), (3, (16, 16, 16, 40))])
def test_concat_cols_matches_torch_cat(lib, t, ns):
    """GGUF fused modules of mixed types: parts side by side, one of them a strided view (a
    padded part's [:, :n]), exactly torch.cat."""
    parts = [torch.randn(t, n + 5)[:, :n] if i == 0 else torch.randn(t, n)
             for i, n in enumerate(ns)]
    got = cpu_ops.concat_cols(parts)
    assert got is not None and torch.equal(got, torch.cat(parts, -1))
    assert cpu_ops.concat_cols([p.double() for p in parts]) is None  # not fp32: the twin
    assert cpu_ops.concat_cols([parts[0]] * 5) is None  # more than 4 parts
