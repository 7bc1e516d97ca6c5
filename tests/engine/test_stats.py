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
