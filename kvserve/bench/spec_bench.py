"""``kvserve bench spec``: output tokens/s with speculative decoding off vs on, per workload
(kvserve/bench/spec_workloads.py), batch size and method, greedy, one engine per method, rounds
rotated between the engines (medians). Reports each method's ratio to off, the mean accepted
length and acceptance per position; optionally llama-cpp-python with and without
``LlamaPromptLookupDecoding`` on the same GGUF (batch 1: it serves one sequence)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from kvserve.bench.common import (
    env_info,
    log,
    median,
    peer_importable,
    resolve_model_path,
    rotated,
    run_peer_script,
)
from kvserve.bench.peers import peer_python, script_path
from kvserve.bench.settings import SpecBenchConfig
from kvserve.bench.spec_workloads import prompts

PEER_SCRIPT = script_path("llamacpp_spec")


def method_config(method: str, sc: SpecBenchConfig) -> dict | None:
    k = sc.num_speculative_tokens
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": max(k, 16)}
    if method == "draft_model":
        return {"method": "draft_model", "num_speculative_tokens": k,
                "model": sc.draft_model or resolve_model_path(sc.base.model)}
    raise ValueError(f"--methods: unknown method {method!r}")


def _groups(llm, wl: str, b: int) -> list[list[str]]:
    """The workload's prompts (cycled to at least b), in groups of b run as one batch each."""
    tok = llm.engine.tokenizer
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in prompts(wl)]
    allp = [texts[i % len(texts)] for i in range(max(b, len(texts)))]
    return [allp[i : i + b] for i in range(0, len(allp), b)]


def _cold_global_tree(llm) -> None:
    """Empty the suffix method's global tree (the outputs of finished requests): a timed run
    then drafts only from what this run itself produced, not from an earlier round's outputs
    of the same prompts."""
    drafter = llm.engine.drafter
    if drafter is not None and drafter.global_tree is not None:
        drafter.global_tree.clear()


def run_spec(sc: SpecBenchConfig) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=sc.output_len)
    engines = {}
    for m in sc.methods:
        args = dataclasses.replace(sc.base, speculative_config=method_config(m, sc))
        engines[m] = LLM.from_engine_args(args)
        log(f"[spec] engine {m} ready")
    results: dict[str, Any] = {}
    for wl in sc.workloads:
        for b in sc.batch_sizes:
            times: dict[str, list[float]] = {m: [] for m in sc.methods}
            toks: dict[str, int] = {}
            before = {m: _counters(e) for m, e in engines.items()}
            for r in range(sc.rounds + 1):  # round 0: warm-up
                for m in rotated(list(sc.methods), r):
                    llm = engines[m]
                    if not sc.warm_global_tree:
                        _cold_global_tree(llm)
                    n, t0 = 0, time.perf_counter()
                    for group in _groups(llm, wl, b):
                        outs = llm.generate(group, sp)
                        n += sum(len(o.outputs[0].token_ids) for o in outs)
                    dt = time.perf_counter() - t0
                    if r:
                        times[m].append(n / dt)
                    toks[m] = n
            row = {}
            for m in sc.methods:
                c = _delta(before[m], _counters(engines[m]))
                row[m] = {"tok_s": median(times[m]), "tok_s_rounds": times[m],
                          "output_tokens": toks[m], **c}
            for m in sc.methods:
                if "off" in row and row["off"]["tok_s"]:
                    row[m]["vs_off"] = row[m]["tok_s"] / row["off"]["tok_s"]
            results[f"{wl}/b{b}"] = row
            log(f"[spec] {wl} b={b}: " + ", ".join(
                f"{m} {row[m]['tok_s']:.1f} tok/s" + (f" (x{row[m]['vs_off']:.2f}, "
                f"mean accepted {row[m]['mean_accepted_length']:.2f})" if m != "off" else "")
                for m in sc.methods))
    for e in engines.values():
        e.engine.shutdown()
    out = {"config": {"model": resolve_model_path(sc.base.model), "methods": list(sc.methods),
                      "workloads": list(sc.workloads), "batch_sizes": list(sc.batch_sizes),
                      "output_len": sc.output_len, "rounds": sc.rounds,
                      "num_speculative_tokens": sc.num_speculative_tokens,
                      "warm_global_tree": sc.warm_global_tree,
                      "draft_model": sc.draft_model},
           "results": results, "env": env_info()}
    if sc.peer == "llamacpp":
        out["peer"] = run_peer(sc)
    return out


def _counters(llm) -> dict:
    s = llm.engine.stats().spec_decode
    return dict(s) if s else {}


def _delta(a: dict, b: dict) -> dict:
    if not b:
        return {"mean_accepted_length": 1.0}
    drafts = b["num_drafts"] - a.get("num_drafts", 0)
    acc = b["num_accepted_tokens"] - a.get("num_accepted_tokens", 0)
    drafted = b["num_draft_tokens"] - a.get("num_draft_tokens", 0)
    per_pos = [y - x for x, y in zip(a.get("accepted_per_pos", [0] * len(
        b["accepted_per_pos"])), b["accepted_per_pos"], strict=True)]
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": acc,
            "acceptance_rate": acc / drafted if drafted else None,
            "acceptance_per_pos": [x / drafts for x in per_pos] if drafts else [],
            "mean_accepted_length": 1.0 + acc / drafts if drafts else 1.0}


def run_peer(sc: SpecBenchConfig) -> dict[str, Any]:
    """llama-cpp-python, batch 1, plain and with LlamaPromptLookupDecoding, same workloads."""
    python = peer_python("llamacpp", sc.peer_python)
    if not peer_importable(python, "llama_cpp"):
        return {"error": f"llama_cpp does not import in the peer's interpreter {python!r} "
                         "(--peer-python, KVSERVE_LLAMACPP_PYTHON or scripts/setup_peers.sh)"}
    gguf = sc.peer_model or resolve_model_path(sc.base.model)
    if not gguf.endswith(".gguf"):
        return {"error": "--peer-model: llama.cpp needs a GGUF"}
    payload = {"gguf": gguf, "threads": sc.threads or os.cpu_count(),
               "max_tokens": sc.output_len, "rounds": sc.rounds,
               "num_pred_tokens": sc.num_speculative_tokens,
               "workloads": {wl: prompts(wl) for wl in sc.workloads}}
    log(f"running the llamacpp peer in {python}")
    return run_peer_script(python or "", PEER_SCRIPT, payload, sc.peer_timeout)


def format_table(result: dict[str, Any]) -> str:
    methods = result["config"]["methods"]
    lines = ["| workload / batch | " + " | ".join(methods) + " |",
             "|---" * (len(methods) + 1) + "|"]
    for key, row in result["results"].items():
        cells = []
        for m in methods:
            r = row[m]
            c = f"{r['tok_s']:.1f}"
            if m != "off" and r.get("vs_off"):
                c += f" (x{r['vs_off']:.2f}, acc {r['mean_accepted_length']:.2f})"
            cells.append(c)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    peer = result.get("peer")
    if peer and "error" not in peer:
        for wl, r in peer.items():
            lines.append(f"| llama.cpp {wl}/b1 | plain {r['plain_tok_s']:.1f} | prompt lookup "
                         f"{r['lookup_tok_s']:.1f} |")
    return "\n".join(lines)
