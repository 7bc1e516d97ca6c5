"""What the runner returns for one step (``StepRunner.execute_model``) and the scheduler
applies (``Scheduler.update_from_output``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.outputs import Logprobs


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result, per request id (the rows sampled are in batch order).

    Each sampled request gets one or more tokens: with speculative decoding, the draft tokens
    the step verified and accepted, then the token sampled after the last accepted one."""

    req_ids: list[str]  # requests whose step ended at their last known token: sampled
    sampled_token_ids: list[list[int]]  # [len(req_ids)][>= 1]
    logprobs: list[list[Logprobs | None]]  # like sampled_token_ids: top-N + the token, or None
    sampled_logprobs: list[list[float]]  # like sampled_token_ids (0.0 when not asked)
    # (request id, first target position, logprobs [n, V] fp32 of targets start .. start+n-1)
    prompt_logprobs: list[tuple[str, int, torch.Tensor]]

