"""Where a decode step's time goes, per KV dtype and running batch: one run, JSON + plot.

    .venv/bin/python benchmarks/step_profile.py [--model PATH] [--configs bf16@32,fp8@32,...]
        [--context 192] [--steps 16] [--repeats 5] [--threads 2] [--input-len 128]
        [--output-len 128] [--clock wall|cpu] [--json OUT] [--plot OUT.png]

Why: ``kvserve bench throughput`` measures what FP8 KV buys end to end (tokens/s at the KV
limit); this says why it buys what it does. For each (KV dtype, batch) config one engine of the
model is built (same weights, KV budget = 16 MiB or what B sequences need, whichever is more),
B requests of random prompts are prefilled, and then ``repeats`` windows of ``steps``
pure-decode steps are timed, round-robin over all configs (rotating who goes first), with
wall-clock timers around the parts of a step:

    attention      the C paged-attention kernel (all layers)
    kv_write       writing the step's K/V into the cache (FP8: quantize + scales)
    rotation       rotated KV modes (int8, fp8_rot): q/k/v times R and the output times R^T
    linear         every Linear / MergedLinear / INT4 / Q8 LM-head forward: the GEMMs, lm_head
                   included
    forward_other  the rest of the model forward and LM-head step (embedding, norms, rope,
                   activations, row gathers)
    sampling       the sampler
    engine         the rest of ``step()``: scheduling, batch building, bookkeeping, detokenize,
                   integrity sealing / scrubbing

Decode steps run eagerly (``enforce_eager``): a recorded CPU graph replays the whole forward in
one C call, which the part timers cannot split (``--graphs`` times that instead: its
``forward_other`` is then the replay, ``linear`` the LM head). With ``--graphs`` each config
also gets ``graph_kernels_ms``, after its timed windows: the recorded forward replayed whole
(``all``) and each kernel's calls replayed alone (``Tape.only``), medians of 20 -- where the
replay's time goes. Alone, a kernel finds more of its data in the caches than inside a step,
so the parts sum to somewhat less than ``all``.

The prompts are ``context - steps * repeats // 2`` tokens long, so the mean context of the
timed steps is ``context``. Prefill cost per prompt token is timed on the same engines (the
steps that prefill the B prompts). Medians over windows are reported, per step and per running
sequence. ``projected`` turns them into the closed-loop rate the figures imply for
``input_len`` / ``output_len`` requests at batch B (every output token also costs one prompt's
share of prefill; preemption ignored):

    tok/s(B) = B * out / (out * T_decode(B) + B * in * t_prefill_token)

The roofline: ``bytes_per_step`` is what a decode step must read at least (every weight once,
the LM head included, and each sequence's KV at the mean context); ``read_bandwidth_gbs`` is
torch.sum's streaming read rate over 512 MiB on the same threads; ``roofline_floor_ms`` their
quotient and ``step_over_floor`` how far the measured step is above it.

``projected_ratio`` compares the last config with the first (default fp8@64 vs bf16@32:
what doubling the batch at the KV limit can give on this machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from kvserve.bench.common import (
    env_info,
    log,
    model_label,
    pyplot,
    random_prompts,
    resolve_model_path,
    write_json,
)
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels.cpu import graph
from kvserve.kernels.cpu import paged_attention as cpu_kernel
from kvserve.layers import linear as linear_mod
from kvserve.layers.int4.merged import Int4MergedLinear
from kvserve.sampling_params import SamplingParams

PARTS = ("attention", "kv_write", "rotation", "linear", "forward_other", "sampling", "engine")
MIN_BUDGET = 16 * 2**20


class Timers:
    """Accumulates seconds per part for whichever config is ``current``."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock  # perf_counter (wall) or process_time (CPU seconds, all threads)
        self.current: dict[str, float] = defaultdict(float)
        self._depth: dict[str, int] = defaultdict(int)  # nested timed calls count once

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._depth[name] += 1
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                if self._depth[name] == 0:  # e.g. a parallel linear calling Linear.forward
                    self.current[name] += self.clock() - t0
        return timed


