"""KV tiers under tensor parallelism (tp=2 on CPU): each rank writes down and restores its own
slice in its own entries; a block is restored only when every rank verified its slice; a
restart finds both ranks' entries."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_driver

pytestmark = pytest.mark.slow  # spawns tensor-parallel engines

PROMPTS = [list(range(3, 90)), list(range(200, 280)), list(range(3, 60)) + [7, 8, 9]]


def _kw(**kw) -> dict:
    base = dict(dtype="float32", kv_cache_dtype="int8", progress=False, tensor_parallel_size=2,
                distributed_timeout_s=60, block_size=16)
    base.update(kw)
    return base


def _tp_tiers(path: str, directory: str) -> dict:
    import os

    from kvserve import LLM, SamplingParams
    from kvserve.cache import block_store as bs

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]

    res: dict = {}
    cold = LLM(path, **_kw(num_blocks=64))
    try:
        res["cold"] = run(cold)
    finally:
        cold.engine.shutdown()
    llm = LLM(path, **_kw(num_blocks=10, kv_offload_dir=directory, kv_offload_disk=0.01))
    try:
        res["first"] = run(llm)
        res["again"] = run(llm)
        res["restored"] = llm.engine.kv_manager.num_restored_tokens
    finally:
        llm.engine.shutdown()
    ranks: dict[int, int] = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            hdr = bs.read_header(f.read())
        ranks[hdr["spec"]["rank"]] = ranks.get(hdr["spec"]["rank"], 0) + 1
    res["files_by_rank"] = ranks
    # restart: both ranks find their entries
    llm = LLM(path, **_kw(num_blocks=64, kv_offload_dir=directory, kv_offload_disk=0.01))
    try:
        res["restart"] = run(llm)
        res["restart_restored"] = llm.engine.kv_manager.num_restored_tokens
    finally:
        llm.engine.shutdown()
    # damage every rank-1 entry: rank 0's slices verify, rank 1's do not -> nothing restored
    for name in os.listdir(directory):
        path_ = os.path.join(directory, name)
        with open(path_, "rb") as f:
            blob = bytearray(f.read())
        if bs.read_header(bytes(blob))["spec"]["rank"] == 1:
            blob[-40] ^= 0x10
            with open(path_, "wb") as f:
                f.write(blob)
    llm = LLM(path, **_kw(num_blocks=64, kv_offload_dir=directory, kv_offload_disk=0.01))
    try:
        res["damaged"] = run(llm)
        res["damaged_restored"] = llm.engine.kv_manager.num_restored_tokens
        res["damaged_rank0_hits"] = llm.engine.stats().kv_tiers["tiers"]["disk"]["hits"]
        llm.engine.debug.check_no_leaks()
    finally:
        llm.engine.shutdown()
    return res


def test_tp2_tiers(model_factory, tmp_path):
    res = run_driver(_tp_tiers, model_factory("llama"), str(tmp_path / "kv"))
    assert res["first"] == res["cold"] and res["again"] == res["cold"]
    assert res["restored"] > 0
    assert set(res["files_by_rank"]) == {0, 1}
    assert res["files_by_rank"][0] == res["files_by_rank"][1]
    assert res["restart"] == res["cold"] and res["restart_restored"] > 0
    assert res["damaged"] == res["cold"]
    assert res["damaged_rank0_hits"] > 0 and res["damaged_restored"] == 0
