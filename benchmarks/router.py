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
import json
import random
import sys
import time
from dataclasses import dataclass

import httpx

from kvserve.bench import served
from kvserve.bench.served import ServeProcess, percentile, scrape

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


def weighted_hit_rate(replica_metrics: list[dict[str, float]]) -> float:
    """Prompt-token weighted prefix-cache hit rate over replicas."""
    total = sum(m.get("kvserve_prompt_tokens_total", 0.0) for m in replica_metrics)
    if total <= 0:
        return 0.0
    return sum(m.get("kvserve_prefix_cache_hit_rate", 0.0) *
               m.get("kvserve_prompt_tokens_total", 0.0) for m in replica_metrics) / total


class Server(ServeProcess):
    def __init__(self, model: str | None, threads: int, policy: str | None,
                 extra: list[str]) -> None:
        env = {}
        if policy is None:  # one replica alone, publishing its events for the same cost
            env["OMP_NUM_THREADS"] = str(threads)
            extra = [*extra, "--kv-events-endpoint", "tcp://127.0.0.1:0"]
        else:
            extra = [*extra, "--data-parallel-size", "2", "--replica-threads", str(threads),
                     "--routing", policy]
        super().__init__(model, extra, key=KEY, log_prefix="kvserve-router-bench-", env=env)
        self.routed = policy is not None

    def wait_ready(self, timeout: float) -> None:
        want = 2 if self.routed else None

        def ready() -> bool:
            r = httpx.get(f"{self.url}/ready", timeout=2)
            return r.status_code == 200 and (want is None or r.json().get("replicas") == want)

        self.wait_until(ready, timeout)

    def replica_urls(self) -> list[str]:
        if not self.routed:
            return [self.url]
        return [r["url"] for r in self.router_replicas()["replicas"]]


async def run_workload(url: str, conversations: int, turns: int, doc_tokens: int,
                       answer_tokens: int, think_time: float = 0.0) -> tuple[list[Turn], float]:
    async def one(c: httpx.AsyncClient, conv: int) -> list[Turn]:
        messages: list[dict] = []
        out = []
        await asyncio.sleep(0.2 * conv)  # staggered starts: turns interleave
        for i, text in enumerate(conversation_turns(conv, turns, doc_tokens)):
            if i:
                await asyncio.sleep(think_time)  # the user reads the answer
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
                async for chunk in served.sse_chunks(r):
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
    if policy is not None and ns.routed_prefix_ttl is not None:
        extra += ["--routed-prefix-ttl", str(ns.routed_prefix_ttl)]
    server = Server(ns.model, ns.threads, policy, extra)
    try:
        server.wait_ready(ns.startup_timeout)
        turns, wall = asyncio.run(run_workload(server.url, ns.conversations, ns.turns,
                                               ns.doc_tokens, ns.answer_tokens,
                                               ns.think_time))
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
        "routed_prefix_ttl_s": ns.routed_prefix_ttl if policy is not None else None,
        "replica_prompt_tokens": [m.get("kvserve_prompt_tokens_total", 0.0)
                                  for m in per_replica],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "routing_decisions"}),
          flush=True)
    return result


def plot(results: list[dict], path: str) -> None:
    def draw(labels: list[str], axes) -> None:
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

    served.save_panels(results, path, draw)


def main(argv: list[str] | None = None) -> int:
    p = served.parser(__doc__)
    p.add_argument("--conversations", type=int, default=8, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length (about)")
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="seconds between an answer and the conversation's next turn")
    p.add_argument("--routed-prefix-ttl", type=float, default=None,
                   help="the router's --routed-prefix-ttl (default: the router's own; 0: "
                   "prefixes known from KV events only)")
    served.add_replica_options(p, kv_cache_memory="96MiB")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list of routing policies to run")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-replica run")
    served.add_output_options(p)
    ns = p.parse_args(argv)
    from kvserve.bench.common import resolve_model_path

    ns.model = resolve_model_path(ns.model)  # None: the default model (SmolLM2 GGUF)
    runs = [] if ns.no_baseline else [("1 replica", None)]
    runs += [(pol, pol) for pol in ns.policies.split(",") if pol]
    results = [run_one(label, pol, ns) for label, pol in runs]
    served.write_results("router", ns, results, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