def install_class_timers(timers: Timers):
    """Time every attention-kernel call and every dense linear forward (all engines); returns
    the function that puts the originals back."""
    saved = [(cpu_kernel, "paged_attention", cpu_kernel.paged_attention)]
    cpu_kernel.paged_attention = timers.wrap("attention", cpu_kernel.paged_attention)
    from kvserve.kernels import reference
    from kvserve.kernels.cpu import cpu_ops
    from kvserve.quant.rotation import KVRotation

    # the CPU backend's C rotation (or its twin), and the MLA backends' KVRotation methods
    for owner, meth in ((cpu_ops, "rotate_heads"), (reference, "rotate_heads"),
                        (KVRotation, "apply"), (KVRotation, "invert")):
        saved.append((owner, meth, getattr(owner, meth)))
        setattr(owner, meth, timers.wrap("rotation", getattr(owner, meth)))
    from kvserve.layers.q8_embedding import Q8LMHead

    # RowParallelLinear (o_proj, down_proj) overrides Linear.forward, so it is wrapped itself
    for cls in (linear_mod.Linear, linear_mod.RowParallelLinear, linear_mod.MergedLinear,
                Int4MergedLinear, Q8LMHead):
        saved.append((cls, "forward", cls.forward))
        cls.forward = timers.wrap("linear", cls.forward)

    def undo() -> None:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return undo


@dataclasses.dataclass
class Config:
    kv: str
    batch: int
    engine: LLMEngine
    windows: list[dict[str, float]] = dataclasses.field(default_factory=list)
    prefill_s_per_token: float | None = None
    kernel_split: dict[str, Any] | None = None  # graph_kernel_split (--graphs)

    @property
    def name(self) -> str:
        return f"{self.kv}@{self.batch}"


def parse_configs(spec: str) -> list[tuple[str, int]]:
    out = []
    for item in spec.split(","):
        kv, _, b = item.strip().partition("@")
        if not kv or not b.isdigit() or int(b) < 1:
            raise ValueError(f"--configs items are DTYPE@BATCH (e.g. fp8@64), got {item!r}")
        out.append((kv, int(b)))
    return out


def build(args, kv: str, batch: int, timers: Timers, prompt_len: int) -> Config:
    model = resolve_model_path(args.model)
    probe = LLMEngine(EngineArgs(model=model, kv_cache_dtype=kv, num_blocks=2, progress=False,
                                 kv_integrity="off"))
    bpt = probe.kv_cache.bytes_per_token
    del probe
    need = batch * (prompt_len + args.steps * args.repeats + 2 * 16 + 16) * bpt
    eng = LLMEngine(EngineArgs(model=model, kv_cache_dtype=kv, progress=False,
                               kv_cache_memory=max(MIN_BUDGET, need), max_num_seqs=batch,
                               seed=args.seed, enforce_eager=not args.graphs))
    eng.kv_cache.write = timers.wrap("kv_write", eng.kv_cache.write)
    drv = eng.executor.driver.model_runner  # rank 0's forward runner
    drv.run = timers.wrap("forward", drv.run)  # model forward + LM head
    eng.runner.sampler = timers.wrap("sampling", eng.runner.sampler)
    cfg = Config(kv, batch, eng)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * args.repeats + 64,
                            ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, eng.model_config.vocab_size,
                                         args.seed)):
        eng.add_request(f"r{i}", p, params)
    # prefill: steps until every request has its first token
    t0 = timers.clock()
    while eng.stats().num_prefilling:
        eng.step()
    cfg.prefill_s_per_token = (timers.clock() - t0) / (batch * prompt_len)
    for _ in range(3):  # warm decode steps
        eng.step()
    return cfg


