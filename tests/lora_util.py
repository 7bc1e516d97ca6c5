"""Random PEFT LoRA adapters for the tiny test models (saved with peft's own save_pretrained)."""

from __future__ import annotations

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out: str, r: int = 8, alpha: float = 16, targets=None,
                 seed: int = 1, std: float = 0.1, **extra) -> str:
    """A random LoRA adapter over the HF model at ``base_path`` (lora_B non-zero, so the
    adapter changes the output), saved as adapter_config.json + adapter_model.safetensors."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    base = tf.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL, lora_dropout=0.0,
                     **extra)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


def merged_hf(base, adapter_path: str):
    """transformers + peft: ``base`` (an HF model) with the adapter merged into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()
