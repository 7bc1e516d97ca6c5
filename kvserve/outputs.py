"""What ``LLM.generate`` and ``LLMEngine.step`` return (mirrors vLLM's output classes)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> logprob (the sampled token is always present).
Logprobs = dict[int, float]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprobs | None] | None = None
    # Prompt tokens this engine's prefix cache (KV tiers included) served when the request was
    # first scheduled (the first sequence's, for n > 1); OpenAI's usage.cached_tokens.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Prefill role (docs/disaggregation.md): where a decode engine fetches the prompt's KV
    # (kvserve.cache.kv_transfer.TransferHandle.to_dict()); None otherwise.
    kv_transfer: dict | None = None