def run_window(cfg: Config, steps: int, timers: Timers) -> dict[str, float]:
    timers.current = defaultdict(float)
    t0 = timers.clock()
    for _ in range(steps):
        outs = cfg.engine.step()
        assert len(outs) == cfg.batch, "a request finished or was preempted mid-window"
    total = timers.clock() - t0
    t = timers.current
    parts = {
        "attention": t["attention"],
        "kv_write": t["kv_write"],
        "rotation": t["rotation"],
        "linear": t["linear"],
        "forward_other": (t["forward"] - t["attention"] - t["kv_write"] - t["rotation"]
                          - t["linear"]),
        "sampling": t["sampling"],
        "engine": total - t["forward"] - t["sampling"],
    }
    return {"step_ms": total / steps * 1e3, **{k: v / steps * 1e3 for k, v in parts.items()}}


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Streaming read bandwidth (GB/s, best of ``repeats``): torch.sum over a buffer far larger
    than the caches, with ``threads`` threads -- the denominator of the roofline."""
    buf = torch.ones(mib * 2**20 // 4)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return buf.numel() * 4 / best / 1e9


def bytes_per_step(cfg: Config, context: int) -> dict[str, int]:
    """Bytes a decode step must read at least: every weight once (the LM head included; an
    untied embedding table only for the B rows it looks up) and each sequence's KV."""
    from kvserve.model.loader import weight_bytes

    model = cfg.engine.model
    held = weight_bytes(model)[0]
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = head is not None and getattr(head, "table", None) is embed or (
        getattr(head, "weight", None) is getattr(embed, "weight", 0))
    if embed is not None and not tied:
        held -= sum(t.numel() * t.element_size() for t in embed.parameters())
    kv = cfg.batch * context * cfg.engine.kv_cache.bytes_per_token
    return {"weights": held, "kv": kv, "total": held + kv}


def graph_kernel_split(cfg: Config, repeats: int = 20) -> dict[str, Any] | None:
    """Replay the config's recorded CPU graph whole and per kernel (None without one). Run
    after the config's last window: a kernel replayed alone reruns on stale buffers (the KV
    write rewrites the last step's slot with other values)."""
    tape = getattr(cfg.engine.executor.driver.model_runner.graphs, "tape", None)
    if not isinstance(tape, graph.Tape):
        return None
    names = list(dict.fromkeys(tape.names))
    subs = {"all": tape, **{n: tape.only({n}) for n in names}}
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, t in subs.items():
            t0 = time.perf_counter()
            t.replay(cfg.batch)
            times[name].append(time.perf_counter() - t0)
    return {"ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
            "calls": {n: len(t) for n, t in subs.items()}}


