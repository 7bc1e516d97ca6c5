"""Recorded CPU decode graphs (kvserve/engine/cpu_graphs.py) against the eager engine: the
same tokens and the same logprobs, bit for bit, while the batch shrinks, prefills mix in,
prefixes are shared and sequences are preempted; and forwards that cannot be recorded are
refused (eager, still right)."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.cpu_graphs import CpuGraphRunner
from kvserve.kernels.cpu import graph
from kvserve.kernels.cpu.w16_gemm import w16_library

pytestmark = pytest.mark.skipif(not graph.available() or w16_library() is None,
                                reason="no C compiler")
# slow: engines recorded and replayed against eager ones
pytestmark = [pytestmark, pytest.mark.slow]

PROMPTS = [[5, 9, 17, 33], [100, 7, 250, 3, 8, 41, 77, 90, 11, 4, 300, 12, 13, 14, 15, 16, 17,
                            18, 19, 20], [5, 9, 17, 33, 60], [400, 401]]
MAX_TOKENS = [3, 9, 14, 21]  # the decode batch shrinks 4 -> 3 -> 2 -> 1


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> str:
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("bf16llama")), "llama",
                           save_dtype=torch.bfloat16, tie_word_embeddings=True)


@pytest.mark.parametrize("kind", ["avx512_bf16", "amx", "avx512", "avx2"])
def test_bf16_folder_records_on_every_cpu_kind(bf16_llama, make_llm, simulate_cpu, kind):
    """Issue 31: on AVX512-BF16 / AMX CPUs ``dtype=auto`` used to compute a bf16 folder in
    torch bf16 and the recording was refused (aten.embedding computes outside the kernels).
    With the CPU's flags simulated, the decode graph must record and replay."""
    simulate_cpu(kind)
    llm = make_llm(bf16_llama)
    g = _graphs(llm)
    assert g is not None, "decode graph refused (see the log)"
    assert g.refused is None and len(g.tape) > 0
    _generate(llm)
    assert g.runs > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["avx512_bf16", "amx"])
def test_default_model_records_on_bf16_cpus(make_llm, simulate_cpu, kind):
    """The default model (SmolLM2-135M Q4_1 GGUF, ``LLM()`` with no model) on an AVX512-BF16 /
    AMX CPU (simulated): the decode graph records (it was refused: aten.floor_divide computed
    outside the kernels when ``auto`` chose bf16)."""
    from kvserve.model.default_model import default_model_path

    try:
        default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    simulate_cpu(kind)
    llm = make_llm(None, kv_cache_memory="32MiB", max_num_seqs=4)
    assert llm.engine.model_config.dtype == torch.float32
    g = _graphs(llm)
    assert g is not None and g.refused is None and len(g.tape) > 0
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and g.runs > 0


def _generate(llm):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
              for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _graphs(llm) -> CpuGraphRunner | None:
    return llm.engine.runner.graphs


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2", "int8_plain", "int8", "fp8_rot"])
def test_replay_equals_eager(bf16_llama, make_llm, kv):
    eager = make_llm(bf16_llama, kv_cache_dtype=kv, enforce_eager=True,
                     max_num_batched_tokens=16)
    fast = make_llm(bf16_llama, kv_cache_dtype=kv, max_num_batched_tokens=16)
    assert _graphs(eager) is None
    g = _graphs(fast)
    assert isinstance(g, CpuGraphRunner) and g.refused is None and len(g.tape) > 0
    want = _generate(eager)
    got = _generate(fast)
    assert got == want  # token ids and every logprob, exactly
    assert g.runs >= sum(MAX_TOKENS) // 4  # decode-only steps replayed


def test_replay_equals_eager_under_preemption_and_prefix_hits(bf16_llama, make_llm):
    kw = dict(num_blocks=9, block_size=4, max_num_batched_tokens=16)
    eager = make_llm(bf16_llama, enforce_eager=True, **kw)
    fast = make_llm(bf16_llama, **kw)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[3]]  # shared prefixes
    want = [o.outputs[0] for o in eager.generate(prompts, sp)]
    got = [o.outputs[0] for o in fast.generate(prompts, sp)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert fast.engine.stats().num_preemptions > 0
    assert _graphs(fast).runs > 0


def test_rotated_kv_records_its_rotations(bf16_llama, make_llm):
    """int8 (rotated): q, k, v times R and the output times R^T run as recorded C kernels
    (kvs_rotate_heads), so the decode graph records; it was refused while torch multiplied."""
    g = _graphs(make_llm(bf16_llama, kv_cache_dtype="int8"))
    assert g is not None and g.refused is None
    assert g.tape.names.count("kvs_rotate_heads") == 4 * 2  # q, k, v, out in 2 layers


def test_fp32_weights_are_refused(tiny_llama, make_llm, caplog):
    """fp32 weights go through torch's GEMM: the recording is refused, with the reason."""
    with caplog.at_level("INFO", logger="kvserve"):
        llm = make_llm(tiny_llama)
    assert _graphs(llm) is None
    assert "CPU decode graphs off" in caplog.text and "computes" in caplog.text


def test_run_rejects_a_batch_it_does_not_cover(bf16_llama, make_llm):
    llm = make_llm(bf16_llama, max_num_seqs=2)
    g = _graphs(llm)
    assert g is not None and g.max_rows == 2
    from kvserve.attention.metadata import AttentionMetadata
    from kvserve.model.forward_batch import ForwardBatch

    meta = AttentionMetadata(num_tokens=3, query_start_loc=[0, 1, 2, 3], query_lens=[1, 1, 1],
                             seq_lens=[2, 2, 2], block_tables=[[0], [1], [2]],
                             write_rows=torch.zeros(3, dtype=torch.int64),
                             slot_mapping=torch.zeros(3, dtype=torch.int64))
    batch = ForwardBatch(input_ids=torch.zeros(3, dtype=torch.int64),
                         positions=torch.ones(3, dtype=torch.int64), meta=meta, attn=g.backend)
    assert not g.can_run(batch)
    with pytest.raises(ValueError, match="does not fit"):
        g.run(batch)
