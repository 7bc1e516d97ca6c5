"""What the runner returns for one step (``ModelRunner.execute_model``) and the scheduler
applies (``Scheduler.update_from_output``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.outputs import Logprobs


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """One step's result, per request id (the rows sampled are in batch order)."""

    req_ids: list[str]  # requests whose step ended at their last known token: sampled
    sampled_token_ids: list[int]  # [len(req_ids)]
    logprobs: list[Logprobs | None]  # [len(req_ids)]: top-N + the sampled token, or None
    sampled_logprobs: list[float]  # [len(req_ids)]: the sampled token's (0.0 when not asked)
    # (request id, first target position, logprobs [n, V] fp32 of targets start .. start+n-1)
    prompt_logprobs: list[tuple[str, int, torch.Tensor]]

