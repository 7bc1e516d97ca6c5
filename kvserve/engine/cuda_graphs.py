"""CUDA graphs for decode-only steps at fixed batch buckets.

A decode step's forward (every sequence has exactly one query token) is captured once per
batch bucket (``batch_buckets``: 1, 2, 4, 8, 16, 24, ... up to ``max_num_seqs``) over static
device buffers, and replayed: a live batch of ``n`` sequences is padded to the smallest bucket
``>= n`` (``pad_decode_batch``) and the first ``n`` rows of the output are kept. Prefill and
mixed steps, and batches larger than the largest bucket, run eagerly.

Padding rows (token 0 at position 0, seq_len 1, block table ``[null_block]``) write their K/V
to slot 0 of the cache's extra block ``null_block`` (index ``num_blocks``: never allocated,
see :mod:`kvserve.cache.kv_cache`) and attend only to it, so they touch no allocated block.
``null_block`` is documented to stay zero (padded block-table entries of live rows point at it;
those positions are masked, but finite zeros are the invariant), so every padded forward is
followed by ``clear_scratch_block`` (captured into the graph on CUDA).

Static buffers (B = largest bucket, MB = ceil(max_model_len / block_size)):

    input_ids  int64 [B]      positions int64 [B]      slots int64 [B]   write_rows int64 [B]
    seq_lens   int32 [B]      block_tables int32 [B, MB] (null_block past each sequence's end)

Graph ``b`` reads/writes the ``[:b]`` prefix of each. Only the Triton attention backend is
captured: its per-step plan can be given static tensors (``TritonAttentionBackend.graph_plan``)
and its decode kernel takes ``max_seq_len`` = the block-table capacity (no host sync).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvserve.attention import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.model.forward_batch import ForwardBatch

logger = logging.getLogger("kvserve")

PAD_TOKEN_ID = 0  # any valid id: padding rows' outputs are discarded


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Capture sizes: 1, 2, 4, then multiples of 8, below ``max_num_seqs``, then
    ``max_num_seqs`` itself (so the largest bucket never exceeds what the scheduler sends)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    small = [1, 2, 4, *range(8, max_num_seqs, 8)]
    return tuple(b for b in small if b < max_num_seqs) + (max_num_seqs,)


def select_bucket(buckets: Sequence[int], n: int) -> int | None:
    """Smallest bucket >= n (buckets ascending); None when n exceeds the largest or n < 1."""
    if n < 1:
        return None
    return next((b for b in buckets if b >= n), None)


def is_decode_only(meta: AttentionMetadata) -> bool:
    return meta.num_seqs > 0 and all(q == 1 for q in meta.query_lens)


def pad_decode_batch(batch: ForwardBatch, bucket: int, null_block: int, block_size: int,
                     components: int) -> ForwardBatch:
    """A decode-only ``batch`` of n sequences padded to ``bucket`` rows (n <= bucket).

    Rows n..bucket-1: token ``PAD_TOKEN_ID`` at position 0, seq_len 1, block table
    ``[null_block]``, writing slot ``null_block * block_size`` (component-0 row
    ``null_block * components * block_size``). Live rows are unchanged and come first.
    """
    meta = batch.meta
    n = meta.num_seqs
    if not is_decode_only(meta):
        raise ValueError("pad_decode_batch needs a decode-only batch (every query_len == 1)")
    if bucket < n:
        raise ValueError(f"bucket must be >= the batch size {n}, got {bucket}")
    pad = bucket - n
    if pad == 0:
        return batch
    dev = batch.input_ids.device

    def ext(t: torch.Tensor, value: int) -> torch.Tensor:  # [n] -> [bucket]
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype, device=dev)])

    row = null_block * components * block_size
    padded = AttentionMetadata(
        num_tokens=meta.num_tokens + pad,
        query_start_loc=list(range(bucket + 1)),
        query_lens=[1] * bucket,
        seq_lens=[*meta.seq_lens, *([1] * pad)],
        block_tables=[*meta.block_tables, *([[null_block]] * pad)],
        write_rows=ext(meta.write_rows, row),
        slot_mapping=ext(meta.slot_mapping, null_block * block_size),
    )
    return ForwardBatch(input_ids=ext(batch.input_ids, PAD_TOKEN_ID),
                        positions=ext(batch.positions, 0), meta=padded, attn=batch.attn)


def clear_scratch_block(kv_cache: PagedKVCache) -> None:
    """Re-zero ``null_block`` (payload, FP8 scales, and the write kernel's checksum state when
    integrity keeps one) after padding rows wrote to it."""
    kv_cache.data[:, kv_cache.null_block].zero_()
    if kv_cache.scales is not None:
        kv_cache.scales[:, kv_cache.null_block].zero_()
    csum = getattr(kv_cache, "csum_state", None)  # [L, NB+1, 4] int64 or None
    if csum is not None:
        csum[:, kv_cache.null_block].zero_()


class CudaGraphRunner:
    """Captures ``model(batch)`` for each bucket over static buffers; ``run`` replays.

    ``capture`` needs CUDA; without it (tests on CPU, Triton interpreter) ``run`` executes the
    identical static, padded forward eagerly.

    ``model(batch)`` must return hidden states [T, hidden] and do no host sync or host->device
    copy during a decode forward (dense Llama-family models with the Triton backend qualify;
    capture failures are logged and leave graphs off).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_cache: PagedKVCache,
                 block_size: int, components: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        if not backend.cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot be graph-captured")
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.components = block_size, components
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)  # MB
        dev = kv_cache.data.device
        B, MB, null = self.buckets[-1], self.max_blocks, kv_cache.null_block
        self.input_ids = torch.full((B,), PAD_TOKEN_ID, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.full((B,), null * block_size, dtype=torch.int64, device=dev)
        self.write_rows = torch.full((B,), null * components * block_size, dtype=torch.int64,
                                     device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((B, MB), null, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the captured batches: their plan tensors (made outside capture) must outlive replays
        self._captured: dict[int, ForwardBatch] = {}
        self.runs = 0  # decode steps served by run()
        self.replays = 0  # ... of which by a graph replay

    def _static_batch(self, b: int) -> ForwardBatch:
        """A ForwardBatch over the [:b] views of the static buffers (lists describe padding)."""
        null = self.kv_cache.null_block
        meta = AttentionMetadata(
            num_tokens=b, query_start_loc=list(range(b + 1)), query_lens=[1] * b,
            seq_lens=[1] * b, block_tables=[[null]] * b, write_rows=self.write_rows[:b],
            slot_mapping=self.slots[:b],
        )
        self.backend.graph_plan(meta, self.block_tables[:b], self.seq_lens[:b], self.slots[:b],
                                max_seq_len=self.max_blocks * self.block_size)
        return ForwardBatch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                            meta=meta, attn=self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (later graphs reuse its memory pool)."""
        pool = None
        for b in reversed(self.buckets):
            batch = self._static_batch(b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, settles allocations
                for _ in range(2):
                    self.model(batch)
                clear_scratch_block(self.kv_cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(batch)  # [b, hidden]
                clear_scratch_block(self.kv_cache)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
            self._captured[b] = batch
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", list(self.buckets))

    def can_run(self, batch: ForwardBatch) -> bool:
        meta = batch.meta
        return (is_decode_only(meta) and meta.num_seqs <= self.buckets[-1]
                and max(meta.seq_lens) <= self.max_blocks * self.block_size)

    def fill(self, batch: ForwardBatch) -> int:
        """Copy a decode-only batch of n sequences (``can_run``) into the static buffers,
        padded to its bucket; returns the bucket b (rows [:n] live, [n:b] padding)."""
        n = batch.meta.num_seqs
        b = select_bucket(self.buckets, n)
        if b is None or not self.can_run(batch):
            raise ValueError(f"batch of {n} sequence(s) does not fit a decode graph bucket")
        p = pad_decode_batch(batch, b, self.kv_cache.null_block, self.block_size, self.components)
        bs = self.block_size
        # Block tables: the blocks covering each seq_len, then null_block up to MB.
        tables = torch.full((b, self.max_blocks), self.kv_cache.null_block, dtype=torch.int32)
        for r, (row, slen) in enumerate(zip(p.meta.block_tables, p.meta.seq_lens, strict=True)):
            nb = -(-slen // bs)
            tables[r, :nb] = torch.tensor(row[:nb], dtype=torch.int32)
        self.block_tables[:b].copy_(tables)
        self.seq_lens[:b].copy_(torch.tensor(p.meta.seq_lens, dtype=torch.int32))
        self.input_ids[:b].copy_(p.input_ids)
        self.positions[:b].copy_(p.positions)
        self.slots[:b].copy_(p.meta.slot_mapping)
        self.write_rows[:b].copy_(p.meta.write_rows)
        return b

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch (``can_run``): the bucket's graph
        replayed, or (bucket not captured: tests on CPU) the same static forward run eagerly.
        The result is a view of the graph's output: consume it before the next ``run``."""
        n = batch.meta.num_seqs
        b = self.fill(batch)
        self.runs += 1
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            self.replays += 1
        else:
            out = self.model(self._static_batch(b))
            clear_scratch_block(self.kv_cache)
        return out[:n]
