"""Routing policies on a multi-turn workload: 2 replicas behind the router vs one replica alone.

Each conversation opens with its own long document and goes on for several turns (each turn
resends the whole conversation, as chat clients do); conversations run concurrently, so their
turns interleave. Every policy gets fresh replicas (``kvserve serve MODEL -dp 2
--replica-threads T --routing P``; cold caches); the baseline is one replica of T threads
alone. Per run: the replicas' prefix-cache hit rate (prompt-token weighted, from their
``/metrics``), TTFT p50 / p90 (client side, streaming), output tokens/s, and the routing
decisions. JSON with the machine (``env.cpu``) and a PNG plot.

    python benchmarks/router.py --conversations 8 --turns 4 --doc-tokens 1500 \\
        --out docs/bench/router_smollm2.json --plot docs/bench/router_smollm2.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

KEY = "sk-router-bench"
POLICIES = ("round-robin", "least-loaded", "session", "prefix")
WORDS = ["river", "stone", "light", "paper", "engine", "garden", "window", "market", "signal",
         "forest", "letter", "copper", "harbor", "thread", "winter", "orbit", "canvas",
         "lantern", "meadow", "pillar"]


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    tokens: int
    replica: str | None


def document(conv: int, doc_tokens: int) -> str:
    """Text of about ``doc_tokens`` tokens, different for every conversation."""
    rng = random.Random(conv)
    words = [f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(doc_tokens // 3)]
    return f"Document {conv}: " + " ".join(words)


def conversation_turns(conv: int, turns: int, doc_tokens: int) -> list[str]:
    doc = document(conv, doc_tokens)
    return [f"{doc}\n\nSummarize the document above." if t == 0 else
            f"Question {t} about document {conv}: what comes next?" for t in range(turns)]


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def weighted_hit_rate(replica_metrics: list[dict[str, float]]) -> float:
    """Prompt-token weighted prefix-cache hit rate over replicas."""
    total = sum(m.get("kvserve_prompt_tokens_total", 0.0) for m in replica_metrics)
    if total <= 0:
        return 0.0
    return sum(m.get("kvserve_prefix_cache_hit_rate", 0.0) *
               m.get("kvserve_prompt_tokens_total", 0.0) for m in replica_metrics) / total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, threads: int, policy: str | None, extra: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the process
            "w+", prefix="kvserve-router-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", model, "--port", str(self.port),
               "--api-key", KEY, "--no-access-log", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if policy is None:  # one replica alone, publishing its events for the same cost
            env["OMP_NUM_THREADS"] = str(threads)
            cmd += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
        else:
            cmd += ["--data-parallel-size", "2", "--replica-threads", str(threads),
                    "--routing", policy]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.routed = policy is not None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = 2 if self.routed else None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.url}/ready", timeout=2)
                if r.status_code == 200 and (want is None or r.json().get("replicas") == want):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout} s")

    def replica_urls(self) -> list[str]:
        if not self.routed:
            return [self.url]
        info = httpx.get(f"{self.url}/router/replicas", timeout=5,
                         headers={"Authorization": f"Bearer {KEY}"}).json()
        return [r["url"] for r in info["replicas"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
            out[key] = s.value
    return out


async def run_workload(url: str, conversations: int, turns: int, doc_tokens: int,
                       answer_tokens: int) -> tuple[list[Turn], float]:
    async def one(c: httpx.AsyncClient, conv: int) -> list[Turn]:
        messages: list[dict] = []
        out = []
        await asyncio.sleep(0.2 * conv)  # staggered starts: turns interleave
        for text in conversation_turns(conv, turns, doc_tokens):
            messages.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            ttft, pieces, tokens = None, [], 0
            async with c.stream("POST", f"{url}/v1/chat/completions",
                                headers={"Authorization": f"Bearer {KEY}",
                                         "x-session-affinity": f"conversation-{conv}"},
                                json={"messages": messages, "max_tokens": answer_tokens,
                                      "temperature": 0, "stream": True, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}}) as r:
                r.raise_for_status()
                replica = r.headers.get("x-kvserve-replica")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if not chunk.get("choices"):
                        continue
                    delta = chunk["choices"][0].get("delta", {}).get("content")
                    if delta:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        pieces.append(delta)
            messages.append({"role": "assistant", "content": "".join(pieces)})
            out.append(Turn(ttft if ttft is not None else float("nan"), tokens, replica))
        return out

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as c:
        results = await asyncio.gather(*(one(c, i) for i in range(conversations)))
    return [t for conv in results for t in conv], time.perf_counter() - t0


def run_one(label: str, policy: str | None, ns: argparse.Namespace) -> dict:
    extra = ["--max-num-seqs", str(ns.max_num_seqs)]
    if ns.kv_cache_memory:
        extra += ["--kv-cache-memory", ns.kv_cache_memory]
    server = Server(ns.model, ns.threads, policy, extra)
    try:
        server.wait_ready(ns.startup_timeout)
        turns, wall = asyncio.run(run_workload(server.url, ns.conversations, ns.turns,
                                               ns.doc_tokens, ns.answer_tokens))
        per_replica = [scrape(u) for u in server.replica_urls()]
        router = scrape(server.url) if server.routed else {}
    finally:
        server.stop()
    ttfts = [t.ttft_s for t in turns]
    decisions = {k.split("{", 1)[1]: v for k, v in router.items()
                 if k.startswith("kvserve_router_routing_decisions_total{")}
    result = {
        "label": label, "policy": policy, "replicas": 1 if policy is None else 2,
        "prefix_cache_hit_rate": weighted_hit_rate(per_replica),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "output_tokens": sum(t.tokens for t in turns), "wall_s": wall,
        "output_tokens_per_s": sum(t.tokens for t in turns) / wall,
        "requests": len(turns), "routing_decisions": decisions,
        "replica_prompt_tokens": [m.get("kvserve_prompt_tokens_total", 0.0)
                                  for m in per_replica],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "routing_decisions"}),
          flush=True)
    return result


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("prefix_cache_hit_rate", "prefix-cache hit rate"),
              ("ttft_p50_s", "TTFT p50 / p90 (s)"),
              ("output_tokens_per_s", "output tokens/s"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(labels, [r[key] for r in results], color="tab:blue", label=key)
        if key == "ttft_p50_s":
            ax.scatter(labels, [r["ttft_p90_s"] for r in results], color="tab:red",
                       label="p90", zorder=3)
            ax.legend()
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="served model (default: SmolLM2 GGUF)")
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length (about)")
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--max-num-seqs", type=int, default=8, help="per replica")
    p.add_argument("--kv-cache-memory", default="96MiB", help="KV budget per replica")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list of routing policies to run")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-replica run")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--plot", default=None, help="PNG plot file")
    ns = p.parse_args(argv)
    from kvserve.bench.common import resolve_model_path

    ns.model = resolve_model_path(ns.model)  # None: the default model (SmolLM2 GGUF)
    from kvserve.bench.common import env_info

    runs = [] if ns.no_baseline else [("1 replica", None)]
    runs += [(pol, pol) for pol in ns.policies.split(",") if pol]
    results = [run_one(label, pol, ns) for label, pol in runs]
    doc = {"benchmark": "router", "env": env_info(), "config": vars(ns), "results": results}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
    if ns.plot:
        plot(results, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
