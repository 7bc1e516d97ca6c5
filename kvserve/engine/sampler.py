"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

Seeded requests draw their randomness from a generator seeded by (seed, output position), so a
request's tokens do not depend on what else is in the batch, nor on preemption and recompute.
Sampling uses the exponential race (argmax p_i / E_i, E_i ~ Exp(1)), one draw per row.

Rows with a grammar (``SampleRow.grammar``, structured outputs) draw only tokens the grammar
allows next; rows without one pay nothing. Each such row's allowed set is computed (a bitmask,
kvserve/structured_output/bitmask.py); masking a row (-inf on every other token, O(vocab)) is
done lazily: a greedy row, or one drawn from the whole distribution (no top-k / top-p / min-p),
whose unmasked draw is allowed has drawn exactly what the masked row would (the argmax of
logits, or of p_i / E_i in the race, over the allowed tokens is the overall one when that is
allowed), so only rows whose draw was refused are masked and drawn again (with the same seeded
noise). Rows with top-k / top-p / min-p are masked before the draw, since those depend on the
masked distribution. A row whose grammar allows no token (a dead end) is all -inf: its drawn
token is then refused by ``GrammarMatcher.accept`` and the request ends (finish reason
"grammar_dead_end").
Logprobs are those of the model, before the mask (as vLLM reports them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.bitmask import allows, grammar_bitmasks, mask_rows
from kvserve.structured_output.matcher import GrammarMatcher

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    grammar: GrammarMatcher | None = None  # structured outputs: the request's grammar state


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or {token: logprob} for the sampled token plus the top-N.
    logprobs: list[dict[int, float] | None]
    sampled_logprob: list[float]


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._rng = torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """logits [N, V] fp32 (modified in place)."""
        assert logits.shape[0] == len(rows)
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_penalties(logits, rows)
        grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
        words = None
        if grammar_rows:
            words = grammar_bitmasks([rows[i].grammar for i in grammar_rows], logits.shape[1])
            eager = [j for j, i in enumerate(grammar_rows) if _needs_masked_draw(rows[i].params)]
            if eager:
                mask_rows(logits, [grammar_rows[j] for j in eager], words[eager])
        tokens = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            self._sample_random(logits, rows, random_rows, tokens)
        if words is not None:  # lazily masked rows whose draw the grammar refuses: again
            refused = [j for j, i in enumerate(grammar_rows)
                       if not _needs_masked_draw(rows[i].params)
                       and not allows(words[j], int(tokens[i]))]
            if refused:
                idx = [grammar_rows[j] for j in refused]
                mask_rows(logits, idx, words[refused])
                for i in idx:
                    tokens[i] = argmax_rows(logits[i:i + 1])[0]
                again = [i for i in idx if not rows[i].params.greedy]
                if again:
                    self._sample_random(logits, rows, again, tokens)
        token_list = tokens.tolist()
        lps: list[dict[int, float] | None] = [None] * len(rows)
        sampled_lp = [0.0] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is None:
                    continue
                lps[i] = top_logprobs(raw_logprobs[i], token_list[i], r.params.logprobs)
                sampled_lp[i] = lps[i][token_list[i]]
        return SamplerOutput(token_list, lps, sampled_lp)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            row = logits[i]
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                banned = [t for t in banned if t < row.shape[0]]
                if banned:
                    row[banned] = float("-inf")
            if not p.needs_penalties:
                continue
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                    dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
            if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                out = torch.tensor(r.output_token_ids, dtype=torch.long)
                counts = torch.bincount(out, minlength=row.shape[0]).float()
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow], idx: list[int],
                       tokens: torch.Tensor) -> None:
        for i in idx:
            p = rows[i].params
            row = logits[i] / p.temperature
            if p.top_k > 0 and p.top_k < row.shape[0]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                cum = sorted_p.cumsum(0)
                drop = cum - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
                probs = probs.scatter(0, order[drop], 0.0)
            if p.min_p > 0.0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            gen = self._rng
            if p.seed is not None:
                pos = len(rows[i].output_token_ids)
                gen = torch.Generator().manual_seed((p.seed * _SEED_MIX + pos) % (2**63))
            noise = torch.empty_like(probs).exponential_(generator=gen)
            tokens[i] = (probs / noise).argmax()


def _needs_masked_draw(p: SamplingParams) -> bool:
    """Sampling whose candidates depend on the whole distribution: mask before drawing."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64, first index among equal maxima). On CPU through numpy,
    whose vectorized argmax is ~9x torch's here ([64, 4096] fp32: 26 vs 229 us)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.argmax(logits.detach().contiguous().numpy(), axis=-1)
                            .astype(np.int64, copy=False))


def top_logprobs(logprobs_row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    out: dict[int, float] = {}
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        out = dict(zip(ids.tolist(), vals.tolist(), strict=True))
    out[token] = float(logprobs_row[token])
    return out
