"""Draft-model proposals: a smaller model with the same tokenizer, in this process, with its own
paged KV cache, block pool and scheduler (built like the target's by ``build_engine``).

Each call drafts greedily for every request at once: the request's tokens so far are the draft
engine's prompt (its prefix cache holds everything but the tokens since the last call, so only
those are prefilled), then k - 1 batched decode steps. Greedy drafts are deterministic, so the
target's verification (exact match of the drawn token) is rejection sampling for them.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.builder import EngineParts, build_engine
from kvserve.engine.spec.cost import DraftCost
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")


class _LengthOnly:
    """The draft engine's token checker: a draft ends at its length, nothing else."""

    def record_prompt_logprobs(self, req, start, lps) -> None:
        return None

    def check_token(self, req, token, accepted, lps, lp, now) -> RequestStatus | None:
        return RequestStatus.FINISHED_LENGTH if req.num_output_tokens >= req.max_tokens else None


class DraftModelProposer:
    def __init__(self, parts: EngineParts, k: int) -> None:
        self.parts = parts
        # a steady catch-up per request: the partial block the prefix cache does not hold,
        # the last verify's accepted tokens (up to k) and its bonus token
        self.steady_rows = parts.config.cache.block_size + k + 1
        self.max_len = parts.config.model.max_model_len
        self._checker = _LengthOnly()
        self._greedy = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False)

    @classmethod
    def build(cls, args: EngineArgs, model: str, tokenizer, vocab_size: int
              ) -> DraftModelProposer:
        """The draft engine for ``model``; ValueError when its tokenizer is not the target's."""
        dargs = dataclasses.replace(
            args, model=model, tokenizer=None, speculative_config=None, kv_integrity="off",
            kv_offload_memory=0.0, kv_offload_dir=None, kv_offload_disk=0.0, kv_transfer=None,
            kv_transfer_dir=None, kv_events_endpoint=None, kv_events_replay_endpoint=None,
            tensor_parallel_size=1, kv_cache_memory=None, num_blocks=None, enable_lora=False,
            lora_modules=[], kv_connector=None,
            kv_cache_memory_fraction=min(args.kv_cache_memory_fraction, 0.1), progress=False)
        parts = build_engine(dargs)
        if parts.config.model.vocab_size != vocab_size or \
                parts.tokenizer.get_vocab() != tokenizer.get_vocab():
            parts.executor.shutdown()
            raise ValueError(f"speculative_config: model {model!r} has a different tokenizer "
                             "than the target (a draft model must share its vocabulary)")
        logger.info("speculative decoding: draft model %s", parts.config.model.path)
        return cls(parts, args.speculative_config.num_speculative_tokens)

    def propose(self, reqs: list[Request], ks: list[int], cost: DraftCost | None = None
                ) -> list[list[int]]:
        """Greedy drafts of ``ks[i]`` tokens for ``reqs[i]`` (fewer where the draft model's
        context ends); the passes' times go to ``cost``."""
        sched, runner = self.parts.scheduler, self.parts.runner
        t0 = time.perf_counter()
        drafts: list[Request | None] = []
        for r, k in zip(reqs, ks, strict=True):
            ids = r.all_token_ids
            if len(ids) + k > self.max_len:
                drafts.append(None)
                continue
            d = Request(f"draft-{r.request_id}", r.request_id, 0, ids, self._greedy, k)
            sched.add(d)
            drafts.append(d)
        live = [d for d in drafts if d is not None]
        # first: until every draft has its first token (the catch-up, in chunks if long);
        # then `steps` passes of one row per unfinished draft (`rest` averages them over all
        # `live`: a little low where drafts end early). A request's catch-up of more rows
        # than a steady one (a new prompt: a one-off prefill, not the per-step price) keeps
        # the first pass from being observed.
        first, steps, steady = None, 0, True
        while any(not d.is_finished for d in live):
            so = sched.schedule()
            if so.is_empty:
                break
            sched.update_from_output(so, runner.execute_model(so), self._checker)
            if first is not None:
                steps += 1
                continue
            # the rows a request has left to compute when its step starts (its first chunk:
            # everything past its prefix-cache hit)
            steady = steady and all(s.req.num_tokens - s.num_computed_tokens <= self.steady_rows
                                    for s in so.scheduled)
            if all(d.num_output_tokens or d.is_finished for d in live):
                first = time.perf_counter() - t0
        for d in live:
            sched.finish(d, RequestStatus.FINISHED_ABORTED)  # frees its blocks (no-op if done)
        if cost is not None and first is not None:
            rest = (time.perf_counter() - t0 - first) / steps if steps else None
            if steady:
                cost.observe(len(live), first, rest)
            elif rest is not None:
                cost.rest.observe(len(live), rest)
        return [list(d.output_token_ids) if d is not None else [] for d in drafts]

    def forget(self, request_id: str) -> None:
        return None  # nothing is kept between calls but the prefix cache

    def shutdown(self) -> None:
        self.parts.kv_manager.close()
        self.parts.executor.shutdown()
