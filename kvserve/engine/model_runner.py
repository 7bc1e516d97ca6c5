"""One rank's forward: a ``StepInput`` -> ``ForwardBatch`` -> the model (or a decode-graph
replay) -> logits per group. Every tensor-parallel rank runs this; only rank 0 keeps the
logits (the driver's ``StepRunner`` samples from them)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.engine.step_input import StepInput
from kvserve.layers.lora import LoRAStep
from kvserve.model.forward_batch import ForwardBatch


class DecodeGraphs(Protocol):
    """Decode-only steps replayed from a capture (CUDA graphs, recorded CPU graphs)."""

    def can_run(self, batch: ForwardBatch) -> bool: ...

    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


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
        lora = None
        if step.lora_slots and max(step.lora_slots) >= 0:  # each token row's slot
            idx = torch.repeat_interleave(torch.tensor(step.lora_slots, dtype=torch.int64),
                                          torch.tensor(step.query_lens, dtype=torch.int64))
            lora = LoRAStep(idx.to(self.device), frozenset(s for s in step.lora_slots if s >= 0))
        return ForwardBatch(input_ids=step.input_ids.to(self.device),
                            positions=step.positions.to(self.device), meta=meta,
                            attn=self.backend, lora=lora)

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
