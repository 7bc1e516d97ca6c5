"""Prompts in: a string, token ids, or a dict with ``prompt`` / ``prompt_token_ids``, checked
and turned into token ids (``ValueError`` naming the parameter when unusable).

``check_prompt_ids`` and ``check_prompt_room`` are the one implementation of the prompt checks:
the engine runs them on every request, the server calls the same functions to refuse a prompt
before it is queued (``ParamError`` carries the parameter and an error code)."""

from __future__ import annotations

from kvserve.sampling_params import ParamError

PromptType = str | list[int] | dict


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    if not ids:
        raise ParamError(param, f"{param} is empty")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ParamError(param, f"{param} has token id {t} outside the vocabulary "
                             f"[0, {vocab_size})", "invalid_token_id")
    return ids


def check_prompt_room(num_tokens: int, max_model_len: int, capacity_tokens: int,
                      param: str = "prompt") -> None:
    """A prompt must leave room to generate, in the context and in the KV cache."""
    if num_tokens >= max_model_len:
        raise ParamError(param, f"{param} has {num_tokens} tokens; the model's context "
                         f"(max_model_len) is {max_model_len}, which must leave room to "
                         "generate", "context_length_exceeded")
    if num_tokens >= capacity_tokens:
        raise ParamError(param, f"{param} has {num_tokens} tokens but the KV cache holds only "
                         f"{capacity_tokens}; raise kv_cache_memory", "context_length_exceeded")


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
    return text, check_prompt_ids(list(ids), vocab_size, param)
