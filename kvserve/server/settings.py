"""``ServerSettings``: the HTTP front end's knobs, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str = "kvserve"
    api_key: str | None = None  # None: no authentication
    max_queue: int = 256  # sequences that may wait beyond the engine's max_num_seqs
    request_timeout: float | None = 600.0  # seconds per request; None: no deadline
    max_body_bytes: int = 4 * 2**20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    tokenizer_workers: int = 2  # threads that tokenize and apply chat templates
    access_log: bool = True  # one "kvserve.access" log line per HTTP request

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout is not None and (
            not math.isfinite(self.request_timeout) or self.request_timeout <= 0
        ):
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 1 <= self.max_n <= 128:
            raise ValueError(f"max_n must be in [1, 128], got {self.max_n}")
        if not 1 <= self.tokenizer_workers <= 64:
            raise ValueError(f"tokenizer_workers must be in [1, 64], got "
                             f"{self.tokenizer_workers}")
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {self.max_prompts}")
