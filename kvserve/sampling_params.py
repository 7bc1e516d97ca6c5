"""Per-request sampling parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

# re-exported: vLLM's users import it from here (its home: kvserve/structured_output/params.py)
from kvserve.structured_output.params import StructuredOutputsParams

_MAX_LOGPROBS = 20


class ParamError(ValueError):
    """A bad request parameter, named in ``param`` (the server's 400 names it without reading
    the message)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # an OpenAI-style error code, e.g. "context_length_exceeded"


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ParamError(name, f"{name} must be a finite number, got {value!r}")


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = "cumulative"  # everything so far, at every step (LLMEngine.step's default)
    DELTA = "delta"  # only what is new since the previous output (the server's streams)
    FINAL_ONLY = "final_only"  # one cumulative output, when the request finishes (LLM.generate)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 128:
            raise ParamError("n", f"n must be an integer in [1, 128], got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ParamError("top_k",
                             f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError("presence_penalty",
                             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError("frequency_penalty",
                             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ParamError("repetition_penalty",
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ParamError("max_tokens",
                             f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ParamError("seed", f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= _MAX_LOGPROBS):
                raise ParamError(name, f"{name} must be in [0, {_MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ParamError("stop", "stop must contain non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "stop_token_ids must be non-negative integers")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ParamError("structured_outputs",
                             "structured_outputs must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParamError("output_kind",
                             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)


MAX_LOGPROBS = _MAX_LOGPROBS
__all__ = ["SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "MAX_LOGPROBS",
           "field"]
