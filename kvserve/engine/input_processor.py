"""Prompts in: a string, token ids, or a dict with ``prompt`` / ``prompt_token_ids``, checked
and turned into token ids (``ValueError`` naming the parameter when unusable)."""

from __future__ import annotations

PromptType = str | list[int] | dict


def tokenize_prompt(tokenizer, vocab_size: int, prompt: PromptType,
                    param: str = "prompt") -> tuple[str | None, list[int]]:
    """(text or None, token ids in [0, vocab_size)) of one prompt."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif "prompt" in prompt:
            return tokenize_prompt(tokenizer, vocab_size, prompt["prompt"], param)
        else:
            raise ValueError(f"{param} dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list):
        text, ids = None, prompt
    else:
        raise ValueError(f"{param} must be a string, a token id list or a dict, "
                         f"got {type(prompt).__name__}")
    if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool)
                                        for t in ids):
        raise ValueError(f"{param} token ids must be a list of integers")
    if not ids:
        raise ValueError(f"{param} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{param} has token id {bad[0]} outside the vocabulary "
                         f"[0, {vocab_size})")
    return text, list(ids)
