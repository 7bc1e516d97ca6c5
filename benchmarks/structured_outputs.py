"""Structured outputs' cost: decode tokens/s at batch 1 / 16 / 64, unconstrained vs a
realistic ~20-field JSON schema, and grammar compile time cold / cached (default model:
SmolLM2-135M-Instruct).

For each batch size B, one engine runs B copies of a chat prompt asking for a user record,
greedy, ``max_tokens=--output-len``, first unconstrained then with
``response_format``-equivalent ``StructuredOutputsParams(json=SCHEMA)`` (modes alternate
over ``--repeats``). Every engine step is timed; the figure is B / (median time of the pure
decode steps that ran all B sequences), so both modes are compared at the same batch even
when JSON answers end earlier. ``slowdown`` = unconstrained tok/s / json tok/s - 1 (the goal
is <= 5% at batch 16). Compile times: the tokenizer's one-off wrap for llguidance, the first
compile of SCHEMA (cold), and a compile of the same schema again (cached), medians of
``--compile-repeats`` fresh compilers.

    python benchmarks/structured_outputs.py --json-out docs/bench/structured_outputs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.bench.common import env_info
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "first_name": {"type": "string", "maxLength": 32},
        "last_name": {"type": "string", "maxLength": 32},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "phone": {"type": "string", "maxLength": 20},
        "company": {"type": "string", "maxLength": 40},
        "title": {"type": "string", "maxLength": 40},
        "department": {"enum": ["sales", "engineering", "support", "finance"]},
        "manager_id": {"type": ["integer", "null"]},
        "created": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "languages": {"type": "array", "items": {"enum": ["en", "de", "fr", "es", "ja"]},
                      "maxItems": 3},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 40},
            "city": {"type": "string", "maxLength": 30},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "JP", "UK"]}},
            "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "verified": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["id", "first_name", "last_name", "email", "age", "active", "role", "score",
                 "phone", "company", "title", "department", "manager_id", "created", "tags",
                 "languages", "address", "verified", "level", "notes"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Invent a realistic employee record for a company "
                                      "directory and give it as JSON."}]


def _run(engine: LLMEngine, prompt_ids: list[int], batch: int, sp: SamplingParams,
         tag: str) -> dict:
    """B requests at once; every step timed with the number of sequences it decoded."""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt_ids}, sp)
    steps, texts = [], []
    while engine.has_unfinished_requests():
        before = engine.counters["generation_tokens"]
        prefilling = any(r.num_computed_tokens < r.num_tokens - 1
                         for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        steps.append((engine.counters["generation_tokens"] - before, dt, prefilling))
        texts += [o.outputs[0].text for o in outs if o.finished]
    full = [dt for n, dt, pre in steps if n == batch and not pre]
    tokens = sum(n for n, _, _ in steps)
    return {"full_batch_steps": len(full),
            "step_ms_median": statistics.median(full) * 1e3 if full else None,
            "tokens_per_s": batch / statistics.median(full) if full else None,
            "tokens": tokens, "texts": texts}


def _valid_json(texts: list[str]) -> int:
    ok = 0
    for t in texts:
        try:
            json.loads(t)
            ok += 1
        except ValueError:
            pass
    return ok


def compile_times(engine: LLMEngine, repeats: int) -> dict:
    so = StructuredOutputsParams(json=SCHEMA)
    setup, cold, cached = [], [], []
    for _ in range(repeats):
        comp = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               engine.model_config.eos_token_ids)
        t0 = time.perf_counter()
        comp._tokenizer()
        setup.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        comp.compile(so)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        comp.matcher(so)  # cache hit + the per-sequence copy
        cached.append(time.perf_counter() - t0)
    return {"tokenizer_setup_s": statistics.median(setup),
            "compile_cold_ms": statistics.median(cold) * 1e3,
            "compile_cached_ms": statistics.median(cached) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compile-repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = LLMEngine(EngineArgs(model=a.model, kv_cache_memory=a.kv_cache_memory,
                                  max_num_seqs=max(a.batch), progress=False))
    prompt_ids = list(engine.tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False))
    free = SamplingParams(temperature=0.0, max_tokens=a.output_len)
    modes = {"unconstrained": free,
             "json_schema": free.clone(structured_outputs=StructuredOutputsParams(json=SCHEMA))}
    engine.grammars.compile(modes["json_schema"].structured_outputs)  # serving compiles first
    _run(engine, prompt_ids, 2, free, "warmup")
    results = []
    for batch in a.batch:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(a.repeats):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for m in order:
                runs[m].append(_run(engine, prompt_ids, batch, modes[m], f"{m}-{batch}-{r}"))
        row = {"batch": batch}
        for m, rs in runs.items():
            tps = [x["tokens_per_s"] for x in rs if x["tokens_per_s"]]
            row[m] = {"tokens_per_s": statistics.median(tps) if tps else None,
                      "step_ms_median": statistics.median(
                          [x["step_ms_median"] for x in rs if x["step_ms_median"]] or [0]),
                      "full_batch_steps": sum(x["full_batch_steps"] for x in rs),
                      "valid_json": _valid_json([t for x in rs for t in x["texts"]]),
                      "answers": sum(len(x["texts"]) for x in rs),
                      "example": rs[0]["texts"][0][:300] if rs[0]["texts"] else ""}
        u, j = row["unconstrained"]["tokens_per_s"], row["json_schema"]["tokens_per_s"]
        row["slowdown"] = (u / j - 1) if u and j else None
        results.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
    report = {"model": a.model or "SmolLM2-135M-Instruct", "output_len": a.output_len,
              "repeats": a.repeats, "schema_fields": len(SCHEMA["properties"]),
              "compile": compile_times(engine, a.compile_repeats), "results": results,
              "env": env_info()}
    print(json.dumps(report["compile"]))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1)
    engine.debug.check_no_leaks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
