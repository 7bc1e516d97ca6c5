"""The mla_triton attention backend (Triton write + split-K MLA decode, torch prefill) equals
mla_torch: backend level on DeepSeek-V3-like dims over several mixed steps, and the engine
end to end (greedy tokens) on a tiny random DeepSeek-V3. On CPU the kernels run under the
Triton interpreter (tests/kernels/conftest.py), so shapes stay tiny."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve import SamplingParams  # noqa: E402
from kvserve.attention import get_backend, kv_writer, resolve_backend_name  # noqa: E402
from kvserve.attention.metadata import AttentionMetadata  # noqa: E402
from kvserve.cache.kv_cache import PagedKVCache  # noqa: E402
from kvserve.config import KVMode, resolve_attention_backend

# slow: Triton MLA backend in the interpreter
pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}

# DeepSeek-V3's attention shape, shrunk: heads, qk_nope, qk_rope, v, kv_lora_rank
H, DN, DR, DV, R = 4, 16, 16, 16, 32
BS, LAYERS, NUM_BLOCKS = 8, 2, 12


def _meta(steps: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """One step: sequence b computes positions [start_b, start_b + n_b) of its block table."""
    qsl, qlens, slens, rows = [0], [], [], []
    for (start, n), table in zip(steps, tables, strict=True):
        pos = torch.arange(start, start + n)
        rows.append(torch.tensor(table)[pos // BS] * BS + pos % BS)  # C = 1: row == slot
        qsl.append(qsl[-1] + n)
        qlens.append(n)
        slens.append(start + n)
    r = torch.cat(rows).to(DEVICE)
    return AttentionMetadata(qsl[-1], qsl, qlens, slens, tables, r, r)


def _backends(kv_dtype: torch.dtype):
    out = []
    for name in ("mla_torch", "mla_triton"):
        kv = PagedKVCache(LAYERS, NUM_BLOCKS, BS, 1, R + DR, 1, KVMode(kv_dtype), DEVICE,
                          writer=kv_writer(name, 1))
        be = get_backend(name, kv, H, 1, R + DR, (DN + DR) ** -0.5, 256)
        assert be.name == name
        out.append(be)
    return out


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_mla_triton_backend_equals_mla_torch(kv):
    """Prefill of two sequences, then steps mixing decodes with an extend chunk, both layers:
    same cache bytes (the fused write is bit-exact with the torch write) and the same output
    (decode through the Triton kernel vs mla_torch's absorbed torch decode)."""
    torch.manual_seed(0)
    ref, tri = _backends(KV_DTYPES[kv])
    tables = [[7, 2, 9, 4], [3, 10, 0]]  # out of order on purpose
    # (start, n) per sequence per step: prefill 11 + 5; then decode + extend; then 2 decodes x3
    schedule = [[(0, 11), (0, 5)], [(11, 1), (5, 6)], [(12, 1), (11, 1)], [(13, 1), (12, 1)],
                [(14, 1), (13, 1)]]
    w = [torch.randn(H * (DN + DV), R, device=DEVICE) * 0.2 for _ in range(LAYERS)]
    n_decode_steps = 0
    for steps in schedule:
        meta_a, meta_b = _meta(steps, tables), _meta(steps, tables)
        t = meta_a.num_tokens
        n_decode_steps += any(n == 1 for _, n in steps)
        for layer in range(LAYERS):
            latent = torch.randn(t, R + DR, device=DEVICE) * 2
            q_nope = torch.randn(t, H, DN, device=DEVICE)
            q_pe = torch.randn(t, H, DR, device=DEVICE)
            a = ref.forward_mla(layer, q_nope, q_pe, latent, meta_a, w[layer])
            b = tri.forward_mla(layer, q_nope, q_pe, latent, meta_b, w[layer])
            assert b.shape == (t, H, DV) and b.dtype == torch.float32
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
        assert meta_b.cache["mla_triton"].triton_decode is not None or all(
            n > 1 for _, n in steps)
    assert n_decode_steps == 4
    ca, cb = ref.kv_cache, tri.kv_cache
    assert torch.equal(ca.data.view(torch.uint8), cb.data.view(torch.uint8))
    if ca.scales is not None:
        assert torch.equal(ca.scales.view(torch.int16), cb.scales.view(torch.int16))


def test_mla_backend_family_resolution():
    mla = PagedKVCache(1, 2, BS, 1, R + DR, 1, KVMode(torch.bfloat16), "cpu")
    gqa = PagedKVCache(1, 2, BS, 2, 16, 2, KVMode(torch.bfloat16), "cpu")
    auto_cpu = resolve_attention_backend("auto", "cpu")  # the builder settles auto
    assert auto_cpu == "cpu" and resolve_attention_backend("auto", "cuda:0") == "triton"
    assert resolve_backend_name(auto_cpu, mla) == "mla_torch"  # CPU cache
    assert resolve_backend_name("torch", mla) == "mla_torch"
    assert resolve_backend_name("triton", mla) == "mla_triton"
    assert resolve_backend_name("mla_triton", mla) == "mla_triton"
    assert resolve_backend_name(auto_cpu, gqa) == "cpu"
    assert resolve_backend_name("torch", gqa) == "cpu"  # the old name, still accepted
    assert resolve_backend_name("triton", gqa) == "triton"
    if torch.cuda.is_available():
        cuda = PagedKVCache(1, 2, BS, 1, R + DR, 1, KVMode(torch.bfloat16), "cuda")
        assert resolve_backend_name(resolve_attention_backend("auto", "cuda"), cuda) \
            == "mla_triton"


@pytest.fixture(scope="module")
def tiny_ds3(tmp_path_factory) -> str:
    from tests.model.test_moe_mla import make_tiny_moe

    return make_tiny_moe(str(tmp_path_factory.mktemp("ds3")), "deepseek_v3")


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_greedy_on_mla_triton_equals_mla_torch(tiny_ds3, make_llm, kv):
    """Tiny DeepSeek-V3 (3 layers, MLA, MoE): greedy tokens with mla_triton forced equal
    mla_torch's; a batch of two prompts of different lengths, so decode steps batch two
    sequences of different lengths in one kernel launch. Pages of 8 tokens, so blocks fill
    (17 and 9 tokens) and get sealed."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 17, 33, 101, 5, 9, 200, 201, 202, 203, 204]},
               {"prompt_token_ids": [1, 9, 40]}]
    kw = dict(dtype="float32", kv_cache_dtype=kv, num_blocks=16, max_model_len=64,
              block_size=8)
    ref = make_llm(tiny_ds3, attention_backend="torch", **kw)  # CPU
    assert ref.engine.runner.backend.name == "mla_torch"
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    tri = make_llm(tiny_ds3, attention_backend="triton", device=DEVICE, **kw)
    assert tri.engine.runner.backend.name == "mla_triton"
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, sp)]
    assert got == want
    # the write kernel kept the checksum state and every full block was sealed from it
    integ = tri.engine.integrity
    assert integ is not None and tri.engine.kv_cache.csum_state is not None
    assert integ.seal_sources["write_state"] > 0 and not integ.seal_sources["recompute"]
    assert not integ.failures
    sealed = sorted(integ.seals)  # 3 full blocks; verify recomputes from the bytes
    assert len(sealed) >= 3 and integ.verify(sealed, "final") == []
