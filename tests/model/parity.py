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


def teacher_forced_stats(base, cand, prompts: list[list[int]], ref_tokens: list[list[int]],
                         check_reference: bool = False) -> tuple[float, int, int, int, int]:
    """Score ``base``'s greedy continuations with both engines: (mean KL(base || cand) per
    position, top-1 hits, positions, hits where base's top-2 gap > 0.1 nats, such positions).
    ``check_reference``: base's own scoring must reproduce its generated tokens."""
    kls, hits, n, dec_hits, dec_n = [], 0, 0, 0, 0
    for ids, toks in zip(prompts, ref_tokens, strict=True):
        seq = ids + toks
        a = base.engine.prompt_logits(seq).log_softmax(-1)
        b = cand.engine.prompt_logits(seq).log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1).mean().item())
        gen = slice(len(ids) - 1, len(seq) - 1)  # positions that chose the generated tokens
        if check_reference:
            assert a[gen].argmax(-1).tolist() == toks
        same = b[gen].argmax(-1) == torch.tensor(toks)
        top2 = a[gen].topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 0.1
        hits += same.sum().item()
        n += len(toks)
        dec_hits += (same & decisive).sum().item()
        dec_n += decisive.sum().item()
    return sum(kls) / len(kls), hits, n, dec_hits, dec_n
