"""The cost of tracing: ``kvserve bench serve``'s load (streaming completions, 16 concurrent
by default) against one server without tracing and one with ``--otlp-traces-endpoint``,
every request carrying a client ``traceparent`` in both. The OTLP collector is a separate
process (``python -m kvserve.bench.otlp_receiver``), so decoding spans never costs the load
generator. Both servers run side by side (the idle one costs nothing but memory) and the runs
alternate, the order rotated each round so neither mode always goes first; per mode the
median over rounds of output tokens/s, TTFT / ITL / E2E p50 and p90. JSON with the machine
(``env.cpu``), each run, the medians and the overhead (on vs off, percent).

    python benchmarks/tracing_overhead.py --concurrency 16 --requests 128 --max-tokens 64 \\
        --rounds 5 --out docs/bench/tracing_overhead_smollm2.json

``--serve-args "-dp 2 --prefill-replicas 1"`` measures a fleet instead (the router and the
replicas all trace).
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import time

import httpx

from kvserve.bench import served
from kvserve.bench.serve_bench import run_serve_bench
from kvserve.bench.served import ServeProcess

KEY = "sk-tracing-bench"
MODES = ("off", "on")
FIGURES = {"output_tok_s": ("output_throughput_tok_s",), "ttft_p50_ms": ("ttft_ms", "p50"),
           "ttft_p90_ms": ("ttft_ms", "p90"), "itl_p50_ms": ("itl_ms", "p50"),
           "itl_p90_ms": ("itl_ms", "p90"), "e2e_p50_ms": ("e2e_ms", "p50"),
           "e2e_p90_ms": ("e2e_ms", "p90")}


class Collector:
    """``python -m kvserve.bench.otlp_receiver`` in its own process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.bench.otlp_receiver"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            raise RuntimeError(f"the OTLP receiver did not start: {self.endpoint!r}")

    def stats(self) -> dict:
        return httpx.get(self.endpoint.replace("/v1/traces", "/stats"), timeout=5).json()

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _figure(report: dict, path: tuple[str, ...]) -> float | None:
    v = report
    for k in path:
        v = v[k]
    return v


def _server(model: str | None, extra: list[str], env: dict[str, str]) -> ServeProcess:
    return ServeProcess(model, extra, key=KEY, log_prefix="kvserve-tracing-bench-", env=env)


def main(argv: list[str] | None = None) -> int:
    p = served.parser(__doc__)
    p.add_argument("--concurrency", type=int, default=16, help="clients streaming at once")
    p.add_argument("--requests", type=int, default=128, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--input-words", type=int, default=32, help="words per prompt")
    p.add_argument("--rounds", type=int, default=5, help="runs per mode (order rotated)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per server (default: torch's)")
    p.add_argument("--serve-args", default="--max-num-seqs 16",
                   help="more `kvserve serve` flags for both servers")
    p.add_argument("--protocol", default="http/protobuf", choices=["http/protobuf"],
                   help="OTLP transport (the collector here speaks HTTP)")
    served.add_output_options(p)
    ns = p.parse_args(argv)
    from kvserve.bench.common import resolve_model_path

    ns.model = resolve_model_path(ns.model)
    env = {"OMP_NUM_THREADS": str(ns.threads)} if ns.threads else {}
    extra = shlex.split(ns.serve_args)
    collector = Collector()
    servers: dict[str, ServeProcess] = {}
    try:
        servers["off"] = _server(ns.model, extra, env)
        servers["on"] = _server(ns.model, [*extra, "--otlp-traces-endpoint", collector.endpoint,
                                           "--otlp-traces-protocol", ns.protocol], env)
        for s in servers.values():
            s.wait_until(lambda s=s: httpx.get(f"{s.url}/ready", timeout=2).status_code == 200,
                         ns.startup_timeout)

        def run(mode: str, requests: int, seed: int) -> dict:
            return run_serve_bench(servers[mode].url, ns.concurrency, requests,
                                   max_tokens=ns.max_tokens, input_words=ns.input_words,
                                   api_key=KEY, temperature=1.0, seed=seed, traceparent=True)

        for mode in MODES:  # warm-up: first-request costs (graphs, caches) off the figures
            run(mode, ns.concurrency, 10_000)
        runs: list[dict] = []
        for rnd in range(ns.rounds):
            order = MODES if rnd % 2 == 0 else MODES[::-1]
            for mode in order:
                rep = run(mode, ns.requests, 1000 * rnd)
                row = {"round": rnd, "mode": mode, "failed": rep["failed"],
                       **{k: _figure(rep, path) for k, path in FIGURES.items()}}
                runs.append(row)
                print(row, flush=True)
        time.sleep(6)  # the servers' batch span processors export every 5 s
        stats = collector.stats()
    finally:
        for s in servers.values():
            s.stop()
        collector.stop()
    medians = {mode: {k: statistics.median(r[k] for r in runs if r["mode"] == mode
                                           and r[k] is not None)
                      for k in FIGURES} for mode in MODES}
    off, on = medians["off"], medians["on"]
    overhead = {k: 100.0 * (on[k] / off[k] - 1.0) for k in FIGURES if off[k]}
    result = {"label": "tracing on vs off", "runs": runs, "median": medians,
              "overhead_pct": overhead, "collector": stats,
              "throughput_within_2pct": abs(overhead["output_tok_s"]) <= 2.0}
    print(f"output tok/s median: off {off['output_tok_s']:.1f}, on {on['output_tok_s']:.1f} "
          f"({overhead['output_tok_s']:+.2f}%); TTFT p50 {overhead['ttft_p50_ms']:+.2f}%, "
          f"ITL p50 {overhead['itl_p50_ms']:+.2f}%; spans received {stats['spans']}")
    served.write_results("tracing_overhead", ns, [result], lambda results, path: None)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
