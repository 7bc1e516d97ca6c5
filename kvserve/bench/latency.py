"""Decode speed at fixed batch sizes, prefill excluded, optionally beside peers on the same
weights.

For each batch size B and round, B random-token prompts of ``input_len`` are submitted at once
(greedy, ``ignore_eos``, ``max_tokens=output_len``); only steps in which all B sequences decode
are timed: decode tokens/s = B x (timed steps) / (their seconds). Reported: the median over
``rounds``. Implementations (kvserve and peers) alternate first place between rounds.

Peers: ``hf`` runs ``transformers`` ``generate`` in this process on the same folder and dtype
(batched, left padding, per-token timestamps from a stopping-criteria hook; its decode time is
first token -> last token). ``llamacpp`` and ``vllm`` run a script in ``--peer-python``; a peer
that does not import there is recorded as ``"not installed"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kvserve.bench.common import (
    StepRecorder,
    env_info,
    log,
    make_random_llama,
    median,
    ms,
    peer_importable,
    pyplot,
    random_prompts,
    resolve_model_path,
    rotated,
    run_peer_script,
)
from kvserve.config import dtype_name
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

PEERS = ("hf", "llamacpp", "vllm")


@dataclass
class LatencyConfig:
    base: EngineArgs = field(default_factory=EngineArgs)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 64])
    input_len: int = 128
    output_len: int = 64
    rounds: int = 5
    warmup: bool = True
    make_random_llama: str | None = None  # spec; used when base.model is None
    peers: list[str] = field(default_factory=list)
    peer_python: str | None = None
    peer_model: str | None = None  # llama.cpp: a GGUF file of the same weights
    peer_timeout: float = 3600.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.output_len < 2:
            raise ValueError("output_len must be >= 2 (decode steps follow the first token)")
        if self.input_len < 1 or self.rounds < 1:
            raise ValueError("input_len and rounds must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes must be positive integers")
        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise ValueError(f"peer must be one of {', '.join(PEERS)}; got {bad[0]!r}")


# --------------------------------------------------------------------------------------------
# kvserve
# --------------------------------------------------------------------------------------------


def kvserve_round(engine: LLMEngine, rec: StepRecorder, prompts: list[list[int]],
                  output_len: int, tag: str) -> dict[str, Any]:
    b = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rec.clear()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    outs: dict[str, list[int]] = {}
    first_decode = None
    while engine.has_unfinished_requests():
        for o in rec.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        if first_decode is None and rec.steps and rec.steps[-1].all_decode:
            first_decode = time.perf_counter() - rec.steps[-1].seconds
    timed = [s for s in rec.steps if s.all_decode and s.batch == b]
    secs = sum(s.seconds for s in timed)
    return {
        "decode_tokens_per_s": b * len(timed) / secs if secs > 0 else None,
        "decode_steps": len(timed),
        "decode_step_ms_median": ms(median(s.seconds for s in timed)),
        "prefill_s": None if first_decode is None else first_decode - t0,
        "tokens": [outs[f"{tag}-{i}"] for i in range(b)],
    }


# --------------------------------------------------------------------------------------------
# HF peer (in process)
# --------------------------------------------------------------------------------------------


class HFPeer:
    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                          local_files_only=True).eval()
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            eos = self.model.config.eos_token_id
            self.pad = (eos[0] if isinstance(eos, list) else eos) or 0

    def round(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        # Left padding: pad every prompt on the left to the longest (they are equal here).
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                min_new_tokens=output_len, do_sample=False, pad_token_id=self.pad,
                stopping_criteria=StoppingCriteriaList([_Stamp()]),
            )
        b = len(prompts)
        secs = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        return {
            "decode_tokens_per_s": b * (len(stamps) - 1) / secs if secs > 0 else None,
            "decode_steps": len(stamps) - 1,
            "decode_step_ms_median": ms(median(b2 - a for a, b2 in zip(stamps, stamps[1:],
                                                                        strict=False))),
            "prefill_s": stamps[0] - t0 if stamps else None,
            "tokens": out[:, width:].tolist(),
        }


# --------------------------------------------------------------------------------------------
# peers in another interpreter
# --------------------------------------------------------------------------------------------

LLAMACPP_SCRIPT = r'''
import json, statistics, sys, time
cfg = json.load(sys.stdin)
import llama_cpp
from llama_cpp import Llama
import random
llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["input_len"] + cfg["output_len"] + 8,
            n_batch=512, n_threads=cfg.get("threads") or None, logits_all=False, verbose=False)
rng = random.Random(cfg["seed"])
vocab = llm.n_vocab()
res = []
for b in cfg["batch_sizes"]:
    if b != 1:
        res.append({"batch_size": b, "error": "the llama-cpp-python hook decodes one sequence"})
        continue
    rounds = []
    for r in range(cfg["rounds"]):
        llm.reset()
        prompt = [rng.randrange(3, vocab) for _ in range(cfg["input_len"])]
        llm.eval(prompt)
        tok = llm.sample(temp=0.0)
        t0 = time.perf_counter()
        for _ in range(cfg["output_len"] - 1):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
        dt = time.perf_counter() - t0
        rounds.append((cfg["output_len"] - 1) / dt)
    res.append({"batch_size": 1, "decode_tokens_per_s": statistics.median(rounds),
                "decode_tokens_per_s_rounds": rounds})
print(json.dumps({"peer": "llamacpp", "version": llama_cpp.__version__, "results": res}))
'''

VLLM_LATENCY_SCRIPT = r'''
import json, statistics, sys, time
cfg = json.load(sys.stdin)
import torch, vllm
from vllm import LLM, SamplingParams
llm = LLM(model=cfg["model"], max_num_seqs=max(cfg["batch_sizes"]), seed=0,
          enable_prefix_caching=False)
eng = llm.llm_engine
vocab = llm.get_tokenizer().vocab_size
sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
g = torch.Generator().manual_seed(cfg["seed"])
res, n = [], 0
for b in cfg["batch_sizes"]:
    rounds = []
    for r in range(cfg["rounds"]):
        prompts = torch.randint(3, vocab, (b, cfg["input_len"]), generator=g).tolist()
        for p in prompts:
            eng.add_request(str(n), {"prompt_token_ids": p}, sp); n += 1
        counts, stamps = {}, []
        while eng.has_unfinished_requests():
            outs = eng.step()
            for o in outs:
                counts[o.request_id] = len(o.outputs[0].token_ids)
            if len(counts) == b and min(counts.values()) >= 1:
                stamps.append((time.perf_counter(), sum(counts.values())))
        if len(stamps) > 1:
            rounds.append((stamps[-1][1] - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]))
    res.append({"batch_size": b, "decode_tokens_per_s": statistics.median(rounds) if rounds
                else None, "decode_tokens_per_s_rounds": rounds})
print(json.dumps({"peer": "vllm", "version": vllm.__version__, "results": res}))
'''


def run_external_peer(name: str, lc: LatencyConfig, model: str) -> dict[str, Any] | str:
    module = {"llamacpp": "llama_cpp", "vllm": "vllm"}[name]
    if not peer_importable(lc.peer_python, module):
        return "not installed"
    payload = {"model": model, "batch_sizes": lc.batch_sizes, "input_len": lc.input_len,
               "output_len": lc.output_len, "rounds": lc.rounds, "seed": lc.seed,
               "threads": torch.get_num_threads()}
    if name == "llamacpp":
        if not lc.peer_model:
            return {"error": "llama.cpp needs a GGUF of the same weights: --peer-model FILE"}
        payload["gguf"] = lc.peer_model
        script = LLAMACPP_SCRIPT
    else:
        script = VLLM_LATENCY_SCRIPT
    log(f"running the {name} peer in {lc.peer_python}")
    return run_peer_script(lc.peer_python or "", script, payload, lc.peer_timeout)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


def run_latency(lc: LatencyConfig) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        spec = None
        model = lc.base.model
        if model is None and lc.make_random_llama is not None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-randllama-"))
            log(f"making a random-init Llama ({lc.make_random_llama}) in {tmp}")
            spec = make_random_llama(tmp, lc.make_random_llama)
            model = tmp
        model = resolve_model_path(model)
        result = _run(lc, model)
        result["random_llama"] = spec
        return result


def _run(lc: LatencyConfig, model: str) -> dict[str, Any]:
    max_b = max(lc.batch_sizes)
    base = dataclasses.replace(lc.base, model=model, progress=False,
                               max_num_seqs=max(max_b, lc.base.max_num_seqs))
    if base.kv_cache_memory is None and base.num_blocks is None:
        per_seq = math.ceil((lc.input_len + lc.output_len) / base.block_size)
        base = dataclasses.replace(base, num_blocks=max_b * per_seq + 1)
    engine = LLMEngine(base)
    if lc.input_len + lc.output_len > engine.model_config.max_model_len:
        raise ValueError(f"input_len + output_len exceeds max_model_len "
                         f"{engine.model_config.max_model_len}")
    rec = StepRecorder(engine)
    vocab = engine.model_config.vocab_size
    impls: list[str] = ["kvserve"]
    hf = None
    peers: dict[str, Any] = {}
    if "hf" in lc.peers:
        hf = HFPeer(model, engine.model_config.dtype)
        impls.append("hf")

    if lc.warmup:
        w = random_prompts(min(max_b, 4), min(lc.input_len, 32), vocab, lc.seed + 999)
        kvserve_round(engine, rec, w, 4, "warmup")
        if hf is not None:
            hf.round(w, 4)

    rows: dict[str, dict[int, list[dict]]] = {i: {b: [] for b in lc.batch_sizes} for i in impls}
    seq = 0
    bar = tqdm(total=lc.rounds * len(lc.batch_sizes) * len(impls), desc="latency",
               unit="run", disable=not lc.progress)
    for r in range(lc.rounds):
        for bi, b in enumerate(lc.batch_sizes):
            prompts = random_prompts(b, lc.input_len, vocab, lc.seed + 1000 * r + bi)
            for impl in rotated(impls, r + bi):
                if impl == "kvserve":
                    res = kvserve_round(engine, rec, prompts, lc.output_len, f"r{seq}")
                    seq += 1
                else:
                    assert hf is not None
                    res = hf.round(prompts, lc.output_len)
                rows[impl][b].append(res)
                tps = res["decode_tokens_per_s"] or 0.0
                bar.set_postfix_str(f"{impl} B={b}: {tps:.0f} tok/s")
                bar.update(1)
    bar.close()

    def table(impl: str) -> list[dict[str, Any]]:
        out = []
        for b in lc.batch_sizes:
            rs = rows[impl][b]
            tps = [x["decode_tokens_per_s"] for x in rs if x["decode_tokens_per_s"]]
            out.append({
                "batch_size": b,
                "decode_tokens_per_s": median(tps),
                "decode_tokens_per_s_rounds": tps,
                "decode_step_ms_median": median(x["decode_step_ms_median"] for x in rs
                                                if x["decode_step_ms_median"] is not None),
                "prefill_s_median": median(x["prefill_s"] for x in rs
                                           if x["prefill_s"] is not None),
                "decode_steps_per_round": rs[0]["decode_steps"] if rs else 0,
            })
        return out

    ours = table("kvserve")
    summary: dict[str, Any] = {}
    if hf is not None:
        hf_rows = table("hf")
        agree = {str(b): _agreement(rows["kvserve"][b][0]["tokens"], rows["hf"][b][0]["tokens"])
                 for b in lc.batch_sizes}
        peers["hf"] = {"results": hf_rows, "greedy_token_agreement_with_kvserve": agree}
        summary["kvserve_over_hf"] = {
            str(a["batch_size"]): (a["decode_tokens_per_s"] / h["decode_tokens_per_s"])
            if a["decode_tokens_per_s"] and h["decode_tokens_per_s"] else None
            for a, h in zip(ours, hf_rows, strict=True)
        }
    result: dict[str, Any] = {
        "bench": "latency",
        "model": model,
        "model_dtype": dtype_name(engine.model_config.dtype),
        "kv_cache_dtype": dtype_name(engine.kv_dtype),
        "kv_integrity": base.kv_integrity,
        "input_len": lc.input_len,
        "output_len": lc.output_len,
        "rounds": lc.rounds,
        "batch_sizes": lc.batch_sizes,
        "env": env_info(),
        "kvserve": ours,
        "peers": peers,
        "summary": summary,
    }
    del engine, rec, hf
    gc.collect()
    for name in ("llamacpp", "vllm"):
        if name in lc.peers:
            peers[name] = run_external_peer(name, lc, model)
    return result


def plot_latency(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {"kvserve": result["kvserve"]}
    for name, peer in result["peers"].items():
        if isinstance(peer, dict) and isinstance(peer.get("results"), list):
            series[name] = peer["results"]
    for name, rows in series.items():
        pts = [(r["batch_size"], r.get("decode_tokens_per_s")) for r in rows]
        pts = [(b, t) for b, t in pts if t]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["batch_sizes"], [str(b) for b in result["batch_sizes"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (prefill excluded)")
    spec = result.get("random_llama")
    name = result["model"] if not spec else "random-init Llama " + ",".join(
        f"{k}={v}" for k, v in spec.items() if k != "seed")
    ax.set_title(f"{name}\nin {result['input_len']} / out {result['output_len']}, "
                 f"median of {result['rounds']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'impl':<10}{'batch':>6}{'decode tok/s':>14}{'step ms':>10}{'prefill s':>11}"]
    series = {"kvserve": result["kvserve"]}
    for name, peer in result["peers"].items():
        if isinstance(peer, dict) and isinstance(peer.get("results"), list):
            series[name] = peer["results"]
        else:
            lines.append(f"{name:<10} {peer if isinstance(peer, str) else peer.get('error')}")
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for name, rows in series.items():
        for r in rows:
            lines.append(f"{name:<10}{r['batch_size']:>6}{f(r.get('decode_tokens_per_s')):>14}"
                         f"{f(r.get('decode_step_ms_median'), 2):>10}"
                         f"{f(r.get('prefill_s_median'), 3):>11}")
    return "\n".join(lines)
