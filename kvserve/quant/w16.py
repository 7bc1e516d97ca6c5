"""16-bit (bf16 / fp16) dense weights on CPU: the kinds the C kernel takes.

On every CPU kind kvserve computes a bf16 / fp16 checkpoint in fp32 (``dtype=auto``). The
weights stay 16-bit in memory (half the bytes a decode step reads); kvserve/csrc/w16_gemm.c
widens them in registers (bf16 -> fp32 and fp16 -> fp32 are exact), so the product is the fp32
product of the same values. Its pure-torch twin is ``kvserve.kernels.reference.w16_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = {torch.bfloat16: 0, torch.float16: 1}  # the C kernel's ``kind`` per weight dtype


# ---- packed tiles ---------------------------------------------------------------------------
#
# A batch-1 decode step reads every weight once, so its speed is the rate the GEMM streams
# them. Row-major, the kernel's register tile (NR weight rows) reads NR streams a row apart;
# packed, each tile's rows are interleaved ``tile_cols`` columns at a time and the tile is one
# sequential stream (~34 GB/s instead of ~26 on 2 AVX2 cores; docs/cpu.md). The values and the
# order they meet x in are the same, so results are bit-identical either way. The layout is the
# C build's (``kvs_w16_packing``: NR, vector width), so it is packed in the process that runs it.


@dataclass(frozen=True, slots=True)
class W16Tiles:
    """A 16-bit table packed for the CPU GEMM: the logical [rows, cols] matrix W held as
    [ceil(rows / tile_rows), cols / tile_cols, tile_rows, tile_cols] (rows past ``rows`` zero),
    stored 2-D as [ceil(rows / tile_rows), tile_rows * cols] -- a shape no code reading W as
    [rows, cols] accepts. Set as ``w16_tiles`` on the packed parameter."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int

    @property
    def num_tiles(self) -> int:
        return -(-self.rows // self.tile_rows)


def tiles_of(weight: torch.Tensor) -> W16Tiles | None:
    """The packing of ``weight`` (None: row-major)."""
    return getattr(weight, "w16_tiles", None)


def can_pack(weight: torch.Tensor, tile_cols: int) -> bool:
    """A row-major 16-bit CPU table [N, K] with K % tile_cols == 0, not packed yet."""
    return (weight.dtype in KINDS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % tile_cols == 0 and weight.is_contiguous()
            and tiles_of(weight) is None)


def pack(weight: torch.Tensor, tile_rows: int, tile_cols: int) -> tuple[torch.Tensor, W16Tiles]:
    """Row-major [N, K] -> (packed [ceil(N / tile_rows), tile_rows * K], its W16Tiles)."""
    n, k = weight.shape
    if tile_rows < 1 or tile_cols < 1 or k % tile_cols:
        raise ValueError(f"cannot pack a [{n}, {k}] table in tiles of {tile_rows} x {tile_cols}")
    tiles = W16Tiles(n, k, tile_rows, tile_cols)
    padded = weight
    if n % tile_rows:  # (a copy only then: a big table is held twice, not three times)
        padded = weight.new_zeros(tiles.num_tiles * tile_rows, k)
        padded[:n] = weight
    t = padded.view(tiles.num_tiles, tile_rows, k // tile_cols, tile_cols).permute(0, 2, 1, 3)
    return t.contiguous().view(tiles.num_tiles, tile_rows * k), tiles


def unpack(packed: torch.Tensor, tiles: W16Tiles) -> torch.Tensor:
    """Inverse of ``pack``: the row-major [rows, cols] table (a copy)."""
    r, c, k = tiles.tile_rows, tiles.tile_cols, tiles.cols
    t = packed.view(tiles.num_tiles, k // c, r, c).permute(0, 2, 1, 3)
    return t.reshape(tiles.num_tiles * r, k)[:tiles.rows]


def table_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of a 16-bit table, packed or row-major: [*ids, cols] in
    the table's dtype (F.embedding for row-major; the twin of the C gather)."""
    tiles = tiles_of(table)
    if tiles is None:
        return torch.nn.functional.embedding(ids, table)
    r, c, k = tiles.tile_rows, tiles.tile_cols, tiles.cols
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= tiles.rows):
        raise IndexError(f"token id out of range for an embedding of {tiles.rows} rows")
    rows = table.view(tiles.num_tiles, k // c, r, c)[flat // r, :, flat % r, :]
    return rows.reshape(*ids.shape, k)
