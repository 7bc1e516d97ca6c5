"""Per-step attention metadata, built once by the model runner and shared by all layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
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


@dataclass(slots=True)
class DecodeChunk:
    """A group of decode sequences whose padded block tables fit the gather workspace."""

    tok: torch.Tensor  # [n] token index of each sequence's query in the step
    block_ids: torch.Tensor  # [n * mb] int64, padded with the cache's null block
    max_blocks: int  # mb
    seq_lens: torch.Tensor  # [n] int64
    pad: torch.Tensor  # [n, mb * bs] bool, True past the sequence's length


def plan_decode_chunks(meta: AttentionMetadata, seqs: list[int], block_size: int,
                       null_block: int, ws_tokens: int) -> list[DecodeChunk]:
    """Split decode sequences (sorted by length, so chunks pad little) into chunks with
    n * mb * block_size <= ws_tokens."""
    decode = sorted(seqs, key=lambda b: meta.seq_lens[b])
    nblocks = {b: -(-meta.seq_lens[b] // block_size) for b in decode}
    chunks = []
    i = 0
    while i < len(decode):
        j, mb = i, 0
        while j < len(decode) and (j - i + 1) * max(mb, nblocks[decode[j]]) * block_size \
                <= ws_tokens:
            mb = max(mb, nblocks[decode[j]])
            j += 1
        group = decode[i:j]
        ids = torch.full((len(group), mb), null_block, dtype=torch.int64)
        for r, b in enumerate(group):
            ids[r, : nblocks[b]] = torch.tensor(meta.block_tables[b][: nblocks[b]])
        lens = torch.tensor([meta.seq_lens[b] for b in group], dtype=torch.int64)
        pad = torch.arange(mb * block_size).unsqueeze(0) >= lens.unsqueeze(1)
        tok = torch.tensor([meta.query_start_loc[b] for b in group])
        chunks.append(DecodeChunk(tok, ids.view(-1), mb, lens, pad))
        i = j
    return chunks


def _padded_tables(meta: AttentionMetadata, seqs: Sequence[int], lens: np.ndarray,
                   block_size: int, null_block: int) -> np.ndarray:
    """[len(seqs), mb] int64 block tables covering ``lens`` tokens, padded with null_block."""
    nblocks = -(-lens // block_size)
    tables = np.full((len(seqs), int(nblocks.max())), null_block, dtype=np.int64)
    for r, b in enumerate(seqs):
        tables[r, : nblocks[r]] = meta.block_tables[b][: nblocks[r]]
    return tables


def plan_decode_tables(meta: AttentionMetadata, seqs: Sequence[int], block_size: int,
                       null_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a kernel that walks each sequence's own length (no workspace, no padding mask):
    (tok [n] query token of each sequence, tables [n, mb] int64 padded with ``null_block``,
    seq_lens [n] int64), in ``seqs`` order. One numpy array fill, no per-sequence tensors."""
    lens = np.fromiter((meta.seq_lens[b] for b in seqs), dtype=np.int64, count=len(seqs))
    tables = _padded_tables(meta, seqs, lens, block_size, null_block)
    tok = np.fromiter((meta.query_start_loc[b] for b in seqs), dtype=np.int64, count=len(seqs))
    return torch.from_numpy(tok), torch.from_numpy(tables), torch.from_numpy(lens)


def plan_rows(meta: AttentionMetadata, block_size: int, null_block: int
              ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Every query row of the step as a causal row for a per-row kernel:
    (row_seq [T] int64 sequence of each row, or None when row t is sequence t (all decode);
    tables [B, mb] int64 padded with ``null_block``; lens [T] int64 tokens row t attends).

        seq b, query i of q_len:  position seq_len - q_len + i  ->  attends seq_len - q_len + i + 1
    """
    slens = np.asarray(meta.seq_lens, dtype=np.int64)
    tables = _padded_tables(meta, range(meta.num_seqs), slens, block_size, null_block)
    if meta.num_tokens == meta.num_seqs:  # one query per sequence: its own length
        return None, torch.from_numpy(tables), torch.from_numpy(slens)
    qlens = np.asarray(meta.query_lens, dtype=np.int64)
    row_seq = np.repeat(np.arange(meta.num_seqs, dtype=np.int64), qlens)
    starts = np.asarray(meta.query_start_loc[:-1], dtype=np.int64)
    # lens = (seq_len - q_len + 1) of the row's sequence + the row's index within it
    lens = (slens - qlens + 1)[row_seq] + (np.arange(meta.num_tokens) - starts[row_seq])
    return torch.from_numpy(row_seq), torch.from_numpy(tables), torch.from_numpy(lens)


def plan_prefills(meta: AttentionMetadata, block_size: int
                  ) -> list[tuple[int, int, int, torch.Tensor]]:
    """(query start, query length, sequence length, block ids) of every multi-token sequence."""
    out = []
    for b, qlen in enumerate(meta.query_lens):
        if qlen > 1:
            nb = -(-meta.seq_lens[b] // block_size)
            ids = torch.tensor(meta.block_tables[b][:nb], dtype=torch.int64)
            out.append((meta.query_start_loc[b], qlen, meta.seq_lens[b], ids))
    return out
