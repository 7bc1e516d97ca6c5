"""Every ggml type llama.cpp's quantize presets write loads (kvserve.layers.int4.gguf_types).

Tiny llama GGUFs (hidden 256: whole K-quant super-blocks) are written with ``gguf.GGUFWriter``;
blocks come from ``gguf.quants.quantize`` where the library can and are hand-packed where it
cannot (tests/model/gguf_blocks.py). The reference is the same file with every tensor
dequantized by ``gguf.quants.dequantize`` and written as F32: with fp32 activations both must
give the same logits up to fp32 rounding, whichever path (packed / dequantized) a type takes.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from tests.model.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from kvserve.layers.int4.gguf_types import GGML_TYPES, path_of  # noqa: E402

PRESET_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
OTHER_IQ = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
PROMPTS = [[5, 9, 17, 33, 8], [100, 7, 250, 3, 8, 41, 2, 77]]

# one file, every type at once: each linear (and the embedding / head) its own type, so the
# fused q/k/v and gate/up modules mix types
ALL_AT_ONCE = {
    "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_1", "blk.0.attn_v": "Q5_0",
    "blk.0.attn_output": "Q5_1", "blk.0.ffn_gate": "Q8_0", "blk.0.ffn_up": "Q2_K",
    "blk.0.ffn_down": "Q3_K", "blk.1.attn_q": "Q4_K", "blk.1.attn_k": "Q5_K",
    "blk.1.attn_v": "Q6_K", "blk.1.attn_output": "IQ4_NL", "blk.1.ffn_gate": "IQ4_XS",
    "blk.1.ffn_up": "BF16", "blk.1.ffn_down": "F16", "token_embd": "IQ2_XS",
    "output": "IQ3_S",
}
# every shard of every fused module packed, with two types inside q/k/v and gate/up
PACKED_MIX = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
              "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0",
              "output": "Q8_0"}


def _by_prefix(table: dict[str, str]):
    def types(gname: str) -> str:
        base = gname.rsplit(".", 1)[0]
        if base in table:
            return table[base]
        return table.get(base.split(".")[-1], "F32")

    return types


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """(types) -> (GGUF path, the same tensors dequantized to F32): both written once."""
    from tests.conftest import make_tiny_model
    from tests.model.gguf_blocks import blocks_of

    hf = make_tiny_model(str(tmp_path_factory.mktemp("hf") / "m"), "llama", **TINY)
    made: dict = {}

    def make(name: str, types) -> tuple[str, str]:
        if name in made:
            return made[name]
        d = str(tmp_path_factory.mktemp(f"gguf-{name}"))
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

        path = write_gguf(hf, os.path.join(d, f"{name}.gguf"), types, data)
        ref = write_gguf(hf, os.path.join(d, f"{name}-f32.gguf"), lambda g: "F32", reference)
        made[name] = (path, ref)
        return made[name]

    return make


def _logits(llm) -> list[torch.Tensor]:
    return [llm.engine.prompt_logits(p) for p in PROMPTS]


def _assert_same_logits(a, b, atol: float = 2e-4) -> None:
    for x, y in zip(_logits(a), _logits(b), strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-4)


def test_table_covers_every_preset_type():
    for name in (*PRESET_TYPES, *OTHER_IQ):
        path = path_of(QT[name], "t")
        assert path.kind in ("float", "packed", "dequantized"), name
    assert {t.name for t in GGML_TYPES if GGML_TYPES[t].kind == "float"} == {"F32", "F16",
                                                                             "BF16"}
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        assert GGML_TYPES[QT[name]].kind == "packed" and GGML_TYPES[QT[name]].linear
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.x' has ggml type Q8_K"):
        path_of(QT.Q8_K, "blk.0.x")
    with pytest.raises(ValueError, match=r"'w' has ggml type id 999"):
        path_of(999, "w")


def test_every_type_in_one_mixed_file(gguf_pair, make_llm, caplog):
    """All 15 preset types and two IQ types in one file (fused modules of mixed types): the
    logits equal the dequantized file's; the start-up log names each type and its path."""
    path, ref = gguf_pair("all", _by_prefix(ALL_AT_ONCE))
    with caplog.at_level(logging.INFO, logger="kvserve.model.gguf"):
        llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32")
    text = caplog.text
    for kind in (*PRESET_TYPES, "IQ2_XS", "IQ3_S"):
        assert f"GGUF {kind} x" in text, kind
    assert "dequantized" in text and "resident" in text and "the file's" in text
    _assert_same_logits(llm, make_llm(ref, dtype="float32", kv_cache_dtype="fp32"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*PRESET_TYPES[1:], *OTHER_IQ])
