"""Where a LoRA decode step's time goes, against the same step without LoRA (offline engines,
one process; a short run: ~1 minute on 2 cores).

    python benchmarks/lora_step_profile.py [--model GGUF_OR_FOLDER] [--adapters 4] [--rank 16]
        [--batch 16] [--prompt-len 64] [--max-tokens 32] [--repeats 20] [--threads 2]
        [--lora-dtype auto|float32|bfloat16] [--json OUT]

Two engines of the model (default: SmolLM2-135M-Instruct, the Q4_1 GGUF kept packed), both
with recorded CPU decode graphs at ``--batch`` rows: ``base`` without LoRA, ``lora`` with
``--adapters`` random rank ``--rank`` PEFT adapters over every projection (written as in
benchmarks/lora_mix_serve.py), their weights in ``--lora-dtype``. Reported:

    generate_tok_s   ``--batch`` requests of ``--prompt-len`` random tokens, ``--max-tokens``
                     each (ignore_eos), through ``LLM.generate``: base; lora with every
                     request on the base; lora with request i on adapter i mod N (mixed)
    replay_ms        the recorded decode forward replayed at ``--batch`` rows (median of
                     ``--repeats``): base; lora with every row on the base (the LoRA kernel
                     only counts); lora mixed (row i on slot i mod N); and the grouped LoRA
                     GEMM's calls alone (``Tape.only``), mixed
    lora_calls       the LoRA kernel calls a replay makes (4 a layer)

so ``replay_ms.lora_mixed - replay_ms.base`` is what the adapters cost a decode step, and
``replay_ms.lora_gemm_mixed`` how much of it is the kernel itself. A replay reruns the last
step's KV writes on stale buffers: harmless here, the engines are done with their results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_mix_serve import _config, write_adapter  # noqa: E402

from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from kvserve.bench.common import env_info, log  # noqa: E402


def _interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each callable, timed round-robin (a busy host slows them alike)."""
    for fn in fns.values():
        fn()  # warm
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _generate_tok_s(llm: LLM, a, loras) -> float:
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (a.prompt_len,),
                                                  generator=g).tolist()}
               for _ in range(a.batch)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], sp, lora_request=None if loras is None else loras[:2])  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: SmolLM2 GGUF)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lora-dtype", default="auto",
                   help="adapter weights' dtype (auto: bf16 on CPU)")
    p.add_argument("--json", default=None, help="JSON results file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    config = _config(a.model)
    kw = dict(max_num_seqs=a.batch, kv_cache_memory="256MiB", progress=False)
    out: dict = {"generate_tok_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(a.adapters)]
        mods = [f"{n}={write_adapter(os.path.join(tmp, n), config, a.rank, i)}"
                for i, n in enumerate(names)]
        base = LLM(a.model, **kw)
        lora = LLM(a.model, lora_modules=mods, max_loras=a.adapters, max_lora_rank=a.rank,
                   lora_dtype=a.lora_dtype, **kw)
        g = lora.engine.runner.graphs
        assert g is not None and g.refused is None, "the LoRA engine's decode graph was refused"
        mixed = [LoRARequest(names[i % len(names)]) for i in range(a.batch)]
        out["generate_tok_s"]["base"] = _generate_tok_s(base, a, None)
        out["generate_tok_s"]["lora_base_rows"] = _generate_tok_s(lora, a, None)
        out["generate_tok_s"]["lora_mixed"] = _generate_tok_s(lora, a, mixed)
        slots = lora.engine.runner.lora.slots
        mixed_idx = torch.tensor([slots.index(names[i % len(names)]) for i in range(a.batch)])
        base_tape, gemm = base.engine.runner.graphs.tape, g.tape.only({"kvs_lora_gemm"})
        out["lora_calls"] = len(gemm)

        def lora_replay(idx: torch.Tensor | None, tape) -> None:
            if idx is None:
                g.lora_idx.fill_(-1)
            else:
                g.lora_idx[:a.batch].copy_(idx)
            tape.replay(a.batch)

        out["replay_ms"] = _interleaved_ms({
            "base": lambda: base_tape.replay(a.batch),
            "lora_base_rows": lambda: lora_replay(None, g.tape),
            "lora_mixed": lambda: lora_replay(mixed_idx, g.tape),
            "lora_gemm_mixed": lambda: lora_replay(mixed_idx, gemm)}, a.repeats)
    gen, rep = out["generate_tok_s"], out["replay_ms"]
    out["mixed_over_base"] = {"generate": gen["lora_mixed"] / gen["base"],
                              "replay": rep["base"] / rep["lora_mixed"]}
    doc = {"benchmark": "lora_step_profile", "env": env_info(), "config": vars(a), **out}
    log(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
