"""Multi-LoRA serving throughput: 4 adapters mixed over 16 concurrent requests vs the same load
on the base model alone (goal: >= 0.8x), with ``kvserve bench serve --lora-mix``.

    python benchmarks/lora_mix_serve.py [--model GGUF_OR_FOLDER] [--adapters 4] [--rank 16]
        [--concurrency 16] [--requests 64] [--max-tokens 64] [--threads 2]
        [--lora-dtype auto|float32|bfloat16] [--out docs/bench/lora_mix_smollm2.json]

Three runs, each on a fresh ``kvserve serve`` (default model: SmolLM2-135M-Instruct, the Q4_1
GGUF kept packed): ``base``: a server without LoRA (decode graphs on), every request on the
base model; ``base_lora_on``: a server with ``--lora-modules`` of ``--adapters`` random rank
``--rank`` adapters (every attention and MLP projection, weights in ``--lora-dtype``), every
request on the base model (what turning LoRA on costs by itself: a LoRA kernel call per linear
that only counts its rows); ``mixed``: the same server, request i on adapter
i mod N (``--lora-mix all``), so every step mixes the adapters. Reported: output tokens/s of
each (client side, streamed, ``ignore_eos``: fixed lengths), ``mixed / base`` (the goal's ratio)
and ``mixed / base_lora_on``, with the machine (``env.cpu``). The adapters are written as PEFT
folders (adapter_config.json + adapter_model.safetensors, N(0, 0.02^2) weights) from the
model's shapes, no peft needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from kvserve.bench import served
from kvserve.bench.common import env_info, log
from kvserve.bench.serve_bench import format_report, run_serve_bench
from kvserve.bench.served import ServeProcess

KEY = "sk-lora-bench"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: str, config, rank: int, seed: int, std: float = 0.02) -> str:
    """A random PEFT LoRA folder for a model of HF ``config`` (every projection of every
    layer)."""
    from safetensors.torch import save_file

    from kvserve.model.lora import module_shapes

    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for mod, part in MODULES.items():
            fan_in, fan_out = shapes[mod]
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(MODULES), "bias": "none"}, f)
    return out


def _config(model: str | None):
    from kvserve.model.default_model import resolve_model
    from kvserve.model.sources import load_hf_config, model_source

    folder, _ = model_source(resolve_model(model))
    return load_hf_config(folder)[0]


def _run(label: str, model: str | None, args: list[str], a, lora_mix: str | None) -> dict:
    srv = ServeProcess(model, ["--max-num-seqs", str(a.concurrency), "--kv-cache-memory",
                               a.kv_cache_memory, *args], key=KEY, log_prefix="lora-bench-",
                       env={"OMP_NUM_THREADS": str(a.threads)})
    try:
        srv.wait_until(lambda: served.httpx.get(f"{srv.url}/health", timeout=2).status_code
                       == 200, a.startup_timeout)
        kw = dict(concurrency=a.concurrency, max_tokens=a.max_tokens, api_key=KEY,
                  temperature=0.0, input_words=a.input_words)
        run_serve_bench(srv.url, requests=a.concurrency, lora_mix=lora_mix, **kw)  # warm-up
        report = run_serve_bench(srv.url, requests=a.requests, lora_mix=lora_mix, **kw)
    finally:
        srv.stop()
    log(f"[{label}]\n{format_report(report)}")
    return {"label": label, **report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="served model (default: SmolLM2 GGUF)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="server threads")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--lora-dtype", default="auto",
                   help="the adapters' weights: auto (bf16 on CPU), float32 or bfloat16")
    p.add_argument("--out", default=None, help="JSON results file")
    a = p.parse_args(argv)
    config = _config(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        mods = [f"a{i}={write_adapter(os.path.join(tmp, f'a{i}'), config, a.rank, i)}"
                for i in range(a.adapters)]
        lora = ["--lora-modules", *mods, "--max-loras", str(a.adapters), "--max-lora-rank",
                str(a.rank), "--lora-dtype", a.lora_dtype]
        runs = [_run("base", a.model, [], a, None),
                _run("base_lora_on", a.model, lora, a, None),
                _run("mixed", a.model, lora, a, "all")]
    tput = {r["label"]: r["output_throughput_tok_s"] for r in runs}
    ratio = tput["mixed"] / tput["base"] if tput["base"] else float("nan")
    doc = {"benchmark": "lora_mix_serve", "env": env_info(), "config": vars(a),
           "throughput_tok_s": tput, "mixed_over_base": ratio,
           "mixed_over_base_lora_on": (tput["mixed"] / tput["base_lora_on"]
                                       if tput["base_lora_on"] else float("nan")),
           "goal": ">= 0.8", "results": runs}
    log(f"mixed / base = {ratio:.3f} (goal >= 0.8); mixed / base with LoRA on = "
        f"{doc['mixed_over_base_lora_on']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    failed = sum(r["failed"] for r in runs)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
