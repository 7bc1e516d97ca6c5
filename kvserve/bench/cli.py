"""``kvserve bench {throughput,integrity,latency,quality,serve}``.

    kvserve bench throughput --model PATH --kv-cache-dtype bf16,fp8 --kv-cache-memory auto32 \\
        --concurrency 1,2,4,8,16,32,64,128 --input-len 128 --output-len 128 \\
        [--kv-integrity off,on,paranoid] [--num-prompts-per-level K] [--repeats R] \\
        --json OUT.json --plot OUT.png [--peer vllm --peer-python PATH]
    kvserve bench latency [--model PATH | --make-random-llama hidden=512,layers=8,...] \\
        --batch-sizes 1,16,64 --input-len 128 --output-len 64 --rounds 5 --json OUT.json \\
        [--peer hf] [--peer llamacpp --peer-python PATH --peer-model GGUF] [--peer vllm ...]
    kvserve bench quality --model PATH [--kv-cache-dtype fp8] \\
        [--quantization int4 --candidate-model PATH2] [--text FILE] --json OUT.json
    kvserve bench integrity --model PATH --json OUT.json --plot OUT.png
    kvserve bench serve --url http://127.0.0.1:8000 --concurrency 16 --requests 256 \\
        --max-tokens 128 [--chat] [--api-key KEY] --json OUT.json   (against a running server)

``--kv-cache-memory auto32`` (throughput's default) means "fits 32 full sequences
(input + output tokens, rounded up to blocks) in BF16", computed from the model's BF16
bytes/token; ``autoN`` for N sequences; or a size such as ``256MiB``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

# kvserve.bench.common imports torch: only inside the commands, so --help stays fast.


def _override(p: argparse.ArgumentParser, dest: str, **attrs) -> None:
    """Change an option that ``add_engine_args`` defined (default, choices, help)."""
    for action in p._actions:
        if action.dest == dest:
            for k, v in attrs.items():
                setattr(action, k, v)
    if "default" in attrs:
        p.set_defaults(**{dest: attrs["default"]})


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="OUT",
                   help="write the results as JSON here (default: stdout)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _throughput_args(p: argparse.ArgumentParser, add_engine_args: Callable, *,
                     dtypes: str, integrity: str, concurrency: str) -> None:
    add_engine_args(p)
    _override(p, "kv_cache_dtype", default=dtypes,
              help=f"comma list of KV dtypes, one engine each (default {dtypes})")
    _override(p, "kv_integrity", default=integrity, choices=None,
              help=f"comma list of off | on | paranoid (default {integrity})")
    _override(p, "kv_cache_memory", default="auto32",
              help="KV byte budget, same for every config: autoN = N full sequences in BF16 "
                   "(default auto32), or a size like 256MiB")
    _override(p, "max_num_seqs", default=None,
              help="scheduler cap on running sequences (default: the largest concurrency)")
    p.add_argument("--concurrency", default=concurrency,
                   help=f"comma list of closed-loop client counts (default {concurrency})")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--num-prompts-per-level", type=int, default=None,
                   help="requests to complete per level (default max(2C, 8))")
    p.add_argument("--repeats", type=int, default=1,
                   help="repeats per level; configs alternate order, medians reported")
    p.add_argument("--warmup-requests", type=int, default=4,
                   help="requests run before measuring, per config")
    p.add_argument("--no-detokenize", action="store_true",
                   help="skip detokenization (measure the engine alone)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a plot here")
    p.add_argument("--peer", default=None, choices=["vllm"],
                   help="also run the sweep through vLLM (kv auto and fp8) in --peer-python")
    p.add_argument("--peer-python", default=None, metavar="PATH",
                   help="interpreter with the peer installed")
    p.add_argument("--peer-timeout", type=float, default=3600.0,
                   help="seconds before the peer run is stopped")
    _common(p)


def _serve_bench(ns) -> int:
    from kvserve.bench import serve_bench

    return serve_bench.main(ns.rest)


def register(subparsers, add_engine_args: Callable, engine_args_from: Callable) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, integrity, latency, "
                                  "quality, serve", description=__doc__)
    sub = bench.add_subparsers(dest="bench_cmd", required=True)

    t = sub.add_parser("throughput", help="closed-loop tokens/s vs concurrency per KV dtype")
    _throughput_args(t, add_engine_args, dtypes="bf16,fp8", integrity="on",
                     concurrency="1,2,4,8,16,32,64,128")
    t.set_defaults(func=lambda ns: _throughput(ns, engine_args_from, "throughput"))

    i = sub.add_parser("integrity", help="throughput of FP8 with integrity off/on/paranoid")
    _throughput_args(i, add_engine_args, dtypes="fp8", integrity="off,on,paranoid",
                     concurrency="32,64")
    i.set_defaults(func=lambda ns: _throughput(ns, engine_args_from, "integrity"))

    lat = sub.add_parser("latency", help="decode tokens/s at fixed batch sizes")
    add_engine_args(lat)
    lat.add_argument("--batch-sizes", default="1,16,64", help="comma list of batch sizes")
    lat.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    lat.add_argument("--output-len", type=int, default=64, help="decode steps measured")
    lat.add_argument("--rounds", type=int, default=5, help="timed rounds per batch size")
    lat.add_argument("--make-random-llama", nargs="?", metavar="SPEC",
                     const="hidden=512,layers=8,heads=8,kv_heads=2,vocab=32000", default=None,
                     help="without --model: make a random-init bf16 Llama in a temp dir "
                          "(SPEC keys hidden, layers, heads, kv_heads, vocab, ffn, max_pos; "
                          "default hidden=512,layers=8,heads=8,kv_heads=2,vocab=32000)")
    lat.add_argument("--peer", action="append", default=[], choices=["hf", "llamacpp", "vllm"],
                     help="also measure a peer on the same weights (repeatable)")
    lat.add_argument("--peer-python", default=None, metavar="PATH",
                     help="interpreter for the llamacpp / vllm peers")
    lat.add_argument("--peer-model", default=None, metavar="GGUF",
                     help="llama.cpp: a GGUF of the same weights")
    lat.add_argument("--peer-timeout", type=float, default=3600.0,
                     help="seconds before a peer run is stopped")
    lat.add_argument("--compare-model", default=None, metavar="PATH",
                     help="a second kvserve engine in the same run, rounds rotated with the "
                          "first (e.g. the model's dequantized bf16 folder vs its packed GGUF)")
    lat.add_argument("--plot", default=None, metavar="OUT.png", help="write a plot here")
    _common(lat)
    lat.set_defaults(func=lambda ns: _latency(ns, engine_args_from))

    q = sub.add_parser("quality", help="candidate vs BF16-KV baseline: perplexity, greedy "
                       "agreement, KL")
    add_engine_args(q)
    _override(q, "kv_cache_dtype", default=None,
              help="candidate KV dtype, or a comma list of them measured against one baseline "
                   "run (then --json needs {kv} in the path); default fp8 (bf16 when "
                   "--candidate-model is given)")
    q.add_argument("--baseline-kv-cache-dtype", default="bf16",
                   help="KV dtype of the reference run")
    q.add_argument("--candidate-model", default=None, metavar="PATH2",
                   help="candidate checkpoint (e.g. an INT4 one of the same model)")
    q.add_argument("--quantization", default=None,
                   help="label of the candidate's weight quantization (e.g. int4); needs "
                        "--candidate-model")
    q.add_argument("--candidate-activations", default=None, choices=("int8x2", "int8", "fp32"),
                   help="GGUF weights: the candidate's activations (default: as the "
                        "baseline's --gguf-activations)")
    q.add_argument("--text", default=None, metavar="FILE",
                   help="evaluation text (default <model>/heldout.txt, else generated)")
    q.add_argument("--num-prompts", type=int, default=16,
                   help="prompts for the greedy-agreement and KL comparison")
    q.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    q.add_argument("--gen-len", type=int, default=256, help="greedy tokens generated per prompt")
    q.add_argument("--ppl-window", type=int, default=256, help="perplexity window in tokens")
    q.add_argument("--ppl-max-tokens", type=int, default=16384,
                   help="evaluation text tokens used for perplexity at most")
    _common(q)
    q.set_defaults(func=lambda ns: _quality(ns, engine_args_from))

    srv = sub.add_parser("serve", add_help=False,
                         help="HTTP load generator against a running server (streaming); "
                              "'kvserve bench serve --help' lists its options")
    srv.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    srv.set_defaults(func=_serve_bench)


def _throughput(ns: argparse.Namespace, engine_args_from: Callable, kind: str) -> int:
    from kvserve.bench import throughput as tp
    from kvserve.bench.common import (
        log,
        parse_list,
        parse_positive_ints,
        pyplot,
        set_threads,
        write_json,
    )

    if ns.plot:
        pyplot()  # fail before the run, not after it, without matplotlib
    set_threads(ns.threads)
    dtypes = parse_list(ns.kv_cache_dtype, str, "--kv-cache-dtype")
    modes = parse_list(ns.kv_integrity, str, "--kv-integrity")
    mem, max_seqs = ns.kv_cache_memory, ns.max_num_seqs
    ns = argparse.Namespace(**{**vars(ns), "kv_cache_dtype": dtypes[0],
                               "kv_integrity": modes[0], "kv_cache_memory": None,
                               "max_num_seqs": ns.max_num_seqs or 64})
    base = engine_args_from(ns)
    tc = tp.ThroughputConfig(
        base=base, kv_cache_dtypes=dtypes, integrity_modes=modes,
        concurrency=parse_positive_ints(ns.concurrency, "--concurrency"),
        input_len=ns.input_len, output_len=ns.output_len, kv_cache_memory=mem,
        num_prompts_per_level=ns.num_prompts_per_level, repeats=ns.repeats,
        warmup_requests=ns.warmup_requests, max_num_seqs=max_seqs,
        detokenize=not ns.no_detokenize, seed=ns.seed, peer=ns.peer,
        peer_python=ns.peer_python, peer_timeout=ns.peer_timeout, progress=not ns.no_progress,
    )
    result = tp.run_throughput(tc)
    result["command"] = kind
    write_json(ns.json, result)
    if ns.plot:
        tp.plot_throughput(result, ns.plot)
    log(tp.format_table(result))
    return 0


def _latency(ns: argparse.Namespace, engine_args_from: Callable) -> int:
    from kvserve.bench import latency as lt
    from kvserve.bench.common import log, parse_positive_ints, pyplot, set_threads, write_json

    if ns.plot:
        pyplot()  # fail before the run, not after it, without matplotlib
    set_threads(ns.threads)
    base = engine_args_from(ns)
    lc = lt.LatencyConfig(
        base=base, batch_sizes=parse_positive_ints(ns.batch_sizes, "--batch-sizes"),
        input_len=ns.input_len, output_len=ns.output_len, rounds=ns.rounds,
        make_random_llama=ns.make_random_llama, peers=list(dict.fromkeys(ns.peer)),
        peer_python=ns.peer_python, peer_model=ns.peer_model, peer_timeout=ns.peer_timeout,
        compare_model=ns.compare_model, seed=ns.seed, progress=not ns.no_progress,
    )
    result = lt.run_latency(lc)
    write_json(ns.json, result)
    if ns.plot:
        lt.plot_latency(result, ns.plot)
    log(lt.format_table(result))
    return 0


def _quality(ns: argparse.Namespace, engine_args_from: Callable) -> int:
    from kvserve.bench import quality as ql
    from kvserve.bench.common import log, parse_list, set_threads, write_json

    set_threads(ns.threads)
    cand_kv = ns.kv_cache_dtype
    base = engine_args_from(argparse.Namespace(**{**vars(ns), "kv_cache_dtype": "auto"}))
    qc = ql.QualityConfig(
        base=dataclasses.replace(base, kv_cache_dtype=ns.baseline_kv_cache_dtype),
        kv_cache_dtype=cand_kv, baseline_kv_cache_dtype=ns.baseline_kv_cache_dtype,
        candidate_model=ns.candidate_model, quantization=ns.quantization, text=ns.text,
        candidate_gguf_activations=ns.candidate_activations,
        num_prompts=ns.num_prompts, prompt_len=ns.prompt_len, gen_len=ns.gen_len,
        ppl_window=ns.ppl_window, ppl_max_tokens=ns.ppl_max_tokens, seed=ns.seed,
        progress=not ns.no_progress,
    )
    cands = parse_list(cand_kv, str, "--kv-cache-dtype") if cand_kv else [qc.candidate_kv_dtype]
    if len(cands) > 1 and ns.json not in (None, "-") and "{kv}" not in ns.json:
        raise ValueError("--json: with several --kv-cache-dtype candidates, put {kv} in the "
                         "path (one JSON per candidate)")
    for kv, result in zip(cands, ql.run_quality_many(qc, cands), strict=True):
        write_json(ns.json.replace("{kv}", kv) if ns.json else ns.json, result)
        log(ql.format_summary(result))
    return 0
