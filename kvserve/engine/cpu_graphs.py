"""Recorded CPU graphs for decode-only steps: the decode forward's C kernel calls, recorded once
(kvserve/kernels/cpu/graph.py), replayed by one C call per step.

On CPU a decode step of a small model is mostly Python: SmolLM2-135M makes ~300 kernel calls
per step (30 layers), each wrapped in a module call, shape checks and tensor allocations. The
runner records ``model(batch)`` once, at ``max_num_seqs`` rows over static buffers, and a step
of n <= max_num_seqs sequences then copies its inputs into the buffers' ``[:n]`` prefixes and
replays the tape over n rows: the same kernels with the same arguments as the eager forward
(so the same results, bit for bit), without the Python in between.

Static buffers (B = max_num_seqs, MB = ceil(max_model_len / block_size)), int64:

    input_ids [B]   positions [B]   write_rows [B]   seq_lens [B]   block_tables [B, MB]
    lora_idx [B] (LoRA on: each row's adapter slot, -1 the base; kvserve/layers/lora.py)

Decode row r attends ``seq_lens[r]`` tokens of ``block_tables[r]`` (entries past a row's last
block are never read). The recording itself runs over B padding rows (token 0 at position 0,
writing and attending slot 0 of ``null_block``, re-zeroed afterwards), as CUDA graph capture
does.

With LoRA on, every wrapped linear records its grouped LoRA GEMM over ``lora_idx`` (the
kernel skips the rows at -1, so a base-only step pays a counting pass per linear), and a replay
reads whatever the adapter slots hold at that step: loading an adapter into a slot rewrites the
slot's buffers in place, never moves them.

A model whose forward cannot be recorded (a torch op between the kernels: tensor parallelism,
biases, a layout without a C kernel) is refused at capture with the reason
logged, and every step runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.engine.cuda_graphs import PAD_TOKEN_ID, clear_scratch_block, is_decode_only
from kvserve.kernels.cpu import graph
from kvserve.layers.lora import LoRAStep
from kvserve.model.forward_batch import ForwardBatch

logger = logging.getLogger("kvserve")


class CpuGraphRunner:
    """``capture`` records the decode forward once; ``run`` replays it (``can_run`` batches)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_cache: PagedKVCache,
                 block_size: int, components: int, max_num_seqs: int,
                 max_model_len: int, *, lora: bool = False) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.components = block_size, components
        self.max_rows = max_num_seqs  # B
        self.max_blocks = -(-max_model_len // block_size)  # MB
        B, MB, null, i64 = self.max_rows, self.max_blocks, kv_cache.null_block, torch.int64
        self.input_ids = torch.full((B,), PAD_TOKEN_ID, dtype=i64)
        self.positions = torch.zeros(B, dtype=i64)
        self.write_rows = torch.full((B,), null * components * block_size, dtype=i64)
        self.seq_lens = torch.ones(B, dtype=i64)
        self.block_tables = torch.full((B, MB), null, dtype=i64)
        self._tables_np = self.block_tables.numpy()  # shares memory: filled row by row
        self._lens_np = self.seq_lens.numpy()
        # LoRA on (``lora``): each row's adapter slot, -1 the base model
        self.lora_idx = torch.full((B,), -1, dtype=i64) if lora else None
        self.tape: graph.Tape | None = None
        self.out: torch.Tensor | None = None  # [B, hidden]: what the tape's last op writes
        self.refused: str | None = None  # why the forward could not be recorded
        self.runs = 0  # decode steps served by run()

    def _static_batch(self) -> ForwardBatch:
        B, null = self.max_rows, self.kv_cache.null_block
        meta = AttentionMetadata(
            num_tokens=B, query_start_loc=list(range(B + 1)), query_lens=[1] * B,
            seq_lens=[1] * B, block_tables=[[null]] * B, write_rows=self.write_rows,
            slot_mapping=self.write_rows // (self.components * self.block_size)
            * self.block_size,
        )
        self.backend.graph_plan(meta, self.block_tables, self.seq_lens, meta.slot_mapping,
                                max_seq_len=self.max_blocks * self.block_size)
        lora = None if self.lora_idx is None else LoRAStep(self.lora_idx, None)
        return ForwardBatch(input_ids=self.input_ids, positions=self.positions, meta=meta,
                            attn=self.backend, lora=lora)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Record the decode forward at B rows; False (reason in ``refused``, logged) when it
        cannot be recorded."""
        try:
            batch = self._static_batch()
            with graph.recording() as tape:
                out = self.model(batch)
            if tape.max_rows != self.max_rows or not len(tape):
                raise graph.GraphCaptureError("the forward recorded no row-count argument")
            if not isinstance(out, torch.Tensor) or out.shape[0] != self.max_rows \
                    or not out.is_contiguous():
                raise graph.GraphCaptureError("the forward's output is not rows-first")
        except (graph.GraphCaptureError, NotImplementedError) as e:
            self.refused = str(e)
            logger.info("CPU decode graphs off (%s); decode steps run eagerly", e)
            return False
        finally:
            clear_scratch_block(self.kv_cache)
        self.tape, self.out = tape, out
        logger.info("CPU decode graph recorded: %d kernel calls for up to %d rows, %.1f MiB of "
                    "activation buffers", len(tape), self.max_rows, tape.alloc_bytes / 2**20)
        return True

    def can_run(self, batch: ForwardBatch) -> bool:
        meta = batch.meta
        return (self.tape is not None and is_decode_only(meta)
                and meta.num_seqs <= self.max_rows
                and max(meta.seq_lens) <= self.max_blocks * self.block_size)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch (``can_run``), replayed. The result
        is a view of the graph's output buffer: consume it before the next ``run``."""
        assert self.tape is not None and self.out is not None
        meta = batch.meta
        n = meta.num_seqs
        if not self.can_run(batch):
            raise ValueError(f"batch of {n} sequence(s) does not fit the CPU decode graph")
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.write_rows[:n].copy_(meta.write_rows)
        self._lens_np[:n] = meta.seq_lens
        if self.lora_idx is not None:
            if batch.lora is None:
                self.lora_idx[:n].fill_(-1)
            else:
                self.lora_idx[:n].copy_(batch.lora.idx)
        bs, tables = self.block_size, self._tables_np
        for r, (row, slen) in enumerate(zip(meta.block_tables, meta.seq_lens, strict=True)):
            nb = -(-slen // bs)
            tables[r, :nb] = row[:nb]
        self.tape.replay(n)
        self.runs += 1
        return self.out[:n]
