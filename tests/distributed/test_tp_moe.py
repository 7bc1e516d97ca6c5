"""MoE and MLA under tensor parallelism (world size 2, spawned, gloo): Qwen3-MoE and GLM-4.5
with experts split like MLPs and with expert parallelism, DeepSeek-V3 (MLA: latent cache
replicated per rank); TP=2 logits, greedy and seeded tokens equal TP=1."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_driver
from tests.distributed.test_tp_engine import _assert_same, _engine_outputs, _replica_drill
from tests.model.test_moe_mla import make_tiny_moe

# slow: spawns tensor-parallel rank processes
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = make_tiny_moe(str(tmp_path_factory.mktemp(name)), name)
        return made[name]

    return get


def _expert_layout(path: str, ep: bool) -> dict:
    from kvserve import LLM
    from kvserve.layers.moe import FusedMoE

    llm = LLM(path, dtype="float32", kv_cache_dtype="fp32", num_blocks=16, progress=False,
              tensor_parallel_size=2, enable_expert_parallel=ep, distributed_timeout_s=60)
    try:
        moe = next(m for m in llm.engine.model.modules() if isinstance(m, FusedMoE))
        return {"lo": moe.expert_lo, "n": moe.num_local, "w13": list(moe.w13.shape),
                "w2": list(moe.w2.shape)}
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_moe_tp2_matches_tp1(moe_models, name, ep):
    _assert_same(run_driver(_engine_outputs, moe_models(name),
                            {"enable_expert_parallel": ep}))


def test_expert_placement(moe_models):
    """Rank 0 (the driver's shard) holds experts [0, 4) of 8 whole under EP, and all 8 with
    half the intermediate rows otherwise."""
    path = moe_models("qwen3_moe")  # 8 experts, moe_intermediate_size 32, hidden 64
    ep = run_driver(_expert_layout, path, True)
    assert ep == {"lo": 0, "n": 4, "w13": [4, 64, 64], "w2": [4, 64, 32]}
    split = run_driver(_expert_layout, path, False)
    assert split == {"lo": 0, "n": 8, "w13": [8, 32, 64], "w2": [8, 64, 16]}


def test_mla_latent_copies_compared_across_ranks(moe_models):
    """MLA under TP: every rank caches the same latent row. Rank 1's copy corrupted before
    its seal (its own seal agrees with the bad bytes) is caught by the seal-time comparison
    of the ranks' checksums, quarantined and recomputed: output identical."""
    res = run_driver(_replica_drill, moe_models("deepseek_v3"))
    assert res["replica"] == 0
    assert res["again"] == res["clean"]
    assert res["stats"]["failures"] == {"replica": 1}, res["stats"]
    assert res["stats"]["repairs"].get("rollback", 0) >= 1, res["stats"]


@pytest.fixture(scope="module")
def int4_moe_models(tmp_path_factory):
    """name -> the tiny MoE with moe_intermediate_size 64, quantized to INT4
    (compressed-tensors, asymmetric, group 32): each expert's 64 down_proj input columns
    split into 32 per rank, one whole group each.

    Why not the usual 32-wide experts with group 16: a 16-column slice is one group, which
    ``Int4Linear`` runs like a channel-wise weight on its fast path (bf16 scale/zero pairs),
    while the unsplit two-group weight takes the exact fp32 path (group 16 has no CPU op):
    a 2e-3 path difference, not a split error. With group 32 both sides take the same path."""
    from kvserve.quant.quantizer import quantize_checkpoint

    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            dense = make_tiny_moe(str(tmp_path_factory.mktemp(name)), name,
                                  moe_intermediate_size=64)
            out = str(tmp_path_factory.mktemp(f"{name}_int4"))
            quantize_checkpoint(dense, out, group_size=32, symmetric=False, progress=False)
            made[name] = out
        return made[name]

    return get


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_int4_moe_tp2_matches_tp1(int4_moe_models, name, ep):
    """INT4 experts split like MLPs (gate/up rows, down columns in whole groups) or placed
    whole per rank (EP); shared experts, dense layers and attention INT4 too."""
    _assert_same(run_driver(_engine_outputs, int4_moe_models(name),
                            {"enable_expert_parallel": ep}))


def _int4_expert_layout(path: str, ep: bool) -> dict:
    from kvserve import LLM
    from kvserve.layers.int4.moe import Int4FusedMoE
    from kvserve.layers.moe import ExpertMLP

    llm = LLM(path, dtype="float32", kv_cache_dtype="fp32", num_blocks=16, progress=False,
              tensor_parallel_size=2, enable_expert_parallel=ep, distributed_timeout_s=60)
    try:
        moe = next(m for m in llm.engine.model.modules() if isinstance(m, Int4FusedMoE))
        held = [e for e, m in enumerate(moe) if isinstance(m, ExpertMLP)]
        w = moe[held[0]]
        return {"held": held, "gate_up": list(w.gate_up_proj.dequantize().shape),
                "down": list(w.down_proj.dequantize().shape), "bytes": moe.weight_bytes()}
    finally:
        llm.engine.shutdown()


def test_int4_expert_placement(int4_moe_models):
    """Rank 0 holds INT4 experts 0-3 of 8 whole under EP; all 8 with half the rows and
    columns (one 32-column group of down_proj) otherwise; both hold half the bytes."""
    path = int4_moe_models("qwen3_moe")
    ep = run_driver(_int4_expert_layout, path, True)
    split = run_driver(_int4_expert_layout, path, False)
    assert ep["held"] == [0, 1, 2, 3] and ep["gate_up"] == [128, 64] and ep["down"] == [64, 64]
    assert split["held"] == list(range(8))
    assert split["gate_up"] == [64, 64] and split["down"] == [64, 32]
    assert abs(ep["bytes"] - split["bytes"]) / split["bytes"] < 0.2


def test_int4_moe_group_alignment_checked_up_front(moe_models, tmp_path):
    """Group 32 cannot split 32 expert columns over 2 ranks: a ValueError before any process
    starts, naming the parameter and the INT4 group size; expert parallel keeps experts whole
    and is accepted by the check."""
    from kvserve.model.parallel_check import validate_parallel
    from kvserve.quant.quantizer import quantize_checkpoint

    out = str(tmp_path / "g32")
    quantize_checkpoint(moe_models("qwen3_moe"), out, group_size=32, progress=False)
    with pytest.raises(ValueError, match=r"moe_intermediate_size / tensor_parallel_size "
                                         r"\(experts input, INT4 group size 32\)=32.*\[1\]"):
        validate_parallel(out, 2)
    validate_parallel(out, 2, enable_expert_parallel=True)
