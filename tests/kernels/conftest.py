"""Shared set-up for the kernel tests.

Without CUDA the Triton kernels run under the interpreter, which must be switched on BEFORE
triton is first imported; pytest loads this conftest before the test modules, so setting the
variable here is early enough. (Nothing else in kvserve imports triton.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve.config import KVStorage  # noqa: E402
from kvserve.kernels import reference as ref  # noqa: E402


@dataclass
class PagedCache:
    """A cache with ``seq_lens`` sequences written into shuffled physical blocks.

    ``dense[b]`` is fp32 [C, seq_len, H, D]: exactly what the cache holds for sequence b,
    computed independently of the paging (FP8 rows quantised with the same formula).
    """

    kv_data: torch.Tensor
    kv_scales: torch.Tensor | None
    layer: int
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    dense: list[torch.Tensor]


def _poison(kv_data: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """NaN everywhere, so a kernel that reads a slot it should not read produces NaN."""
    if KVStorage(kv_data.dtype).is_fp8:
        kv_data.view(torch.uint8).fill_(0x7F)  # NaN in both e4m3fn and e5m2
    elif kv_data.dtype == torch.int8:
        kv_data.fill_(127)  # no NaN code: 127 * the largest scale (~7.6e6) poisons INT8 reads
    else:
        kv_data.fill_(float("nan"))
    if kv_scales is not None and kv_scales.dtype == torch.int8:
        kv_scales.fill_(127)  # INT8 scale codes have no NaN either: scale 2^15.875
    elif kv_scales is not None:
        kv_scales.fill_(float("nan"))


def build_paged_cache(
    seq_lens: Sequence[int],
    *,
    dtype: torch.dtype,
    n_comp: int,
    block_size: int,
    n_kv_heads: int,
    head_dim: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 2,
    value_std: float = 1.0,
) -> PagedCache:
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    per_seq = max(1, max(-(-s // block_size) for s in seq_lens))
    max_blocks = per_seq + 1  # one extra table column pointing at a poisoned block
    n_blocks = B * per_seq + spare_blocks
    shape = (num_layers, n_blocks, n_comp, block_size, n_kv_heads, head_dim)
    kv_data = torch.empty(shape, dtype=dtype, device=device)
    kv_scales = None
    if KVStorage(dtype).scaled:
        kv_scales = torch.empty(shape[:-1], dtype=KVStorage(dtype).scale_dtype, device=device)
    _poison(kv_data, kv_scales)
    perm = torch.randperm(n_blocks, generator=gen)
    tables = torch.full((B, max_blocks), int(perm[-1]), dtype=torch.int32)  # spare = poisoned
    tables[:, :per_seq] = perm[: B * per_seq].view(B, per_seq).to(torch.int32)
    dense = []
    for b, s in enumerate(seq_lens):
        rows = torch.randn(s, n_comp, n_kv_heads, head_dim, generator=gen) * value_std
        pos = torch.arange(s)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        comps = [rows[:, c] for c in range(n_comp)]
        ref.write_kv(
            kv_data,
            kv_scales,
            layer,
            slots.to(device),
            comps[0].to(device),
            comps[1].to(device) if n_comp == 2 else None,
        )
        if KVStorage(dtype).is_fp8:
            q8, sc = ref.quantize_fp8_rows(rows, dtype)
            dense.append(ref.dequantize_rows(q8, sc).transpose(0, 1))
        elif dtype == torch.int8:
            q8, sc = ref.int8_quantize_dynamic(rows)
            dense.append(ref.int8_dequantize(q8, sc).transpose(0, 1))
        else:
            dense.append(rows.to(dtype).float().transpose(0, 1))
    return PagedCache(
        kv_data,
        kv_scales,
        layer,
        tables.to(device),
        torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        dense,
    )


@pytest.fixture
def paged_cache() -> Callable[..., PagedCache]:
    return build_paged_cache


def query_start_loc(q_lens: Sequence[int], device: str | torch.device = "cpu") -> torch.Tensor:
    out = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(list(q_lens)).cumsum(0)
    return out.to(device)


@pytest.fixture
def make_qsl() -> Callable[..., torch.Tensor]:
    return query_start_loc