def summarize(cfg: Config, args) -> dict[str, Any]:
    med = {k: statistics.median(w[k] for w in cfg.windows) for k in ("step_ms", *PARTS)}
    t_dec = med["step_ms"] / 1e3
    p = cfg.prefill_s_per_token or 0.0
    proj = cfg.batch * args.output_len / (
        args.output_len * t_dec + cfg.batch * args.input_len * p)
    return {
        "kv_cache_dtype": cfg.kv,
        "batch": cfg.batch,
        "kv_bytes_per_token": cfg.engine.kv_cache.bytes_per_token,
        "step_ms": med["step_ms"],
        "parts_ms": {k: med[k] for k in PARTS},
        "per_seq_us": {k: med[k] / cfg.batch * 1e3 for k in ("step_ms", *PARTS)},
        "decode_tokens_per_s": cfg.batch / t_dec,
        "prefill_us_per_token": p * 1e6,
        "projected_tokens_per_s": proj,
        "bytes_per_step": bytes_per_step(cfg, args.context),
        "windows": cfg.windows,
        "graph_kernels_ms": cfg.kernel_split,
    }


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = result["configs"]
    names = [f"{r['kv_cache_dtype']} @ {r['batch']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.9 * len(rows) + 2.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, unit in ((axes[0], "parts_ms", "ms per decode step"),
                          (axes[1], "per_seq_us", "us per running sequence per step")):
        left = [0.0] * len(rows)
        for i, part in enumerate(PARTS):
            vals = [r[key].get(part, 0.0) for r in rows]  # (older JSONs: no "rotation")
            ax.barh(names, vals, left=left, color=colors[i % len(colors)], label=part)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(PARTS), fontsize=8)
    s = result["summary"]
    axes[1].set_title(
        f"projected closed loop ({result['input_len']} in / {result['output_len']} out): "
        f"{s['candidate']} / {s['baseline']} = x{s['projected_ratio']:.2f}", fontsize=9)
    axes[0].set_title(f"mean context {result['context']} tokens, median of "
                      f"{result['repeats']} windows x {result['steps']} steps", fontsize=9)
    fig.suptitle(f"kvserve decode step profile: {result['model']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF folder, .gguf file or demo (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", default="bf16@32,fp8@32,bf16@64,fp8@64",
                    help="comma list of KVDTYPE@BATCH; the ratio is last / first")
    ap.add_argument("--context", type=int, default=192, help="mean context of timed steps")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graphs", action="store_true",
                    help="replay decode steps from the recorded CPU graph (default: eager, so "
                         "that the parts of a step can be timed; a replay is one C call)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: CPU seconds of this process (all threads), "
                         "robust to other jobs on a shared machine; with --threads 1 it is "
                         "the step time an idle machine would show")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only redraw --plot from a JSON this script wrote")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.plot:
            raise ValueError("--replot needs --plot OUT.png")
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return 0
    pairs = parse_configs(args.configs)
    if args.steps < 1 or args.repeats < 1:
        raise ValueError("--steps and --repeats must be >= 1")
    prompt_len = args.context - args.steps * args.repeats // 2
    if prompt_len < 1:
        raise ValueError(f"--context {args.context} is too short for {args.steps} x "
                         f"{args.repeats} timed steps")
    if args.threads:
        torch.set_num_threads(args.threads)
    timers = Timers(time.process_time if args.clock == "cpu" else time.perf_counter)
    undo = install_class_timers(timers)
    try:
        configs = []
        for kv, b in pairs:
            log(f"step_profile: building {kv}@{b} and prefilling {b} x {prompt_len} tokens")
            configs.append(build(args, kv, b, timers, prompt_len))
        for r in range(args.repeats):
            for i in range(len(configs)):
                cfg = configs[(i + r) % len(configs)]
                cfg.windows.append(run_window(cfg, args.steps, timers))
            log(f"step_profile: round {r + 1}/{args.repeats}: " + ", ".join(
                f"{c.name} {c.windows[-1]['step_ms']:.2f} ms" for c in configs))
    finally:
        undo()
    for c in configs:  # after every window: the split reruns kernels on stale buffers
        c.kernel_split = graph_kernel_split(c) if args.graphs else None
        if c.kernel_split:
            log(f"step_profile: {c.name} graph replay: " + ", ".join(
                f"{n} {ms:.3f} ms" for n, ms in c.kernel_split["ms"].items()))
    rows = [summarize(c, args) for c in configs]
    bw = read_bandwidth_gbs(torch.get_num_threads())
    for row in rows:  # the floor: bytes that must be read / measured read bandwidth
        row["roofline_floor_ms"] = row["bytes_per_step"]["total"] / bw / 1e6
        row["step_over_floor"] = row["step_ms"] / row["roofline_floor_ms"]
    base, cand = rows[0], rows[-1]
    result = {
        "bench": "step_profile",
        "model": model_label(resolve_model_path(args.model)),
        "context": args.context,
        "clock": args.clock,
        "read_bandwidth_gbs": bw,
        "steps": args.steps,
        "repeats": args.repeats,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "parts": list(PARTS),
        "configs": rows,
        "summary": {
            "baseline": f"{base['kv_cache_dtype']}@{base['batch']}",
            "candidate": f"{cand['kv_cache_dtype']}@{cand['batch']}",
            "decode_ratio": cand["decode_tokens_per_s"] / base["decode_tokens_per_s"],
            "projected_ratio": cand["projected_tokens_per_s"] / base["projected_tokens_per_s"],
        },
        "command": " ".join(sys.argv),
        "env": env_info(),
    }
    for row in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["parts_ms"].items())
        log(f"{row['kv_cache_dtype']:>9}@{row['batch']:<3} step {row['step_ms']:.2f} ms "
            f"({parts}); prefill {row['prefill_us_per_token']:.1f} us/token; projected "
            f"{row['projected_tokens_per_s']:.0f} tok/s; reads "
            f"{row['bytes_per_step']['total'] / 2**20:.1f} MiB/step -> floor "
            f"{row['roofline_floor_ms']:.2f} ms ({row['step_over_floor']:.2f}x)")
    log(f"read bandwidth {bw:.1f} GB/s ({torch.get_num_threads()} threads)")
    log(f"decode_ratio {result['summary']['decode_ratio']:.3f}, projected_ratio "
        f"{result['summary']['projected_ratio']:.3f}")
    if args.plot:
        plot(result, args.plot)
    write_json(args.json, result)
    del configs
    return 0 if all(math.isfinite(r["step_ms"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
