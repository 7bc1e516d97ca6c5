"""HTTP load generator for ``kvserve serve`` (or any OpenAI-compatible server).

    python -m kvserve.bench.serve_bench --url http://127.0.0.1:8000 --concurrency 16 \\
        --requests 128 --max-tokens 64 --json OUT.json

Every request streams (SSE) from ``/v1/completions`` (or ``/v1/chat/completions`` with
``--chat``) with ``ignore_eos`` so output lengths are fixed, and is timed on the client:
TTFT = send -> first content chunk, ITL = gaps between content chunks, E2E = send -> [DONE].
Output tokens come from the final ``usage`` chunk (``stream_options.include_usage``).
Reports throughput, TTFT / ITL / E2E mean and p50/p90/p99 in ms, and errors by kind.

The client is aiohttp (its HTTP parser is C) on uvloop where installed, reading each response
body as it arrives and splitting the SSE lines itself: a client on the server's host takes
its CPU from the cores the server computes on (docs/server.md "Served vs offline").

``--lora-mix`` spreads the requests over LoRA adapters (request i asks for adapter i mod N as
its ``model``): a comma list of adapter names, or ``all`` for every adapter ``/v1/models``
lists (the entries with a ``parent``); the report counts completed requests per model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config_cli import arg

if TYPE_CHECKING:  # imported where used: `kvserve bench serve --help` stays fast
    import aiohttp

_WORDS = (
    "the", "function", "returns", "a", "new", "list", "of", "objects", "from", "module",
    "class", "method", "value", "string", "file", "data", "is", "called", "with", "each",
    "argument", "and", "raises", "an", "error", "when", "key", "missing", "in", "dictionary",
)


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """``kvserve bench serve``: the HTTP load generator's knobs."""

    url: str = arg("http://127.0.0.1:8000", "the server's base URL")
    concurrency: int = arg(8, "clients streaming at once", type=int)
    requests: int = arg(64, "requests in all", type=int)
    max_tokens: int = arg(64, "tokens per request (sent with ignore_eos, so exact)", type=int)
    prompt: str | None = arg(None, "one prompt for all requests (default: synthetic ones)")
    input_words: int = arg(32, "words per synthetic prompt", type=int)
    chat: bool = arg(False, "use /v1/chat/completions", action="store_true")
    model: str | None = arg(None, "default: the first of /v1/models")
    lora_mix: str | None = arg(
        None, "spread requests over LoRA adapters (request i -> adapter i mod N): NAME,NAME,... "
        "or all (every adapter /v1/models lists)", metavar="NAMES")
    api_key: str | None = arg(None, "sent as 'Authorization: Bearer KEY'")
    temperature: float = arg(1.0, "sampling temperature", type=float)
    seed: int = arg(0, "seed of request i is seed + i", type=int)
    timeout: float = arg(600.0, "seconds a request may take to connect, and a stream to go "
                         "without data", type=float)
    json_out: str | None = arg(None, "write the report here", flags=("--json",))
    traceparent: bool = arg(False, "send each request with a new sampled W3C traceparent "
                            "header (a traced client; the server's --otlp-traces-endpoint)",
                            action="store_true")


@dataclass(slots=True)
class _Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 (linear interpolation), multiplied by ``scale`` (s -> ms)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": scale * sum(xs) / len(xs), "p50": scale * pct(0.5),
            "p90": scale * pct(0.9), "p99": scale * pct(0.99)}


