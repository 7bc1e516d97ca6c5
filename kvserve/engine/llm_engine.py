"""The synchronous engine: ``add_request`` / ``step`` / ``abort_request``.

One ``step()`` = schedule -> one model forward over the mixed batch -> sample -> update
requests (stop checks, detokenization) -> commit newly full blocks (seal + prefix-cache) ->
free finished requests. Everything the user can get wrong is checked in ``add_request`` and
raises ``ValueError`` naming the parameter, leaving the engine untouched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kvserve.attention import get_backend
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_cache import PagedKVCache, bytes_per_block
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.config import ModelConfig, dtype_name, resolve_kv_mode
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.cuda_graphs import CudaGraphRunner, clear_scratch_block
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.layers.sampler import Sampler, SampleRow, top_logprobs
from kvserve.model.default_model import resolve_model
from kvserve.model.loader import checkpoint_dtype, describe_weight_bytes, load_model, load_tokenizer
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

PromptType = str | list[int] | dict
# Without kv_cache_memory: kv_cache_memory_fraction of available RAM, capped here (like
# vLLM-CPU's 4 GiB default KV space) so a small model does not zero-fill half the machine.
DEFAULT_MAX_KV_BYTES = 4 * 2**30


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
        path = resolve_model(args.model)
        t0 = time.perf_counter()
        loaded = load_model(path, args.dtype, args.device, progress=args.progress)
        folder = loaded.folder  # config.json + tokenizer (a GGUF's converted metadata)
        self.model = loaded.model
        self.tokenizer = load_tokenizer(args.tokenizer or folder)
        spec = self.model.kv_spec()
        # "auto" KV = the checkpoint's dtype: a bf16 checkpoint computed in fp32 on an AVX2 CPU
        # still caches bf16 (half the bytes; attention reads it with the C kernel).
        ckpt = checkpoint_dtype(loaded.hf_config)
        auto_kv = ckpt if ckpt in (torch.bfloat16, torch.float16) else loaded.dtype
        kv_mode = resolve_kv_mode(cache_cfg.kv_cache_dtype, auto_kv)
        kv_dtype = kv_mode.dtype
        self.kv_dtype = kv_dtype
        # Canonical KV mode name (``int8``, ``int8_plain``, ``fp8_e4m3_rot``, ``bf16``...).
        self.kv_mode = kv_mode.name
        rot_seed = cache_cfg.kv_rotation_seed if kv_mode.rotate else None
        if kv_mode.rotate and spec["components"] != 2:
            raise ValueError(f"kv_cache_dtype {cache_cfg.kv_cache_dtype!r} (rotated) is not "
                             "supported for an MLA latent cache; use fp8 or bf16")
        if kv_dtype == torch.int8 and spec["components"] != 2:
            raise ValueError(f"kv_cache_dtype {cache_cfg.kv_cache_dtype!r} (INT8) is not "
                             "supported for an MLA latent cache; use fp8 or bf16")
        per_block = bytes_per_block(spec["num_layers"], cache_cfg.block_size,
                                    spec["num_kv_heads"], spec["head_dim"],
                                    spec["components"], kv_dtype)
        bs = cache_cfg.block_size
        max_len = spec["max_position_embeddings"]
        if spec.get("sliding_window"):
            max_len = min(max_len, spec["sliding_window"])
        if sched_cfg.max_model_len is not None:
            if sched_cfg.max_model_len > max_len:
                raise ValueError(f"max_model_len {sched_cfg.max_model_len} exceeds the model's "
                                 f"context length {max_len}")
            max_len = sched_cfg.max_model_len
        num_blocks = self._num_blocks(cache_cfg, per_block, sched_cfg.max_num_seqs * max_len)
        self.capacity_tokens = num_blocks * bs
        self.model_config = ModelConfig(
            path=path, architecture=loaded.architecture, dtype=loaded.dtype,
            vocab_size=loaded.hf_config.vocab_size, num_layers=spec["num_layers"],
            num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"],
            kv_components=spec["components"], max_model_len=max_len,
            eos_token_ids=self._eos_ids(folder), bos_token_id=self.tokenizer.bos_token_id,
        )
        static = loaded.kv_scales
        if static is not None:
            static = static.unsqueeze(-1).expand(-1, -1, spec["num_kv_heads"])
        self.kv_cache = PagedKVCache(
            spec["num_layers"], num_blocks, bs, spec["num_kv_heads"], spec["head_dim"],
            spec["components"], kv_dtype, args.device, static_scales=static,
            rotation_seed=rot_seed,
        )
        self.fingerprint = self._fingerprint(folder, loaded.weight_files, loaded.dtype,
                                             self.kv_cache, bs)
        self.pool = BlockPool(num_blocks)
        self.integrity = self._make_integrity(cache_cfg)
        self.kv = KVCacheManager(self.pool, bs, cache_cfg.enable_prefix_caching,
                                 self.fingerprint, self.integrity)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        # auto/torch/triton name a family; an MLA cache (components == 1) gets its MLA member
        # (mla_triton on CUDA, mla_torch on CPU), see kvserve.attention.resolve_backend_name.
        backend_name = args.attention_backend
        backend = get_backend(backend_name, self.kv_cache, spec["num_heads"],
                              spec["num_kv_heads"], spec["head_dim"], spec["scale"], max_len)
        self.runner = ModelRunner(self.model, backend, bs, spec["components"], args.device,
                                  graphs=self._cuda_graphs(backend, spec, sched_cfg, max_len))
        self.sampler = Sampler(self.model_config.vocab_size)
        self._parents: dict[str, _Parent] = {}
        self._finished_outputs: list[RequestOutput] = []
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                      "finished": 0, "aborted": 0}
        logger.info("model %s (%s, %s): %s", path, loaded.architecture,
                    dtype_name(loaded.dtype), describe_weight_bytes(self.model))
        logger.info("%s; max_model_len %d; %d B/token of KV; %s", self.kv_cache.describe(),
                    max_len, self.kv_cache.bytes_per_token, self._kv_budget_note)
        logger.info("ready in %.1f s", time.perf_counter() - t0)

    # ---- construction helpers -------------------------------------------------------------
    def _cuda_graphs(self, backend, spec: dict, sched_cfg, max_len: int
                     ) -> CudaGraphRunner | None:
        """Decode CUDA graphs (kvserve/engine/cuda_graphs.py) unless ``enforce_eager``, off
        CUDA, or the backend cannot be captured; a failed capture logs and runs eagerly."""
        if self.args.enforce_eager or not self.kv_cache.data.is_cuda:
            return None
        if not hasattr(backend, "graph_plan"):
            logger.info("CUDA graphs off: attention backend %r is not capturable", backend.name)
            return None
        graphs = CudaGraphRunner(self.model, backend, self.kv_cache, self.kv_cache.block_size,
                                 spec["components"], sched_cfg.max_num_seqs, max_len)
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 - e.g. a model that syncs the host: run eager
            logger.warning("CUDA graph capture failed (%r); decode steps run eagerly", e)
            torch.cuda.synchronize()
            clear_scratch_block(self.kv_cache)
            return None
        return graphs

    def _num_blocks(self, cfg, per_block: int, want_tokens: int) -> int:
        """Blocks for ``kv_cache_memory``, else enough for ``max_num_seqs x max_model_len``
        tokens (``want_tokens``) capped by ``kv_cache_memory_fraction`` of available memory
        and DEFAULT_MAX_KV_BYTES; ``_kv_budget_note`` says which applied."""
        if cfg.num_blocks_override is not None:
            self._kv_budget_note = f"num_blocks {cfg.num_blocks_override} given"
            return cfg.num_blocks_override
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
            self._kv_budget_note = f"kv_cache_memory {budget / 2**20:.0f} MiB given"
        else:
            need = -(-want_tokens // cfg.block_size) * per_block
            avail = int(_available_memory() * cfg.kv_cache_memory_fraction)
            budget = min(need, avail, DEFAULT_MAX_KV_BYTES)
            why = ("max_num_seqs x max_model_len" if budget == need else
                   f"capped by {cfg.kv_cache_memory_fraction:.0%} of available memory"
                   if budget == avail else "capped at 4 GiB (set kv_cache_memory to change)")
            self._kv_budget_note = (f"KV budget {budget / 2**20:.0f} MiB: {why} "
                                    f"(wanted {need / 2**20:.0f} MiB for {want_tokens} tokens)")
        n = budget // per_block
        if n < 2:
            raise ValueError(f"kv_cache_memory {budget} B holds fewer than 2 blocks "
                             f"({per_block} B per block)")
        return n

    @staticmethod
    def _eos_ids(path: str) -> tuple[int, ...]:
        ids: list[int] = []
        gen = os.path.join(path, "generation_config.json")
        cfg = os.path.join(path, "config.json")
        for f in (gen, cfg):
            if os.path.isfile(f):
                with open(f) as fh:
                    eos = json.load(fh).get("eos_token_id")
                if isinstance(eos, int):
                    ids.append(eos)
                elif isinstance(eos, list):
                    ids.extend(int(e) for e in eos)
                if ids:
                    break
        return tuple(dict.fromkeys(ids))

    @staticmethod
    def _fingerprint(folder: str, weight_files: tuple[str, ...], dtype: torch.dtype,
                     kv: PagedKVCache, bs: int) -> bytes:
        """Model files, compute dtype, KV mode (storage dtype + rotation and its seed) and
        block size: the prefix-cache salt and the integrity records' identity. Blocks written
        under another mode or rotation never match."""
        h = hashlib.blake2b(digest_size=16)
        with open(os.path.join(folder, "config.json"), "rb") as f:
            h.update(f.read())
        for file in weight_files:
            st = os.stat(file)
            h.update(f"{os.path.basename(file)}:{st.st_size}:{st.st_mtime_ns}".encode())
        rot = "" if kv.rotation is None else f"|rot={kv.rotation.describe()}"
        h.update(f"{dtype_name(dtype)}|{dtype_name(kv.dtype)}|{bs}{rot}".encode())
        return h.digest()

    def _make_integrity(self, cfg):
        if cfg.kv_integrity == "off":
            return None
        from kvserve.cache.integrity import IntegrityChecker

        return IntegrityChecker(self.kv_cache, self.pool, self.fingerprint, cfg.kv_integrity,
                                cfg.scrub_blocks_per_step)

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
            self.integrity.scrub_step(self)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        result = self.runner.execute(sched, self.kv)
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
            batch = self.runner.build_batch(SchedulerOutput([(req, len(ids))]), self.kv)
            return self.model.compute_logits(self.model(batch)).float().cpu()
        finally:
            self.kv.free(req)
            self.kv.forget(req)

    # ---- introspection --------------------------------------------------------------------
    def inject_kv_fault(self, block_id: int, layer: int = 0, kind: str = "bitflip",
                        **kw) -> None:
        """Corrupt one KV block on purpose (drills, tests); see IntegrityChecker.inject."""
        from kvserve.cache.integrity import IntegrityChecker

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


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30
