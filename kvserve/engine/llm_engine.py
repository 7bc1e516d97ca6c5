"""The synchronous engine: ``add_request`` / ``step`` / ``abort_request`` / ``stats``.

One ``step()`` = integrity check-up (rollback of requests on bad blocks) -> the scheduler's
``SchedulerOutput`` -> the runner (one model forward over the mixed batch through the
executor, then sampling) -> its ``StepOutput`` applied by the scheduler alone (tokens
computed, blocks committed, tokens appended, stop checks by the output processor, finished
requests freed) -> the output processor's ``RequestOutput``s. Everything the user can get
wrong is checked in ``add_request`` and raises ``ValueError`` naming the parameter, leaving the
engine untouched. Start-up (loading,
sizing, wiring) is ``kvserve.engine.builder``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvserve.cache.kv_transfer import TransferHandle
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.builder import build_engine
from kvserve.engine.debug import EngineDebug
from kvserve.engine.input_processor import PromptType, check_prompt_room, tokenize_prompt
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.engine.spec.drafter import make_drafter
from kvserve.engine.stats import (
    ITERATION_TOKEN_BOUNDS,
    BucketCounts,
    EngineStats,
    SpecDecodeCounters,
)
from kvserve.engine.step_output import StepOutput
from kvserve.engine.worker import DEFAULT_MAX_KV_BYTES  # noqa: F401 - re-exported
from kvserve.outputs import RequestOutput, SpecDecodeUsage
from kvserve.request import FirstToken, LoRARequest, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.compiler import GrammarCompiler

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        parts = build_engine(args or EngineArgs(**kwargs))
        self.args, self.config = parts.args, parts.config
        self.executor, self.runner = parts.executor, parts.runner
        self.tokenizer = parts.tokenizer
        self.pool, self.kv_manager, self.scheduler = parts.pool, parts.kv_manager, parts.scheduler
        self.integrity = parts.integrity
        self.kv_events = parts.kv_events  # KVEventPublisher or None
        # Read-only facts (tests and the front end read them).
        self.model_config = self.config.model
        self.cache_config = self.config.cache
        self.capacity_tokens = self.config.capacity_tokens
        self.fingerprint = self.config.fingerprint
        self.kv_mode = self.config.kv_mode.name  # int8_rot, int8_plain, fp8_e4m3_plain, bf16, ...
        self.kv_dtype = self.config.kv_mode.dtype
        self.model = self.executor.driver.model  # rank 0's shard under tensor parallelism
        self.kv_cache = self.executor.driver.kv_cache  # rank 0's slice under TP
        self.output_processor = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids)
        # Structured outputs: compiled grammars (thread-safe; the server compiles off its loop)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        self.model_config.eos_token_ids)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "finished": 0, "aborted": 0}
        self.iteration_tokens = BucketCounts(ITERATION_TOKEN_BOUNDS)  # tokens per step
        # Hooks for the metrics: speculative decoding records its drafts here (None: off);
        # LoRA serving sets ``lora_info`` to a callable giving EngineStats.lora (None: off).
        self.drafter = make_drafter(self.args, self.tokenizer, self.model_config.vocab_size)
        self.spec_decode: SpecDecodeCounters | None = (
            self.drafter.counters if self.drafter is not None else None)
        self.lora_info: Callable[[], dict[str, Any]] | None = (
            self._lora_info if self.runner.lora is not None else None)
        cc = self.cache_config
        self._cache_info = {"block_size": str(cc.block_size),
                            "num_gpu_blocks": str(self.pool.num_blocks),
                            "cache_dtype": str(self.kv_mode),
                            "enable_prefix_caching": str(cc.enable_prefix_caching)}
        # Test / drill / benchmark hooks (fault injection, leak checks, schedule observer)
        self.debug = EngineDebug(self.executor, self.pool, self.integrity, self.fingerprint,
                                 self.output_processor)

    def check_health(self) -> None:
        """Raise ``DistributedError`` if a tensor-parallel worker died (no-op otherwise)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Write the KV tiers down and stop them; stop the tensor-parallel workers and the KV
        event publisher (and a draft model's engine)."""
        if self.drafter is not None and self.drafter.draft_model is not None:
            self.drafter.draft_model.shutdown()
        self.kv_manager.close()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, param: str = "prompt") -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt, param)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    kv_export: bool = False, kv_transfer: dict | None = None,
                    first_token: FirstToken | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """``kv_export`` (prefill role): when the request ends by length, its prompt's KV is
        offered to a decode engine (RequestOutput.kv_transfer: the handle). ``kv_transfer`` +
        ``first_token`` (decode role): the handle and the token the prefill engine sampled; the
        prompt's KV is fetched, verified and counted as computed, and the request goes on
        (docs/disaggregation.md). ``lora_request``: the LoRA adapter to run the request with
        (loaded from its ``lora_path`` on first use; None: the base model)."""
        params = params or SamplingParams()
        lora = None
        if lora_request is not None:
            if self.runner.lora is None:
                raise ValueError("lora_request: LoRA is off in this engine (enable_lora or "
                                 "lora_modules)")
            lora = self.runner.lora.resolve(lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        max_len = self.model_config.max_model_len
        check_prompt_room(len(ids), max_len, self.capacity_tokens)
        room = min(max_len, self.capacity_tokens) - len(ids)
        # Like vLLM/OpenAI: generation stops at the context limit with finish_reason=length.
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if (kv_export or kv_transfer is not None) and "transfer" not in self.kv_manager.connectors:
            raise ValueError("kv_transfer: this engine has no KV transfer (--kv-transfer)")
        if (kv_export or kv_transfer is not None) and params.n != 1:
            raise ValueError("n must be 1 with a KV transfer (send n requests)")
        if kv_transfer is not None:
            TransferHandle.from_dict(kv_transfer)  # ValueError naming the field
            if not isinstance(first_token, FirstToken):
                raise ValueError("first_token is required with kv_transfer")
            if not 0 <= first_token.token_id < self.model_config.vocab_size:
                raise ValueError(f"first_token.token_id {first_token.token_id} is not a token")
            if max_tokens < 2:
                raise ValueError("max_tokens: the prefill engine's token ended the request")
        so = params.structured_outputs
        grammar = self.grammars.compile(so) if so is not None else None  # ValueError: refused
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):  # n > 1: sibling sequences "<id>#i", seeds seed + i
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)
            children.append(Request(cid, request_id, i, ids, child_params, max_tokens,
                                    prompt=text, priority=priority, cache_salt=cache_salt,
                                    lora=lora, arrival_time=arrival))
            if grammar is not None:
                children[-1].grammar = self.grammars.matcher(so)
        if self.cache_config.enable_prefix_caching:
            for child in children[1:]:
                child.prefill_leader = children[0]
        self.output_processor.add(request_id, text, ids, children)
        for child in children:
            child.kv_export = kv_export
            child.kv_import = kv_transfer
            self.scheduler.add(child)
        if kv_transfer is not None:
            self._continue_after(children[0], first_token)
        self.counters["prompt_tokens"] += len(ids)

    def _continue_after(self, req: Request, first: FirstToken | None) -> None:
        """Decode role: the prefill engine's token is applied like a token sampled here (the
        scheduler's one apply step, with nothing computed): logprobs, text, stop checks."""
        assert first is not None
        sched = SchedulerOutput(new=[ScheduledRequest(req, 0, 0, ())])
        out = StepOutput([req.request_id], [[first.token_id]], [[first.logprobs]],
                                [[first.logprob]], [])
        self.scheduler.update_from_output(sched, out, self.output_processor)
        if req.is_finished:
            self.output_processor.pop(req.parent_id)
            raise ValueError("first_token: it already ends the request (no decode needed)")

    # ---- LoRA adapters (kvserve/engine/lora_manager.py) ---------------------------------------
    def add_lora(self, lora_name: str, lora_path: str) -> int:
        """Register a PEFT adapter folder under ``lora_name``; its id (ValueError: bad adapter,
        name taken, LoRA off)."""
        if self.runner.lora is None:
            raise ValueError("lora_name: LoRA is off in this engine (enable_lora or "
                             "lora_modules)")
        return self.runner.lora.add(lora_name, lora_path).lora_id

    def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter no unfinished request uses (ValueError otherwise)."""
        if self.runner.lora is None or lora_name not in self.runner.lora.refs:
            raise ValueError(f"lora_name: no adapter {lora_name!r} is loaded")
        busy = [r for r in (*self.scheduler.running, *self.scheduler.waiting)
                if r.lora is not None and r.lora.lora_name == lora_name]
        if busy:
            raise ValueError(f"lora_name: adapter {lora_name!r} is in use by {len(busy)} "
                             "unfinished request(s)")
        self.runner.lora.remove(lora_name)

    def list_loras(self) -> list[tuple[str, int]]:
        """(name, id) of every registered adapter."""
        if self.runner.lora is None:
            return []
        return [(n, r.lora_id) for n, r in self.runner.lora.refs.items()]

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self.output_processor.pop(rid)
            if parent is None:
                continue
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self.counters["aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, before_forward: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduler iteration. ``before_forward`` is called once the step is scheduled,
        before its forward runs (not when nothing was scheduled): ``AsyncLLMEngine`` hands the
        previous step's outputs to the event loop there, so the loop turns them into HTTP
        chunks while the forward runs without the GIL."""
        if self.integrity is not None:
            bad = self.integrity.begin_step(self.scheduler.held_block_ids)
            if bad:
                self.integrity.record_rollbacks(len(self.scheduler.rollback(bad)))
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.kv_manager.wait_for_loads()  # nothing to run but KV loads in flight: no spinning
            return []
        if self.debug.on_schedule is not None:
            self.debug.on_schedule(sched, len(self.scheduler.running))
        if before_forward is not None:
            before_forward()
        t0 = time.perf_counter()
        out = self.runner.execute_model(sched)
        seconds = time.perf_counter() - t0
        self.counters["steps"] += 1
        self.iteration_tokens.observe(sum(x.num_new_tokens for x in sched.scheduled))
        sampled = self.scheduler.update_from_output(sched, out, self.output_processor)
        if self.integrity is not None:
            self.integrity.end_step()
        self.counters["generation_tokens"] += sum(map(len, out.sampled_token_ids))
        if self.drafter is not None:
            self._draft(sched, out, seconds)
        outs = self.output_processor.make_outputs(dict.fromkeys(r.parent_id for r in sampled))
        self.counters["finished"] += sum(o.finished for o in outs)
        return outs

    def _draft(self, sched: SchedulerOutput, out: StepOutput, seconds: float) -> None:
        """Speculative decoding: account the step's drafts, then draft for the next step."""
        assert self.drafter is not None
        drafts = {s.req.request_id: len(s.draft) for s in sched.scheduled if s.draft}
        accepted = {rid: len(t) - 1 for rid, t in zip(out.req_ids, out.sampled_token_ids,
                                                      strict=True) if rid in drafts}
        for s in sched.scheduled:  # the request's own counts (trace attributes)
            use = s.req.metrics.spec_decode
            if use is None:
                use = s.req.metrics.spec_decode = SpecDecodeUsage()
            if s.draft:
                use.num_drafts += 1
                use.num_draft_tokens += len(s.draft)
                use.num_accepted_tokens += accepted.get(s.req.request_id, 0)
        # the cost curve is of decode-shaped steps (a prefill chunk's rows are far cheaper)
        decode_only = all(s.num_new_tokens == 1 + len(s.draft) for s in sched.scheduled)
        self.drafter.observe(drafts, accepted, sched.num_batched_tokens,
                             seconds if decode_only else None)
        sched_ = self.scheduler
        self.drafter.sweep({r.request_id for r in sched_.running}
                           | {r.request_id for r in sched_.waiting})
        base = sum(r.num_tokens - r.num_computed_tokens for r in sched_.running)
        self.drafter.propose(sched_.running, min(base, sched_.config.max_num_batched_tokens))

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [P, V] fp32 for one token sequence, computed through the paged
        KV cache (so a quantized cache affects them exactly as in generation)."""
        _, ids = self.tokenize({"prompt_token_ids": list(token_ids)}, "token_ids")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"token_ids has {len(ids)} tokens, over max_model_len "
                             f"{self.model_config.max_model_len}")
        req = Request(f"__score_{id(ids)}", "__score", 0, ids, SamplingParams(max_tokens=1), 1)
        if not self.kv_manager.allocate_slots(req, len(ids)):
            raise ValueError("not enough free KV blocks to score token_ids")
        try:
            blocks = tuple(self.kv_manager.get_block_ids(req))
            return self.runner.prompt_logits(ScheduledRequest(req, len(ids), 0, blocks))
        finally:
            self.kv_manager.free(req)
            self.kv_manager.forget(req)

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        prefilling = sum(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        kv_stats = {name: c.stats() for name, c in self.kv_manager.connectors.items()}
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_prefilling=prefilling + len(sched.waiting),
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_used_blocks,
            num_blocks_free=pool.num_free_blocks, block_size=self.cache_config.block_size,
            prefix_cache_hit_rate=float(self.kv_manager.hit_rate),
            num_preemptions=self.scheduler.num_preemptions,
            num_unfinished_requests=self.get_num_unfinished_requests(),
            counters={**self.counters, "prefix_cache_queries": self.kv_manager.num_queried_tokens,
                      "prefix_cache_hits": self.kv_manager.num_hit_tokens},
            iteration_tokens=self.iteration_tokens.copy(), cache_config=self._cache_info,
            integrity=self.integrity.stats() if self.integrity is not None else None,
            kv_tiers=kv_stats.get("tiers"), kv_transfer=kv_stats.get("transfer"),
            spec_decode=self.spec_decode.as_dict() if self.spec_decode is not None else None,
            lora=self.lora_info() if self.lora_info is not None else None,
            timestamp=time.monotonic(),
        )

    def _lora_info(self) -> dict[str, Any]:
        """EngineStats.lora: the adapter slots and the adapters of running / waiting
        sequences (vllm:lora_requests_info)."""
        assert self.runner.lora is not None

        def names(reqs: list[Request]) -> list[str]:
            return sorted({r.lora.lora_name for r in reqs if r.lora is not None})

        return {"max_lora": self.runner.lora.max_loras, "running": names(self.scheduler.running),
                "waiting": names(self.scheduler.waiting)}

    def reset_integrity_timers(self) -> None:
        """Start the integrity checker's wall-time counters afresh (benchmarks)."""
        if self.integrity is not None:
            self.integrity.seconds.clear()

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
