"""The cross-rank wire format of one step: what the driver (rank 0) broadcasts to every
tensor-parallel rank so that each runs the same forward. Plain int64 tensors and int tuples,
serialized explicitly (no pickle crosses ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepInput:
    """Everything a rank needs to run one forward: what the driver (rank 0) sends the workers.

    T tokens of B sequences. ``logits_groups`` lists the hidden rows to compute logits for,
    one ``compute_logits`` call per group: group 0 the rows to sample (may be empty), then one
    group per prompt-logprobs chunk. Plain int64 tensors and int tuples only, serialized
    explicitly by ``to_tensor`` / ``from_tensor`` (no pickle crosses ranks).
    """

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    write_rows: torch.Tensor  # int64 [T]: component-0 cache rows (same block ids every rank)
    query_lens: tuple[int, ...]  # [B]
    seq_lens: tuple[int, ...]  # [B]
    block_tables: tuple[tuple[int, ...], ...]  # [B][blocks]
    logits_groups: tuple[tuple[int, ...], ...]  # [G][rows]
    # each sequence's LoRA slot, -1: none ([B]); empty: no sequence of the step has an adapter
    lora_slots: tuple[int, ...] = ()

    HEADER = 6  # T, B, total table entries, G, total logits rows, LoRA slots (0 or B)

    def to_tensor(self) -> torch.Tensor:
        """One flat int64 tensor: header, ids, positions, rows, query_lens, seq_lens,
        table lengths, tables, group lengths, groups."""
        tables = [b for t in self.block_tables for b in t]
        groups = [r for g in self.logits_groups for r in g]
        head = torch.tensor([self.input_ids.numel(), len(self.query_lens), len(tables),
                             len(self.logits_groups), len(groups), len(self.lora_slots)],
                            dtype=torch.int64)
        ints = torch.tensor([*self.query_lens, *self.seq_lens,
                             *(len(t) for t in self.block_tables), *tables,
                             *(len(g) for g in self.logits_groups), *groups,
                             *self.lora_slots], dtype=torch.int64)
        return torch.cat([head, self.input_ids.cpu(), self.positions.cpu(),
                          self.write_rows.cpu(), ints])

    @classmethod
    def from_tensor(cls, x: torch.Tensor) -> StepInput:
        """The inverse of ``to_tensor``; ValueError if ``x`` is not one (sizes disagree)."""
        if x.dtype != torch.int64 or x.dim() != 1 or x.numel() < cls.HEADER:
            raise ValueError(f"malformed step input: need flat int64 of >= {cls.HEADER} words")
        t, b, nt, g, ng, nl = x[: cls.HEADER].tolist()
        o = cls.HEADER
        ids, pos, rows = x[o : o + t], x[o + t : o + 2 * t], x[o + 2 * t : o + 3 * t]
        rest = x[o + 3 * t :].tolist()
        if min(t, b, nt, g, ng, nl) < 0 or len(rest) != 3 * b + nt + g + ng + nl \
                or nl not in (0, b) or x.numel() < o + 3 * t:
            raise ValueError(f"malformed step input: header (T, B, table entries, groups, "
                             f"logits rows, LoRA slots) = {(t, b, nt, g, ng, nl)} does not "
                             f"match {x.numel()} words")
        qlens, slens, tlens = rest[:b], rest[b : 2 * b], rest[2 * b : 3 * b]
        flat, rest = rest[3 * b : 3 * b + nt], rest[3 * b + nt :]
        tables, i = [], 0
        for n in tlens:
            tables.append(tuple(flat[i : i + n]))
            i += n
        glens, gflat, lora = rest[:g], rest[g : g + ng], rest[g + ng :]
        if sum(tlens) != nt or sum(glens) != ng or min((*tlens, *glens), default=0) < 0:
            raise ValueError("malformed step input: table / group lengths do not add up")
        groups, i = [], 0
        for n in glens:
            groups.append(tuple(gflat[i : i + n]))
            i += n
        return cls(ids, pos, rows, tuple(qlens), tuple(slens), tuple(tables), tuple(groups),
                   tuple(lora))
