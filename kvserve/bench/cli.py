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
    kvserve bench spec [--model PATH] --workloads edit,rag,json,chat --batch-sizes 1,4,16 \\
        --methods off,ngram,suffix,draft_model [--peer llamacpp --peer-python PATH] --json OUT
    kvserve bench serve --url http://127.0.0.1:8000 --concurrency 16 --requests 256 \\
        --max-tokens 128 [--chat] [--api-key KEY] --json OUT.json   (against a running server)

``--kv-cache-memory auto32`` (throughput's default) means "fits 32 full sequences
(input + output tokens, rounded up to blocks) in BF16", computed from the model's BF16
bytes/token; ``autoN`` for N sequences; or a size such as ``256MiB``.
"""

from __future__ import annotations

import argparse

from kvserve.bench.settings import (
    QUALITY_REPLACES,
    THROUGHPUT_REPLACES,
    BenchOutput,
    LatencyConfig,
    QualityConfig,
    SpecBenchConfig,
    ThroughputConfig,
)
from kvserve.config_cli import add_cli_args, cli_values, from_cli_args
from kvserve.engine.arg_utils import EngineArgs

# kvserve.bench.common imports torch: only inside the commands, so --help stays fast.


def _add(p: argparse.ArgumentParser, config: type, *, replaces: tuple[str, ...] = (),
         plot: bool = True, **overrides: dict) -> None:
    """The engine's flags (less those the benchmark replaces), the benchmark's own, output."""
    EngineArgs.add_cli_args(p, skip=replaces)
    add_cli_args(p, config, overrides=overrides)
    add_cli_args(p, BenchOutput, skip=() if plot else ("plot",))


def _serve_bench(ns) -> int:
    from kvserve.bench import serve_bench

    return serve_bench.main(ns.rest)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, integrity, latency, "
                                  "spec, quality, serve", description=__doc__)
    sub = bench.add_subparsers(dest="bench_cmd", required=True)

    t = sub.add_parser("throughput", help="closed-loop tokens/s vs concurrency per KV dtype")
    _add(t, ThroughputConfig, replaces=THROUGHPUT_REPLACES)
    t.set_defaults(func=lambda ns: _throughput(ns, "throughput"))

    i = sub.add_parser("integrity", help="throughput of FP8 with integrity off/on/paranoid")
    _add(i, ThroughputConfig, replaces=THROUGHPUT_REPLACES, kv_cache_dtypes={"default": "fp8"},
         integrity_modes={"default": "off,on,paranoid"}, concurrency={"default": "32,64"})
    i.set_defaults(func=lambda ns: _throughput(ns, "integrity"))

    lat = sub.add_parser("latency", help="decode tokens/s at fixed batch sizes")
    _add(lat, LatencyConfig)
    lat.set_defaults(func=_latency)

    q = sub.add_parser("quality", help="candidate vs BF16-KV baseline: perplexity, greedy "
                       "agreement, KL")
    _add(q, QualityConfig, replaces=QUALITY_REPLACES, plot=False)
    q.set_defaults(func=_quality)

    spec = sub.add_parser("spec", help="speculative decoding off vs on: output tokens/s per "
                          "workload, batch and method")
    _add(spec, SpecBenchConfig, plot=False)
    spec.set_defaults(func=_spec)

    srv = sub.add_parser("serve", add_help=False,
                         help="HTTP load generator against a running server (streaming); "
                              "'kvserve bench serve --help' lists its options")
    srv.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    srv.set_defaults(func=_serve_bench)


def _output(ns: argparse.Namespace) -> BenchOutput:
    from kvserve.bench.common import pyplot, set_threads

    out = from_cli_args(BenchOutput, ns)
    if out.plot:
        pyplot()  # fail before the run, not after it, without matplotlib
    set_threads(out.threads)
    return out


def _throughput(ns: argparse.Namespace, kind: str) -> int:
    from kvserve.bench import throughput as tp
    from kvserve.bench.common import log, write_json

    out = _output(ns)
    own = cli_values(ThroughputConfig, ns)
    base = EngineArgs.from_cli_args(
        ns, skip=THROUGHPUT_REPLACES, kv_cache_dtype=own["kv_cache_dtypes"][0],
        kv_integrity=own["integrity_modes"][0], max_num_seqs=own["max_num_seqs"] or 64)
    tc = ThroughputConfig(base=base, seed=base.seed, **own)
    result = tp.run_throughput(tc)
    result["command"] = kind
    write_json(out.json, result)
    if out.plot:
        tp.plot_throughput(result, out.plot)
    log(tp.format_table(result))
    return 0


def _latency(ns: argparse.Namespace) -> int:
    from kvserve.bench import latency as lt
    from kvserve.bench.common import log, write_json

    out = _output(ns)
    base = EngineArgs.from_cli_args(ns)
    lc = from_cli_args(LatencyConfig, ns, base=base, seed=base.seed)
    result = lt.run_latency(lc)
    write_json(out.json, result)
    if out.plot:
        lt.plot_latency(result, out.plot)
    log(lt.format_table(result))
    return 0


def _quality(ns: argparse.Namespace) -> int:
    from kvserve.bench import quality as ql
    from kvserve.bench.common import log, write_json

    out = _output(ns)
    own = cli_values(QualityConfig, ns)
    base = EngineArgs.from_cli_args(ns, skip=QUALITY_REPLACES,
                                    kv_cache_dtype=own["baseline_kv_cache_dtype"])
    qc = QualityConfig(base=base, seed=base.seed, **own)
    cands = qc.candidates()
    if len(cands) > 1 and out.json not in (None, "-") and "{kv}" not in out.json:
        raise ValueError("--json: with several --kv-cache-dtype candidates, put {kv} in the "
                         "path (one JSON per candidate)")
    for kv, result in zip(cands, ql.run_quality_many(qc, cands), strict=True):
        write_json(out.json.replace("{kv}", kv) if out.json else out.json, result)
        log(ql.format_summary(result))
    return 0


def _spec(ns: argparse.Namespace) -> int:
    from kvserve.bench import spec_bench as sb
    from kvserve.bench.common import log, write_json

    out = _output(ns)
    base = EngineArgs.from_cli_args(ns)
    sc = from_cli_args(SpecBenchConfig, ns, base=base, threads=out.threads)
    result = sb.run_spec(sc)
    write_json(out.json, result)
    log(sb.format_table(result))
    return 0
