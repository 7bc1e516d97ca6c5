"""The paged KV tensors: one preallocated tensor for all layers, plus FP8 / INT8 scales.

    data   [num_layers, num_blocks + 1, C, block_size, num_kv_heads, head_dim]  storage dtype
    scales [num_layers, num_blocks + 1, C, block_size, num_kv_heads]   bf16 (FP8) or int8
                                                                        codes (INT8) only

Rotated modes (``int8``, ``fp8_rot``...) store k R and v R for one orthogonal R [D, D]
(``rotation``, kvserve/quant/rotation.py); the attention backends rotate q alike and rotate the
output back, so what is stored here is still "one row per (token, head)".

C = 2 (K at c=0, V at c=1) for MHA/GQA and 1 for MLA (the latent row). The extra block at
index ``num_blocks`` (``null_block``) is never allocated and stays zero: padded block tables
point at it, so padded reads see finite zeros. A slot is ``block_id * block_size + offset``;
the row of token ``slot``, component c, in ``data[layer].view(-1, H, D)`` is

    row = (block_id * C + c) * block_size + offset

Everything is allocated (and zero-touched, to take the page faults) once at start-up.

The writer is chosen once, when the cache is built (``writer``, one of ``KV_WRITERS``):

    "c"          the C writer (kvserve/csrc/paged_attention.c) for fp32 rows on CPU, where it
                 builds; its pure-torch twin (``kvserve.kernels.reference.write_rows``) for the
                 rest (a bf16 model's v, a CUDA cache, no C compiler)
    "triton"     the fused Triton write kernel (kvserve/kernels/triton/cache.py), which also
                 keeps the checksum state below; what the Triton attention backends need
    "reference"  the pure-torch twin only (what tests compare the others with)

Optional checksum state (``kvserve.cache.integrity``), present only when integrity checking is
on AND the writes accumulate it (the ``"triton"`` writer)::

    csum_state [num_layers, num_blocks + 1, 4]  int64  (S1, S2 payload, S1, S2 scales)

Row ``csum_state[l, b]`` is zeroed when block b is (re)allocated; every token written into b
then adds its words' contribution, so once b is full the row equals the sums recomputed from
the bytes and sealing needs no read of the KV (``IntegrityChecker.seal``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvserve.config import KVMode
from kvserve.kernels import reference
from kvserve.kernels.cpu import paged_attention as cpu_attention
from kvserve.quant.rotation import KVRotation

logger = logging.getLogger(__name__)

SCALE_DTYPE = torch.bfloat16  # FP8 (and static checkpoint scales); INT8 stores 1-byte codes
KV_WRITERS = ("c", "triton", "reference")  # the ``writer`` a cache is built with (docstring)


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, components: int,
    mode: KVMode,
) -> int:
    per_row = head_dim * mode.dtype.itemsize + mode.scale_bytes
    return num_layers * components * block_size * num_kv_heads * per_row


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        components: int,
        mode: KVMode,
        device: torch.device | str = "cpu",
        static_scales: torch.Tensor | None = None,
        rotation_seed: int | None = None,
        rotation_split: tuple[int, ...] | None = None,
        checksums: bool = False,
        writer: str = "c",
    ) -> None:
        """``mode``: the settled KV mode (storage kind and rotation); ``rotation_seed``: the
        seed of a rotated mode's rotation (``CacheConfig.kv_rotation_seed``), None otherwise."""
        if writer not in KV_WRITERS:
            raise ValueError(f"writer must be one of {', '.join(KV_WRITERS)}, got {writer!r}")
        if mode.rotate != (rotation_seed is not None):
            raise ValueError(f"rotation_seed goes with a rotated KV mode, and only there: "
                             f"{mode.name} (rotate={mode.rotate}), got {rotation_seed!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.null_block = num_blocks  # never allocated, stays zero (padded tables point here)
        self.num_kv_heads, self.head_dim, self.components = num_kv_heads, head_dim, components
        # The storage kind is the mode's; backends read these flags, never the dtype.
        self.mode = mode
        self.dtype = mode.dtype  # the tensors' dtype
        self.is_fp8 = self.mode.is_fp8
        self.is_int8 = self.mode.is_int8
        self.has_scales = self.mode.scaled  # FP8 / INT8: one scale per row
        if self.has_scales and head_dim % 2:
            raise ValueError(f"8-bit KV cache needs an even head_dim, got {head_dim}")
        if self.is_int8 and (components * block_size * num_kv_heads) % 2:
            # the checksum reads a block's 1-byte scale codes as 16-bit words
            raise ValueError(f"INT8 KV cache needs an even block_size, got {block_size}")
        # q/k/v rotation of the rotated modes (None: stored as computed).
        # (MLA: block-diagonal over [c_kv | k_pe], ``rotation_split`` = (R, dr).)
        self.rotation = (
            KVRotation(head_dim, rotation_seed, device, split=rotation_split)
            if mode.rotate else None
        )
        shape = (num_layers, num_blocks + 1, components, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=self.dtype, device=device)
        self.scales = (
            torch.zeros(shape[:-1], dtype=self.mode.scale_dtype, device=device)
            if self.has_scales else None
        )
        self.writer = writer  # chosen here, once (the module docstring)
        # "c": fp32 writes on CPU go through the C writer when it builds (kvs_write_kv); its
        # twin, kvserve.kernels.reference.write_rows, takes every other write.
        self.use_kernel = (writer == "c" and not self.data.is_cuda
                           and cpu_attention.load() is not None)
        # "triton": the fused kernel (kernels/triton/cache.write_kv), which also keeps the
        # per-block checksum state when integrity is on (``checksums``, decided by whoever
        # builds the cache). Allocated here, before any block is: the checker zeroes a block's
        # row when it allocates the block, so a row older than allocation would be untrusted.
        self._fused_write: Callable[..., None] | None = None
        self.csum_state: torch.Tensor | None = None
        if writer == "triton":
            from kvserve.kernels.triton import cache as triton_cache

            self._fused_write = triton_cache.write_kv
            if checksums:
                self.csum_state = torch.zeros((num_layers, num_blocks + 1, 4),
                                              dtype=torch.int64, device=self.data.device)
        # Optional checkpoint scales [num_layers, C, H] (per-tensor scales broadcast over H).
        self.static_scales = None
        if static_scales is not None:
            if not self.is_fp8 or self.rotation is not None:
                # INT8 scales are dynamic; a checkpoint's scales were calibrated unrotated.
                logger.info("checkpoint KV scales ignored: KV cache is %s", self.mode.name)
            else:
                self.static_scales = static_scales.to(SCALE_DTYPE).reshape(
                    num_layers, components, num_kv_heads
                )

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
            self.components, self.mode,
        )

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def layer_rows(self, layer: int) -> torch.Tensor:
        """data[layer] as rows [(NB+1)*C*bs, H, D] (a view)."""
        return self.data[layer].view(-1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, rows: torch.Tensor, *parts: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """The one write path: component c of T tokens, parts[c] [T, H, D]; rows [T] int64 =
        component-0 rows (see the module docstring); ``slots`` [T] int64 the same tokens as
        slot ids (computed from rows when None). Below it, the cache's ``writer``: the fused
        Triton kernel (takes slots), or the C writer (fp32 rows on CPU, where it builds) and
        its pure-torch twin ``reference.write_rows`` (both take rows)."""
        if self._fused_write is not None:
            if slots is None:
                cbs = self.components * self.block_size
                slots = rows // cbs * self.block_size + rows % cbs
            static = [None] * len(parts) if self.static_scales is None else \
                list(self.static_scales[layer, : len(parts)])  # per component: [H] bf16
            v = parts[1] if len(parts) > 1 else None
            self._fused_write(self.data, self.scales, layer, slots, parts[0], v,
                              self.csum_state, *static)
            return
        flat = self.layer_rows(layer)
        scale_rows = self.scales[layer].view(-1, self.num_kv_heads) if self.has_scales else None
        for c, x in enumerate(parts):
            # per component: the C writer takes fp32 rows on CPU, its twin the rest (a bf16
            # model's v, say); both take the same arguments
            c_writes = (self.use_kernel and x.dtype == torch.float32 and x.device.type == "cpu"
                        and self.dtype in cpu_attention.WRITE_DTYPES)
            write = cpu_attention.write_kv if c_writes else reference.write_rows
            static = None if self.static_scales is None else self.static_scales[layer, c]
            write(x, rows, flat, scale_rows, static, row_offset=c * self.block_size)

    def describe(self) -> str:
        cap_tokens = self.num_blocks * self.block_size
        scale_note = ""
        if self.has_scales:
            per = self.mode.scale_bytes
            scale_bytes = self.num_layers * self.components * self.num_kv_heads * per
            kind = "1-byte log-domain" if self.is_int8 else "bf16"
            scale_note = f" (incl. {scale_bytes} B/token of {kind} scales)"
        if self.rotation is not None:
            scale_note += f", q/k/v rotated ({self.rotation.describe()})"
        return (
            f"KV cache: {self.mode.name}, {self.num_blocks} blocks x {self.block_size} "
            f"tokens = {cap_tokens} tokens, {self.bytes_per_token} B/token{scale_note}, "
            f"{self.num_blocks * self.bytes_per_block / 2**20:.1f} MiB"
        )
