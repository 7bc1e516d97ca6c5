"""``LLMEngine.stats()``: the public picture of the queues that tools (benchmarks/step_profile)
read instead of the scheduler's lists."""

from __future__ import annotations

from kvserve import SamplingParams


def test_num_prefilling_counts_prompts_not_yet_computed(tiny_llama, make_llm):
    eng = make_llm(tiny_llama, dtype="float32", num_blocks=32, max_model_len=64,
                   max_num_batched_tokens=16).engine
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(3, 23))}, sp)  # 20 tokens
    assert eng.stats().num_prefilling == 2  # both waiting
    eng.step()  # a 16-token budget: part of the first prompt
    s = eng.stats()
    assert s.num_prefilling == 2 and s.num_running >= 1
    steps = 0
    while eng.stats().num_prefilling:
        eng.step()
        steps += 1
    assert 1 <= steps <= 3 and eng.stats().num_running == 2
    while eng.has_unfinished_requests():
        eng.step()


def test_bucket_counts_read_exactly_under_any_subset_of_bounds():
    from kvserve.engine.stats import BucketCounts

    acc = BucketCounts((0.1, 0.5, 1.0, 5.0))
    for v in (0.05, 0.1, 0.3, 0.7, 2.0, 9.0):
        acc.observe(v)
    acc.observe(0.2, n=3)
    assert acc.count == 9 and abs(acc.sum - 12.75) < 1e-9
    inf = float("inf")
    assert acc.cumulative() == [(0.1, 2), (0.5, 6), (1.0, 7), (5.0, 8), (inf, 9)]
    assert acc.cumulative((0.5, 5.0)) == [(0.5, 6), (5.0, 8), (inf, 9)]
    try:
        acc.cumulative((0.3,))
    except AssertionError:
        pass
    else:
        raise AssertionError("a bound that was not recorded must be refused")


def test_iteration_tokens_and_prefix_counters_in_stats(tiny_llama, make_llm):
    eng = make_llm(tiny_llama, dtype="float32", num_blocks=32, max_model_len=64).engine
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = list(range(3, 23))  # 20 tokens: one whole block can be a hit
    for rid in ("a", "b"):
        eng.add_request(rid, {"prompt_token_ids": ids}, sp)
        while eng.has_unfinished_requests():
            eng.step()
    s = eng.stats()
    assert s.counters["prefix_cache_queries"] == 40 and s.counters["prefix_cache_hits"] == 16
    it = s.iteration_tokens
    assert it.count == s.counters["steps"] == 6
    assert it.sum == 20 + 2 + (20 - 16) + 2  # prefill, 2 decodes, the uncached tail, 2 decodes
    assert s.cache_config["block_size"] == "16" and s.block_size == 16


def test_lora_info_names_running_and_waiting_adapters(tmp_path, make_llm):
    """With LoRA on, EngineStats.lora (vllm:lora_requests_info) has the slots and the
    adapters of running and waiting sequences; without LoRA it is None."""
    import pytest

    pytest.importorskip("peft")
    from kvserve import LoRARequest
    from tests.conftest import make_tiny_model
    from tests.lora_util import make_adapter

    base = make_tiny_model(str(tmp_path / "base"))
    ads = {n: make_adapter(base, str(tmp_path / n), r=4, alpha=8, seed=i)
           for i, n in enumerate(("a1", "a2"), 1)}
    assert make_llm(base, dtype="fp32").engine.stats().lora is None
    eng = make_llm(base, dtype="fp32", kv_cache_dtype="fp32", enable_lora=True,
                   max_loras=1).engine
    assert eng.stats().lora == {"max_lora": 1, "running": [], "waiting": []}
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for n in ads:  # one slot: the second adapter waits while the first runs
        eng.add_request(n, {"prompt_token_ids": [1, 5, 9, 33]}, sp,
                        lora_request=LoRARequest(n, 0, ads[n]))
    eng.step()
    assert eng.stats().lora == {"max_lora": 1, "running": ["a1"], "waiting": ["a2"]}
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().lora == {"max_lora": 1, "running": [], "waiting": []}
