"""Integer-dot weight layout for CPU decode (W4A8 / W8A8).

GGUF-style weights -- unsigned codes u (4 or 8 bits) and a (scale, min) pair per group of G
input columns, w = u * s + m (Q4_0: m = -8 s; Q4_1: its min; Q8_0: u = q + 128, m = -128 s) --
are multiplied with activations quantized per row in blocks of 32 to int8, as llama.cpp does
for its Q4/Q8 formats (``ggml-cpu``: Q8_0 / Q8_1 activation blocks). The C kernel
(kvserve/csrc/wq_gemm.c) runs the products on integer units (AVX-512 VNNI, AVX2, or plain C).

Activation quantization, per row and 32-column block b (identical in C and here)::

    amax = max |x|,  q = clamp(rint(x * (127 / amax)), -127, 127),  dx = amax / 127
    (amax == 0: q = 0, dx = 0);  qs = sum q

so the layer computes dequant(W) . x^ with x^ = dx * q. The pure-torch twins of the
kernel (``wq_quantize_act``, ``wq_fake_quant_act``, ``wq_dequantize``, ``wq_matmul``) live
with every other kernel twin in :mod:`kvserve.kernels.reference`.

Tile layout (16 output rows per tile, N padded to 16; K % 32 == 0, G % 32 == 0)::

    bits 4: codes uint8 [N/16, K/8, 16, 4]   byte j of row r, k-oct t: low nibble u[r, 8t+j],
                                             high nibble u[r, 8t+4+j]
    bits 8: codes uint8 [N/16, K/4, 16, 4]   byte j of row r, k-quad t: u[r, 4t+j]
    sm      fp16  [N/16, K/G, 2, 16]         s of the tile's rows, then m
"""

from __future__ import annotations

import torch

BLOCK = 32  # activation block (columns per int8 scale)
TILE = 16  # output rows per weight tile
# EngineArgs.gguf_activations -> int8 terms per activation (0: fp32 activations, no int8 path)
ACTIVATIONS = {"int8x2": 2, "int8": 1, "fp32": 0}


def activation_terms(name: str) -> int:
    """``gguf_activations`` -> int8 passes: "int8x2" 2 (~15-bit activations, the default),
    "int8" 1 (llama.cpp's Q8 activation blocks), "fp32" 0 (no quantized activations)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {', '.join(ACTIVATIONS)}, "
                         f"got {name!r}")
    return ACTIVATIONS[name]


def check_shape(k: int, group: int, bits: int) -> None:
    """ValueError unless the layout can hold a [*, k] weight with this group and width."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group % BLOCK or k % group:
        raise ValueError(f"group_size must be a multiple of {BLOCK} dividing in_features; "
                         f"got group_size={group}, in_features={k}")


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] (N % 16 == 0) -> tile bytes (module docstring), flat uint8."""
    n, k = u.shape
    assert n % TILE == 0 and k % BLOCK == 0 and u.dtype == torch.uint8
    if bits == 4:
        assert int(u.max()) < 16 if u.numel() else True
        t = u.view(n // TILE, TILE, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [nt, K/8, 16, 4, 2]
        return (t[..., 0] | (t[..., 1] << 4)).contiguous().view(-1)
    return u.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)


def unpack_codes(codes: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 [n, k] (n % 16 == 0)."""
    if bits == 4:
        t = codes.view(n // TILE, k // 8, TILE, 4)
        u = torch.stack((t & 15, t >> 4), -1)  # [nt, K/8, 16, 4 (j), 2 (half)]
        return u.permute(0, 2, 1, 4, 3).reshape(n, k)
    return codes.view(n // TILE, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(n, k)


def pack_scales(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp16 s, m [N, K/G] (N % 16 == 0) -> fp16 [N/16, K/G, 2, 16]."""
    n, ng = s.shape
    sm = torch.stack((s.to(torch.float16), m.to(torch.float16)), 0)  # [2, N, ng]
    return sm.view(2, n // TILE, TILE, ng).permute(1, 3, 0, 2).contiguous()


def unpack_scales(sm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_scales``: fp16 (s, m), each [N, K/G]."""
    nt, ng = sm.shape[:2]
    t = sm.permute(2, 0, 3, 1).reshape(2, nt * TILE, ng)
    return t[0], t[1]
