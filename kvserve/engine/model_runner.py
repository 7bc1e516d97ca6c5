"""Turns a ``SchedulerOutput`` into one model forward and the logits to sample from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.model.forward_batch import ForwardBatch
from kvserve.request import Request


class DecodeGraphs(Protocol):
    """Decode-only steps replayed from a capture (CUDA graphs, recorded CPU graphs)."""

    def can_run(self, batch: ForwardBatch) -> bool: ...

    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(slots=True)
class StepResult:
    # Requests whose step ended at their last known token: one logits row each, in order.
    sample_reqs: list[Request]
    logits: torch.Tensor | None  # [len(sample_reqs), V] fp32
    # Prompt logprobs: (request, first target position, logprobs [n, V]) per chunk.
    prompt_logprobs: list[tuple[Request, int, torch.Tensor]]


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

    HEADER = 5  # T, B, total table entries, G, total logits rows

    def to_tensor(self) -> torch.Tensor:
        """One flat int64 tensor: header, ids, positions, rows, query_lens, seq_lens,
        table lengths, tables, group lengths, groups."""
        tables = [b for t in self.block_tables for b in t]
        groups = [r for g in self.logits_groups for r in g]
        head = torch.tensor([self.input_ids.numel(), len(self.query_lens), len(tables),
                             len(self.logits_groups), len(groups)], dtype=torch.int64)
        ints = torch.tensor([*self.query_lens, *self.seq_lens,
                             *(len(t) for t in self.block_tables), *tables,
                             *(len(g) for g in self.logits_groups), *groups], dtype=torch.int64)
        return torch.cat([head, self.input_ids.cpu(), self.positions.cpu(),
                          self.write_rows.cpu(), ints])

    @classmethod
    def from_tensor(cls, x: torch.Tensor) -> StepInput:
        t, b, nt, g, ng = (int(v) for v in x[: cls.HEADER])
        o = cls.HEADER
        ids, pos, rows = x[o : o + t], x[o + t : o + 2 * t], x[o + 2 * t : o + 3 * t]
        rest = x[o + 3 * t :].tolist()
        assert len(rest) == 3 * b + nt + g + ng, "malformed step input"
        qlens, slens, tlens = rest[:b], rest[b : 2 * b], rest[2 * b : 3 * b]
        flat, rest = rest[3 * b : 3 * b + nt], rest[3 * b + nt :]
        tables, i = [], 0
        for n in tlens:
            tables.append(tuple(flat[i : i + n]))
            i += n
        glens, gflat = rest[:g], rest[g:]
        groups, i = [], 0
        for n in glens:
            groups.append(tuple(gflat[i : i + n]))
            i += n
        return cls(ids, pos, rows, tuple(qlens), tuple(slens), tuple(tables), tuple(groups))


@dataclass(slots=True)
class StepPlan:
    """The driver's side of a step: which request each logits group belongs to."""

    sample_reqs: list[Request]
    prompt_logprobs: list[tuple[Request, int]]  # (request, first target) for groups 1..


