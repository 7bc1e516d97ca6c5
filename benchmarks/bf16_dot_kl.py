"""Accuracy cost of the 16-bit GEMM's bf16 dot products (AMX tiles or AVX512-BF16 vdpbf16ps,
for GEMMs of >= ``--cpu-bf16-dot-rows`` rows; the default on such CPUs is 1, every row)
against fp32 activations on the same bf16 weights:
KL(fp32 || bf16-dot) of next-token distributions and top-1 agreement, one run, JSON out.

    .venv/bin/python benchmarks/bf16_dot_kl.py [--model BF16_FOLDER] [--prompts 8] [--len 256]
        [--rows 1] [--threads 2] [--json docs/bench/bf16_dot_kl.json]

Method: the engine samples ``--prompts`` sequences of ``--len`` tokens at temperature 1
(seeded; fp32 activations) from its chat template's empty prompt, then teacher-forces every
sequence twice through the paged KV cache (``LLMEngine.prompt_logits``): once with fp32
activations everywhere, once with the bf16 dot products for every GEMM of >= ``--rows`` rows
(with ``--len`` >= ``--rows`` that is every dense GEMM of the prompt, KV written from it
included). Reported per position: KL mean / p99 / max (nats) and the top-1 agreement.

Without ``--model``: the default model's Q4_1 GGUF exported to a bf16 HF folder in a temp
directory (its weights dequantized and rounded to bf16 once: a bf16 checkpoint of SmolLM2's
weights). Where this CPU lacks AVX512-BF16 the kernel's pure-torch twin
(kvserve.kernels.reference.w16_linear_bf16_dot: the same bf16-rounded activations and exact
products, fp32 sums in another order) stands in for the kernel; ``"ran"`` in the JSON says
which ("kernel": a second engine built with ``--cpu-bf16-dot-rows ROWS`` ran the C kernel on
the packed tables it holds, AMX tiles or vdpbf16ps). The fp32 run is an engine built with
``--cpu-bf16-dot-rows 0``, the C kernel with fp32 dot products, either way. A bf16-dot run
equal to the fp32 one is an error (the switch reached nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from kvserve.bench.common import env_info, log, write_json
from kvserve.bench.quality import kl_rows
from kvserve.cbuild import kernel_build
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import w16_gemm as w16
from kvserve.quant.w16 import tiles_of, unpack
from kvserve.sampling_params import SamplingParams

_REAL = (w16.linear_w16, w16.bf16_dot_rows)  # restored when main() returns


def _policy(rows: int, kernel: bool):
    """Where the CPU has bf16 dot products, the C kernel as the engine runs it: each engine's
    worker sets its own ``--cpu-bf16-dot-rows`` for every step it runs. Elsewhere: the twin for
    the bf16-weight GEMMs of >= rows rows (0: none) of the fp32 engine."""
    real = _REAL[0]
    if kernel:
        w16.linear_w16 = real
        return

    def emulated(x, weight, bias=None):
        m = x.reshape(-1, x.shape[-1]).shape[0]
        if rows and m >= rows and weight.dtype == torch.bfloat16:
            tiles = tiles_of(weight)  # the engine holds its tables packed (kvserve.quant.w16)
            y = ref.w16_linear_bf16_dot(x, weight if tiles is None else unpack(weight, tiles))
            return y if bias is None else y + bias.float()
        return real(x, weight, bias)

    w16.linear_w16 = emulated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a bf16 HF folder (default: SmolLM2 "
                    "exported from the default GGUF)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=w16.BF16_DOT_SUGGESTED_ROWS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    lib = w16.w16_library()
    if lib is None:
        raise SystemExit("the C kernel did not build here (no compiler?)")
    kernel = w16.has_bf16_dot(lib)
    engine_rows = w16._engine_rows
    try:
        return _measure(a, kernel)
    finally:
        w16.linear_w16, w16.bf16_dot_rows = _REAL
        w16.set_bf16_dot_rows(engine_rows)


def _measure(a: argparse.Namespace, kernel: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="kvserve-bf16kl-") as tmp:
        model = a.model
        if model is None:
            from kvserve.model.default_model import default_model_path
            from kvserve.model.loader import export_gguf_to_hf

            log("exporting the default GGUF to a bf16 folder")
            model = export_gguf_to_hf(default_model_path(), tmp, torch.bfloat16, progress=False)
        shape = dict(model=model, progress=False, seed=a.seed, max_model_len=a.len + 8,
                     max_num_batched_tokens=max(a.len, 256))
        engine = LLMEngine(EngineArgs(cpu_bf16_dot_rows=0, **shape))
        # the kernel's bf16 dots: an engine of their own (each engine's worker sets its
        # --cpu-bf16-dot-rows for its steps); the twin: the fp32 engine with linear_w16 swapped
        dots = engine if not kernel else LLMEngine(EngineArgs(
            cpu_bf16_dot_rows=a.rows, kv_cache_memory="256MiB", **shape))
        if engine.model_config.dtype != torch.float32:
            raise SystemExit(f"{model}: dtype=auto computes in {engine.model_config.dtype}; "
                             "this measures a bf16 checkpoint computed in fp32")
        _policy(0, kernel)
        start = engine.tokenizer.apply_chat_template([{"role": "user", "content": ""}],
                                                     add_generation_prompt=True)
        if not isinstance(start, list):  # a BatchEncoding in some transformers versions
            start = list(start["input_ids"])
        log(f"sampling {a.prompts} x {a.len} tokens")
        for i in range(a.prompts):
            engine.add_request(f"s{i}", list(start), SamplingParams(
                temperature=1.0, max_tokens=a.len - len(start), ignore_eos=True,
                seed=a.seed + i))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(start) + list(o.outputs[0].token_ids)
        seqs = [done[f"s{i}"] for i in range(a.prompts)]
        kls, top1, n = [], 0, 0
        for i, ids in enumerate(seqs):
            _policy(0, kernel)
            base = engine.prompt_logits(ids)
            _policy(a.rows, kernel)
            cand = dots.prompt_logits(ids)
            kls.append(kl_rows(base, cand))
            top1 += int((base.argmax(-1) == cand.argmax(-1)).sum())
            n += base.shape[0]
            log(f"sequence {i}: KL mean {kls[-1].mean():.2e}")
        kl = torch.cat(kls)
        if not float(kl.max()) > 0:
            raise SystemExit("the bf16-dot run equals the fp32 run: the switch did not reach "
                             "the GEMMs")
        result = {"bench": "bf16_dot_kl", "model": a.model or "SmolLM2-135M (default GGUF as "
                  "bf16)", "ran": "kernel" if kernel else "twin (this CPU lacks AVX512-BF16)",
                  "kernel_build": kernel_build(), "switch": f"--cpu-bf16-dot-rows {a.rows}",
                  "rows": a.rows, "prompts": a.prompts, "len": a.len, "positions": n,
                  "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)),
                  "kl_max": float(kl.max()), "top1_agreement": top1 / n,
                  "threads": a.threads, "env": env_info()}
        log(f"KL(fp32 || bf16-dot) mean {result['kl_mean']:.2e}, p99 {result['kl_p99']:.2e}, "
            f"max {result['kl_max']:.2e}; top-1 agreement {result['top1_agreement']:.4f} "
            f"({result['ran']})")
        write_json(a.json, result)
        del engine, dots
    return 0


if __name__ == "__main__":
    sys.exit(main())
