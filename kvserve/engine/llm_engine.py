"""The synchronous engine: ``add_request`` / ``step`` / ``abort_request``.

One ``step()`` = schedule -> one model forward over the mixed batch -> sample -> update
requests (stop checks, detokenization) -> commit newly full blocks (seal + prefix-cache) ->
free finished requests. Everything the user can get wrong is checked in ``add_request`` and
raises ``ValueError`` naming the parameter, leaving the engine untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.config import ModelConfig, dtype_name
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.executor import MultiprocExecutor, make_executor
from kvserve.engine.model_runner import finish_step, prepare_step
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.worker import DEFAULT_MAX_KV_BYTES  # noqa: F401 - re-exported
from kvserve.layers.sampler import Sampler, SampleRow, top_logprobs
from kvserve.model.loader import describe_weight_bytes, load_tokenizer
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

PromptType = str | list[int] | dict


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    emitted: bool = False
    finished_reported: bool = False
    deltas: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs) -> None:
        args = args or EngineArgs(**kwargs)
        self.args = args
        cache_cfg, sched_cfg = args.cache_config(), args.scheduler_config()
        self.cache_config = cache_cfg
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        # The executor owns the model: in this process (tp=1) or over tp ranks, rank 0 here.
        self.executor = make_executor(args)
        worker = self.executor.driver
        loaded, spec, layout = worker.loaded, worker.spec, worker.layout
        path = worker.path
        folder = loaded.folder  # config.json + tokenizer (a GGUF's converted metadata)
        self.model = worker.model  # rank 0's shard under tensor parallelism
        self.tokenizer = load_tokenizer(args.tokenizer or folder)
        self.kv_dtype = layout.dtype
        # Canonical KV mode name (``int8``, ``int8_plain``, ``fp8_e4m3_rot``, ``bf16``...).
        self.kv_mode = layout.mode_name
        bs, num_blocks, max_len = layout.block_size, layout.num_blocks, layout.max_model_len
        self._kv_budget_note = layout.budget_note
        self.capacity_tokens = num_blocks * bs
        self.model_config = ModelConfig(
            path=path, architecture=loaded.architecture, dtype=loaded.dtype,
            vocab_size=loaded.hf_config.vocab_size, num_layers=spec["num_layers"],
            num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"],
            kv_components=spec["components"], max_model_len=max_len,
            eos_token_ids=worker.eos_ids(), bos_token_id=self.tokenizer.bos_token_id,
        )
        self.kv_cache = worker.kv_cache  # rank 0's slice (its KV heads) under TP
        self.fingerprint = worker.fingerprint
        self.pool = BlockPool(num_blocks)
        self.integrity = self._make_integrity(cache_cfg)
        self.kv = KVCacheManager(self.pool, bs, cache_cfg.enable_prefix_caching,
                                 self.fingerprint, self.integrity)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        # After the integrity checker: a fused-write backend keeps checksum state if asked.
        self.runner = worker.init_runner()
        self.sampler = Sampler(self.model_config.vocab_size)
        self._parents: dict[str, _Parent] = {}
        self._finished_outputs: list[RequestOutput] = []
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                      "finished": 0, "aborted": 0}
        tp = args.tensor_parallel_size
        logger.info("model %s (%s, %s): %s%s", path, loaded.architecture,
                    dtype_name(loaded.dtype), describe_weight_bytes(self.model),
                    f" on rank 0 of {tp} (tensor parallel)" if tp > 1 else "")
        logger.info("%s; max_model_len %d; %d B/token of KV; %s", self.kv_cache.describe(),
                    max_len, self.kv_cache.bytes_per_token, self._kv_budget_note)
        logger.info("ready in %.1f s", time.perf_counter() - t0)

    def check_health(self) -> None:
        """Raise ``DistributedError`` if a tensor-parallel worker died (no-op otherwise)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op for the single-process engine)."""
        self.executor.shutdown()

    def _make_integrity(self, cfg):
        if cfg.kv_integrity == "off":
            return None
        from kvserve.cache.integrity import IntegrityChecker

        peers = self.executor if isinstance(self.executor, MultiprocExecutor) else None
        return IntegrityChecker(self.kv_cache, self.pool, self.fingerprint, cfg.kv_integrity,
                                cfg.scrub_blocks_per_step, peers=peers)

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, param: str = "prompt") -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"], param)
            else:
                raise ValueError(f"{param} dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise ValueError(f"{param} must be a string, a token id list or a dict, "
                             f"got {type(prompt).__name__}")
        if not isinstance(ids, list) or any(
            not isinstance(t, int) or isinstance(t, bool) for t in ids
        ):
            raise ValueError(f"{param} token ids must be a list of integers")
        if not ids:
            raise ValueError(f"{param} is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{param} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        return text, list(ids)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        max_len = self.model_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context "
                             f"(max_model_len) is {max_len}, which must leave room to generate")
        room = min(max_len, self.capacity_tokens) - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens but the KV cache holds only "
                             f"{self.capacity_tokens}; raise kv_cache_memory")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
            # Like vLLM/OpenAI: generation stops at the context limit with finish_reason=length.
            pass
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)
            children.append(Request(cid, request_id, i, ids, child_params, max_tokens,
                                    prompt=text, priority=priority, cache_salt=cache_salt,
                                    arrival_time=arrival))
        if self.cache_config.enable_prefix_caching:
            for child in children[1:]:
                child.prefill_leader = children[0]
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                   params.include_stop_str_in_output)
            if params.detokenize else None
            for _ in children
        ]
        self._parents[request_id] = _Parent(request_id, text, ids, children, detoks)
        for child in children:
            self.scheduler.add(child)
        self.stats["prompt_tokens"] += len(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self.stats["aborted"] += 1
            self._parents.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.integrity is not None:
            bad = self.integrity.begin_step(self.scheduler.held_block_ids)
            if bad:
                self.integrity.record_rollbacks(len(self.scheduler.rollback(bad)))
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        step, plan = prepare_step(sched, self.kv, self.runner.block_size,
                                  self.runner.components)
        result = finish_step(plan, self.executor.execute(step))
        self.stats["steps"] += 1
        sampled = None
        if result.sample_reqs:
            rows = [SampleRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids,
                              self.model_config.eos_token_ids) for r in result.sample_reqs]
            sampled = self.sampler(result.logits, rows)
        for req, lps, start in ((r, lp, s) for r, s, lp in result.prompt_logprobs):
            self._record_prompt_logprobs(req, start, lps)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            self.kv.commit(req)
        self.kv.flush_commits()  # seal + cache newly full blocks before anything is freed
        if self.integrity is not None:
            self.integrity.end_step()
        touched: set[str] = set()
        if sampled is not None:
            now = time.monotonic()
            for i, req in enumerate(result.sample_reqs):
                self._append_token(req, sampled.token_ids[i], sampled.logprobs[i],
                                   sampled.sampled_logprob[i], now)
                touched.add(req.parent_id)
        return self._make_outputs(touched)

    def _record_prompt_logprobs(self, req: Request, start: int, lps: torch.Tensor) -> None:
        k = req.sampling_params.prompt_logprobs or 0
        assert req.prompt_logprobs is not None
        if start != len(req.prompt_logprobs):
            return  # a recompute after preemption: already recorded
        for j in range(lps.shape[0]):
            tok = req.prompt_token_ids[start + j]
            req.prompt_logprobs.append(top_logprobs(lps[j], tok, k))

    def _append_token(self, req: Request, token: int, lps, lp: float, now: float) -> None:
        req.output_token_ids.append(token)
        self.stats["generation_tokens"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.logprobs is not None:
            req.logprobs.append(lps)
            req.cumulative_logprob += lp
        p = req.sampling_params
        parent = self._parents[req.parent_id]
        detok = parent.detoks[req.index]
        status = None
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.model_config.eos_token_ids:
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
            self.scheduler.finish(req, status)

    def _make_outputs(self, touched: set[str]) -> list[RequestOutput]:
        outs = []
        for pid in touched:
            parent = self._parents.get(pid)
            if parent is None:
                continue
            out = self._request_output(parent)
            outs.append(out)
            if out.finished:
                self.stats["finished"] += 1
                del self._parents[pid]
        return outs

    def _request_output(self, parent: _Parent) -> RequestOutput:
        finished = all(c.is_finished for c in parent.children)
        comps = []
        for child, detok in zip(parent.children, parent.detoks, strict=True):
            text = detok.output_text(child.is_finished) if detok is not None else ""
            reason = child.status.value if child.is_finished else None
            comps.append(CompletionOutput(
                index=child.index, text=text, token_ids=list(child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None
                else None,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=reason, stop_reason=child.stop_reason,
            ))
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=comps, finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None
            else None,
            num_cached_tokens=first.metrics.num_cached_tokens, metrics=first.metrics,
        )

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [P, V] fp32 for one token sequence, computed through the paged
        KV cache (so a quantized cache affects them exactly as in generation)."""
        from kvserve.engine.scheduler import SchedulerOutput

        _, ids = self.tokenize({"prompt_token_ids": list(token_ids)}, "token_ids")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"token_ids has {len(ids)} tokens, over max_model_len "
                             f"{self.model_config.max_model_len}")
        req = Request(f"__score_{id(ids)}", "__score", 0, ids, SamplingParams(max_tokens=1), 1)
        if not self.kv.allocate_slots(req, len(ids)):
            raise ValueError("not enough free KV blocks to score token_ids")
        try:
            step, _ = prepare_step(SchedulerOutput([(req, len(ids))]), self.kv,
                                   self.runner.block_size, self.runner.components)
            # group 0 (rows to sample) empty; group 1 every position, like a prompt-logprobs run
            step = dataclasses.replace(step, logits_groups=((), tuple(range(len(ids)))))
            logits = self.executor.execute(step)[1]
            assert logits is not None
            return logits.float().cpu()
        finally:
            self.kv.free(req)
            self.kv.forget(req)

    # ---- introspection --------------------------------------------------------------------
    def inject_kv_fault(self, block_id: int, layer: int = 0, kind: str = "bitflip",
                        rank: int = 0, **kw) -> None:
        """Corrupt one KV block on purpose (drills, tests); see IntegrityChecker.inject.
        ``rank``: the tensor-parallel rank whose slice of the block is corrupted."""
        from kvserve.cache.integrity import IntegrityChecker

        if rank != 0:
            if not isinstance(self.executor, MultiprocExecutor):
                raise ValueError(f"rank {rank}: this engine is not tensor parallel")
            self.executor.inject(rank, block_id, layer, kind, **kw)
            return

        checker = self.integrity or IntegrityChecker(self.kv_cache, self.pool, self.fingerprint,
                                                     "on")
        checker.inject(block_id, layer, kind, **kw)

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_no_leaks(self) -> None:
        """All blocks back in the pool (none in use) once no request is unfinished."""
        self.pool.check_invariants()
        assert not self._parents, f"unfinished requests: {list(self._parents)}"
        assert self.pool.num_used_blocks == 0, f"{self.pool.num_used_blocks} blocks in use"

