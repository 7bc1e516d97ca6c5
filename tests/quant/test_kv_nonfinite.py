"""All-zero, all-NaN and +-inf rows through the 8-bit KV writers (INT8, FP8 E4M3 / E5M2).

The behaviour chosen (kvserve/quant/int8.py, fp8.py; twins in kvserve/kernels/reference): the
cache never stores a non-finite scale or an undefined code. A NaN element is stored as 0 and
does not enter its row's amax; +-inf saturates (INT8: code 127, element +-127; FP8: amax
clamped to FLT_MAX, so the scale is finite and the element reads back as +-FP8_MAX * scale); an
all-zero (or all-NaN) row gets the smallest scale and exact zeros. The C writer and the torch
twin agree bit for bit, and since scales are per row, a bad row never changes another row's
bytes."""

from __future__ import annotations

import pytest
import torch

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.config import KVMode
from kvserve.kernels import reference as ref
from kvserve.quant import fp8, int8

NAN, INF = float("nan"), float("inf")
D = 16
DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    good = torch.randn(3, D, generator=g) * 3
    mixed_nan = good[0].clone()
    mixed_nan[[1, 7]] = NAN
    mixed_inf = good[1].clone()
    mixed_inf[2], mixed_inf[9] = INF, -INF
    rows = [torch.zeros(D), torch.full((D,), NAN), torch.full((D,), INF),
            torch.full((D,), -INF), mixed_nan, mixed_inf, good[2]]
    return torch.stack(rows).view(-1, 1, D)  # [7, H=1, D]


def _write(kind: str, x: torch.Tensor, kernel: bool):
    kv = PagedKVCache(1, 4, 8, 1, D, 2, KVMode(DTYPES[kind]), writer="c" if kernel else "reference")
    if kernel and not kv.use_kernel:
        pytest.skip("C kernel not built")
    rows = torch.arange(x.shape[0])
    kv.write(0, rows, x, x)
    q = kv.layer_rows(0)[rows].clone()
    s = kv.scales[0].view(-1, 1)[rows].clone()
    return q, s


def _values(kind, q, s):
    return ref.int8_dequantize(q, s) if kind == "int8" else ref.fp8_dequantize(q, s)


@pytest.mark.parametrize("kind", list(DTYPES))
def test_c_writer_equals_twin_on_nonfinite_rows(kind):
    x = _rows()
    qc, sc = _write(kind, x, kernel=True)
    qt, st = _write(kind, x, kernel=False)
    assert torch.equal(qc.view(torch.uint8), qt.view(torch.uint8))
    assert torch.equal(sc.view(torch.uint8), st.view(torch.uint8))
    if kind == "int8":
        q2, s2 = ref.int8_quantize_dynamic(x)
    else:
        q2, s2 = ref.fp8_quantize_dynamic(x, DTYPES[kind])
        q3, s3 = ref.quantize_fp8_rows(x, DTYPES[kind])  # the Triton kernels' twin
        assert torch.equal(q3.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s3, s2)
    assert torch.equal(q2.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s2, st)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("kind", list(DTYPES))
def test_nonfinite_rows_store_finite_values_and_leave_other_rows_alone(kind, kernel):
    x = _rows()
    q, s = _write(kind, x, kernel)
    vals = _values(kind, q, s)[:, 0]  # [7, D]
    assert torch.isfinite(vals).all()
    if kind == "int8":
        assert int(q.min()) >= -127  # never the unused -128
        assert s[0].item() == s[1].item() == int8.CODE_MIN  # zero / all-NaN: smallest scale
        assert s[2].item() == s[3].item() == int8.CODE_MAX  # inf: largest scale
        top = 127 * int8.code_to_scale(s[2])
    else:
        assert torch.isfinite(s.float()).all() and (s.float() > 0).all()
        assert s[0].item() == s[1].item() == ref.fp8_compute_scales(torch.zeros(1, D),
                                                                DTYPES[kind]).item()
        top = fp8.FP8_MAX[DTYPES[kind]] * s[2].float()
    # all-zero and all-NaN rows: exact zeros; +-inf rows: +-the largest value, everywhere
    assert torch.equal(vals[0], torch.zeros(D)) and torch.equal(vals[1], torch.zeros(D))
    assert torch.equal(vals[2], top.expand(D)) and torch.equal(vals[3], -top.expand(D))
    # a NaN element is stored as 0 and the rest of its row as if it were 0
    clean = x[4].nan_to_num(nan=0.0).unsqueeze(0)
    qa, sa = _write(kind, clean, kernel)
    assert torch.equal(q[4].view(torch.uint8), qa[0].view(torch.uint8)) and s[4] == sa[0]
    assert (vals[4, [1, 7]] == 0).all()
    # +-inf elements saturate: the row's scale is the largest, the element +-top
    assert vals[5, 2] == top and vals[5, 9] == -top
    # the good row is stored exactly as when written alone (scales are per row)
    qg, sg = _write(kind, x[6:], kernel)
    assert torch.equal(q[6].view(torch.uint8), qg[0].view(torch.uint8)) and s[6] == sg[0]
    bound = x[6].abs().amax() / 254 * 2 ** (1 / 8) if kind == "int8" else (
        x[6].abs().amax() * 2**-3)
    assert ((vals[6] - x[6, 0]).abs() <= bound * (1 + 2**-20)).all()
