"""Pure-torch twins of the kernels: these functions ARE the specification, and this package is
their one home (tests/test_ownership.py keeps it so).

Every Triton kernel in ``kvserve/kernels/triton/*.py`` must agree with its twin here (bit-exact
for the cache write and the checksum state, within floating-point tolerance for attention and
the INT4 GEMM), and so must the C kernels whose twins live here (the 16-bit GEMM of
``kvserve/csrc/w16_gemm.c``, the integer-dot GEMMs of ``kvserve/csrc/wq_gemm.c`` and
``kvserve/csrc/kq_gemm.c``, the KV writer and the attention of
``kvserve/csrc/paged_attention.c``). Clarity beats speed: loops over sequences are fine. This
package never imports triton and runs on CPU and CUDA alike.

    quant.py          FP8 / INT8 row quantizers (the KV writers' quantization)
    kv.py             the KV cache write and the checksum state
    attention.py      paged attention (prefill / decode), MLA decode
    cpu_attention.py  the CPU backend's pure-torch path (workspaces; the C kernel's twin)
    int4.py           INT4 weight-only GEMM (pack-quantized)
    gemm.py           16-bit-weight and integer-dot (GGUF Q4 / Q8) CPU GEMMs
    kquant.py         integer-dot GEMM of GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K kept packed
    lora.py           the grouped multi-LoRA GEMM (C and Triton)

Everything but ``cpu_attention`` is re-exported here (``from kvserve.kernels import reference as
ref; ref.write_kv(...)``).

Paged KV cache layout (fixed; the engine's CPU path uses exactly this)::

    kv_data   [num_layers, num_blocks, C, block_size, num_kv_heads, head_dim]   storage dtype
    kv_scales [num_layers, num_blocks, C, block_size, num_kv_heads]     bfloat16 (FP8) or
                                                                        int8 codes (INT8) only

    C = 2 (K at c=0, V at c=1) for MHA/GQA; C = 1 for MLA (one latent row [c_kv | k_rope],
    num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim).

    slot id = block_id * block_size + offset_in_block
    block_tables int32 [B, max_blocks_per_seq]: logical block j of sequence b -> physical block

    sequence b, token position p  ->  block block_tables[b, p // bs], offset p % bs

FP8 / INT8 dequantisation: ``x = stored_value.float() * scale`` with one scale per (token,
head, component), chosen at write time from the row's absolute maximum. FP8 stores the scale
as bf16. INT8 (symmetric, round half to even) stores a 1-byte code e, ``scale = 2^(e/8)``, the
smallest such step with ``127 * scale >= amax`` (the code table: :mod:`kvserve.quant.int8`).

Integrity checksum over one block ``kv_data[l, b]`` (shape [C, bs, H, D], row-major), viewed as
signed int16 words w_0 .. w_{N-1}::

    S1 = sum_i w_i            S2 = sum_i (i + 1) * w_i          (exact, int64)

and the same over ``kv_scales[l, b]`` (shape [C, bs, H]: one bf16 = one word; INT8's 1-byte
codes pair up into words like FP8 payload bytes, whatever token they belong to). The state of a
block is int64 [4] = (S1_payload, S2_payload, S1_scales, S2_scales). Any single-word change
alters S1 (w is a bijection of the bits), two changes that cancel in S1 alter S2 by
(i - j) * delta != 0, and swapping two distinct words alters S2 by (i - j) * (w_j - w_i) != 0.
Because both sums are linear in the words, each token's write adds an independent contribution,
so a fused write kernel can accumulate the state with atomics and sealing a block needs no
re-read of the KV bytes.
"""

from __future__ import annotations

from kvserve.kernels.reference.attention import (
    gather_kv,
    mla_decode,
    paged_attention,
    paged_decode_attention,
)
from kvserve.kernels.reference.gemm import (
    bf16_round,
    w16_linear,
    w16_linear_bf16_dot,
    wq_dequantize,
    wq_fake_quant_act,
    wq_matmul,
    wq_quantize_act,
)
from kvserve.kernels.reference.int4 import (
    dequantize_int4,
    int4_matmul,
    quantize_int4,
    unpack_int4,
    unpack_zero_points,
)
from kvserve.kernels.reference.kquant import kq_dequantize, kq_matmul
from kvserve.kernels.reference.kv import (
    block_checksum_state,
    rotate_heads,
    token_checksum_contrib,
    write_kv,
    write_rows,
)
from kvserve.kernels.reference.lora import lora_delta
from kvserve.kernels.reference.quant import (
    dequantize_rows,
    fp8_compute_scales,
    fp8_dequantize,
    fp8_max,
    fp8_quantize,
    fp8_quantize_dynamic,
    int8_compute_codes,
    int8_compute_scales,
    int8_dequantize,
    int8_quantize,
    int8_quantize_dynamic,
    quantize_fp8_rows,
    static_scale_rows,
)

__all__ = [
    "fp8_max",
    "fp8_compute_scales",
    "fp8_quantize",
    "fp8_quantize_dynamic",
    "fp8_dequantize",
    "int8_compute_codes",
    "int8_compute_scales",
    "int8_quantize",
    "int8_quantize_dynamic",
    "int8_dequantize",
    "quantize_fp8_rows",
    "dequantize_rows",
    "rotate_heads",
    "write_kv",
    "write_rows",
    "block_checksum_state",
    "token_checksum_contrib",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "mla_decode",
    "quantize_int4",
    "unpack_int4",
    "unpack_zero_points",
    "dequantize_int4",
    "int4_matmul",
    "bf16_round",
    "w16_linear",
    "w16_linear_bf16_dot",
    "wq_quantize_act",
    "wq_fake_quant_act",
    "wq_dequantize",
    "wq_matmul",
    "kq_dequantize",
    "kq_matmul",
    "static_scale_rows",
    "lora_delta",
]
