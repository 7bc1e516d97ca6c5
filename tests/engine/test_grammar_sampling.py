"""The sampler's grammar masks, dense and sparse: a grammar never changes a draw it allows
(greedy and seeded whole-distribution rows keep their no-grammar token when it is allowed),
greedy and top-k / top-p / min-p rows draw what masking first draws, every drawn token is
allowed, and a seeded row's draws follow the masked distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.engine.sampler import Sampler, SampleRow
from kvserve.sampling_params import SamplingParams

V = 256


class FixedGrammar:
    """A grammar state allowing a fixed token set."""

    def __init__(self, allowed: np.ndarray) -> None:
        self.words = np.packbits(allowed, bitorder="little").view(np.int32)

    def fill_bitmask(self, words: np.ndarray) -> bool:
        words[:] = self.words
        return bool(self.words.any())


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
          SamplingParams(temperature=1.0, seed=9, top_p=0.9),
          SamplingParams(temperature=0.7, seed=4, top_k=20, min_p=0.01)]


@pytest.mark.parametrize("density", [0.02, 0.5, 0.98])
def test_lazy_masks_draw_what_masking_first_draws(density):
    gen = np.random.default_rng(int(density * 100))
    for trial in range(20):
        logits = torch.randn(len(PARAMS) * 2, V) * 3
        allowed = gen.random((logits.shape[0], V)) < density
        allowed[:, gen.integers(V)] = True
        rows = [SampleRow(PARAMS[i % len(PARAMS)], [1, 2], list(range(trial)), (0,),
                          FixedGrammar(allowed[i]) if i % 2 == 0 else None)
                for i in range(logits.shape[0])]
        lazy = Sampler(V)(logits.clone(), rows)
        first = logits.clone()
        for i in range(0, logits.shape[0], 2):
            first[i][torch.from_numpy(~allowed[i])] = float("-inf")
        plain = [SampleRow(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids)
                 for r in rows]
        ref = Sampler(V)(first, plain)
        free = Sampler(V)(logits.clone(), plain)  # no grammar at all
        for i, (a, b) in enumerate(zip(lazy.token_ids, ref.token_ids, strict=True)):
            p = rows[i].params
            if p.greedy or (p.seed is not None and (p.top_p < 1.0 or p.top_k > 0)):
                assert a == b, (i, trial)  # masked first, or the masked argmax
            elif p.seed is not None and i % 2 == 0 and allowed[i, free.token_ids[i]]:
                assert a == free.token_ids[i], (i, trial)  # an allowed draw is kept
            if p.seed is not None and i % 2 == 1:
                assert a == free.token_ids[i]  # no grammar: the plain draw
            if i % 2 == 0:
                assert allowed[i, a]


def test_a_refused_draw_follows_the_masked_distribution():
    """A seeded whole-distribution row whose grammar allows 3 of 8 tokens (40% of the mass):
    over 6,000 output positions its draws follow p restricted to those 3 (chi-square, df = 2,
    p = 0.001), whether the first draw was allowed or drawn again."""
    logits = torch.tensor([[1.0, 0.2, -0.3, 0.5, 0.0, 0.8, -1.0, 0.3]])
    allowed = np.array([False, True, False, True, False, False, True, False])
    p = torch.softmax(logits[0], 0)[torch.from_numpy(allowed)]
    p = p / p.sum()
    counts = {1: 0, 3: 0, 6: 0}
    sampler = Sampler(8)
    params = SamplingParams(temperature=1.0, seed=11)
    for pos in range(6000):
        row = SampleRow(params, [1], [0] * pos, (), FixedGrammar(
            np.concatenate([allowed, np.zeros(24, bool)])))
        counts[sampler(logits.clone(), [row]).token_ids[0]] += 1
    got = torch.tensor([counts[1], counts[3], counts[6]], dtype=torch.float64)
    expected = p.double() * 6000
    assert float(((got - expected) ** 2 / expected).sum()) < 13.82
