"""``Int4Scheme``: how one module's INT4 weight is stored in a checkpoint (format, group size,
symmetry, act order) and which tensors it owns. Read from ``quantization_config`` by
``kvserve.model.quant_config``; consumed by the INT4 layer (``kvserve.layers``)."""

from __future__ import annotations

from dataclasses import dataclass

# Tensors a quantized module owns in the checkpoint, per format.
CT_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
              "weight_g_idx")
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
GGUF_TENSORS = ("gguf_blocks",)  # uint8 [out, blocks * bytes]: raw Q4_0 / Q4_1 blocks


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How one module's INT4 weight is stored."""

    format: str  # "pack-quantized", "gptq" or "gguf" (raw Q4_0 / Q4_1 blocks)
    group_size: int  # -1: channel-wise (one group per row)
    symmetric: bool
    act_order: bool = False  # a g_idx tensor is required
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" (v1) or "gptq_v2"
    gguf_type: str | None = None  # GGUF only: "Q4_0" or "Q4_1"
    # GGUF only: int8 terms per activation on CPU (kvserve.quant.wq); 0: fp32 activations
    act_terms: int = 0

    @property
    def tensor_names(self) -> tuple[str, ...]:
        if self.format == "gguf":
            return GGUF_TENSORS
        return CT_TENSORS if self.format == "pack-quantized" else GPTQ_TENSORS

    def required_tensors(self) -> tuple[str, ...]:
        """Tensor names (``<module>.<name>``) a checkpoint must hold for this module."""
        if self.format == "gguf":
            return GGUF_TENSORS
        if self.format == "pack-quantized":
            names = ["weight_packed", "weight_scale", "weight_shape"]
            if not self.symmetric:
                names.append("weight_zero_point")
            if self.act_order:
                names.append("weight_g_idx")
        else:
            names = ["qweight", "scales"]
            if not self.symmetric:
                names.append("qzeros")
            if self.act_order:
                names.append("g_idx")
        return tuple(names)

    def eager_tensors(self) -> tuple[str, ...]:
        """Tensors a module waits for before building itself as soon as they are in (GPTQ
        writers always store qzeros and g_idx); the loader builds the rest at the end."""
        if self.format == "gptq":
            return self.tensor_names
        return self.required_tensors()

    def describe(self) -> str:
        if self.format == "gguf":
            return f"int4 gguf {self.gguf_type} group {self.group_size} (min form)"
        group = "channel" if self.group_size == -1 else f"group {self.group_size}"
        sym = "sym" if self.symmetric else "asym"
        fmt = self.format if self.format != "gptq" else self.checkpoint_format
        return f"int4 {fmt} {group} {sym}" + (" act-order" if self.act_order else "")
