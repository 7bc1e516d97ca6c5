"""What the engine records on a request's ``RequestMetrics`` for the server's trace spans
(kvserve/http/tracing.py): a KV-tier restore (its blocks per tier, its time), an integrity
rollback (a repair), and nothing of either on a plain request."""

from __future__ import annotations

import torch

from kvserve import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BS = 16


def _prompt(n: int = 90) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return [1] + torch.randint(3, 500, (n,), generator=g).tolist()


def _final(eng):
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    return final


def test_tier_restore_recorded_per_tier(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, block_size=BS, num_blocks=40, kv_offload_memory=0.01)
    eng, p = llm.engine, _prompt()
    try:
        first = llm.generate([{"prompt_token_ids": p}], SP)[0]
        assert first.metrics.kv_restores is None and first.metrics.integrity_repairs == 0
        assert eng.kv_manager.write_down_cached() > 0  # the prompt's blocks in the memory tier ...
        eng.pool.reset_prefix_cache()  # ... and no longer in the pool
        again = llm.generate([{"prompt_token_ids": p}], SP)[0]
        (mv,) = again.metrics.kv_restores
        full = len(p) // BS  # every full prompt block but the last token's is a hit
        assert mv.by_tier == (("memory", full),) and mv.blocks == full
        assert mv.seconds >= 0 and again.metrics.arrival_time <= mv.start
        assert mv.start <= again.metrics.first_scheduled_time
        assert again.num_cached_tokens == full * BS
    finally:
        eng.shutdown()


def test_integrity_rollback_counted_on_the_request(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, dtype="float32", kv_integrity="paranoid", block_size=BS)
    eng = llm.engine
    eng.add_request("r", {"prompt_token_ids": _prompt(40)}, SP)
    req = eng.output_processor.parents["r"].children[0]
    eng.step()  # prefill: the prompt's full blocks sealed
    eng.debug.inject_kv_fault(eng.kv_manager.get_block_ids(req)[1], 1, "bitflip", index=100, bit=6)
    final = _final(eng)
    assert final.metrics.integrity_repairs == 1
    assert eng.integrity.repairs["rollback"] == 1
