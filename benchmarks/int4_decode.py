"""INT4 (W4A16) vs dense decode through the kvserve engine, one run, JSON out.

    .venv/bin/python benchmarks/int4_decode.py --json int4_decode.json [--threads 1]
        [--work DIR] [--steps 3] [--repeats 5] [--small]

1. A random-init Llama (TinyLlama-shaped: hidden 2048, 16 layers, FFN 5632, 32 heads / 4 KV
   heads of 64, vocab 32000; std-0.02 weights, bf16: ~0.85 B parameters; ``--small`` for a quick
   smoke run) is written straight to safetensors, with a word-level tokenizer.
2. It is quantized with ``kvserve.quant.quantizer.quantize_checkpoint`` (group 128, symmetric,
   RTN). Reported: the linear weights' bytes and the ``*.safetensors`` size, INT4 vs BF16, and
   the bytes the loaded model holds.
3. Decode tokens/s through ``LLM`` (KV cache in the model dtype, integrity on) for INT4 with
   bf16 activations (``int4``, the checkpoint dtype), INT4 with fp32 activations (``int4-fp32``:
   the INT4 GEMMs still run the bf16 int4 op, but lm_head / embeddings / attention run fp32),
   BF16 dense (dtype bf16) and FP32 dense (the bf16 checkpoint loaded as fp32; on AVX2 CPUs
   without AVX512-BF16 the faster dense run at batch > 1), at batch 1 and 32. Per (model,
   batch): B prompts of 8 random tokens are prefilled in one step, one decode step warms up,
   then ``repeats`` windows of ``steps`` decode steps are timed: tok/s = B x steps / seconds;
   the median window is reported (all windows are in the JSON). All models stay loaded and the
   windows run round-robin (rotating who goes first), so load swings on a shared host hit all
   alike; speedups are given as the ratio of medians and the median of per-round ratios.
4. llama.cpp beside it on the same weights (``--peer-python`` with llama-cpp-python and
   ``--llamacpp-convert``): the bf16 checkpoint converted to GGUF bf16 by llama.cpp's converter
   and quantized to Q4_0 by ``llama_model_quantize``; decode tok/s at the same batch sizes.

The host load average is recorded before and after: on a shared machine, compare runs only
with similar load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

FULL = dict(hidden=2048, layers=16, ffn=5632, heads=32, kv_heads=4, vocab=32000)
SMALL = dict(hidden=512, layers=2, ffn=1408, heads=8, kv_heads=2, vocab=4000)
PROMPT_LEN = 8


def make_model(path: str, s: dict[str, int], seed: int = 0) -> None:
    """Random bf16 Llama saved as an HF folder (no transformers model is instantiated)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    h, f, d = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], h), "lm_head.weight": (s["vocab"], h),
              "model.norm.weight": (h,)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (s["heads"] * d, h),
            p + "self_attn.k_proj.weight": (s["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": (s["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, s["heads"] * d),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    sd = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            sd[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            sd[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(path, s["vocab"])


def _save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - 3)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes held by the loaded model: all params + buffers, and the linear layers' share."""
    from kvserve.layers.int4.merged import Int4MergedLinear
    from kvserve.layers.linear import Linear, MergedLinear

    total = sum(t.numel() * t.element_size()
                for t in list(model.parameters()) + list(model.buffers()))
    linear = 0
    for name, m in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(m, Int4MergedLinear):
            linear += m.weight_bytes()
        elif isinstance(m, (Linear, MergedLinear)):
            linear += sum(p.numel() * p.element_size() for p in m.parameters())
    return {"total": total, "decoder_linears": linear}


def start_batch(llm, batch: int, max_tokens: int, vocab: int, seed: int) -> tuple[list, float]:
    """Submit ``batch`` prompts, prefill them (one step) and run one warm-up decode step."""
    from kvserve import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [1] + torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=g).tolist()
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    t0 = time.perf_counter()
    eng.step()  # prefill (B x 8 tokens, one step) + first token
    prefill_s = time.perf_counter() - t0
    eng.step()  # warm-up decode step
    return ids, prefill_s


def timed_window(llm, batch: int, steps: int) -> float:
    """tok/s over ``steps`` decode steps of a running batch."""
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return batch * steps / (time.perf_counter() - t0)


def run_configs(names: list[str], paths: dict[str, tuple[str, str]], args,
                vocab: int) -> dict:
    """Load every config, then per batch size time windows round-robin (the first config
    rotates each round) so that host-load swings hit every config alike."""
    from kvserve import LLM

    out: dict = {}
    llms = {}
    for name in names:
        path, dtype = paths[name]
        t0 = time.perf_counter()
        llms[name] = LLM(path, dtype=dtype, kv_cache_memory="256MiB", progress=False)
        out[name] = {"model": path, "dtype": dtype,
                     "load_s": round(time.perf_counter() - t0, 1),
                     "bytes": model_bytes(llms[name].engine.model)}
        print(f"  loaded {name} in {out[name]['load_s']}s", flush=True)
    for b in args.batches:
        started = {n: start_batch(llms[n], b, 2 + args.steps * args.repeats + 4, vocab, seed=b)
                   for n in names}
        windows: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats):
            for n in names[r % len(names):] + names[: r % len(names)]:
                windows[n].append(timed_window(llms[n], b, args.steps))
        for n in names:
            ids, prefill_s = started[n]
            eng = llms[n].engine
            eng.abort_request(ids)
            while eng.has_unfinished_requests():
                eng.step()
            tok_s = statistics.median(windows[n])
            out[n][f"batch_{b}"] = {"tok_s": tok_s, "windows_tok_s": windows[n],
                                    "prefill_s": prefill_s, "ms_per_step": 1e3 * b / tok_s}
            print(f"  {n:9s} batch {b:3d}: {tok_s:8.2f} tok/s "
                  f"(windows {[round(w, 2) for w in windows[n]]})", flush=True)
    for llm in llms.values():
        llm.engine.debug.check_no_leaks()
    llms.clear()
    gc.collect()
    return out


QUANTIZE_SCRIPT = r'''
import json, sys
import llama_cpp as L
cfg = json.load(sys.stdin)
qp = L.llama_model_quantize_default_params()
qp.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
qp.nthread = int(cfg["threads"])
rc = L.llama_model_quantize(cfg["src"].encode(), cfg["dst"].encode(), qp)
print(json.dumps({"rc": rc}))
'''


def _llamacpp_tok_s(run: dict | str, batch: int) -> float | None:
    if not isinstance(run, dict):
        return None
    row = next((r for r in run.get("results", []) if r.get("batch_size") == batch), None)
    return row["decode_tokens_per_s"] if row else None


def run_llamacpp(args: argparse.Namespace, dense: str, work: str, vocab: int) -> dict | str:
    """llama.cpp on the same weights: the bf16 checkpoint converted to GGUF bf16 by llama.cpp's
    converter, then quantized to Q4_0 by llama.cpp itself; decode tok/s at the same batch sizes
    (B prompts of PROMPT_LEN random tokens, ``steps + 1`` tokens out, ``repeats`` rounds),
    measured by the latency bench's llama.cpp script in ``--peer-python``."""
    from kvserve.bench.common import peer_importable, run_peer_script
    from kvserve.bench.latency import convert_to_gguf
    from kvserve.bench.peers import script_path

    python = args.peer_python
    if not peer_importable(python, "llama_cpp"):
        return "not run: pass --peer-python, an interpreter where llama_cpp imports"
    converter = args.llamacpp_convert or os.environ.get("KVSERVE_LLAMACPP_CONVERT")
    if not converter:
        return "not run: pass --llamacpp-convert (or KVSERVE_LLAMACPP_CONVERT)"
    out: dict = {}
    ggufs = {"bf16": os.path.join(work, "model-bf16.gguf"),
             "q4_0": os.path.join(work, "model-q4_0.gguf")}
    if not os.path.isfile(ggufs["bf16"]):
        err, vocab_kind = convert_to_gguf(python, converter, dense, ggufs["bf16"], "bf16", 1800)
        if err is not None:
            return {"error": err}
        out["gguf_vocab"] = vocab_kind
    if not os.path.isfile(ggufs["q4_0"]):
        r = run_peer_script(python, QUANTIZE_SCRIPT, {"src": ggufs["bf16"], "dst": ggufs["q4_0"],
                                                      "threads": os.cpu_count() or 1}, 1800)
        if r.get("rc") != 0:
            return {"error": f"llama_model_quantize: {r}"}
    out["gguf_bytes"] = {k: os.path.getsize(v) for k, v in ggufs.items()}
    g = torch.Generator().manual_seed(1)
    prompts = {str(b): [[[1] + torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=g).tolist()
                         for _ in range(b)] for _ in range(args.repeats)]
               for b in args.batches}
    for kind in ("q4_0", "bf16"):
        payload = {"gguf": ggufs[kind], "batch_sizes": args.batches, "input_len": PROMPT_LEN,
                   "output_len": args.steps + 2, "rounds": args.repeats, "seed": 0,
                   "threads": args.threads, "prompts": prompts, "dtype": kind}
        print(f"  llama.cpp {kind} ...", flush=True)
        run = run_peer_script(python, script_path("llamacpp_latency"), payload, 3600)
        for row in run.get("results", []):
            row.pop("tokens", None)
            print(f"  llama.cpp {kind:5s} batch {row['batch_size']:3d}: "
                  f"{row['decode_tokens_per_s']:8.2f} tok/s", flush=True)
        out[kind] = run
    return out


