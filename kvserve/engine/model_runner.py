"""Turns a ``SchedulerOutput`` into one model forward and the logits to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache_manager import KVCacheManager
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
                 components: int, device: str = "cpu") -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.components = components
        self.device = device

    def build_batch(self, sched: SchedulerOutput, kv: KVCacheManager) -> ForwardBatch:
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
        rows_t = torch.from_numpy(np.concatenate(rows)).to(self.device)
        meta = AttentionMetadata(
            num_tokens=qsl[-1], query_start_loc=qsl, query_lens=qlens, seq_lens=slens,
            block_tables=tables, write_rows=rows_t,
            slot_mapping=(rows_t // (c * bs)) * bs + rows_t % bs,
        )
        return ForwardBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(self.device),
            positions=torch.from_numpy(np.concatenate(pos)).to(self.device),
            meta=meta, attn=self.backend,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        batch = self.build_batch(sched, kv)
        hidden = self.model(batch)  # [T, hidden]
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
