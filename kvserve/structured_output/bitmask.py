"""Allowed-token bitmasks and the logits they mask: int32 [k, ceil(V / 32)] rows in which bit
t % 32 of word t // 32 is set iff token t may come next (the layout llguidance fills and
xgrammar uses too). The sampler asks here; it never reads a grammar itself."""

from __future__ import annotations

import numpy as np
import torch


def grammar_bitmasks(grammars: list, vocab: int) -> np.ndarray:
    """int32 [k, ceil(V / 32)]: bit t % 32 of word t // 32 set iff grammar j allows token t
    next (a dead end leaves row j all zero). ``grammars``: ``GrammarMatcher``s, or the one-use
    masks of ``GrammarMatcher.masks_along``."""
    words = np.zeros((len(grammars), (vocab + 31) // 32), np.int32)
    for j, g in enumerate(grammars):
        g.fill_bitmask(words[j])
    return words


def allows(words: np.ndarray, token: int) -> bool:
    """Bitmask row ``words`` allows ``token``."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def mask_rows(logits: torch.Tensor, idx: list[int], words: np.ndarray) -> None:
    """Set to -inf, in row idx[j] of logits [N, V], every token that words[j] does not allow.
    The bits are unpacked for all rows in one call."""
    vocab = logits.shape[1]
    # [k, 32 W] uint8 0/1: bit b of word w is token 32 w + b (little-endian bytes and bits)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(bits == 0)
    if logits.device.type != "cpu":
        banned = banned.to(logits.device)
    for j, i in enumerate(idx):
        logits[i].masked_fill_(banned[j], float("-inf"))
