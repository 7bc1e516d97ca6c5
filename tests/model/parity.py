"""Our engine against an HF transformers model on the same weights: prompt logits within a
tolerance, greedy continuations identical."""

from __future__ import annotations

import torch

from kvserve import SamplingParams


def assert_logits_close(llm, hf, prompts: list[list[int]], atol: float, rtol: float) -> None:
    for ids in prompts:
        ours = llm.engine.prompt_logits(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)


def assert_greedy_equal(llm, hf, prompts: list[list[int]], max_tokens: int = 32) -> list:
    """Greedy tokens (EOS ignored) equal to ``hf.generate``'s; returns our outputs."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, ids
    return outs
