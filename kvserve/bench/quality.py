"""Quality of a candidate configuration against the BF16-KV baseline of the same model, in one run.

Baseline: the model with a BF16 KV cache. Candidate: the same model with ``kv_cache_dtype``
(default FP8), or another checkpoint (``candidate_model``, e.g. an INT4 one built from the same
weights with ``quantization="int4"``; the KV dtype then defaults to BF16 so that only the
weights differ). Both engines share the tokenizer (checked by vocabulary size).

Token stream (``text_source``): ``text`` if given; else ``<model>/heldout.txt`` if the model
ships one (the demo model's held-out split); else ``generated``: the baseline samples
``num_prompts`` sequences of ``ppl_window`` tokens at temperature 1 (seeded), which then serve
as the text.

Metrics:
* perplexity of each engine on non-overlapping ``ppl_window``-token windows of the stream (at
  most ``ppl_max_tokens`` tokens), teacher-forced through the paged KV cache
  (``LLMEngine.prompt_logits``); ``perplexity_ratio`` = candidate / baseline;
* greedy decoding of ``gen_len`` tokens from ``num_prompts`` prompts (``prompt_len``-token
  windows evenly spaced over the stream): ``greedy_agreement`` = fraction of equal tokens
  position by position, ``first_divergence_fraction`` = mean over prompts of (index of the first
  differing token) / gen_len (1.0 when identical);
* KL(baseline || candidate) of next-token distributions teacher-forced on prompt + the
  baseline's continuation (the ``gen_len`` predicting positions per prompt): mean, p99, max;
* where greedy runs part: ``divergence_margin`` per prompt = the baseline's log-probability
  gap, at the first differing position, between its own token and the candidate's (nats; 0
  is an exact tie), beside the distribution of the baseline's top-1 / top-2 gap over all its
  greedy positions (``baseline_top2_gap``): how close to a tie a flip had to be.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
from typing import Any

import torch
from tqdm.auto import tqdm

from kvserve.bench.common import env_info, log, model_label, percentile, resolve_model_path
from kvserve.bench.settings import QualityConfig  # noqa: F401
from kvserve.config import dtype_name
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# engine helpers
# --------------------------------------------------------------------------------------------


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list,
             tag: str, progress: bool = False) -> list[list[int]]:
    """All prompts at once; token ids per prompt, in order."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, ps, strict=True)):
        engine.add_request(f"{tag}-{i}", p, sp)
    outs: dict[str, list[int]] = {}
    total = sum(sp.max_tokens or 0 for sp in ps)
    gen0 = engine.counters["generation_tokens"]
    with tqdm(total=total, desc=f"generate ({tag})", disable=not progress, unit="tok",
              leave=False) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
            bar.update(engine.counters["generation_tokens"] - gen0 - bar.n)
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))]


