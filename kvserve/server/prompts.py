"""Turn a validated request into engine inputs: token ids and ``SamplingParams``.

Two halves: cheap shape and size checks on the event loop (``completion_items``,
``chat_conversation``: nothing here is proportional to more than the body's length), then
tokenization and chat templating in a worker thread of the ``TokenizerPool``, each worker with
its own tokenizer copy (``tokenize_prompts``, ``tokenize_chat``). Text longer than
``Limits.max_prompt_chars`` is refused before it is tokenized. Everything raises ``APIError``
400 naming the parameter.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from kvserve.engine.input_processor import check_prompt_ids, check_prompt_room
from kvserve.http.errors import APIError, bad_request
from kvserve.http.protocol import (
    MAX_STOP_SEQUENCES,
    AssistantMessageIn,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    ToolMessage,
)
from kvserve.sampling_params import ParamError, RequestOutputKind, SamplingParams
from kvserve.server.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served engine allows (read once from the engine at startup)."""

    vocab_size: int
    max_model_len: int
    capacity_tokens: int
    max_prompt_chars: int  # longer prompt text is refused before tokenizing


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The character bound for prompt text: ``max_model_len`` tokens of the vocabulary's longest
    token, each with one separator. Text over it cannot fit the context (short of a tokenizer
    that drops long runs of characters), so it is refused without spending time on it."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * (longest + 1)


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None
    token_ids: list[int]