def main() -> None:
    from kvserve.quant.quantizer import quantize_checkpoint
    from kvserve.quantize_cli import safetensors_size, tensor_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="int4_decode.json")
    ap.add_argument("--work", default=None, help="keep the checkpoints here (default: temp)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="decode steps per timed window")
    ap.add_argument("--repeats", type=int, default=5, help="timed windows (median reported)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--configs", nargs="+", default=["int4", "int4-fp32", "bf16", "fp32"],
                    choices=["int4", "int4-fp32", "bf16", "fp32"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="tiny model: smoke-test the script")
    ap.add_argument("--peer-python", default=None,
                    help="interpreter with llama_cpp (llama-cpp-python) for the Q4_0 peer")
    ap.add_argument("--llamacpp-convert", default=None,
                    help="llama.cpp's convert_hf_to_gguf.py (or env KVSERVE_LLAMACPP_CONVERT)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SMALL if args.small else FULL
    work = args.work or tempfile.mkdtemp(prefix="int4_decode_")
    dense, quant = os.path.join(work, "bf16"), os.path.join(work, f"int4_g{args.group_size}")
    result: dict = {
        "spec": spec, "group_size": args.group_size, "threads": args.threads,
        "steps": args.steps, "repeats": args.repeats, "prompt_len": PROMPT_LEN,
        "env": {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "cores": os.cpu_count(), "loadavg_before": os.getloadavg()},
    }
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(dense, "model.safetensors")):
        os.makedirs(dense, exist_ok=True)
        make_model(dense, spec)
    result["make_model_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(quant, "model.safetensors")):
        quantize_checkpoint(dense, quant, group_size=args.group_size, symmetric=True)
    result["quantize_s"] = round(time.perf_counter() - t0, 1)
    tb_dense, tb_quant = tensor_bytes(dense), tensor_bytes(quant)
    qmods = {k.removesuffix(".weight") for k in tb_dense if ".layers." in k and
             k.endswith("_proj.weight")}
    result["checkpoint"] = {
        "quantized_modules": sum(k.endswith(".weight_packed") for k in tb_quant),
        "linear_weight_bytes": {
            "bf16": sum(v for k, v in tb_dense.items() if k.removesuffix(".weight") in qmods),
            "int4": sum(v for k, v in tb_quant.items() if k.rsplit(".", 1)[0] in qmods)},
        "tensor_bytes": {"bf16": sum(tb_dense.values()), "int4": sum(tb_quant.values())},
        "safetensors_bytes": {"bf16": safetensors_size(dense), "int4": safetensors_size(quant)},
    }
    print(json.dumps(result["checkpoint"], indent=1), flush=True)

    paths = {"int4": (quant, "bfloat16"), "int4-fp32": (quant, "float32"),
             "bf16": (dense, "bfloat16"), "fp32": (dense, "float32")}
    result["decode"] = run_configs(list(args.configs), paths, args, spec["vocab"])

    dec = result["decode"]
    speedups: dict = {}
    for b in args.batches:
        key = f"batch_{b}"
        for q in ("int4", "int4-fp32"):
            for base in ("bf16", "fp32"):
                if q in dec and base in dec:
                    wq, wb = dec[q][key]["windows_tok_s"], dec[base][key]["windows_tok_s"]
                    speedups[f"{q}_vs_{base}_{key}"] = {
                        "of_medians": round(dec[q][key]["tok_s"] / dec[base][key]["tok_s"], 3),
                        "median_paired": round(statistics.median(
                            x / y for x, y in zip(wq, wb, strict=True)), 3)}
        q_best = max((dec[q][key]["tok_s"], q) for q in ("int4", "int4-fp32") if q in dec)
        d_best = max((dec[d][key]["tok_s"], d) for d in ("bf16", "fp32") if d in dec)
        speedups[f"best_int4_vs_best_dense_{key}"] = {
            "int4": q_best[1], "dense": d_best[1], "speedup": round(q_best[0] / d_best[0], 3)}
    result["speedup"] = speedups
    result["llama_cpp"] = run_llamacpp(args, dense, work, spec["vocab"])
    lc = result["llama_cpp"]
    if isinstance(lc, dict) and "q4_0" in lc and "bf16" in lc:
        for b in args.batches:
            q, d = (_llamacpp_tok_s(lc[t], b) for t in ("q4_0", "bf16"))
            if q and d:
                speedups[f"llamacpp_q4_0_vs_bf16_batch_{b}"] = round(q / d, 3)
    result["env"]["loadavg_after"] = os.getloadavg()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(speedups, indent=1))
    print(f"wrote {args.json}; checkpoints in {work}")


if __name__ == "__main__":
    main()
