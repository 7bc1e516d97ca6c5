"""Per-step attention metadata, built once by the model runner and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Sequences are laid out back to back in the step's token dimension T:

        tokens   [ seq0: q_len0 | seq1: q_len1 | ... ]      query_start_loc = [0, q0, q0+q1, ...]
        seq b's queries are its LAST query_lens[b] tokens: positions seq_lens[b]-q_len .. -1
    """

    num_tokens: int
    query_start_loc: list[int]  # [B+1]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B] context length including this step's tokens
    block_tables: list[list[int]]  # [B][num_blocks_b]
    write_rows: torch.Tensor  # [T] int64 rows of component 0 (see PagedKVCache)
    slot_mapping: torch.Tensor  # [T] int64 slot ids
    # Backend-private per-step precomputation (filled lazily by the backend, reused by layers).
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)