def check_model(model: str | None, settings: ServerSettings,
                adapters: Collection[str] = ()) -> None:
    """``model`` names the served model or one of its LoRA ``adapters`` (else a 404)."""
    if model is not None and model != settings.served_model_name and model not in adapters:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{settings.served_model_name}`.", param="model", code="model_not_found")


def check_n(n: int, settings: ServerSettings) -> None:
    if n > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n} on this server, got {n}", "n")


def check_request(req: SamplingRequest, settings: ServerSettings,
                  adapters: Collection[str] = ()) -> None:
    """What every generation request is checked for first: the model it names (a 404), then n."""
    check_model(req.model, settings, adapters)
    check_n(req.n, settings)


# ---- prompts ----------------------------------------------------------------------------------
def _check_ids(ids: list[int], limits: Limits, param: str) -> list[int]:
    """The engine's own check (kvserve.engine.input_processor), run before queueing."""
    try:
        return check_prompt_ids(ids, limits.vocab_size, param)
    except ParamError as e:
        raise bad_request(str(e), e.param, e.code) from e


def _too_long(param: str, what: str, limits: Limits) -> APIError:
    return bad_request(f"the {param} has {what}, leaving no room to generate: this model's "
                       f"maximum context length is {limits.max_model_len} tokens (and prompt "
                       f"text is limited to {limits.max_prompt_chars} characters)", param,
                       "context_length_exceeded")


def completion_items(req: CompletionRequest, limits: Limits,
                     settings: ServerSettings) -> list[str | list[int]]:
    """The prompts of a completion request (text or token ids), checked for emptiness and
    size without tokenizing: event-loop side."""
    p = req.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif not p:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    if len(items) > settings.max_prompts:
        raise bad_request(f"prompt batch has {len(items)} prompts; at most "
                          f"{settings.max_prompts} allowed", "prompt")
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if not item:
            raise bad_request(f"{param} must not be empty", param)
        if isinstance(item, str) and len(item) > limits.max_prompt_chars:
            raise _too_long(param, f"{len(item)} characters", limits)
        if not isinstance(item, str) and len(item) >= limits.max_model_len:
            raise _too_long(param, f"{len(item)} tokens", limits)
    return items


def tokenize_prompts(tokenizer, items: list[str | list[int]], limits: Limits) -> list[Prompt]:
    """Worker-thread side of ``completion_items``; stops at the first prompt over the context."""
    out = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=True)
            if len(ids) >= limits.max_model_len:
                raise _too_long(param, f"{len(ids)} tokens", limits)
            out.append(Prompt(item, _check_ids(list(ids), limits, param)))
        else:
            out.append(Prompt(None, _check_ids(list(item), limits, param)))
    return out


def _message_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise bad_request(f"{param} has type {part.type!r}, which this server does not "
                              "support; send text parts ({\"type\": \"text\", \"text\": "
                              "...}) or a string", param, "unsupported_content_type")
        if part.text is None:
            raise bad_request(f"{param} is a text part without its 'text' field", param)
        texts.append(part.text)
    return "\n".join(texts)


def chat_conversation(req: ChatCompletionRequest, tokenizer, limits: Limits) -> list[dict]:
    """The messages as the chat template takes them, size-checked: event-loop side.
    ``developer`` (OpenAI's newer name for ``system``) is rendered as ``system``."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("the served model's tokenizer has no chat template; use "
                          "/v1/completions", "messages")
    conversation, chars = [], 0
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role, "content": _message_text(m.content, i)}
        chars += len(msg["content"])
        if m.name is not None:
            msg["name"] = m.name
        if isinstance(m, ToolMessage):
            msg["tool_call_id"] = m.tool_call_id
        elif isinstance(m, AssistantMessageIn) and m.tool_calls:
            # as transformers' templates take them: arguments as a mapping
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls]
            chars += sum(len(c.function.arguments) for c in m.tool_calls)
        conversation.append(msg)
    if chars > limits.max_prompt_chars:
        raise _too_long("messages", f"{chars} characters", limits)
    return conversation


# apply_chat_template's own arguments: not template variables a request may set
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "messages"})


def check_template_kwargs(kwargs: dict | None) -> dict:
    """``chat_template_kwargs``: variables for the template; apply_chat_template's own
    arguments are refused (a 400 naming the key)."""
    kwargs = kwargs or {}
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs may not set {key!r} (an argument of the "
                              "template call, not a template variable)",
                              "chat_template_kwargs")
    return kwargs


def tokenize_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool,
                  limits: Limits, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> Prompt:
    """Worker-thread side of ``chat_conversation``: the chat template (given the tools, as
    transformers passes them, and ``template_kwargs`` as template variables), then token
    ids."""
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True,
                                            add_generation_prompt=add_generation_prompt,
                                            **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja templates raise anything on bad input
        raise bad_request(f"messages could not be rendered with the chat template: {e}",
                          "messages") from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return Prompt(None, _check_ids(list(ids), limits, "messages"))


def check_budget(max_tokens: int | None, limits: Limits, param: str) -> None:
    """A token budget the context cannot hold whatever the prompt (the schema's maximum)."""
    if max_tokens is not None and max_tokens >= limits.max_model_len:
        raise bad_request(f"{param} must be less than this model's maximum context length "
                          f"({limits.max_model_len} tokens), got {max_tokens}", param,
                          "context_length_exceeded")


def check_lengths(prompts: list[Prompt], max_tokens: int | None, limits: Limits,
                  prompt_param: str, max_tokens_param: str) -> None:
    """The engine's prompt-room check (run before queueing), then OpenAI's rule that prompt +
    max_tokens fit the context (the engine itself would cut generation at the context)."""
    ctx = limits.max_model_len
    for p in prompts:
        n = len(p.token_ids)
        try:
            check_prompt_room(n, ctx, limits.capacity_tokens, prompt_param)
        except ParamError as e:
            raise bad_request(str(e), e.param, e.code) from e
        if max_tokens is not None and n + max_tokens > ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, "
                              f"you requested {n + max_tokens} tokens ({n} in the "
                              f"{prompt_param}, {max_tokens} in the completion). Please reduce "
                              f"the length of the {prompt_param} or {max_tokens_param}.",
                              max_tokens_param, "context_length_exceeded")


# ---- sampling ---------------------------------------------------------------------------------
def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES}",
                          "stop")
    if any(not s for s in stops):
        raise bad_request("stop sequences must not be empty strings", "stop")
    return stops


def sampling_params(req: SamplingRequest, *, max_tokens: int | None, max_tokens_param: str,
                    logprobs: int | None, prompt_logprobs: int | None,
                    limits: Limits) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else -1
    if top_k > limits.vocab_size:
        top_k = limits.vocab_size
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=_stops(req.stop),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA,  # the server consumes deltas
        )
    except ValueError as e:  # SamplingParams names the parameter (ParamError.param)
        param = getattr(e, "param", None)
        raise bad_request(str(e), max_tokens_param if param == "max_tokens" else param) from e
