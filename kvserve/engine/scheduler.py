"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step every running request gets its next tokens first (decodes: 1; unfinished prefills: a
chunk), then waiting requests are admitted while the token budget, ``max_num_seqs`` and free
blocks allow. When a running request cannot get a block, the lowest-priority request not yet
scheduled this step (the latest arrival under FCFS) is preempted: its blocks are freed and it
goes back to the waiting queue to be recomputed from its token ids (prefix cache hits make
that cheap); no new request is admitted in a step that preempted.

The scheduler owns the requests' progress: ``schedule`` emits a ``SchedulerOutput`` (what to
compute this step), the runner returns a ``StepOutput`` (what was sampled), and
``update_from_output`` alone applies it: advances ``num_computed_tokens``, commits the newly
full blocks, appends the sampled tokens, and finishes (frees) the requests that stopped.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.config import SchedulerConfig
from kvserve.outputs import KVMove, Logprobs
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from kvserve.engine.step_output import StepOutput

logger = logging.getLogger("kvserve.scheduler")


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, + num_new_tokens).

    With draft tokens (speculative decoding) a decoding request's share is its last token and
    the drafts: num_new_tokens = 1 + len(draft), every row sampled and verified."""

    req: Request
    num_new_tokens: int
    num_computed_tokens: int  # already in the cache when the step starts
    block_ids: tuple[int, ...]  # its block table with this step's blocks allocated
    draft: tuple[int, ...] = ()  # draft tokens verified this step (positions after the last)


@dataclass(slots=True)
class SchedulerOutput:
    # Batch order: the continuing (running) requests, then the ones admitted this step (new,
    # or re-admitted after a preemption: they recompute from their prefix-cache hit).
    continuing: list[ScheduledRequest] = field(default_factory=list)
    new: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.continuing + self.new

    @property
    def is_empty(self) -> bool:
        return not self.continuing and not self.new


class TokenChecker(Protocol):
    """What the output processor does for ``update_from_output``: record what the user sees
    (logprobs, text) and say whether a request stops; it never frees anything."""

    def record_prompt_logprobs(self, req: Request, start: int, lps: torch.Tensor) -> None: ...

    def check_token(self, req: Request, token: int, accepted: bool, lps: Logprobs | None,
                    lp: float, now: float) -> RequestStatus | None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 max_loras: int = 0) -> None:
        self.config = config
        # LoRA: the most distinct adapters running at once (the adapter slots); 0: LoRA off
        self.max_loras = max_loras
        self.kv_manager = kv_manager
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        self.num_preemptions = 0

    def _key(self, req: Request) -> tuple[int, int]:
        prio = req.priority if self.config.policy == "priority" else 0
        return prio, self._order[req.request_id]

    def add(self, req: Request) -> None:
        self._order[req.request_id] = next(self._seq)
        bisect.insort(self.waiting, req, key=self._key)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = tuple(req.spec_token_ids[: budget - 1]) if n == 1 else ()
            # drafts only where their blocks are free: never preempt for a draft
            if draft and self.kv_manager.allocate_slots(req, 1 + len(draft)):
                out.continuing.append(self._scheduled(req, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                i += 1
                continue
            while not self.kv_manager.allocate_slots(req, n):
                victim = max(self.running[i:], key=self._key)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.continuing.append(self._scheduled(req, n))
                budget -= n
                i += 1
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if req.waits_for_leader or not self._lora_fits(req):
                i += 1
                continue
            # prefix hits, KV a connector loads (tiers, a store; meanwhile it waits), or
            # (decode role) its prompt's KV by transfer
            hit = self.kv_manager.get_computed_blocks(req)
            if hit.loading:
                i += 1
                continue
            computed = hit.num_tokens
            n = req.num_tokens - computed
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv_manager.allocate_slots(req, n, hit):
                break
            self.waiting.pop(i)
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                # prompt tokens served by this engine's prefix cache (tiers included), taken
                # once: a recompute after preemption hitting its own blocks is not a cache
                # hit, and neither are blocks a decode engine received by transfer
                req.metrics.num_cached_tokens = (0 if hit.imported else
                                                 min(hit.num_tokens, req.num_prompt_tokens))
            self.running.append(req)
            out.new.append(self._scheduled(req, n))
            budget -= n
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget

    def _lora_fits(self, req: Request) -> bool:
        """A request's adapter runs already, or a slot is left for it."""
        if req.lora is None:
            return True
        running = {r.lora.lora_id for r in self.running if r.lora is not None}
        return req.lora.lora_id in running or len(running) < self.max_loras

    def _scheduled(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens,
                                tuple(self.kv_manager.get_block_ids(req)), draft)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._key)
        out.preempted.append(req)

    # ---- applying a step's result --------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: StepOutput,
                           checker: TokenChecker) -> list[Request]:
        """The one place a step advances requests: the scheduled tokens are now in the cache
        (their newly full blocks sealed and cached before anything is freed), each sampled
        token is appended, and a request that stops is finished here. Returns the requests
        that got a token, in batch order.

        A verified draft (speculative decoding): of the step's 1 + k rows only the last token
        and the accepted drafts are computed KV; the accepted drafts join the output before
        the commit, so blocks are sealed over accepted tokens only. The rejected rows' slots
        are overwritten by later steps."""
        reqs = {s.req.request_id: s.req for s in sched.scheduled}
        tokens = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        for rid, start, lps in out.prompt_logprobs:
            checker.record_prompt_logprobs(reqs[rid], start, lps)
        for s in sched.scheduled:
            if s.draft:  # accepted drafts: all sampled tokens but the last
                accepted = tokens[s.req.request_id][:-1]
                s.req.num_computed_tokens += 1 + len(accepted)
                s.req.output_token_ids.extend(accepted)
            else:
                s.req.num_computed_tokens += s.num_new_tokens
            self.kv_manager.commit(s.req)
        self.kv_manager.flush_commits()
        now = time.monotonic()
        sampled = []
        drafted = {s.req.request_id for s in sched.scheduled if s.draft}
        for i, rid in enumerate(out.req_ids):
            req, toks = reqs[rid], out.sampled_token_ids[i]
            n_in = len(toks) - 1 if rid in drafted else 0  # already appended (accepted drafts)
            base = req.num_output_tokens - n_in
            for j, token in enumerate(toks):
                # structured outputs: a token the grammar refuses (a dead end) is not added
                # (a draft is accepted only where its row's mask allowed it)
                accepted = req.grammar is None or req.grammar.accept(token)
                if accepted and j >= n_in:
                    req.output_token_ids.append(token)
                status = checker.check_token(req, token, accepted, out.logprobs[i][j],
                                             out.sampled_logprobs[i][j], now)
                if status is not None:
                    if j < n_in:  # stopped inside the accepted drafts: drop the rest
                        del req.output_token_ids[base + j + 1 :]
                        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    self.finish(req, status)
                    break
            sampled.append(req)
        return sampled

    # ---- bookkeeping --------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request for good and free its blocks (idempotent)."""
        if req.is_finished:
            return
        # prefill role: a decode engine continues it (a stop needs no continuation)
        export = (req.kv_export and status is RequestStatus.FINISHED_LENGTH
                  and req.num_computed_tokens >= req.num_prompt_tokens)
        try:
            t0 = time.monotonic()
            req.kv_handle = h = self.kv_manager.request_finished(req, export)  # KV connectors save
            if h is not None:
                req.metrics.kv_export = KVMove(t0, time.monotonic() - t0, h["nbytes"],
                                               h["num_blocks"])
        except OSError:  # no handle: the caller continues without one (a full prefill)
            logger.exception("kv connector: saving %s failed", req.request_id)
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            i = bisect.bisect_left(self.waiting, self._key(req), key=self._key)
            if i < len(self.waiting) and self.waiting[i] is req:
                self.waiting.pop(i)
        self.kv_manager.free(req)
        self.kv_manager.forget(req)
        self._order.pop(req.request_id, None)

    def held_block_ids(self) -> list[int]:
        """Every block a running request holds (paranoid integrity checks)."""
        return [b for r in self.running for b in self.kv_manager.get_block_ids(r)]

    def rollback(self, block_ids: list[int]) -> list[Request]:
        """Integrity repair: roll every running request holding one of ``block_ids`` (bad,
        quarantined blocks) back to its last good block, to recompute from there. Returns the
        requests rolled back."""
        bad = set(block_ids)
        bs = self.kv_manager.block_size
        rolled = []
        for req in list(self.running):
            hit = [i for i, b in enumerate(self.kv_manager.get_block_ids(req)) if b in bad]
            if not hit:
                continue
            first = min(hit)
            self.kv_manager.truncate(req, first)
            req.num_computed_tokens = min(req.num_computed_tokens, first * bs)
            req.metrics.integrity_repairs += 1
            rolled.append(req)
            logger.warning("integrity: request %s rolled back to token %d (recompute)",
                           req.request_id, first * bs)
        return rolled

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