def synthetic_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _content(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else \
            (choice.get("text") or "")
    return text


def new_traceparent(rng: random.Random) -> str:
    """A sampled W3C traceparent with random (never all-zero) trace and span ids."""
    return (f"00-{rng.getrandbits(128) | 1:032x}-{rng.getrandbits(64) | 1:016x}-01")


def _client_errors() -> tuple[type[BaseException], ...]:
    """What one request may raise that the report counts as its error
    (``exception_<name>``)."""
    import aiohttp

    return (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, OSError,
            UnicodeDecodeError)


async def _one(client: aiohttp.ClientSession, url: str, payload: dict,
               headers: dict[str, str] | None = None) -> _Result:
    res = _Result()
    start = time.perf_counter()
    last = None
    try:
        async with client.post(url, json=payload, headers=headers) as r:
            if r.status != 200:
                await r.read()
                res.error = f"http_{r.status}"
                return res
            # SSE: "data: ..." lines; the body is read as it arrives (one read may hold
            # several events, or part of one) and split into lines here
            tail = b""
            async for data in r.content.iter_any():
                lines = (tail + data).split(b"\n") if tail else data.split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    body = line[6:].rstrip(b"\r")
                    if body == b"[DONE]":
                        res.ok = True
                        break
                    chunk = json.loads(body)
                    if "error" in chunk:
                        res.error = f"stream_{chunk['error'].get('code') or 'error'}"
                        return res
                    if chunk.get("usage"):
                        res.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                    if _content(chunk):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
                if res.ok:
                    break
    except _client_errors() as e:
        res.error = f"exception_{type(e).__name__}"
        return res
    if not res.ok:
        res.error = "stream_ended_without_done"
    res.e2e = time.perf_counter() - start
    return res


async def _models(client: aiohttp.ClientSession, base: str) -> list[dict]:
    """``/v1/models``' entries (``aiohttp.ClientResponseError`` on an HTTP error)."""
    async with client.get(base + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"]


async def _model_id(client: aiohttp.ClientSession, base: str) -> str:
    return (await _models(client, base))[0]["id"]


async def lora_models(client: aiohttp.ClientSession, base: str, lora_mix: str) -> list[str]:
    """The adapter names ``lora_mix`` stands for (ValueError: none, or one not served)."""
    served = [m["id"] for m in await _models(client, base) if m.get("parent")]
    names = served if lora_mix == "all" else [n.strip() for n in lora_mix.split(",")
                                              if n.strip()]
    missing = [n for n in names if n not in served]
    if not names or missing:
        raise ValueError(f"lora_mix: the server serves adapters {served}, not "
                         f"{missing or lora_mix!r}")
    return names


async def serve_bench(url: str, concurrency: int, requests: int, *, max_tokens: int = 64,
                      prompt: str | None = None, input_words: int = 32, chat: bool = False,
                      model: str | None = None, api_key: str | None = None,
                      temperature: float = 1.0, seed: int = 0, timeout: float = 600.0,
                      traceparent: bool = False, lora_mix: str | None = None,
                      prompt_token_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Async core of ``run_serve_bench`` (same arguments, returns the report).
    ``prompt_token_ids``: request i sends ``prompt_token_ids[i % len]`` as its prompt (token
    ids, as ``/v1/completions`` accepts them) instead of text."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # as many connections as streams, kept alive; ``timeout`` bounds connecting and each read
    # (a stream that goes quiet that long fails), not a whole stream (as httpx's did)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    rng = random.Random(seed)
    base = url.rstrip("/")  # (httpx's base_url kept a path prefix: so do these URLs)
    async with aiohttp.ClientSession(
            headers=headers, connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout),
            raise_for_status=False) as client:
        model = model or await _model_id(client, base)
        models = [model] if lora_mix is None else await lora_models(client, base, lora_mix)
        payloads = []
        if prompt_token_ids is not None and (chat or not prompt_token_ids):
            raise ValueError("prompt_token_ids: completions only, and at least one prompt")
        for i in range(requests):
            text: str | list[int]
            if prompt_token_ids is not None:
                text = prompt_token_ids[i % len(prompt_token_ids)]
            else:
                text = prompt if prompt is not None else synthetic_prompt(rng, input_words)
            body: dict[str, Any] = {
                "model": models[i % len(models)], "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed + i, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            payloads.append(body)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        sem = asyncio.Semaphore(concurrency)

        trace_rng = random.Random(seed ^ 0x7ace)
        traced = [{"traceparent": new_traceparent(trace_rng)} if traceparent else None
                  for _ in payloads]

        async def bounded(body: dict, hdrs: dict[str, str] | None) -> _Result:
            async with sem:
                return await _one(client, base + path, body, hdrs)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(b, h) for b, h in zip(payloads, traced,
                                                                         strict=True)))
        duration = time.perf_counter() - start
    report = _report(url, path, concurrency, results, duration)
    report["models"] = {m: sum(r.ok for r, b in zip(results, payloads, strict=True)
                               if b["model"] == m) for m in models}
    return report


def _report(url: str, path: str, concurrency: int, results: list[_Result],
            duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "url": url, "endpoint": path, "concurrency": concurrency,
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def _run_loop(coro):
    """``coro`` on uvloop where it is installed (a dependency off Windows): less of the
    client's CPU per chunk, CPU that a client on the server's host takes from its cores."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_serve_bench(url: str, concurrency: int, requests: int, *, max_tokens: int = 64,
                    prompt: str | None = None, input_words: int = 32, chat: bool = False,
                    model: str | None = None, api_key: str | None = None,
                    temperature: float = 1.0, seed: int = 0, timeout: float = 600.0,
                    json_out: str | None = None, traceparent: bool = False,
                    lora_mix: str | None = None,
                    prompt_token_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Run the load and return the report; also write it to ``json_out`` when given."""
    report = _run_loop(serve_bench(
        url, concurrency, requests, max_tokens=max_tokens, prompt=prompt,
        input_words=input_words, chat=chat, model=model, api_key=api_key,
        temperature=temperature, seed=seed, timeout=timeout, traceparent=traceparent,
        lora_mix=lora_mix, prompt_token_ids=prompt_token_ids))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def format_report(r: dict[str, Any]) -> str:
    def row(name: str, d: dict) -> str:
        vals = " ".join(f"{k} {v:8.1f}" if v is not None else f"{k}      n/a"
                        for k, v in d.items())
        return f"{name:<9}{vals}"

    lines = [
        f"{r['endpoint']} @ {r['url']}: {r['completed']}/{r['requests']} ok, "
        f"concurrency {r['concurrency']}, {r['duration_s']:.2f} s",
        f"throughput: {r['output_throughput_tok_s']:.1f} output tok/s, "
        f"{r['request_throughput']:.2f} req/s ({r['total_output_tokens']} tokens)",
        row("TTFT ms", r["ttft_ms"]), row("ITL ms", r["itl_ms"]), row("E2E ms", r["e2e_ms"]),
    ]
    if len(r.get("models", ())) > 1:
        lines.append("per model: " + ", ".join(f"{m} {n}" for m, n in r["models"].items()))
    if r["errors"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from kvserve.cli_help import HelpParser
    from kvserve.config_cli import add_cli_args, from_cli_args

    p = HelpParser(prog="kvserve bench serve", description=__doc__.split("\n\n")[0])
    add_cli_args(p, ServeBenchConfig)
    cfg = from_cli_args(ServeBenchConfig, p.parse_args(argv))
    import aiohttp

    try:
        report = run_serve_bench(**dataclasses.asdict(cfg))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, aiohttp.ClientError) as e:
        print(f"error: cannot reach {cfg.url}: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
