"""MoE and MLA under tensor parallelism (world size 2, spawned, gloo): Qwen3-MoE and GLM-4.5
with experts split like MLPs and with expert parallelism, DeepSeek-V3 (MLA: latent cache
replicated per rank); TP=2 logits, greedy and seeded tokens equal TP=1."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_driver
from tests.distributed.test_tp_engine import _assert_same, _engine_outputs, _replica_drill
from tests.model.test_moe_mla import make_tiny_moe


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
