"""The sampler's grammar masks: masking lazily (only rows whose draw the grammar refuses) draws
exactly what masking every row first draws, for greedy, seeded and top-p rows, dense and
sparse masks; every drawn token is allowed."""

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
        for i, (a, b) in enumerate(zip(lazy.token_ids, ref.token_ids, strict=True)):
            if rows[i].params.seed is not None or rows[i].params.greedy:
                assert a == b, (i, trial)
            if i % 2 == 0:
                assert allowed[i, a]
