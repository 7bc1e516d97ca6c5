"""From sampled tokens to ``RequestOutput``: stop checks, incremental detokenization, and the
fan-in of a request's ``n`` sequences (its children) into one output.

What an output carries follows ``SamplingParams.output_kind``: ``DELTA`` (the server's
streams) only what is new since the request's previous output (new token ids, new text, new
logprobs: O(new) per step however long the request), ``FINAL_ONLY`` (``LLM.generate``) one
cumulative output when the request finishes, ``CUMULATIVE`` (``LLMEngine.step``'s default)
everything so far at every step.

The processor owns the per-request state the user sees (text so far, stop reasons, logprobs);
it never frees KV blocks: the scheduler appends each sampled token, asks ``check_token`` for the
finish status, and finishes the request itself (``Scheduler.update_from_output``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.sampler import top_logprobs
from kvserve.outputs import CompletionOutput, Logprobs, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import RequestOutputKind


@dataclass(slots=True)
class ParentRequest:
    """One ``add_request``: its ``n`` children (sequences) and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]  # [n]; None when detokenize=False
    kind: RequestOutputKind
    # DELTA: per child, the tokens and characters of text already in an output
    sent_tokens: list[int]  # [n]
    sent_chars: list[int]  # [n]
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.parents: dict[str, ParentRequest] = {}

    def add(self, request_id: str, prompt: str | None, ids: list[int],
            children: list[Request]) -> None:
        params = children[0].sampling_params
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                   params.include_stop_str_in_output)
            if params.detokenize else None
            for _ in children
        ]
        n = len(children)
        self.parents[request_id] = ParentRequest(request_id, prompt, ids, children, detoks,
                                                 params.output_kind, [0] * n, [0] * n)

    def pop(self, request_id: str) -> ParentRequest | None:
        return self.parents.pop(request_id, None)

    # ---- per token ----------------------------------------------------------------------------
    def record_prompt_logprobs(self, req: Request, start: int, lps: torch.Tensor) -> None:
        """lps [n, V]: logprobs of prompt positions start+1 .. start+n."""
        k = req.sampling_params.prompt_logprobs or 0
        assert req.prompt_logprobs is not None
        if start != len(req.prompt_logprobs):
            return  # a recompute after preemption: already recorded
        for j in range(lps.shape[0]):
            tok = req.prompt_token_ids[start + j]
            req.prompt_logprobs.append(top_logprobs(lps[j], tok, k))

    def check_token(self, req: Request, token: int, accepted: bool, lps: Logprobs | None,
                    lp: float, now: float) -> RequestStatus | None:
        """After the scheduler appended ``token`` (``accepted``; or not: the request's grammar
        refused it, a dead end): record its logprobs, detokenize, and return the status the
        request finishes with (FINISHED_GRAMMAR for a refused token), or None."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if not accepted:
            req.metrics.finished_time = now
            return RequestStatus.FINISHED_GRAMMAR
        if req.logprobs is not None:
            req.logprobs.append(lps)
            req.cumulative_logprob += lp
        p = req.sampling_params
        detok = self.parents[req.parent_id].detoks[req.index]
        status = None
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        if detok is not None:
            stop_str = detok.update([token])
            if status is None and stop_str is not None and n_out >= p.min_tokens:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and n_out >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.metrics.finished_time = now
        return status

    # ---- outputs ------------------------------------------------------------------------------
    def make_outputs(self, touched: Iterable[str]) -> list[RequestOutput]:
        """At most one output per touched parent (see the module docstring for what it
        carries); finished parents are dropped."""
        outs = []
        for pid in touched:
            parent = self.parents.get(pid)
            if parent is None:
                continue
            finished = all(c.is_finished for c in parent.children)
            if finished:
                del self.parents[pid]
            elif parent.kind is RequestOutputKind.FINAL_ONLY:
                continue
            outs.append(self._request_output(parent, finished))
        return outs

    @staticmethod
    def _request_output(parent: ParentRequest, finished: bool) -> RequestOutput:
        delta = parent.kind is RequestOutputKind.DELTA
        comps = []
        for j, (child, detok) in enumerate(zip(parent.children, parent.detoks, strict=True)):
            t0, c0 = (parent.sent_tokens[j], parent.sent_chars[j]) if delta else (0, 0)
            text = ""
            if detok is not None:
                # a stop string found later truncates only text never shown (held back)
                end = max(c0, detok.visible_len(child.is_finished))
                text = detok.text[c0:end]
                parent.sent_chars[j] = end
            parent.sent_tokens[j] = len(child.output_token_ids)
            lps = child.logprobs
            comps.append(CompletionOutput(
                index=child.index, text=text, token_ids=child.output_token_ids[t0:],
                cumulative_logprob=child.cumulative_logprob if lps is not None else None,
                logprobs=lps[t0:] if lps is not None else None,
                finish_reason=child.status.value if child.is_finished else None,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[0]
        plp = first.prompt_logprobs
        if plp is not None and not (delta and parent.sent_prompt_logprobs):
            plp = list(plp)  # complete by a request's first output (sampled after the prompt)
            parent.sent_prompt_logprobs = True
        else:
            plp = None
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=comps, finished=finished,
            prompt_logprobs=plp, num_cached_tokens=first.metrics.num_cached_tokens,
            metrics=first.metrics,
            kv_transfer=first.kv_handle,
        )
