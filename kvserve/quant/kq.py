"""GGUF Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights kept packed for the integer-dot kernel
(kvserve/csrc/kq_gemm.c): the blocks of a GGUF tensor read into their parts, and the parts
packed into the kernel's tile layout (same bytes within 3%, see the kernel's header).

Parts (``KqParts``), per weight [n, k] (k a multiple of the type's block)::

    u   uint8 [n, k]       the unsigned code (Q5_*: 5 bits, Q4_K: 4, Q5_K: 5, Q6_K: 6)
    d   fp16 [n, k / S]    per super-block (S = 32 for Q5_0 / Q5_1, 256 for K-quants)
    dm  fp16 [n, k / S]    Q5_1: m; Q4_K / Q5_K: dmin; else None
    sc  Q4_K / Q5_K: uint8 [n, k / 32] (6-bit); Q6_K: int8 [n, k / 16]; else None
    mn  Q4_K / Q5_K: uint8 [n, k / 32] (6-bit mins); else None

and the weight (``kvserve.kernels.reference.kq_dequantize``, equal to gguf.quants.dequantize)::

    Q5_0 d (u - 16)   Q5_1 d u + m   Q4_K / Q5_K (d sc) u - dmin mn   Q6_K (d sc) (u - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.quant import wq

TILE = 16
# ggml type id -> (name, weights per file block, bytes per file block, code bits, blocks of 32
# per kernel super-block)
TYPES: dict[int, tuple[str, int, int, int, int]] = {
    6: ("Q5_0", 32, 22, 5, 1),
    7: ("Q5_1", 32, 24, 5, 1),
    12: ("Q4_K", 256, 144, 4, 8),
    13: ("Q5_K", 256, 176, 5, 8),
    14: ("Q6_K", 256, 210, 6, 8),
}
TYPE_IDS = {v[0]: k for k, v in TYPES.items()}


@dataclass(frozen=True, slots=True)
class KqParts:
    """One weight's parts (module docstring); ``qtype`` a ggml type id of ``TYPES``."""

    qtype: int
    u: torch.Tensor
    d: torch.Tensor
    dm: torch.Tensor | None
    sc: torch.Tensor | None
    mn: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)  # type: ignore[return-value]


def type_id(qtype: int | str) -> int:
    """ggml type id of a kept-packed type (name or id); ValueError for any other."""
    t = TYPE_IDS.get(qtype) if isinstance(qtype, str) else qtype
    if t not in TYPES:
        raise ValueError(f"qtype must be one of {', '.join(TYPE_IDS)}, got {qtype!r}")
    return t


def check_shape(qtype: int, k: int) -> None:
    """ValueError unless a row of k columns is whole blocks of the type."""
    name, block = TYPES[qtype][0], TYPES[qtype][1]
    if k <= 0 or k % block:
        raise ValueError(f"{name} rows must be a multiple of {block} columns, got {k}")


