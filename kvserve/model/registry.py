"""Architecture name (config.json ``architectures[0]``) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "kvserve.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvserve.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "kvserve.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kvserve.model.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "kvserve.model.qwen3_moe:Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM": "kvserve.model.glm4_moe:Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM": "kvserve.model.deepseek_v3:DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM": "kvserve.model.gemma3:Gemma3ForCausalLM",
}


def register_model(arch: str, target: str) -> None:
    _MODELS[arch] = target


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve(arch: str):
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported architecture {arch!r} (config.json 'architectures'); "
            f"supported: {', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module), cls)
