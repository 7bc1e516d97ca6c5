"""The Grafana dashboard (deploy/grafana/kvserve.json) drawn from a short real run, without a
Prometheus or a Grafana: one scrape, one picture.

``kvserve serve MODEL -dp 2 --prefill-replicas 1`` (a prefill and a decode replica behind the
router, the KV through a shared directory) with a host-memory KV tier under a small pool, so
every panel has something to show: queue, KV use per tier, prefix hits, TTFT / ITL, transfer,
integrity. ``--concurrency`` clients stream completions whose prompts are one of
``--documents`` long documents plus a question (repeats hit the prefix cache, evictions go to
the tier and come back), for ``--duration`` seconds. Every replica's ``/metrics`` is scraped
each ``--interval`` seconds (labelled ``instance`` = its role), and each panel's PromQL is
evaluated over the scrapes by kvserve/bench/promql.py and drawn with matplotlib, one subplot
per panel, as Grafana would draw it. JSON with the machine (``env.cpu``), the run and each
series' last and peak values.

    python benchmarks/dashboard.py --model demo --duration 40 \\
        --out docs/bench/dashboard.json --plot docs/bench/dashboard.png
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import httpx

from kvserve.bench import served
from kvserve.bench.promql import Evaluator, scrape_samples
from kvserve.bench.served import ServeProcess

KEY = "sk-dashboard-bench"
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvserve.json"
WORDS = ["river", "stone", "light", "paper", "engine", "garden", "window", "market", "signal",
         "forest", "letter", "copper", "harbor", "thread", "winter", "orbit", "canvas"]


def document(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}"
                                        for _ in range(words))


class Fleet(ServeProcess):
    def __init__(self, model: str | None, ns) -> None:
        args = ["--data-parallel-size", "2", "--prefill-replicas", "1",
                "--replica-threads", str(ns.threads), "--max-num-seqs", str(ns.max_num_seqs),
                "--kv-cache-memory", ns.kv_cache_memory,
                "--kv-offload-memory", str(ns.kv_offload_gib), "--health-interval", "0.5"]
        super().__init__(model, args, key=KEY, log_prefix="kvserve-dashboard-bench-")

    def replicas(self) -> dict[str, str]:
        """role -> URL of each replica."""
        j = self.router_replicas()
        out = {f"prefill{i}": r["url"] for i, r in enumerate(j.get("prefill_replicas", []))}
        out.update({f"decode{i}": r["url"] for i, r in enumerate(j["replicas"])})
        return out

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            j = self.router_replicas()
            reps = j["replicas"] + j.get("prefill_replicas", [])
            return len(reps) == 2 and all(r["healthy"] for r in reps)

        self.wait_until(ready, timeout)


async def _client(c: httpx.AsyncClient, url: str, seed: int, ns, stop: float,
                  stats: dict[str, int]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop:
        d = rng.randrange(ns.documents)
        body = {"prompt": document(d, ns.document_words) + f"\nQuestion {rng.randrange(50)}: "
                "what is it about?\nAnswer:", "max_tokens": ns.max_tokens, "stream": True,
                "temperature": 0.8, "ignore_eos": True}
        try:
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    stats["errors"] += 1
                    await r.aread()
                    continue
                async for _ in served.sse_chunks(r):
                    pass
            stats["requests"] += 1
        except (httpx.HTTPError, RuntimeError):
            stats["errors"] += 1


async def _scraper(urls: dict[str, str], interval: float, stop: float,
                   scrapes: list) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            t = time.time()
            samples = {}
            for role, u in urls.items():
                samples.update(scrape_samples((await c.get(f"{u}/metrics")).text,
                                              {"instance": role}))
            scrapes.append((t, samples))
            if time.monotonic() >= stop:
                return
            await asyncio.sleep(max(0.0, interval - (time.time() - t)))


async def run_load(server: Fleet, ns) -> tuple[list, dict[str, int]]:
    urls = server.replicas()
    scrapes: list = []
    stats = {"requests": 0, "errors": 0}
    start = time.monotonic()
    stop = start + ns.duration
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=300, headers=headers) as c:
        scraper = asyncio.create_task(_scraper(urls, ns.interval, stop + 2 * ns.interval,
                                               scrapes))
        await asyncio.sleep(ns.interval)  # a baseline scrape before the load
        await asyncio.gather(*(_client(c, server.url, i, ns, stop, stats)
                               for i in range(ns.concurrency)))
        await scraper
    return scrapes, stats


def legend(fmt: str, labels: frozenset) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip()


# Grafana unit -> (scale, axis label)
UNITS = {"s": (1000.0, "ms"), "percentunit": (100.0, "%"), "Bps": (1 / 1024, "KiB/s"),
         "short": (1.0, "")}


def evaluate(scrapes: list, window_s: float) -> list[dict]:
    """Each panel of the dashboard: its title, unit and series [(legend, [(t, v)])]."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {"model_name": ".*", "__rate_interval": f"{int(window_s)}s"}
    ev = Evaluator(scrapes)
    panels = []
    for p in dash["panels"]:
        series = []
        for t in p["targets"]:
            for labels, pts in sorted(ev.series(t["expr"], variables).items(),
                                      key=lambda kv: sorted(kv[0])):
                series.append((legend(t.get("legendFormat", ""), labels), pts))
        panels.append({"title": p["title"], "unit": p["fieldConfig"]["defaults"]["unit"],
                       "series": series})
    return panels