def prepare_step(sched: SchedulerOutput, kv: KVCacheManager, block_size: int,
                 components: int) -> tuple[StepInput, StepPlan]:
    """The step's input for every rank, and the driver's plan to read the logits back."""
    bs, c = block_size, components
    if all(n == 1 for _, n in sched.scheduled):  # pure decode: plain lists, no numpy
        ids_l, pos_l, rows_l, tables = [], [], [], []
        for req, _ in sched.scheduled:
            p = req.num_computed_tokens
            blocks = kv.get_block_ids(req)
            ids_l.append(req.token_range(p, p + 1)[0])
            pos_l.append(p)
            rows_l.append(blocks[p // bs] * (c * bs) + p % bs)
            tables.append(tuple(blocks))
        i64 = torch.int64
        ids, pos = torch.tensor(ids_l, dtype=i64), torch.tensor(pos_l, dtype=i64)
        rows = torch.tensor(rows_l, dtype=i64)
        qlens, slens = [1] * len(ids_l), [p + 1 for p in pos_l]
    else:
        ids_a, pos_a, rows_a = [], [], []
        qlens, slens, tables = [], [], []
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            p = np.arange(start, start + n, dtype=np.int64)
            blocks = kv.get_block_ids(req)
            blk = np.asarray(blocks, dtype=np.int64)[p // bs]
            ids_a.append(np.asarray(req.token_range(start, start + n), dtype=np.int64))
            pos_a.append(p)
            rows_a.append(blk * (c * bs) + p % bs)
            qlens.append(n)
            slens.append(start + n)
            tables.append(tuple(blocks))
        ids = torch.from_numpy(np.concatenate(ids_a))
        pos = torch.from_numpy(np.concatenate(pos_a))
        rows = torch.from_numpy(np.concatenate(rows_a))
    sample_rows: list[int] = []
    plan = StepPlan([], [])
    groups: list[tuple[int, ...]] = []
    loc = 0
    for req, n in sched.scheduled:
        start = req.num_computed_tokens
        if start + n == req.num_tokens:
            sample_rows.append(loc + n - 1)
            plan.sample_reqs.append(req)
        k = req.sampling_params.prompt_logprobs
        if k is not None and start + 1 < req.num_prompt_tokens:
            # hidden at position p predicts token p+1; record targets start+1 .. P-1.
            last = min(start + n, req.num_prompt_tokens - 1)
            if last > start and start + 1 >= len(req.prompt_logprobs or ()):
                groups.append(tuple(range(loc, loc + last - start)))
                plan.prompt_logprobs.append((req, start + 1))
        loc += n
    step = StepInput(ids, pos, rows, tuple(qlens), tuple(slens), tuple(tables),
                     (tuple(sample_rows), *groups))
    return step, plan


def finish_step(plan: StepPlan, logits: list[torch.Tensor | None]) -> StepResult:
    """StepResult from rank 0's logits per group (``ModelRunner.run``'s output)."""
    sampled = logits[0].float().cpu() if plan.sample_reqs else None  # sampled on CPU
    plp = [(req, start, torch.log_softmax(lg.float(), dim=-1).cpu())
           for (req, start), lg in zip(plan.prompt_logprobs, logits[1:], strict=True)]
    return StepResult(plan.sample_reqs, sampled, plp)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                 components: int, device: str = "cpu", *,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.components = components
        self.device = device
        # decode-only steps replayed from a capture (None: every step eager)
        self.graphs = graphs

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden]: a graph replay for a decode-only step the capture
        covers, else the eager forward."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch)

    def build_batch(self, sched: SchedulerOutput, kv: KVCacheManager) -> ForwardBatch:
        step, _ = prepare_step(sched, kv, self.block_size, self.components)
        return self.batch_from(step)

    def batch_from(self, step: StepInput) -> ForwardBatch:
        """The step's ForwardBatch (host int64 tensors moved to the model's device here)."""
        bs, c = self.block_size, self.components
        rows_t = step.write_rows.to(self.device)
        qsl = [0]
        for n in step.query_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            num_tokens=qsl[-1], query_start_loc=qsl, query_lens=list(step.query_lens),
            seq_lens=list(step.seq_lens), block_tables=[list(t) for t in step.block_tables],
            write_rows=rows_t, slot_mapping=(rows_t // (c * bs)) * bs + rows_t % bs,
        )
        return ForwardBatch(input_ids=step.input_ids.to(self.device),
                            positions=step.positions.to(self.device), meta=meta,
                            attn=self.backend)

    @torch.inference_mode()
    def run(self, step: StepInput) -> list[torch.Tensor | None]:
        """Forward + logits per group: [rows, V] fp32 on rank 0, None on other ranks (and for
        an empty group)."""
        hidden = self.forward(self.batch_from(step))  # [T, hidden]
        out: list[torch.Tensor | None] = []
        for i, rows in enumerate(step.logits_groups):
            if not rows:
                out.append(None)
                continue
            if i == 0:
                h = hidden[torch.tensor(rows, device=hidden.device)]
            else:  # a prompt-logprobs chunk: a contiguous run of rows
                h = hidden[rows[0] : rows[-1] + 1]
            out.append(self.model.compute_logits(h))
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        step, plan = prepare_step(sched, kv, self.block_size, self.components)
        return finish_step(plan, self.run(step))
