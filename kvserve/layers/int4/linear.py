"""INT4 weight-only linear layer (W4A16): y = x W^T + b with W held as 4-bit groups.

The layer is small on purpose; the rest of INT4 is in this package (see its ``__init__``) and
in ``kvserve/quant/int4.py`` (the format).

Building: ``Int4Linear(weight: Int4Weight, bias=None, *, act_terms=0, dequant_min_m=...,
gemv_max_m=...)`` (packing happens once, here; the layer is immutable afterwards), or
``Int4Linear.from_dense(w, group_size, symmetric)`` (round-to-nearest). Fused projections
(q/k/v, gate/up): pass ``kvserve.quant.int4.concat_out(parts)``.

``forward(x[..., in])`` -> ``[..., out]`` in x's dtype (bf16, fp16 or fp32). ``dequantize()``
returns the dense fp32 [out, in] weight the layer computes with (the twin); ``weight_bytes()``
the bytes held. Buffers are non-persistent: the packed layout is specific to this CPU and
process, so rebuild from the checkpoint tensors instead of saving a state_dict.

GPTQ act-order (g_idx): input columns are permuted once so each group is contiguous (as vLLM's
Marlin does) and x is permuted with ``index_select`` per call; irregular groups keep g_idx
(the canonical CPU method; on the GPU the dense weight).

GPU: ``to_device_layout(kernel, device)`` repacks once, from whichever CPU layout the layer
holds, for the Triton W4A16 kernel or torch's CUDA tinygemm (``EngineArgs.int4_cuda_kernel``;
the loader calls it for ``--device cuda``) and drops the CPU buffers. Moving a CPU layout with
``.to("cuda")`` alone is refused at the first forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvserve.layers.int4 import methods
from kvserve.quant import int4
from kvserve.quant.int4 import Int4Weight


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as 4-bit groups (see module docstring)."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        dequant_min_m: int = methods.DEQUANT_MIN_M,
        gemv_max_m: int | None = None,
        act_terms: int = 0,
    ) -> None:
        super().__init__()
        n, k = weight.out_features, weight.in_features
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [out={n}], got {tuple(bias.shape)}")
        self.in_features, self.out_features = k, n
        self.group_size = weight.group_size
        self.symmetric = weight.symmetric
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None,
                             persistent=False)
        # act-order: sort columns so groups are contiguous and regular
        perm: torch.Tensor | None = None
        if weight.g_idx is not None:
            gi = weight.g_idx.long()
            perm = torch.argsort(gi, stable=True)
            if torch.equal(gi[perm], torch.arange(k) // weight.group_size) and \
                    weight.n_groups == math.ceil(k / weight.group_size):
                weight = Int4Weight(weight.values[:, perm].contiguous(), weight.scales,
                                    weight.zeros, weight.group_size, None, weight.mins)
            else:
                perm = None  # irregular groups: the canonical method with g_idx
        self.register_buffer("perm", perm, persistent=False)  # int64 [in] or None
        self.method: methods.Int4Method = methods.select_cpu_method(
            weight, act_terms=act_terms if perm is None else 0, dequant_min_m=dequant_min_m,
            gemv_max_m=gemv_max_m)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                   bias: torch.Tensor | None = None) -> Int4Linear:
        """Round-to-nearest quantize a dense [out, in] weight (group_size -1: channel-wise)."""
        return cls(int4.quantize_rtn(weight, group_size, symmetric), bias)

    @property
    def device_kernel(self) -> str | None:
        """None: a CPU layout; else "triton", "tinygemm" or "dense"."""
        return self.method.device_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        else:
            if x2.is_cuda and self.method.device_kernel is None:
                raise ValueError("Int4Linear holds a CPU layout: call to_device_layout(kernel, "
                                 "device) to move it to CUDA")
            y = self.method.matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    @torch.no_grad()
    def to_device_layout(self, kernel: str = "triton",
                         device: torch.device | str | None = None) -> Int4Linear:
        """Repack, in place, for a GPU kernel ("triton", "tinygemm"; "dense" is what
        irregular act-order groups get whatever is asked), then move to ``device`` (None: stay);
        returns self. tinygemm's int32 tiles are made on CUDA (a CPU layer keeps its bytes)."""
        if kernel not in methods.layouts.CUDA_KERNELS:
            raise ValueError(f"kernel must be one of {methods.layouts.CUDA_KERNELS}, got "
                             f"{kernel!r}")
        current = self.method.device_kernel
        if current is not None:
            if current != kernel and kernel != "dense":
                raise ValueError(f"already packed for {current!r}; rebuild the layer from its "
                                 f"checkpoint tensors to use {kernel!r}")
        else:
            method = methods.gpu_method(kernel, self.out_features, self.in_features,
                                        self.method.canonical(), self.dequantize)
            if isinstance(method, methods.DenseMethod):
                self.register_buffer("perm", None, persistent=False)  # original column order
            self.method = method
        if device is not None:
            self.to(device)
        self.method.finish()
        return self

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The dense fp32 [out, in] weight this layer computes with (original column order)."""
        w = self.method.dequantize()
        if self.perm is None:
            return w
        dense = torch.empty_like(w)
        dense[:, self.perm] = w
        return dense

    def weight_bytes(self) -> int:
        """Bytes of every tensor the layer holds (packed weight, scales/zeros, perm, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, "
                f"bias={self.bias is not None}, path={self.method.path}, "
                f"act_order={self.perm is not None}")


def int4_experts_from_dense(
    weights: torch.Tensor | Sequence[torch.Tensor],
    group_size: int = 128,
    symmetric: bool = True,
) -> nn.ModuleList:
    """MoE experts: E dense [out, in] weights (or one [E, out, in] tensor) -> ModuleList of E
    Int4Linear, each quantized independently like a plain linear (compressed-tensors and GPTQ
    checkpoints store ``experts.<e>.<proj>`` per expert: build each from its Int4Weight)."""
    return nn.ModuleList(Int4Linear.from_dense(w, group_size, symmetric) for w in weights)