def plot(panels: list[dict], path: str, t0: float, subtitle: str) -> None:
    from kvserve.bench.common import pyplot

    plt = pyplot()
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.1 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels, strict=False):
        scale, unit = UNITS.get(p["unit"], (1.0, p["unit"]))
        for name, pts in p["series"]:
            ax.plot([t - t0 for t, _ in pts], [v * scale for _, v in pts], label=name or None,
                    linewidth=1.4)
        ax.set_title(p["title"], fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if p["series"]:
            ax.legend(fontsize=6.5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle(f"deploy/grafana/kvserve.json, rendered from /metrics scrapes: {subtitle}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = served.parser(__doc__)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--window", type=float, default=6.0,
                   help="seconds for rate() and the histograms ($__rate_interval)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    p.add_argument("--documents", type=int, default=24, help="distinct prompt documents")
    p.add_argument("--document-words", type=int, default=120, help="words per document")
    p.add_argument("--max-tokens", type=int, default=24, help="output tokens per request")
    p.add_argument("--kv-offload-gib", type=float, default=0.25, help="host-memory KV tier")
    served.add_replica_options(p, kv_cache_memory="4MiB")
    served.add_output_options(p)
    ns = p.parse_args(argv)
    from kvserve.bench.common import env_info, log, resolve_model_path

    ns.model = resolve_model_path(ns.model)
    server = Fleet(ns.model, ns)
    try:
        server.wait_ready(ns.startup_timeout)
        t0 = time.time()
        scrapes, stats = asyncio.run(run_load(server, ns))
    finally:
        server.stop()
    log(f"{stats['requests']} requests, {stats['errors']} errors, {len(scrapes)} scrapes")
    panels = evaluate(scrapes, ns.window)
    subtitle = (f"{Path(ns.model).name}, 1 prefill + 1 decode replica, {ns.concurrency} "
                f"clients, {ns.duration:g} s, {stats['requests']} requests")
    if ns.plot:
        plot(panels, ns.plot, t0, subtitle)
    if ns.out:
        summary = [{"title": p["title"], "unit": p["unit"], "series": [
            {"legend": name, "last": pts[-1][1], "peak": max(v for _, v in pts),
             "points": len(pts)} for name, pts in p["series"] if pts]} for p in panels]
        doc = {"benchmark": "dashboard", "env": env_info(), "config": vars(ns),
               "requests": stats["requests"], "errors": stats["errors"],
               "scrapes": len(scrapes), "panels": summary}
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if stats["requests"] and not stats["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
