"""Turns a ``SchedulerOutput`` into one model forward and the logits to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.cuda_graphs import CudaGraphRunner
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.model.forward_batch import ForwardBatch
from kvserve.request import Request


@dataclass(slots=True)
class StepResult:
    # Requests whose step ended at their last known token: one logits row each, in order.
    sample_reqs: list[Request]
    logits: torch.Tensor | None  # [len(sample_reqs), V] fp32
    # Prompt logprobs: (request, first target position, logprobs [n, V]) per chunk.
    prompt_logprobs: list[tuple[Request, int, torch.Tensor]]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                 components: int, device: str = "cpu", *,
                 graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.components = components
        self.device = device
        # CUDA graphs for decode-only steps (None: every step eager; always None on CPU).
        self.graphs = graphs

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden]: a graph replay for a decode-only step that fits a
        captured bucket, else the eager forward."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch)

    def build_batch(self, sched: SchedulerOutput, kv: KVCacheManager) -> ForwardBatch:
        if all(n == 1 for _, n in sched.scheduled):
            return self._build_decode_batch(sched, kv)
        bs, c = self.block_size, self.components
        ids, pos, rows = [], [], []
        qsl, qlens, slens, tables = [0], [], [], []
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            p = np.arange(start, start + n, dtype=np.int64)
            blocks = kv.get_block_ids(req)
            blk = np.asarray(blocks, dtype=np.int64)[p // bs]
            ids.append(np.asarray(req.token_range(start, start + n), dtype=np.int64))
            pos.append(p)
            rows.append(blk * (c * bs) + p % bs)
            qsl.append(qsl[-1] + n)
            qlens.append(n)
            slens.append(start + n)
            tables.append(blocks)
        return self._batch(torch.from_numpy(np.concatenate(ids)),
                           torch.from_numpy(np.concatenate(pos)),
                           torch.from_numpy(np.concatenate(rows)), qsl, qlens, slens, tables)

    def _build_decode_batch(self, sched: SchedulerOutput, kv: KVCacheManager) -> ForwardBatch:
        """``build_batch`` for a step where every request feeds one token (pure decode): the
        same tensors, built from plain lists (no per-request numpy arrays)."""
        bs, c = self.block_size, self.components
        ids, pos, rows, tables = [], [], [], []
        for req, _ in sched.scheduled:
            p = req.num_computed_tokens
            blocks = kv.get_block_ids(req)
            ids.append(req.token_range(p, p + 1)[0])
            pos.append(p)
            rows.append(blocks[p // bs] * (c * bs) + p % bs)
            tables.append(blocks)
        n = len(ids)
        i64 = torch.int64
        return self._batch(torch.tensor(ids, dtype=i64), torch.tensor(pos, dtype=i64),
                           torch.tensor(rows, dtype=i64), list(range(n + 1)), [1] * n,
                           [p + 1 for p in pos], tables)

    def _batch(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, qsl: list[int],
               qlens: list[int], slens: list[int], tables: list[list[int]]) -> ForwardBatch:
        """The step's ForwardBatch from host int64 [T] token ids, positions and component-0
        cache rows (moved to the model's device here) plus the per-sequence lists."""
        bs, c = self.block_size, self.components
        rows_t = rows.to(self.device)
        meta = AttentionMetadata(
            num_tokens=qsl[-1], query_start_loc=qsl, query_lens=qlens, seq_lens=slens,
            block_tables=tables, write_rows=rows_t,
            slot_mapping=(rows_t // (c * bs)) * bs + rows_t % bs,
        )
        return ForwardBatch(input_ids=ids.to(self.device), positions=pos.to(self.device),
                            meta=meta, attn=self.backend)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        batch = self.build_batch(sched, kv)
        hidden = self.forward(batch)  # [T, hidden]
        sample_idx, sample_reqs = [], []
        plp: list[tuple[Request, int, torch.Tensor]] = []
        loc = batch.meta.query_start_loc
        for b, (req, n) in enumerate(sched.scheduled):
            start = req.num_computed_tokens
            if start + n == req.num_tokens:
                sample_idx.append(loc[b + 1] - 1)
                sample_reqs.append(req)
            k = req.sampling_params.prompt_logprobs
            if k is not None and start + 1 < req.num_prompt_tokens:
                # hidden at position p predicts token p+1; record targets start+1 .. P-1.
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > start and start + 1 >= len(req.prompt_logprobs or ()):
                    h = hidden[loc[b] : loc[b] + (last - start)]
                    plp.append((req, start + 1, torch.log_softmax(
                        self.model.compute_logits(h).float(), dim=-1).cpu()))
        logits = None
        if sample_idx:
            idx = torch.tensor(sample_idx, device=hidden.device)
            logits = self.model.compute_logits(hidden[idx]).float().cpu()  # sampled on CPU
        return StepResult(sample_reqs, logits, plp)
