"""Which 8-bit KV recipe: a simulation inside HF attention (the engine is not involved).

    .venv/bin/python benchmarks/kv8_sim.py --model /tmp/smollm2-hf \\
        --text kvserve/demo_model/heldout.txt [--windows 10] [--window 256] [--json OUT]

The HF model runs in fp32 with K (after RoPE) and V replaced by their quantize-dequantize
round trip, per token and head, before attention: a candidate's next-token distribution is
compared with the same model's with BF16-rounded K/V (the engine's BF16 KV baseline). Recipes:
FP8 E4M3 / INT8 symmetric (the cache's 1-byte 2^(e/8) scale; ``int8_bf16s``: the previous
bf16 scale) / INT8 asymmetric (bf16 scale + bf16 zero point), each plain, with
the randomized Hadamard rotation of q/k/v (``kvserve.quant.rotation``), and with rotation + K
smoothing (SageAttention, Zhang et al. 2024, arXiv:2410.02367: the per-head channel mean of the
sequence's first 16 keys subtracted from every key; softmax-invariant). Reported per recipe:
KL(base || cand) mean and p99, teacher-forced top-1 agreement and the perplexity ratio.
This is what chose symmetric INT8 and decided about K smoothing
(docs/benchmarks.md, "8-bit KV on a real model").
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from kvserve.bench.common import env_info, log, write_json
from kvserve.kernels import reference as ref
from kvserve.quant.rotation import rotation_matrix


def int8_bf16_scales(x: torch.Tensor) -> torch.Tensor:
    """The previous INT8 recipe: x's fp32 values after a round trip with bf16(max(amax, 1e-12)
    / 127) per row instead of the cache's 1-byte log-domain codes."""
    amax = x.detach().abs().amax(dim=-1).float().clamp_min_(1e-12)
    s = (amax / 127.0).to(torch.bfloat16).float()
    return ref.int8_quantize(x, s).float() * s.unsqueeze(-1)


def int8_asymmetric(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> its fake-quantized fp32 values on a 255-level min/max grid per row (bf16
    scale and bf16 zero point ``lo``), ``x' = lo + q * scale``: four times the scale bytes."""
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).to(torch.bfloat16).float()
    hi = xf.amax(dim=-1, keepdim=True)
    scale = ((hi - lo).clamp_min(1e-12) / 255.0).to(torch.bfloat16).float()
    q = torch.round((xf - lo) / scale).clamp_(0, 255)
    return lo + q * scale


def fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] fp32 -> its stored-and-read-back values for ``kind``."""
    if kind == "bf16":
        return x.to(torch.bfloat16).float()
    if kind == "fp8":
        return ref.fp8_dequantize(*ref.fp8_quantize_dynamic(x, torch.float8_e4m3fn))
    if kind == "int8":
        return ref.int8_dequantize(*ref.int8_quantize_dynamic(x))
    if kind == "int8_bf16s":
        return int8_bf16_scales(x)
    if kind == "int8_asym":
        return int8_asymmetric(x)
    raise ValueError(f"unknown kind {kind!r}")


def make_attention(recipe: dict):
    """An HF attention function (q/k/v [B, H, S, D]) applying ``recipe`` to K/V."""

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        q, k, v = query.float(), key.float(), value.float()
        rot = recipe.get("rot")
        if rot is not None:
            r = rot.to(q.device)
            q, k, v = q @ r, k @ r, v @ r
        if recipe.get("smooth"):
            k = k - k[:, :, : recipe.get("smooth_keys", 16)].mean(dim=2, keepdim=True)
        k, v = fake_quant(k, recipe["kind"]), fake_quant(v, recipe["kind"])
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        if rot is not None:
            o = o @ rot.to(q.device).t()
        return o.transpose(1, 2).contiguous().to(query.dtype), None

    return attn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--recipes", default=None,
                    help="comma list of recipe names to run (default: all)")
    ap.add_argument("--smooth-keys", type=int, default=16,
                    help="K smoothing: mean of the sequence's first N keys (default 16)")
    a = ap.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    with open(a.text, encoding="utf-8") as f:
        ids = tok.encode(f.read()[: a.windows * a.window * 8], add_special_tokens=False)
    windows = [ids[i * a.window:(i + 1) * a.window] for i in range(a.windows)]
    windows = [w for w in windows if len(w) == a.window]
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    rot = rotation_matrix(d, a.seed)
    recipes = {"bf16": {"kind": "bf16"}}
    for kind in ("fp8", "int8", "int8_bf16s", "int8_asym"):
        recipes[kind] = {"kind": kind}
        recipes[f"{kind}+rot"] = {"kind": kind, "rot": rot}
        recipes[f"{kind}+rot+smooth16"] = {"kind": kind, "rot": rot, "smooth": True,
                                           "smooth_keys": a.smooth_keys}
    if a.recipes:
        keep = a.recipes.split(",")
        unknown = [r for r in keep if r not in recipes]
        if unknown:
            raise ValueError(f"--recipes: unknown {unknown}; known: {', '.join(recipes)}")
        recipes = {k: v for k, v in recipes.items() if k == "bf16" or k in keep}

    def logprobs(name: str) -> list[torch.Tensor]:
        AttentionInterface.register(f"kv8_{name}", make_attention(recipes[name]))
        model.config._attn_implementation = f"kv8_{name}"
        for m in model.modules():
            if hasattr(m, "config") and m is not model:
                m.config._attn_implementation = f"kv8_{name}"
        out = []
        with torch.inference_mode():
            for w in windows:
                logits = model(torch.tensor([w])).logits[0, :-1].double()
                out.append(torch.log_softmax(logits, -1))
        return out

    base = logprobs("bf16")
    results = {}
    for name in recipes:
        if name == "bf16":
            continue
        cand = logprobs(name)
        kl, top1, nll_b, nll_c, n = [], 0, 0.0, 0.0, 0
        for w, lb, lc in zip(windows, base, cand, strict=True):
            kl.append((lb.exp() * (lb - lc)).sum(-1).clamp_min(0))
            top1 += int((lb.argmax(-1) == lc.argmax(-1)).sum())
            tgt = torch.tensor(w[1:])
            nll_b -= float(lb.gather(1, tgt[:, None]).sum())
            nll_c -= float(lc.gather(1, tgt[:, None]).sum())
            n += len(w) - 1
        k = torch.cat(kl)
        results[name] = {"kl_mean": float(k.mean()), "kl_p99": float(k.quantile(0.99)),
                         "top1": top1 / n, "ppl_ratio": math.exp((nll_c - nll_b) / n)}
        r = results[name]
        log(f"{name:>20}: KL mean {r['kl_mean']:.2e} p99 {r['kl_p99']:.2e} "
            f"top-1 {r['top1']:.4f} ppl ratio {r['ppl_ratio']:.5f}")
    write_json(a.json, {"bench": "kv8_sim", "model": a.model.rstrip("/").split("/")[-1],
                        "windows": len(windows), "window": a.window, "seed": a.seed,
                        "results": results, "env": env_info()})


if __name__ == "__main__":
    main()
