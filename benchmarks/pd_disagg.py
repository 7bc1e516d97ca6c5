"""Prefill/decode disaggregation vs colocated replicas on a mixed workload (docs/disaggregation.md).

Chat requests (short prompt, ``--chat-tokens`` output tokens, streamed) decode while long
requests (``--long-tokens``-token prompts, ``--long-output`` output tokens) arrive every
``--long-interval`` seconds. Two runs on the same cores, fresh servers each:

  * colocated: ``kvserve serve MODEL -dp 2 --replica-threads T --routing least-loaded``
  * disaggregated: ``kvserve serve MODEL -dp 2 --prefill-replicas 1 --replica-threads T``
    (1 prefill + 1 decode replica, the KV through a shared /dev/shm directory)

Per run: the chat requests' inter-token latency p50 / p90 / p99 (client side, per token:
the gap between stream chunks divided by the tokens they carried), TTFT p50 / p90 of both
kinds, output tokens/s, and the replicas' transfer counters. JSON with the machine
(``env.cpu``) and a PNG plot.

    python benchmarks/pd_disagg.py --chats 4 --chat-tokens 256 --longs 6 --long-tokens 2000 \\
        --long-interval 4 --out docs/bench/pd_disagg_smollm2.json \\
        --plot docs/bench/pd_disagg_smollm2.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench import served
from kvserve.bench.served import ServeProcess, percentile, scrape

KEY = "sk-pd-bench"
WORDS = ["river", "stone", "light", "paper", "engine", "garden", "window", "market", "signal",
         "forest", "letter", "copper", "harbor", "thread", "winter", "orbit", "canvas"]


@dataclass
class Stream:
    kind: str  # chat | long
    ttft_s: float = float("nan")
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # per token, after the first


def long_prompt(i: int, tokens: int) -> str:
    """About ``tokens`` tokens of text, different for every i (no prefix sharing)."""
    rng = random.Random(i)
    return f"Report {i}: " + " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}"
                                      for _ in range(tokens // 3)) + "\nOne-line summary:"


def token_gaps(events: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps from stream chunks (arrival time, tokens carried): a chunk of k tokens
    after a gap g counts k gaps of g / k. The first chunk (TTFT) is not a gap."""
    out = []
    for (t0, _), (t1, k) in zip(events, events[1:], strict=False):
        if k > 0:
            out += [(t1 - t0) / k] * k
    return out


class Server(ServeProcess):
    def __init__(self, model: str | None, threads: int, disaggregated: bool,
                 extra: list[str]) -> None:
        args = ["--data-parallel-size", "2", "--replica-threads", str(threads), *extra]
        args += ["--prefill-replicas", "1"] if disaggregated else ["--routing", "least-loaded"]
        super().__init__(model, args, key=KEY, log_prefix="kvserve-pd-bench-")

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            j = self.router_replicas()
            reps = j["replicas"] + j.get("prefill_replicas", [])
            return len(reps) == 2 and all(r["healthy"] for r in reps)

        self.wait_until(ready, timeout)


async def _stream(c: httpx.AsyncClient, url: str, kind: str, body: dict) -> Stream:
    out = Stream(kind)
    t0 = time.perf_counter()
    events: list[tuple[float, int]] = []
    async with c.stream("POST", f"{url}/v1/completions", json={
            **body, "stream": True, "temperature": 0, "ignore_eos": True, "logprobs": 0},
            headers={"Authorization": f"Bearer {KEY}"}) as r:
        r.raise_for_status()
        async for chunk in served.sse_chunks(r):
            for ch in chunk.get("choices") or []:
                k = len((ch.get("logprobs") or {}).get("tokens") or [])
                if k:
                    events.append((time.perf_counter(), k))
    if events:
        out.ttft_s = events[0][0] - t0
        out.tokens = sum(k for _, k in events)
        out.gaps = token_gaps(events)
    return out


async def run_workload(url: str, ns: argparse.Namespace) -> tuple[list[Stream], float]:
    async with httpx.AsyncClient(timeout=None) as c:
        async def chat(i: int) -> Stream:
            await asyncio.sleep(0.1 * i)
            return await _stream(c, url, "chat", {"prompt": f"Chat {i}: tell me a long story "
                                                  "about a lighthouse keeper.",
                                                  "max_tokens": ns.chat_tokens})

        async def long(i: int) -> Stream:
            await asyncio.sleep(ns.long_start + ns.long_interval * i)
            return await _stream(c, url, "long", {"prompt": long_prompt(i, ns.long_tokens),
                                                  "max_tokens": ns.long_output})

        t0 = time.perf_counter()
        res = await asyncio.gather(*[chat(i) for i in range(ns.chats)],
                                   *[long(i) for i in range(ns.longs)])
        return list(res), time.perf_counter() - t0