def _bits(x: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """[..., L] -> [..., len(shifts), L]: (x >> s) & mask for each shift."""
    sh = torch.tensor(shifts, dtype=torch.int32).view(*([1] * (x.dim() - 1)), -1, 1)
    return ((x.to(torch.int32).unsqueeze(-2) >> sh) & mask).to(torch.uint8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K 12-byte packed 6-bit (sc, mn) [nb, 12] -> each uint8 [nb, 8]
    (gguf.quants.Q4_K.get_scale_min)."""
    s = scales.view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] -> fp16 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def from_blocks(qtype: int | str, raw: torch.Tensor, shape: tuple[int, int]) -> KqParts:
    """A GGUF tensor's bytes (uint8, [n, row bytes] or flat) of logical shape [n, k] -> parts
    (the layout of gguf.quants' dequantize_blocks for each type)."""
    t = type_id(qtype)
    name, block, nbytes = TYPES[t][:3]
    n, k = shape
    check_shape(t, k)
    if raw.dtype != torch.uint8 or raw.numel() != n * k // block * nbytes:
        raise ValueError(f"{name} [{n}, {k}] needs {n * k // block * nbytes} bytes of uint8, "
                         f"got {raw.numel()} of {raw.dtype}")
    b = raw.reshape(n * k // block, nbytes)
    nb = b.shape[0]
    if t in (6, 7):
        d = _f16(b[:, :2])
        m = _f16(b[:, 2:4]) if t == 7 else None
        o = 4 if t == 7 else 2
        qh = b[:, o:o + 4].contiguous().view(torch.int32).view(nb)
        qs = b[:, o + 4:]
        sh = torch.arange(32, dtype=torch.int32)
        hi = ((qh.view(nb, 1) >> sh) & 1).to(torch.uint8)  # [nb, 32]
        lo = _bits(qs, [0, 4], 0x0F).reshape(nb, 32)
        u = lo | (hi << 4)
        return KqParts(t, u.view(n, k), d.view(n, k // 32),
                       None if m is None else m.view(n, k // 32), None, None)
    if t in (12, 13):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        if t == 12:
            qs = b[:, 16:]
            u = _bits(qs.view(nb, 4, 32), [0, 4], 0x0F).reshape(nb, 256)
        else:
            qh, qs = b[:, 16:48], b[:, 48:]
            lo = _bits(qs.view(nb, 4, 32), [0, 4], 0x0F).reshape(nb, 8, 32)
            hi = _bits(qh, list(range(8)), 1)  # [nb, 8, 32]
            u = (lo | (hi << 4)).reshape(nb, 256)
        return KqParts(t, u.view(n, k), d.view(n, k // 256), dmin.view(n, k // 256),
                       sc.reshape(n, k // 32), mn.reshape(n, k // 32))
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    lo = _bits(ql.view(nb, 2, 64), [0, 4], 0x0F).reshape(nb, 8, 32)
    hi = _bits(qh.view(nb, 2, 32), [0, 2, 4, 6], 0x03).reshape(nb, 8, 32)
    u = (lo | (hi << 4)).reshape(nb, 256)
    return KqParts(t, u.view(n, k), d.view(n, k // 256), None,
                   scales.contiguous().view(torch.int8).reshape(n, k // 16), None)


def concat_rows(parts: list[KqParts]) -> KqParts:
    """Parts of one type stacked along the output dim."""
    p0 = parts[0]
    assert all(p.qtype == p0.qtype and p.u.shape[1] == p0.u.shape[1] for p in parts)

    def cat(name: str) -> torch.Tensor | None:
        xs = [getattr(p, name) for p in parts]
        return None if xs[0] is None else torch.cat(xs)

    return KqParts(p0.qtype, cat("u"), cat("d"), cat("dm"), cat("sc"), cat("mn"))


def slice_rows(p: KqParts, start: int, size: int) -> KqParts:
    """Rows [start, start + size) (tensor-parallel column split)."""
    def take(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[start:start + size].contiguous()

    return KqParts(p.qtype, take(p.u), take(p.d), take(p.dm), take(p.sc), take(p.mn))


def slice_cols(p: KqParts, start: int, size: int) -> KqParts:
    """Columns [start, start + size) (row-parallel split): whole super-blocks only."""
    block = TYPES[p.qtype][1]
    if start % block or size % block:
        raise ValueError(f"{TYPES[p.qtype][0]} rows split at column {start} (+{size}): not a "
                         f"multiple of its {block}-column blocks")

    def cols(x: torch.Tensor | None, per: int) -> torch.Tensor | None:
        return None if x is None else x[:, start // per:(start + size) // per].contiguous()

    sc_per = 16 if p.qtype == 14 else 32
    return KqParts(p.qtype, cols(p.u, 1), cols(p.d, block), cols(p.dm, block),
                   cols(p.sc, sc_per), cols(p.mn, 32))


# ---------------------------------------------------------------- the kernel's tile layout


def packed_bytes(qtype: int, n: int, k: int) -> int:
    """Bytes of the packed layout of an [n, k] weight (n padded to 16 rows)."""
    _, _, _, bits, sb = TYPES[qtype]
    hdr = 32 * (2 if qtype in (7, 12, 13) else 1)
    blk = (32 if qtype >= 12 else 0) + 256 + 64 * (bits - 4)
    return -(-n // TILE) * (k // (32 * sb)) * (hdr + sb * blk)


def file_bytes(qtype: int, n: int, k: int) -> int:
    """Bytes the [n, k] weight takes in a GGUF file."""
    _, block, nbytes = TYPES[qtype][:3]
    return n * k // block * nbytes


def _pad_rows(x: torch.Tensor | None, n_pad: int) -> torch.Tensor | None:
    if x is None or x.shape[0] == n_pad:
        return x
    return torch.cat([x, x.new_zeros(n_pad - x.shape[0], *x.shape[1:])])


def _tile_major(x: torch.Tensor) -> torch.Tensor:
    """[n_pad, c] -> [n_pad / 16, c, 16] (row within the tile fastest)."""
    n, c = x.shape
    return x.reshape(n // TILE, TILE, c).permute(0, 2, 1)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def pack(p: KqParts) -> torch.Tensor:
    """Parts -> the kernel's tile bytes (kvserve/csrc/kq_gemm.c's header), flat uint8."""
    t = p.qtype
    _, _, _, bits, sb = TYPES[t]
    n, k = p.shape
    n_pad = -(-n // TILE) * TILE
    nt, nblk = n_pad // TILE, k // 32
    nsb = nblk // sb
    u = _pad_rows(p.u, n_pad)
    hdr = [_as_bytes(_tile_major(_pad_rows(p.d, n_pad)).contiguous()).view(nt, nsb, 32)]
    if p.dm is not None:
        hdr.append(_as_bytes(_tile_major(_pad_rows(p.dm, n_pad)).contiguous()).view(nt, nsb, 32))
    pieces = []
    if t in (12, 13):
        pieces += [_tile_major(_pad_rows(p.sc, n_pad)), _tile_major(_pad_rows(p.mn, n_pad))]
    elif t == 14:  # [n_pad, nblk, 2] -> [nt, nblk, 2 halves, 16 rows]
        sc = _pad_rows(p.sc, n_pad).reshape(nt, TILE, nblk, 2).permute(0, 2, 3, 1)
        pieces.append(_as_bytes(sc.contiguous()).reshape(nt, nblk, 32))
    pieces.append(wq.pack_codes((u & 15).contiguous(), 4).view(nt, nblk, 256))
    for plane in range(bits - 4):  # bit 4 + plane of u[r, 8t + 4n + j] at lane 4r + j
        bit = ((u >> (4 + plane)) & 1).reshape(nt, TILE, nblk, 4, 2, 4)
        lanes = bit.permute(0, 2, 3, 4, 1, 5).reshape(nt, nblk, 8, 8, 8)  # [.., mask, byte, bit]
        w = (1 << torch.arange(8, dtype=torch.int32))
        pieces.append((lanes.to(torch.int32) * w).sum(-1).to(torch.uint8).reshape(nt, nblk, 64))
    blocks = torch.cat([x.contiguous().reshape(nt, nblk, -1) for x in pieces], -1)
    stream = torch.cat(hdr + [blocks.reshape(nt, nsb, -1)], -1)
    out = stream.reshape(-1).contiguous()
    assert out.numel() == packed_bytes(t, n, k)
    return out


def unpack(qtype: int, packed: torch.Tensor, n: int, k: int) -> KqParts:
    """Inverse of ``pack``: the parts of the first n rows."""
    _, _, _, bits, sb = TYPES[qtype]
    n_pad = -(-n // TILE) * TILE
    nt, nblk = n_pad // TILE, k // 32
    nsb = nblk // sb
    has_dm = qtype in (7, 12, 13)
    hdr_b = 32 * (2 if has_dm else 1)
    s = packed.view(nt, nsb, -1)

    def untile(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[nt, c, 16 * size] bytes -> [n, c] of dtype."""
        v = x.contiguous().view(dtype)  # [nt, c, 16]
        return v.permute(0, 2, 1).reshape(n_pad, -1)[:n].contiguous()

    d = untile(s[..., :32], torch.float16)
    dm = untile(s[..., 32:64], torch.float16) if has_dm else None
    blocks = s[..., hdr_b:].reshape(nt, nblk, -1)
    o = 0
    sc = mn = None
    if qtype in (12, 13):
        sc, mn = untile(blocks[..., :16], torch.uint8), untile(blocks[..., 16:32], torch.uint8)
        o = 32
    elif qtype == 14:
        v = blocks[..., :32].contiguous().view(torch.int8).reshape(nt, nblk, 2, TILE)
        sc = v.permute(0, 3, 1, 2).reshape(n_pad, 2 * nblk)[:n].contiguous()
        o = 32
    lo = wq.unpack_codes(blocks[..., o:o + 256].contiguous().view(-1), n_pad, k, 4)
    u = lo.clone()
    for plane in range(bits - 4):
        mb = blocks[..., o + 256 + 64 * plane:o + 320 + 64 * plane].reshape(nt, nblk, 8, 8, 1)
        lanes = (mb.to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1  # [.., 8, 8, 8]
        bit = lanes.reshape(nt, nblk, 4, 2, TILE, 4).permute(0, 4, 1, 2, 3, 5).reshape(n_pad, k)
        u |= (bit.to(torch.uint8) << (4 + plane))
    return KqParts(qtype, u[:n].contiguous(), d, dm, sc, mn)
