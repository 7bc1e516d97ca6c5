"""A tiny Llama GGUF mixing the types of a llama.cpp Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0; fused
q/k/v and gate/up of different types) loads with every linear packed (Q4_K / Q6_K / Q5_0 on
kvserve/csrc/kq_gemm.c, Q8_0 on wq_gemm.c), holds its linears within 10% of their file bytes,
generates the same greedy tokens as the same file with every tensor dequantized to F32, and
replays its decode steps from recorded CPU graphs."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from tests.model.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
# llama.cpp's Q4_K_M choices, in miniature: v / down Q6_K, the rest Q4_K, one fused shard Q5_0
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "token_embd": "Q8_0",
          "output": "Q6_K"}
PROMPTS = [[5, 9, 17, 33, 8], [100, 7, 250, 3, 8, 41, 2, 77], [1, 2, 3]]


def _types(gname: str) -> str:
    base = gname.rsplit(".", 1)[0].split(".")[-1]
    return Q4_K_M.get(base, "F32")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the mixed GGUF, the same tensors dequantized by gguf and written as F32)."""
    from tests.conftest import make_tiny_model
    from tests.model.gguf_blocks import blocks_of

    hf = make_tiny_model(str(tmp_path_factory.mktemp("hf") / "m"), "llama", **TINY)
    d = str(tmp_path_factory.mktemp("gguf"))
    stored: dict[str, tuple[np.ndarray, str]] = {}

    def data(gname: str, arr: np.ndarray, kind: str) -> np.ndarray:
        raw = blocks_of(arr, kind, seed=len(stored))
        stored[gname] = (raw, kind)
        return raw

    def reference(gname: str, arr: np.ndarray, kind: str) -> np.ndarray:
        raw, k = stored[gname]
        if k in ("F32", "F16"):
            return raw.astype(np.float32)
        return dequantize(raw, QT[k]).astype(np.float32).reshape(arr.shape)

    path = write_gguf(hf, os.path.join(d, "q4_k_m.gguf"), _types, data)
    ref = write_gguf(hf, os.path.join(d, "f32.gguf"), lambda g: "F32", reference)
    return path, ref


def _greedy(llm, n: int = 8):
    from kvserve import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


def test_q4_k_m_mix_loads_packed_and_decodes_like_dequantized(files, make_llm, caplog):
    from kvserve.layers.int4.gguf_linear import GGUFLinear
    from kvserve.layers.int4.kq_linear import KqLinear

    path, ref = files
    with caplog.at_level(logging.INFO, logger="kvserve.model.gguf"):
        llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32")
    for kind in ("Q4_K", "Q6_K", "Q5_0"):
        assert f"GGUF {kind} x" in caplog.text and "kq_gemm.c" in caplog.text, kind
    model = llm.engine.model
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, GGUFLinear) and isinstance(gate_up, GGUFLinear)
    # q Q4_K, k Q5_0, v Q6_K: three parts; gate Q4_K + up Q8_0: two
    assert [type(p).__name__ for p in qkv.parts] == ["KqLinear"] * 3
    assert [p.type_name for p in qkv.parts] == ["Q4_K", "Q5_0", "Q6_K"]
    assert [type(p).__name__ for p in gate_up.parts] == ["KqLinear", "Q8Linear"]
    assert isinstance(layer.mlp.down_proj.parts[0], KqLinear)
    # resident bytes of the packed linears vs the same tensors' bytes in the file
    reader = gguf.GGUFReader(path)
    file_linear = sum(int(t.n_bytes) for t in reader.tensors  # every linear, the head too
                      if "norm" not in t.name and not t.name.startswith("token_embd"))
    held = sum(m.weight_bytes() for m in model.modules() if isinstance(m, GGUFLinear))
    assert file_linear <= held <= 1.10 * file_linear, (held, file_linear)
    # greedy tokens equal the dequantized file's (int8x2 activations, the default)
    want = _greedy(make_llm(ref, dtype="float32", kv_cache_dtype="fp32", enforce_eager=True))
    assert _greedy(llm) == want


def test_q4_k_m_mix_decode_graph_replays_eager(files, make_llm):
    from kvserve import SamplingParams
    from kvserve.kernels.cpu import graph

    if not graph.available():
        pytest.skip("no C compiler")
    path, _ = files
    fast, eager = make_llm(path), make_llm(path, enforce_eager=True)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fast.generate(PROMPTS, sp)]
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in eager.generate(PROMPTS, sp)]
    assert got == want
    g = fast.engine.runner.graphs
    assert g is not None and g.runs > 0
    assert g.tape is not None and "kvs_kq_linear" in g.tape.names


def test_docs_type_table_matches_the_dispatch_table():
    """docs/quantization.md's coverage rows say packed / dequantized / as stored as
    GGML_TYPES does, and name the kernel of every packed type."""
    import pathlib
    import re

    from kvserve.layers.int4.gguf_types import GGML_TYPES

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "quantization.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("packed", "dequantized", "as stored"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = cells
    kinds = {"packed": "packed", "dequantized": "dequantized", "as stored": "float"}
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        assert name in rows, name
        path = GGML_TYPES[QT[name]]
        assert kinds[rows[name][1]] == path.kind, name
        if path.kind == "packed":
            assert rows[name][2].strip("`").split("`")[0] in path.kernel, name
