"""KV tiers below the pool (docs/kv-tiers.md): multi-turn chat with the pool holding about a
quarter of the working set, with the tiers off, the host-memory tier, the disk tier, and the
disk tier after a restart; and a workload with no reuse (the tiers' overhead).

    .venv/bin/python benchmarks/kv_tiers.py --model MODEL [--conversations 32 --turns 6
        --doc 1500 --question 24 --answer 32 --concurrency 4 --pool-share 0.25]
        [--kv-cache-dtype int8] [--threads N] [--json OUT] [--plot OUT.png]

Chat workload: each conversation opens with its own ``--doc``-token document; turn t's prompt
is the document, every earlier question and answer (the model's own greedy answer), and a new
``--question``-token question. Turns go round robin over the conversations (so between two
turns of one conversation every other one runs and the pool evicts it), ``--concurrency``
requests in flight, each arriving when a slot frees. TTFT = arrival to first token. The pool
is sized to ``--pool-share`` of the working set (all conversations' final contexts); the
tiers to hold all of it. Every configuration must produce the same tokens (checked).

No-reuse workload: ``--noreuse-requests`` prompts of ``--doc`` random tokens, none sharing a
block, ``--answer`` tokens each; throughput (prompt + generated tokens / s) with the tiers off
and on (memory + disk), the pool as small as above (every block is evicted and written down).

Reported (JSON, with env.cpu): per configuration TTFT p50 / p90, throughput, prefix-hit and
restored tokens, the tiers' counters; a PNG with TTFT and throughput per configuration.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from kvserve.bench.common import (
    env_info,
    log,
    model_label,
    percentile,
    pyplot,
    random_prompts,
    resolve_model_path,
    set_threads,
    write_json,
)
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--doc", type=int, default=1500, help="document tokens per conversation")
    p.add_argument("--question", type=int, default=24, help="new tokens per turn")
    p.add_argument("--answer", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--pool-share", type=float, default=0.25,
                   help="KV pool size as a share of the working set")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--noreuse-requests", type=int, default=32)
    p.add_argument("--noreuse-rounds", type=int, default=1,
                   help="no-reuse runs per configuration, alternating off / both; the figures "
                   "are the median round's")
    p.add_argument("--configs", default="off,memory,disk,disk_restart,redis",
                   help="chat configurations to run (comma separated): off, memory, disk, "
                   "disk_restart, redis (the remote store alone)")
    p.add_argument("--redis-url", default=None,
                   help="Redis / Valkey for the redis configuration (default: start a private "
                   "redis-server on a free loopback port, no persistence, stopped at the end)")
    p.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    return p


def _engine(args, num_blocks: int, tier_gib: float, config: str, directory: str) -> LLMEngine:
    kw: dict[str, Any] = {}
    if config in ("memory", "both"):
        kw["kv_offload_memory"] = tier_gib
    if config in ("disk", "disk_restart", "both"):
        kw.update(kv_offload_dir=directory, kv_offload_disk=tier_gib)
    if config == "redis":
        kw["kv_offload_url"] = args.redis_url
    return LLMEngine(EngineArgs(
        model=args.model, kv_cache_dtype=args.kv_cache_dtype, num_blocks=num_blocks,
        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(args.concurrency, 1), progress=False, seed=args.seed, **kw))


def _start_redis() -> tuple[subprocess.Popen, str]:
    """A private redis-server (or valkey-server) on a free loopback port and its URL."""
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        raise ValueError("--configs redis needs --redis-url or redis-server on PATH "
                         "(apt install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"{exe} did not start on port {port}")


def _drive(eng: LLMEngine, todo: list, concurrency: int, on_done) -> dict[str, Any]:
    """Run ``todo`` [(request id, prompt ids, params)] with at most ``concurrency`` in flight;
    ``on_done(rid, output)`` may append more work. Returns TTFTs and token counts."""
    queue = list(todo)
    inflight: dict[str, float] = {}
    ttft: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            rid, prompt, params = queue.pop(0)
            now = time.monotonic()
            eng.add_request(rid, {"prompt_token_ids": prompt}, params, arrival_time=now)
            inflight[rid] = now
            tokens += len(prompt)
        for out in eng.step():
            if not out.finished:
                continue
            m = out.metrics
            if m is not None and m.first_token_time is not None:
                ttft.append(m.first_token_time - m.arrival_time)
            tokens += len(out.outputs[0].token_ids)
            inflight.pop(out.request_id, None)
            queue.extend(on_done(out.request_id, out) or [])
    return {"seconds": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens}


def run_chat(args, eng: LLMEngine, docs: list[list[int]], questions: list[list[list[int]]]):
    """All turns, round robin over conversations; returns the measurements and a digest of
    every generated token (equal across configurations)."""
    params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    history = [list(d) for d in docs]
    digest = hashlib.blake2b(digest_size=16)
    results: dict[int, dict] = {}
    for turn in range(args.turns):
        todo = [(f"c{c}t{turn}", history[c] + questions[c][turn], params)
                for c in range(len(docs))]

        def done(rid: str, out, turn=turn) -> None:
            c = int(rid[1:].split("t")[0])
            history[c] = history[c] + questions[c][turn] + out.outputs[0].token_ids

        r = _drive(eng, todo, args.concurrency, done)
        results[turn] = r
        for h in history:
            digest.update(repr(h).encode())
    ttft = [x for r in results.values() for x in r["ttft"]]
    seconds = sum(r["seconds"] for r in results.values())
    tokens = sum(r["tokens"] for r in results.values())
    return {
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
        "ttft_first_turn_p50_ms": 1e3 * percentile(results[0]["ttft"], 50),
        "ttft_later_turns_p50_ms": (1e3 * percentile(
            [x for t, r in results.items() if t > 0 for x in r["ttft"]], 50)
            if args.turns > 1 else None),
        "seconds": seconds, "tokens": tokens, "throughput_tok_s": tokens / seconds,
        "requests": len(ttft),
    }, digest.hexdigest()


def _engine_figures(eng: LLMEngine) -> dict[str, Any]:
    st = eng.stats()
    return {"prefix_hit_rate": st.prefix_cache_hit_rate,
            "restored_tokens": eng.kv_manager.num_restored_tokens,
            "preemptions": st.num_preemptions, "kv_tiers": st.kv_tiers}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    set_threads(args.threads)
    args.model = resolve_model_path(args.model)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in ("off", "memory", "disk", "disk_restart", "redis"):
            raise ValueError(f"--configs: unknown configuration {c!r}")
    if "disk_restart" in configs and "disk" not in configs[: configs.index("disk_restart")]:
        raise ValueError("--configs: disk_restart restarts on what the disk run left: list "
                         "disk before it")
    probe = _engine(args, 64, 0.0, "off", "")
    vocab = probe.model_config.vocab_size
    bytes_per_token = probe.kv_cache.bytes_per_token
    probe.shutdown()
    del probe
    n, bs = args.conversations, args.block_size
    docs = random_prompts(n, args.doc, vocab, args.seed)
    qs = [random_prompts(args.turns, args.question, vocab, args.seed + 1 + c) for c in range(n)]
    final_ctx = args.doc + args.turns * (args.question + args.answer)
    working_set_blocks = n * -(-final_ctx // bs)
    num_blocks = max(int(working_set_blocks * args.pool_share), -(-final_ctx // bs) + 2)
    tier_gib = 1.5 * working_set_blocks * bs * bytes_per_token / 2**30
    ws_mib = working_set_blocks * bs * bytes_per_token / 2**20
    log(f"working set {working_set_blocks} blocks ({ws_mib:.0f} MiB); pool {num_blocks} "
        f"blocks; tiers {tier_gib:.2f} GiB each")
    own_dir = args.dir is None
    directory = args.dir or tempfile.mkdtemp(prefix="kvserve-tiers-")
    if not own_dir and os.listdir(directory):
        raise ValueError(f"--dir {directory} must be empty (the restart run reuses it)")
    out: dict[str, Any] = {
        "benchmark": "kv_tiers", "env": env_info(), "model": model_label(args.model),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "dir")},
        "working_set_blocks": working_set_blocks, "pool_blocks": num_blocks,
        "tier_gib": tier_gib, "bytes_per_token": bytes_per_token, "chat": {}, "noreuse": {},
    }
    digests = {}
    redis_proc = None
    try:
        if "redis" in configs and args.redis_url is None:
            redis_proc, args.redis_url = _start_redis()
        for config in configs:
            if config == "redis":
                import redis

                redis.Redis.from_url(args.redis_url).flushdb()  # the redis run starts empty
            if config == "disk":
                shutil.rmtree(directory, ignore_errors=True)  # the disk run starts empty
            eng = _engine(args, num_blocks, tier_gib, config, directory)
            log(f"chat: {config} ...")
            r, digests[config] = run_chat(args, eng, docs, qs)
            r.update(_engine_figures(eng))
            eng.shutdown()  # the disk run leaves its blocks for disk_restart
            out["chat"][config] = r
            log(f"  TTFT p50 {r['ttft_p50_ms']:.1f} ms p90 {r['ttft_p90_ms']:.1f} ms, "
                f"{r['throughput_tok_s']:.0f} tok/s, restored {r['restored_tokens']} tokens")
        out["outputs_identical"] = len(set(digests.values())) <= 1
        params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
        prompts = random_prompts(args.noreuse_requests, args.doc, vocab, args.seed + 10**6)
        rounds: dict[str, list[dict]] = {"off": [], "both": []}
        for i in range(max(1, args.noreuse_rounds)):
            for config in ("off", "both") if i % 2 == 0 else ("both", "off"):
                shutil.rmtree(directory, ignore_errors=True)
                eng = _engine(args, num_blocks, tier_gib, config, directory)
                log(f"no reuse: tiers {config} (round {i + 1}) ...")
                todo = [(f"n{i}", p, params) for i, p in enumerate(prompts)]
                r = _drive(eng, todo, args.concurrency, lambda rid, o: None)
                res = {"seconds": r["seconds"], "tokens": r["tokens"],
                       "throughput_tok_s": r["tokens"] / r["seconds"]}
                res.update(_engine_figures(eng))
                eng.shutdown()
                rounds[config].append(res)
        for config, runs in rounds.items():  # the median round (by throughput)
            runs = sorted(runs, key=lambda x: x["throughput_tok_s"])
            out["noreuse"]["tiers_" + config] = {
                **runs[(len(runs) - 1) // 2],
                "rounds_tok_s": [x["throughput_tok_s"] for x in rounds[config]]}
        off, on = (out["noreuse"][k]["throughput_tok_s"] for k in ("tiers_off", "tiers_both"))
        out["noreuse"]["throughput_ratio"] = on / off
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
    write_json(args.json, out)
    if args.plot:
        _plot(out, args.plot)
    return 0


def _plot(out: dict[str, Any], path: str) -> None:
    plt = pyplot()
    chat = out["chat"]
    names = list(chat)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [chat[k]["ttft_p50_ms"] for k in names], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [chat[k]["ttft_p90_ms"] for k in names], 0.4, label="p90")
    a.set_xticks(list(x), names)
    a.set_ylabel("TTFT (ms)")
    a.set_title("multi-turn chat: time to first token")
    a.legend()
    labels = names + ["no reuse: off", "no reuse: tiers"]
    vals = [chat[k]["throughput_tok_s"] for k in names] + [
        out["noreuse"][k]["throughput_tok_s"] for k in ("tiers_off", "tiers_both")]
    b.bar(range(len(labels)), vals)
    b.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    b.set_ylabel("tokens / s (prompt + generated)")
    b.set_title("throughput")
    fig.suptitle(f"KV tiers, {out['model']}, pool = {out['settings']['pool_share']:.0%} of the "
                 f"working set")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