def test_each_type_loads_and_matches_dequantized(kind, gguf_pair, make_llm):
    """A file whose every matrix is ``kind`` (norms F32): logits equal the F32 reference."""
    path, ref = gguf_pair(kind, lambda g: kind)
    llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32")
    _assert_same_logits(llm, make_llm(ref, dtype="float32", kv_cache_dtype="fp32"))
    if GGML_TYPES[QT[kind]].kind == "packed":
        assert type(llm.engine.model.model.layers[0].mlp.gate_up_proj).__name__ == "GGUFLinear"


def test_packed_mixed_fused_modules(gguf_pair, make_llm):
    """q/k Q4_0 + v Q8_0 and gate Q8_0 + up Q4_1: each fused module stays packed as two parts
    (outputs side by side); logits equal the reference; weights held near the file's bytes."""
    from kvserve.layers.int4.gguf_linear import GGUFLinear
    from kvserve.model.loader import weight_bytes

    path, ref = gguf_pair("mix", _by_prefix(PACKED_MIX))
    llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32")
    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)
    assert len(layer.self_attn.qkv_proj.parts) == 2
    assert isinstance(layer.mlp.gate_up_proj, GGUFLinear)
    _assert_same_logits(llm, make_llm(ref, dtype="float32", kv_cache_dtype="fp32"))
    held, _ = weight_bytes(llm.engine.model)
    gg = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in gg.tensors)
    assert held < 1.25 * file_bytes  # norms fp32, rows padded to 16-row tiles


def test_packed_mixed_decode_graph_replays_eager(gguf_pair, make_llm):
    """The mixed packed file's decode steps replay from a recorded CPU graph (the parts'
    concatenation included): same tokens and logprobs as the eager engine."""
    from kvserve import SamplingParams
    from kvserve.kernels.cpu import graph

    if not graph.available():
        pytest.skip("no C compiler")
    path, _ = gguf_pair("mix", _by_prefix(PACKED_MIX))
    fast, eager = make_llm(path), make_llm(path, enforce_eager=True)
    sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
          for m in (4, 9)]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fast.generate(PROMPTS, sp)]
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in eager.generate(PROMPTS, sp)]
    assert got == want
    g = fast.engine.runner.graphs
    assert g is not None and g.runs > 0


def test_unreadable_type_names_type_and_tensor(tmp_path):
    """A tensor of a type gguf cannot dequantize (Q8_K): a ValueError naming both."""
    from kvserve.model.gguf import GGUFCheckpoint

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 256), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 292), np.uint8), raw_dtype=QT.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q8_K"):
        GGUFCheckpoint(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("dim", [0, 1])
def test_gguf_linear_slices_blocks_for_tensor_parallel(dim):
    """A rank's part of a packed GGUF module: rows (column parallel) or whole blocks of columns
    (row parallel) of each shard's raw blocks, the same weights as the dequantized slice; a
    split inside a block is refused."""
    from gguf.quants import quantize

    from kvserve.layers.int4.gguf_linear import GGUFLinear
    from kvserve.layers.linear import ShardSlice

    g = torch.Generator().manual_seed(dim)
    full = {"q": torch.randn(32, 128, generator=g), "v": torch.randn(16, 128, generator=g)}
    kinds = {"q": QT.Q4_0, "v": QT.Q8_0}
    raw = {s: torch.from_numpy(quantize(w.numpy(), kinds[s])) for s, w in full.items()}
    dense = {s: torch.from_numpy(dequantize(raw[s].numpy(), kinds[s])) for s in full}
    if dim == 0:
        plan = {"q": ShardSlice(0, 16, 16, 32), "v": ShardSlice(0, 8, 8, 16)}
        sizes, k = (16, 8), 128
        want = torch.cat([dense["q"][16:], dense["v"][8:]])
    else:
        plan = {s: ShardSlice(1, 64, 64, 128) for s in full}
        sizes, k = (32, 16), 64
        want = torch.cat([dense["q"][:, 64:], dense["v"][:, 64:]])
    mod = GGUFLinear(k, sizes, ("q", "v"), kinds, {"q": "m.q", "v": "m.v"}, act_terms=0,
                     tp_plan=plan, full_in=128, full_out_sizes=(32, 16))
    for s in ("q", "v"):
        mod.gguf_blocks.weight_loader(mod.gguf_blocks, raw[s], s)
    assert torch.equal(mod.dequantize(), want)
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(mod(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    bad = GGUFLinear(48, (32,), (None,), {None: QT.Q8_0}, {None: "m.o"}, act_terms=0,
                     tp_plan={None: ShardSlice(1, 16, 48, 128)}, full_in=128)
    with pytest.raises(ValueError, match="not whole Q8_0 blocks of 32"):
        bad.gguf_blocks.weight_loader(bad.gguf_blocks, raw["q"].new_zeros(32, 4 * 34), None)
