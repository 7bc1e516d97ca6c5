"""kvserve: a compact, checked KV-cache LLM inference engine.

``LLM``, ``SamplingParams``, ``RequestOutput`` and ``CompletionOutput`` are imported on first
use (PEP 562), so ``import kvserve.<submodule>`` (the command line's ``--help``) does not pay
for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvserve.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "__version__"]

_LAZY = {"LLM": "kvserve.llm", "SamplingParams": "kvserve.sampling_params",
         "RequestOutput": "kvserve.outputs", "CompletionOutput": "kvserve.outputs",
         "LoRARequest": "kvserve.request"}

if TYPE_CHECKING:
    from kvserve.llm import LLM
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.request import LoRARequest
    from kvserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