def summarize(label: str, streams: list[Stream], wall: float) -> dict:
    chats = [s for s in streams if s.kind == "chat"]
    longs = [s for s in streams if s.kind == "long"]
    itl = [g for s in chats for g in s.gaps]
    tokens = sum(s.tokens for s in streams)
    return {
        "label": label,
        "chat_itl_p50_s": percentile(itl, 0.5), "chat_itl_p90_s": percentile(itl, 0.9),
        "chat_itl_p99_s": percentile(itl, 0.99),
        "chat_ttft_p50_s": percentile([s.ttft_s for s in chats], 0.5),
        "chat_ttft_p90_s": percentile([s.ttft_s for s in chats], 0.9),
        "long_ttft_p50_s": percentile([s.ttft_s for s in longs], 0.5),
        "long_ttft_p90_s": percentile([s.ttft_s for s in longs], 0.9),
        "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
        "requests": len(streams),
    }


def run_one(label: str, disaggregated: bool, ns: argparse.Namespace) -> dict:
    extra = ["--max-num-seqs", str(ns.max_num_seqs), "--kv-cache-memory", ns.kv_cache_memory]
    if ns.model == "demo" or (ns.model and ns.model.endswith("demo_model")):
        extra += ["--served-model-name", "demo"]
    server = Server(ns.model, ns.threads, disaggregated, extra)
    try:
        server.wait_ready(ns.startup_timeout)
        streams, wall = asyncio.run(run_workload(server.url, ns))
        reps = server.router_replicas()
        urls = [r["url"] for r in reps["replicas"] + reps.get("prefill_replicas", [])]
        transfer = {}
        for u in urls:
            for k, v in scrape(u).items():
                if k.startswith(("kvserve_kv_transfer_bytes_total",
                                 "kvserve_kv_transfer_rejected_total",
                                 "kvserve_kv_transfer_fallbacks_total",
                                 "kvserve_kv_transfer_blocks_installed_total")):
                    transfer[k] = transfer.get(k, 0.0) + v
    finally:
        server.stop()
    result = {**summarize(label, streams, wall), "disaggregated": disaggregated,
              "transfer": transfer}
    print(json.dumps(result), flush=True)
    return result


def plot(results: list[dict], path: str) -> None:
    def draw(labels: list[str], axes) -> None:
        ax = axes[0]
        for i, q in enumerate(("p50", "p90", "p99")):
            ax.bar([j + 0.27 * i for j in range(len(labels))],
                   [r[f"chat_itl_{q}_s"] * 1000 for r in results], width=0.27, label=q)
        ax.set_xticks([j + 0.27 for j in range(len(labels))], labels)
        ax.set_title("chat inter-token latency (ms)")
        ax.legend()
        ax = axes[1]
        for i, kind in enumerate(("chat", "long")):
            ax.bar([j + 0.4 * i for j in range(len(labels))],
                   [r[f"{kind}_ttft_p50_s"] for r in results], width=0.4, label=f"{kind} p50")
            ax.scatter([j + 0.4 * i for j in range(len(labels))],
                       [r[f"{kind}_ttft_p90_s"] for r in results], color="k", zorder=3,
                       label="p90" if i else None)
        ax.set_xticks([j + 0.2 for j in range(len(labels))], labels)
        ax.set_title("TTFT (s)")
        ax.legend()
        axes[2].bar(labels, [r["output_tokens_per_s"] for r in results])
        axes[2].set_title("output tokens/s")

    served.save_panels(results, path, draw)


def main(argv: list[str] | None = None) -> int:
    p = served.parser(__doc__)
    p.add_argument("--chats", type=int, default=4, help="concurrent chat requests")
    p.add_argument("--chat-tokens", type=int, default=256, help="output tokens per chat")
    p.add_argument("--longs", type=int, default=6, help="long-prompt requests")
    p.add_argument("--long-tokens", type=int, default=2000, help="long prompt length (about)")
    p.add_argument("--long-output", type=int, default=4, help="output tokens per long request")
    p.add_argument("--long-start", type=float, default=2.0, help="seconds before the first")
    p.add_argument("--long-interval", type=float, default=4.0, help="seconds between longs")
    served.add_replica_options(p, kv_cache_memory="256MiB")
    p.add_argument("--runs", default="colocated,disaggregated", help="which runs, in order")
    served.add_output_options(p)
    ns = p.parse_args(argv)
    from kvserve.bench.common import resolve_model_path

    ns.model = resolve_model_path(ns.model)  # None: the default model (SmolLM2 GGUF)
    runs = {"colocated": ("2 colocated", False), "disaggregated": ("1 prefill + 1 decode", True)}
    results = [run_one(*runs[r], ns) for r in ns.runs.split(",") if r]
    served.write_results("pd_disagg", ns, results, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
