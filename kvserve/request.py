"""A request's mutable state as the scheduler and engine see it.

A user request with ``n > 1`` becomes ``n`` sequences (``Request`` objects) that share the
prompt; the engine groups their outputs back by ``parent_id``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.outputs import Logprobs, RequestMetrics
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.structured_output.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Structured outputs: the grammar allowed no next token (or refused the sampled one).
    FINISHED_GRAMMAR = "grammar_dead_end"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_GRAMMAR,
        )


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Decode role: the token a prefill engine sampled after the prompt; the request goes on
    from it (``logprobs``: that position's, when the request asked for logprobs)."""

    token_id: int
    logprob: float = 0.0
    logprobs: Logprobs | None = None


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A request's LoRA adapter (vLLM's ``LoRARequest``): ``lora_name`` names it,
    ``lora_int_id`` (> 0) is its number (the engine keeps its own for a name it already has),
    ``lora_path`` the PEFT folder to load it from when the engine does not have it yet."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 0:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 0, got "
                             f"{self.lora_int_id!r}")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """The adapter a sequence runs with, as the engine resolved it: its id and name (KV
    events' ``lora_id`` / ``lora_name``) and its content digest, which salts every block hash
    of the sequence (different adapters never share KV; kvserve.cache.kv_cache_manager)."""

    lora_id: int
    lora_name: str
    digest: bytes


@dataclass(eq=False, slots=True)
class Request:
    request_id: str  # unique per sequence: "<parent>" or "<parent>#<index>"
    parent_id: str
    index: int  # which of the parent's n sequences
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: min(params.max_tokens, context left)
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora: AdapterRef | None = None  # None: the base model
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Sampling outputs, appended per generated token.
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[Logprobs | None] | None = None
    # n > 1: siblings wait until this one has prefilled the shared prompt, then hit its blocks.
    prefill_leader: Request | None = None
    # Structured outputs: the grammar state, advanced by each accepted output token. Output
    # tokens survive preemption and integrity rollback, so it never moves back.
    grammar: GrammarMatcher | None = None
    # Disaggregation (kvserve/cache/kv_transfer.py, docs/disaggregation.md). Prefill role:
    # ``kv_export`` -- when the request finishes by length its prompt's KV is offered to a
    # decode engine and ``kv_handle`` (TransferHandle.to_dict()) tells the caller where.
    # Decode role: ``kv_import`` -- the handle to fetch; cleared once the blocks are in.
    kv_export: bool = False
    kv_handle: dict | None = None
    kv_import: dict | None = None
    # Speculative decoding (kvserve/engine/spec/): the draft tokens the next step verifies,
    # set by the drafter after each step (empty: none). Never part of the token ids.
    spec_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)
    # Detokenizer state lives in the engine's output processor, keyed by request_id.

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def waits_for_leader(self) -> bool:
        lead = self.prefill_leader
        return (lead is not None and not lead.is_finished
                and lead.num_computed_tokens < lead.num_prompt_tokens)
