"""KqLinear (kvserve/layers/int4/kq_linear.py): a GGUF Q5_0 / Q5_1 / K-quant linear kept packed
computes its twin's product, holds the file's bytes within 10%, and records into a CPU graph
that replays it over fewer rows."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import graph
from kvserve.layers.int4.kq_linear import KqLinear
from kvserve.quant import kq
from tests.quant.test_kq import TYPES, random_blocks

pytest.importorskip("gguf")


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("terms", [0, 1, 2])
def test_forward_matches_twin_and_bytes_stay_near_the_file(name, terms):
    n, k = 40, 512
    raw = torch.from_numpy(random_blocks(name, n, k, 7).copy())
    layer = KqLinear.from_blocks(raw, (n, k), terms, name)
    x = torch.randn(3, 2, k)
    y = layer(x)
    assert y.shape == (3, 2, n)
    w = layer.dequantize()
    x2 = x.reshape(-1, k)
    want = ref.kq_matmul(x2, [layer.parts()], terms) if terms else x2 @ w.t()
    scale = x2.abs() @ w.abs().t()
    assert ((y.reshape(-1, n) - want).abs() / scale).max() < 2e-5
    # rows pad to 16 (40 -> 48): per padded row the file's bytes within 10%
    assert 1.0 <= layer.weight_bytes() / (raw.numel() * 48 / 40) <= 1.1
    assert name in repr(layer)
    # the layer's weight is gguf.quants.dequantize's, bit for bit
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    assert torch.equal(w, torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[name])))


@pytest.mark.skipif(not graph.available(), reason="no C compiler")
def test_records_into_a_cpu_graph_and_replays_fewer_rows():
    n, k = 48, 256
    layer = KqLinear.from_blocks(torch.from_numpy(random_blocks("Q4_K", n, k, 1).copy()),
                                 (n, k), 2, "Q4_K")
    x = torch.randn(6, k)
    with torch.inference_mode(), graph.recording() as tape:
        y = layer(x)
    assert tape.names == ["kvs_kq_linear"] and tape.max_rows == 6
    x_new = torch.randn(2, k)
    want = layer(x_new)
    before = y[2:].clone()
    x[:2] = x_new
    tape.replay(2)
    assert torch.equal(y[:2], want) and torch.equal(y[2:], before)


def test_errors():
    raw = torch.from_numpy(random_blocks("Q6_K", 16, 256).copy())
    with pytest.raises(ValueError, match="act_terms"):
        KqLinear.from_blocks(raw, (16, 256), 3, "Q6_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        KqLinear(kq.KqParts(14, torch.zeros(16, 32, dtype=torch.uint8),
                            torch.zeros(16, 1, dtype=torch.float16), None, None, None))
