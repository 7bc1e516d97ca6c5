"""``kvserve quantize``: HF folder or GGUF file -> INT4 (W4A16) compressed-tensors folder, or
a GGUF file -> a dense HF folder (``--weights bf16|fp16|fp32``: every tensor dequantized).

    kvserve quantize --model IN --out OUT --weights int4 --group-size 128 \\
        [--symmetric | --asymmetric] [--calibration TEXTFILE] [--clip-search] [--experts-only]
        [--json OUT.json]
    kvserve quantize --model model.Q4_1.gguf --out OUT --weights bf16

A GGUF input to ``int4`` is dequantized first (to fp32, in a temporary folder) and then
quantized like an HF folder; serving the GGUF directly keeps its Q4_0 / Q4_1 weights as they are.

MoE models (Qwen3-MoE, GLM-4.5, DeepSeek-V3 / Kimi K2): routed experts are quantized per
expert like any linear (``--experts-only``: only them, as Kimi K2 Thinking ships); router gates
stay dense. Round-to-nearest by default; ``--calibration`` runs AWQ on the text first (see
``kvserve.quant.quantizer``). Prints what it did: the quantized linear weights' bytes before and
after, all tensor bytes, and the ``*.safetensors`` size on disk. ``LLM(model=OUT)`` loads the
result directly.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_DENSE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # torch dtype names
_ST_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                     "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def register(subparsers) -> None:
    """Add ``quantize`` to the ``kvserve`` command line."""
    p = subparsers.add_parser("quantize", help="quantize an HF checkpoint's weights to INT4",
                              description=__doc__)
    p.add_argument("--model", required=True, metavar="IN",
                   help="HF model folder or .gguf file")
    p.add_argument("--out", required=True, metavar="OUT", help="output folder (created)")
    p.add_argument("--weights", default="int4", choices=["int4", *_DENSE],
                   help="int4: W4A16 compressed-tensors pack-quantized; bf16/fp16/fp32: a GGUF "
                        "input dequantized to a dense HF folder")
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale (-1: one scale per output channel)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=True,
                     help="zero point 0 (default)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false",
                     help="per-group zero points")
    p.add_argument("--calibration", default=None, metavar="TEXTFILE",
                   help="text file for AWQ activation-aware scaling (default: plain RTN)")
    p.add_argument("--clip-search", action="store_true",
                   help="MSE search of each group's range (slower, lower weight error)")
    p.add_argument("--experts-only", action="store_true",
                   help="quantize the routed MoE experts only; attention, shared experts and "
                        "dense MLPs stay dense (the Kimi K2 Thinking layout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", default=None, metavar="OUT.json", help="also write the summary")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import tempfile

    from kvserve.model.gguf import is_gguf

    if ns.group_size != -1 and ns.group_size < 1:
        raise ValueError(f"--group-size must be -1 or >= 1, got {ns.group_size}")
    gguf_in = is_gguf(ns.model)
    if not gguf_in and not os.path.isdir(ns.model):
        raise ValueError(f"--model {ns.model!r} is neither a directory nor a .gguf file")
    if os.path.exists(ns.out) and os.listdir(ns.out):
        raise ValueError(f"--out {ns.out!r} exists and is not empty")
    if ns.weights in _DENSE:
        if not gguf_in:
            raise ValueError(f"--weights {ns.weights} dequantizes a GGUF file; --model "
                             f"{ns.model!r} is an HF folder (already dense)")
        return _dequantize(ns)
    if gguf_in:
        with tempfile.TemporaryDirectory(prefix="kvserve-gguf-") as tmp:
            from kvserve.model.loader import export_gguf_to_hf

            print(f"dequantizing {ns.model} to fp32 first")
            export_gguf_to_hf(ns.model, tmp, _torch_dtype("fp32"), progress=not ns.no_progress)
            return _quantize(ns, tmp)
    return _quantize(ns, ns.model)


def _dequantize(ns: argparse.Namespace) -> int:
    from kvserve.model.loader import export_gguf_to_hf

    t0 = time.perf_counter()
    export_gguf_to_hf(ns.model, ns.out, _torch_dtype(ns.weights), progress=not ns.no_progress)
    size = safetensors_size(ns.out)
    print(f"dequantized {ns.model} ({_size(os.path.getsize(ns.model))}) to {ns.weights} in "
          f"{time.perf_counter() - t0:.1f}s -> {ns.out} ({_size(size)})")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": ns.model, "out": ns.out, "weights": ns.weights,
                       "gguf_bytes": os.path.getsize(ns.model), "checkpoint_bytes": size}, f,
                      indent=2)
    return 0


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DENSE[name])


def _quantize(ns: argparse.Namespace, model: str) -> int:
    from kvserve.quant.quantizer import quantize_checkpoint

    text = None
    if ns.calibration is not None:
        if not os.path.isfile(ns.calibration):
            raise ValueError(f"--calibration {ns.calibration!r} is not a file")
        with open(ns.calibration, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"--calibration {ns.calibration!r} is empty")
    if ns.experts_only and text is not None:
        raise ValueError("--experts-only and --calibration do not combine: AWQ scales the "
                         "attention and dense MLP layers, which --experts-only keeps dense")
    t0 = time.perf_counter()
    summary = quantize_checkpoint(model, ns.out, ns.group_size, ns.symmetric, text,
                                  progress=not ns.no_progress, clip_search=ns.clip_search,
                                  experts_only=ns.experts_only)
    seconds = time.perf_counter() - t0
    before, after = tensor_bytes(model), tensor_bytes(ns.out)
    q_before = sum(v for k, v in before.items()
                   if k.removesuffix(".weight") in set(summary.quantized))
    prefixes = tuple(m + "." for m in summary.quantized)
    q_after = sum(v for k, v in after.items() if k.startswith(prefixes))
    report = {
        "model": ns.model, "out": ns.out, "weights": ns.weights, "group_size": ns.group_size,
        "symmetric": ns.symmetric, "awq": text is not None, "clip_search": ns.clip_search,
        "experts_only": ns.experts_only,
        "quantized_modules": len(summary.quantized), "ignore": list(summary.ignore),
        "quantized_weight_bytes": {"before": q_before, "after": q_after},
        "tensor_bytes": {"before": sum(before.values()), "after": sum(after.values())},
        "checkpoint_bytes": {"before": safetensors_size(model),
                             "after": safetensors_size(ns.out)},
        "seconds": round(seconds, 2),
    }
    if summary.awq:
        gains = [r.rtn_error / r.error for r in summary.awq.values() if r.error > 0]
        report["awq_mean_error_reduction"] = round(sum(gains) / len(gains), 3) if gains else None
    print(format_report(report))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def format_report(r: dict) -> str:
    def pair(d: dict) -> str:
        ratio = d["before"] / d["after"] if d["after"] else float("inf")
        return f"{_size(d['before'])} -> {_size(d['after'])} ({ratio:.2f}x smaller)"

    group = "channel-wise" if r["group_size"] == -1 else f"group {r['group_size']}"
    kind = "symmetric" if r["symmetric"] else "asymmetric"
    method = "AWQ" if r["awq"] else "RTN" + (" + clip search" if r["clip_search"] else "")
    if r.get("experts_only"):
        method += ", MoE experts only"
    lines = [
        f"quantized {r['quantized_modules']} linear modules to {r['weights']} ({group}, {kind}, "
        f"{method}) in {r['seconds']:.1f}s -> {r['out']}",
        f"  quantized weights: {pair(r['quantized_weight_bytes'])}",
        f"  all tensors:       {pair(r['tensor_bytes'])}",
        f"  checkpoint size:   {pair(r['checkpoint_bytes'])}",
        f"  kept dense:        {', '.join(r['ignore'])} (+ embeddings, norms)",
    ]
    if r.get("awq_mean_error_reduction"):
        lines.append(f"  AWQ: output error {r['awq_mean_error_reduction']:.2f}x lower than RTN "
                     "on the calibration text (mean over layers)")
    return "\n".join(lines)


def tensor_bytes(folder: str) -> dict[str, int]:
    """name -> bytes of every tensor in a folder's safetensors files (headers only)."""
    from safetensors import safe_open

    from kvserve.model.sources import safetensors_files

    out: dict[str, int] = {}
    for fn in safetensors_files(folder):
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = f.get_slice(name)
                n = 1
                for s in sl.get_shape():
                    n *= s
                out[name] = n * _ST_ELEMENT_BYTES.get(sl.get_dtype(), 4)
    return out


def safetensors_size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith(".safetensors"))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
