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


@dataclass(frozen=True, slots=True)
class KVMove:
    """One KV movement of a request, timed where it happened (``time.monotonic`` start): a
    disaggregated export / import (kvserve/cache/kv_transfer.py) or a tier restore
    (kvserve/cache/kv_tiers.py). The server turns these into trace spans after the fact."""

    start: float
    seconds: float
    nbytes: int = 0
    blocks: int = 0  # blocks sent / installed / read back
    rejected: int = 0  # blocks refused on verification (recomputed)
    fallback: str | None = None  # an import that became a local prefill: why
    by_tier: tuple[tuple[str, int], ...] = ()  # restore: blocks read back per tier


@dataclass(slots=True)
class SpecDecodeUsage:
    """One sequence's speculative decoding (kvserve/engine/spec/): verify steps that carried
    drafts, draft tokens verified, and of those accepted. Counted by the engine as it steps."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # every time here is time.monotonic()
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Recorded by the cache / scheduler as they happen (None / 0: it did not happen).
    kv_export: KVMove | None = None  # prefill role: the prompt's KV offered
    kv_import: KVMove | None = None  # decode role: fetched, verified, installed
    kv_restores: list[KVMove] | None = None  # prefix blocks read back from KV tiers
    integrity_repairs: int = 0  # rollbacks to recompute from a corrupt block
    spec_decode: SpecDecodeUsage | None = None  # set when the engine speculates


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