def window_nll(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(token | prefix) over ids[1:] and the count."""
    logits = engine.prompt_logits(ids)
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    return float(-lp.gather(1, tgt[:, None]).sum()), len(ids) - 1


def perplexity(engine: LLMEngine, windows: list[list[int]], desc: str,
               progress: bool) -> dict[str, Any]:
    nll, n = 0.0, 0
    for w in tqdm(windows, desc=f"perplexity ({desc})", disable=not progress, leave=False):
        a, b = window_nll(engine, w)
        nll += a
        n += b
    return {"perplexity": math.exp(nll / n), "nll_mean": nll / n, "tokens_scored": n,
            "windows": len(windows)}


def kl_rows(base_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_base || p_cand) per row, float64 (exactly 0 for identical rows)."""
    lp = torch.log_softmax(base_logits.double(), dim=-1)
    lq = torch.log_softmax(cand_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------


def token_stream(qc: QualityConfig, engine: LLMEngine, model: str) -> tuple[list[int], dict]:
    path, kind = qc.text, "file"
    if path is None and os.path.isfile(os.path.join(model, "heldout.txt")):
        path, kind = os.path.join(model, "heldout.txt"), "heldout"
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        need = max(qc.ppl_max_tokens, qc.num_prompts * (qc.prompt_len + qc.gen_len)) * 8
        ids = engine.tokenizer.encode(text[:need] if len(text) > need else text,
                                      add_special_tokens=False)
        if len(ids) < qc.prompt_len + 1:
            raise ValueError(f"text {path} has only {len(ids)} tokens")
        return ids, {"kind": kind, "path": model_label(path), "tokens": len(ids)}
    # generated: the baseline samples its own text (temperature 1, seeded)
    vocab = engine.model_config.vocab_size
    bos = engine.model_config.bos_token_id
    g = torch.Generator().manual_seed(qc.seed)
    starts = torch.randint(3, vocab, (qc.num_prompts,), generator=g).tolist()
    prompts = [[bos, s] if bos is not None else [s] for s in starts]
    params = [SamplingParams(temperature=1.0, seed=qc.seed + i, ignore_eos=True,
                             max_tokens=qc.ppl_window - len(p), detokenize=False)
              for i, p in enumerate(prompts)]
    outs = generate(engine, prompts, params, "text", qc.progress)
    ids = [t for p, o in zip(prompts, outs, strict=True) for t in p + o]
    return ids, {"kind": "generated", "tokens": len(ids),
                 "note": "baseline samples at temperature 1 from random start tokens"}


def prompt_windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens, evenly spaced over ``ids`` (may overlap if short)."""
    span = max(1, len(ids) - length)
    starts = [round(i * span / max(1, n - 1)) if n > 1 else 0 for i in range(n)]
    return [ids[s:s + length] for s in starts]


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def _engine_args(qc: QualityConfig, model: str, kv: str, num_blocks: int | None,
                 quantization: str | None) -> EngineArgs:
    args = dataclasses.replace(qc.base, model=model, kv_cache_dtype=kv, progress=False)
    if num_blocks is not None and qc.base.kv_cache_memory is None:
        args = dataclasses.replace(args, num_blocks=num_blocks)
    if quantization:
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        if "quantization" in names:
            args = dataclasses.replace(args, quantization=quantization)  # type: ignore[call-arg]
    return args


def run_quality(qc: QualityConfig) -> dict[str, Any]:
    """One candidate against the baseline (see :func:`run_quality_many`)."""
    return run_quality_many(qc, [qc.candidate_kv_dtype])[0]


def run_quality_many(qc: QualityConfig, candidate_kv_dtypes: list[str]) -> list[dict[str, Any]]:
    """Every candidate KV dtype against ONE baseline run (its perplexity, greedy continuations
    and logits computed once); one result dict per candidate, in order. Candidate engines are
    built one at a time."""
    model = resolve_model_path(qc.base.model)
    cand_model = resolve_model_path(qc.candidate_model) if qc.candidate_model else model
    bs = qc.base.block_size
    seq = qc.prompt_len + qc.gen_len
    blocks = (qc.num_prompts * math.ceil(max(seq, qc.ppl_window) / bs)
              + math.ceil(max(seq, qc.ppl_window) / bs) + 2)
    base_eng = LLMEngine(_engine_args(qc, model, qc.baseline_kv_cache_dtype, blocks, None))
    max_len = base_eng.model_config.max_model_len
    if seq > max_len:
        raise ValueError(f"prompt_len + gen_len = {seq} exceeds max_model_len {max_len}")
    window = min(qc.ppl_window, max_len)

    ids, source = token_stream(qc, base_eng, model)
    windows = [ids[i:i + window] for i in range(0, min(len(ids), qc.ppl_max_tokens), window)]
    windows = [w for w in windows if len(w) >= 2]
    log(f"quality: {source['kind']} text, {len(ids)} tokens; {len(windows)} perplexity windows "
        f"of {window}; {qc.num_prompts} prompts x {qc.gen_len} greedy tokens; "
        f"candidates {', '.join(candidate_kv_dtypes)}")
    base_ppl = perplexity(base_eng, windows, "baseline", qc.progress)
    prompts = prompt_windows(ids, qc.num_prompts, qc.prompt_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=qc.gen_len, ignore_eos=True,
                            detokenize=False)
    base_out = generate(base_eng, prompts, greedy, "baseline", qc.progress)
    base_logits = [base_eng.prompt_logits(p + b)[len(p) - 1:len(p + b) - 1]
                   for p, b in zip(prompts, base_out, strict=True)]
    base_desc = _describe(base_eng, model)
    base_eng.debug.check_no_leaks()
    del base_eng
    gc.collect()

    results = []
    for kv in candidate_kv_dtypes:
        cand_args = _engine_args(qc, cand_model, kv, blocks, qc.quantization)
        if qc.candidate_gguf_activations is not None:
            cand_args = dataclasses.replace(cand_args,
                                            gguf_activations=qc.candidate_gguf_activations)
        cand_eng = LLMEngine(cand_args)
        if cand_eng.model_config.vocab_size != base_logits[0].shape[-1]:
            raise ValueError("candidate and baseline vocabularies differ "
                             f"({cand_eng.model_config.vocab_size} vs "
                             f"{base_logits[0].shape[-1]})")
        if seq > cand_eng.model_config.max_model_len:
            raise ValueError(f"prompt_len + gen_len = {seq} exceeds max_model_len "
                             f"{cand_eng.model_config.max_model_len}")
        cand_ppl = perplexity(cand_eng, windows, "candidate", qc.progress)
        cand_out = generate(cand_eng, prompts, greedy, "candidate", qc.progress)
        result = _compare(qc, prompts, base_out, base_logits, cand_eng, cand_out)
        results.append({
            "bench": "quality",
            "model": model_label(model),
            "candidate_model": model_label(cand_model),
            "quantization": qc.quantization,
            "text_source": source,
            "baseline": {**base_desc, **base_ppl},
            "candidate": {**_describe(cand_eng, cand_model), **cand_ppl},
            "perplexity_ratio": cand_ppl["perplexity"] / base_ppl["perplexity"],
            **result,
            "env": env_info(),
        })
        cand_eng.debug.check_no_leaks()
        del cand_eng
        gc.collect()
    return results


def _describe(eng: LLMEngine, path: str) -> dict[str, Any]:
    return {"model": model_label(path), "model_dtype": dtype_name(eng.model_config.dtype),
            "kv_cache_dtype": eng.kv_mode,
            "kv_bytes_per_token": eng.kv_cache.bytes_per_token,
            "gguf_activations": eng.args.gguf_activations}


def _compare(qc: QualityConfig, prompts: list[list[int]], base_out: list[list[int]],
             base_logits: list[torch.Tensor], cand_eng: LLMEngine,
             cand_out: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement, teacher-forced KL / top-1 and divergence margins of one candidate
    against the baseline's continuations ``base_out`` and their logits ``base_logits``."""
    per_prompt, equal, total, fdf = [], 0, 0, []
    for b, c in zip(base_out, cand_out, strict=True):
        n = min(len(b), len(c))
        eq = [x == y for x, y in zip(b[:n], c[:n], strict=True)]
        first = eq.index(False) if False in eq else n
        equal += sum(eq)
        total += max(len(b), len(c))
        fdf.append(first / n if n else 1.0)
        per_prompt.append({"first_divergence": first if first < n else None,
                           "agreement": sum(eq) / n if n else 1.0})

    kls: list[torch.Tensor] = []
    gaps: list[torch.Tensor] = []
    top1 = top1_n = 0
    for i, (p, b) in enumerate(tqdm(list(zip(prompts, base_out, strict=True)), desc="KL",
                                    disable=not qc.progress, leave=False)):
        full = p + b
        lb = base_logits[i]
        lc = cand_eng.prompt_logits(full)[len(p) - 1:len(full) - 1]
        kls.append(kl_rows(lb, lc))
        top1 += int((lb.argmax(-1) == lc.argmax(-1)).sum())
        top1_n += lb.shape[0]
        lpb = torch.log_softmax(lb.float(), dim=-1)
        top2 = lpb.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        first = per_prompt[i]["first_divergence"]
        per_prompt[i]["divergence_margin"] = (
            None if first is None else float(lpb[first, b[first]] - lpb[first, cand_out[i][first]]))
    kl = torch.cat(kls).tolist()
    gap = torch.cat(gaps).tolist()
    margins = [x["divergence_margin"] for x in per_prompt if x["divergence_margin"] is not None]
    return {
        "num_prompts": qc.num_prompts,
        "prompt_len": qc.prompt_len,
        "gen_len": qc.gen_len,
        "greedy_agreement": equal / total if total else 1.0,
        "first_divergence_fraction": sum(fdf) / len(fdf),
        "identical_continuations": sum(1 for x in per_prompt if x["first_divergence"] is None),
        "kl_mean": sum(kl) / len(kl),
        "kl_p99": percentile(kl, 99),
        "kl_max": max(kl),
        "kl_positions": len(kl),
        "teacher_forced_top1_agreement": top1 / top1_n if top1_n else None,
        "divergence_margin_max": max(margins) if margins else None,
        "baseline_top2_gap": {f"p{q}": percentile(gap, q) for q in (1, 5, 10, 50)},
        "per_prompt": per_prompt,
    }


def format_summary(r: dict[str, Any]) -> str:
    b, c = r["baseline"], r["candidate"]
    return "\n".join([
        f"baseline  {b['kv_cache_dtype']:>9} KV, {b['model_dtype']} weights: "
        f"ppl {b['perplexity']:.4f}",
        f"candidate {c['kv_cache_dtype']:>9} KV, {c['model_dtype']} weights"
        f"{' (' + r['quantization'] + ')' if r['quantization'] else ''}: "
        f"ppl {c['perplexity']:.4f}",
        f"perplexity_ratio {r['perplexity_ratio']:.5f}",
        f"greedy_agreement {r['greedy_agreement']:.4f}, first_divergence_fraction "
        f"{r['first_divergence_fraction']:.4f} ({r['identical_continuations']}/"
        f"{r['num_prompts']} identical)",
        f"KL mean {r['kl_mean']:.3e}, p99 {r['kl_p99']:.3e}, max {r['kl_max']:.3e} "
        f"over {r['kl_positions']} positions; teacher-forced top-1 agreement "
        f"{r['teacher_forced_top1_agreement']:.4f}",
        f"divergences at baseline log-prob gaps <= {r['divergence_margin_max']} nats "
        f"(baseline top-2 gap p1/p5/p50: "
        + "/".join(f"{r['baseline_top2_gap'][k]:.3f}" for k in ("p1", "p5", "p50")) + ")"
        if r["divergence_margin_max"] is not None else "no greedy divergence",
        f"text: {r['text_source']['kind']} ({r['text_source']['tokens']} tokens)",
    ])
