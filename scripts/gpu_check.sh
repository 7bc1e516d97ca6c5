#!/usr/bin/env bash
# GPU acceptance check for the Triton kernels (issue #9), for ONE run on a lent H200.
#
#   bash scripts/gpu_check.sh            # on the GPU machine: writes results under $OUT
#   bash scripts/gpu_check.sh --dry-run  # anywhere (CPU): parse, import, print the plan
#
# Self-contained: no network; uses the machine's python3 (torch, triton, transformers, pytest
# preinstalled there) with the repo on PYTHONPATH. Steps, all inside GPU_CHECK_BUDGET_S
# (default 460 s, under 8 minutes) -- a step that fails is recorded and the next one runs:
#
#   t=0      [bg] random-init Llama-8B-shaped bf16 model -> $MODEL_DIR (meta device, to_empty
#                 on CUDA, normal_ in place; + word-level tokenizer)
#   (1)      pytest tests/kernels on CUDA (xdist -n 8 when available)     -> pytest.log
#            (incl. mla_triton == mla_torch on a tiny DeepSeek-V3, sealing from the write
#            kernel's checksum state == recompute; (2) with integrity on seals that way too)
#   (3)      decode-attention micro-benchmark: KV-read GB/s vs device copy GB/s
#                                                     -> decode_bw.json, decode_bw.png
#   (4)      scripts/gpu_check_int4_graphs.py: INT4 GEMM Triton vs torch tinygemm (error, ms,
#            which is faster), decode CUDA graphs vs --enforce-eager (tok/s at B=1/5/32, greedy
#            tokens, logits of a padded step), INT4 checkpoint end to end on CUDA
#                                                     -> int4_graphs.json, int4_graphs.log
#   (5)      scripts/gpu_check_tp.py: tensor_parallel_size=2 (NCCL) vs 1 on a tiny Llama,
#            logits within 1e-3, greedy tokens equal; skipped below 2 GPUs  -> tp.json
#   (2)      kvserve bench throughput, BF16 vs FP8 KV, integrity off/on, Llama-8B shape
#                                                     -> throughput.json, throughput.png,
#                                                        bench.log
#   end      summary.json (versions, device, per-step status and seconds)
#
# (3) and (4) run before (2) so the cheap, kernel-level numbers land even if the end-to-end
# bench overruns; each of them is capped so that (2) keeps at least RESERVE_S (150 s) of the
# budget (460 s of the 8 minutes), and (2) gets whatever is left (timeout), minimum 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
OUT=${OUT:-$ROOT/out/gpu_check}
MODEL_DIR=${MODEL_DIR:-/tmp/kvserve-llama8b-random}
BUDGET_S=${GPU_CHECK_BUDGET_S:-460}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
WORK=$(mktemp -d /tmp/kvserve-gpu-check.XXXXXX)
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }

# ------------------------------------------------------------------------------------------
# Inline Python helpers (written out in both modes; --dry-run only byte-compiles them)
# ------------------------------------------------------------------------------------------
cat >"$WORK/make_model.py" <<'PYEOF'
"""Random-init Llama-3-8B-shaped bf16 checkpoint, initialised on the GPU in seconds."""
import json
import os
import sys
import time

import torch
import transformers as tf

path = sys.argv[1]
t0 = time.time()
done = os.path.join(path, ".complete")
if os.path.exists(done):
    print(f"[model] reusing {path}")
    sys.exit(0)
shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128)
if os.environ.get("GPU_CHECK_TINY_MODEL") == "1":  # smoke test of this script on a CPU
    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
cfg = tf.LlamaConfig(
    **shape, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
with torch.device("meta"):
    model = tf.LlamaForCausalLM(cfg)
model = model.to(torch.bfloat16).to_empty(device=device)
gen = torch.Generator(device=device).manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
if device == "cuda":
    torch.cuda.synchronize()
n = sum(p.numel() for p in model.parameters())
print(f"[model] {n / 1e9:.2f}B params initialised on {device} in {time.time() - t0:.1f}s")
model.save_pretrained(path, max_shard_size="4GB")
try:
    from kvserve.bench.common import save_word_tokenizer
except Exception:  # noqa: BLE001 - fall back to an equivalent inline tokenizer
    save_word_tokenizer = None
if save_word_tokenizer is not None:
    save_word_tokenizer(path, cfg.vocab_size)
else:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    toks = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(cfg.vocab_size - 3)]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
with open(done, "w") as f:
    json.dump({"params": n, "seconds": time.time() - t0}, f)
print(f"[model] saved to {path} in {time.time() - t0:.1f}s total")
PYEOF

cat >"$WORK/decode_bench.py" <<'PYEOF'
"""Decode-attention micro-benchmark: achieved KV-read bandwidth vs device copy bandwidth.

Llama-3-8B layer shape (32 q heads, 8 kv heads, head_dim 128, page 16), random page order.
Bytes counted per call: K + V (+ FP8 scales) of every context token, q, out and the block
table; copy bandwidth counts the bytes read AND written by a clone of a 4 GiB tensor.
"""
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

from kvserve.kernels.triton import attention as ta

out_dir = sys.argv[1]
dev = torch.device("cuda")
torch.manual_seed(0)
t_start = time.time()
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__, "cases": [], "config_sweep": []}

x = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device=dev)  # 4 GiB
ms = do_bench(lambda: x.clone(), warmup=25, rep=200)
res["copy_GBps_read_plus_write"] = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
del x
torch.cuda.empty_cache()
print(f"[bw] device copy {res['copy_GBps_read_plus_write']:.0f} GB/s (read+write)")

HQ, HKV, D, BS = 32, 8, 128, 16
SM = D**-0.5


def make(dtype, batch, ctx):
    blocks = batch * (ctx // BS)
    shape = (1, blocks, 2, BS, HKV, D)
    kv = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    sc = None
    if dtype != torch.bfloat16:
        kv = (kv * 64).clamp(-448, 448).to(dtype)
        sc = torch.rand(shape[:-1], device=dev).to(torch.bfloat16) * 0.01
    bt = torch.randperm(blocks, device=dev).to(torch.int32).view(batch, -1).contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    nbytes = kv.numel() * kv.element_size() + (0 if sc is None else sc.numel() * 2)
    nbytes += 2 * q.numel() * 2 + bt.numel() * 4
    return (q, kv, sc, 0, bt, sl, SM), nbytes


def bench(args):
    return do_bench(lambda: ta.paged_decode_attention(*args), warmup=25, rep=100)


DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
for name, dtype in DTYPES.items():
    for batch, ctx in [(16, 4096), (64, 2048), (128, 1024), (256, 1024), (64, 8192)]:
        args, nbytes = make(dtype, batch, ctx)
        ms = bench(args)
        gbps = nbytes / (ms * 1e-3) / 1e9
        case = {"kv_dtype": name, "batch": batch, "context": ctx, "ms": ms,
                "bytes": nbytes, "kv_read_GBps": gbps,
                "fraction_of_copy_bw": gbps / res["copy_GBps_read_plus_write"],
                "config": dict(ta.DECODE_CONFIG)}
        res["cases"].append(case)
        print(f"[bw] {name:8s} B={batch:4d} ctx={ctx:5d} {ms * 1e3:8.1f} us "
              f"{gbps:7.0f} GB/s ({case['fraction_of_copy_bw']:.0%} of copy)")
        del args
        torch.cuda.empty_cache()

# Launch-config sweep at one mid-size shape (tuning input for DECODE_CONFIG).
default = dict(ta.DECODE_CONFIG)
for name, dtype in DTYPES.items():
    args, nbytes = make(dtype, 64, 2048)
    for bn, nw, ns in [(32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 2)]:
        if time.time() - t_start > 100:
            break
        ta.DECODE_CONFIG.update(BLOCK_N=bn, num_warps=nw, num_stages=ns)
        try:
            ms = bench(args)
            row = {"kv_dtype": name, "BLOCK_N": bn, "num_warps": nw, "num_stages": ns,
                   "ms": ms, "kv_read_GBps": nbytes / (ms * 1e-3) / 1e9}
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a data point
            row = {"kv_dtype": name, "BLOCK_N": bn, "num_warps": nw, "num_stages": ns,
                   "error": repr(e)[:300]}
        res["config_sweep"].append(row)
        print(f"[bw] sweep {row}")
    ta.DECODE_CONFIG.update(default)
    del args
    torch.cuda.empty_cache()

with open(f"{out_dir}/decode_bw.json", "w") as f:
    json.dump(res, f, indent=2)
try:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = sorted({(c["batch"], c["context"]) for c in res["cases"]},
                    key=lambda bc: (bc[1], bc[0]))
    width = 0.38
    for i, name in enumerate(DTYPES):
        ys = [next(c["kv_read_GBps"] for c in res["cases"]
                   if c["kv_dtype"] == name and (c["batch"], c["context"]) == lab)
              for lab in labels]
        ax.bar([j + (i - 0.5) * width for j in range(len(labels))], ys, width, label=name)
    ax.axhline(res["copy_GBps_read_plus_write"], color="k", ls="--",
               label="torch clone (read+write)")
    ax.set_xticks(range(len(labels)), [f"B={b}\nctx={c}" for b, c in labels])
    ax.set_ylabel("GB/s")
    ax.set_title(f"paged decode attention, Llama-8B layer shape ({res['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out_dir}/decode_bw.png", dpi=120)
except Exception as e:  # noqa: BLE001
    print(f"[bw] plot failed: {e!r}")
print(f"[bw] done in {time.time() - t_start:.0f}s")
PYEOF

cat >"$WORK/summary.py" <<'PYEOF'
import json
import os
import subprocess
import sys

out, steps_file = sys.argv[1], sys.argv[2]
summary = {"steps": {}}
for line in open(steps_file):
    name, rc, secs = line.split()
    summary["steps"][name] = {"rc": int(rc), "seconds": int(secs), "ok": rc == "0"}
try:
    import torch
    import triton

    summary["torch"], summary["triton"] = torch.__version__, triton.__version__
    summary["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
except Exception as e:  # noqa: BLE001
    summary["import_error"] = repr(e)
try:
    summary["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception:  # noqa: BLE001
    pass
summary["files"] = sorted(os.listdir(out))
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary["steps"]))
PYEOF

BENCH_CMD=("$PY" -m kvserve.cli bench throughput --model "$MODEL_DIR" --device cuda --kv-cache-dtype bf16,fp8
    --kv-cache-memory 16GiB --concurrency 16,32,64,128,256 --input-len 1024 --output-len 128
    --kv-integrity off,on --no-progress --json "$OUT/throughput.json"
    --plot "$OUT/throughput.png")

plan() {
    cat <<EOF
gpu_check plan (budget ${BUDGET_S}s; python: $PY; results: $OUT)
  [bg]  $PY make_model.py $MODEL_DIR   (Llama-8B shape: hidden 4096, 32 layers, 32/8 heads, hd 128)
  (1)   $PY -m pytest tests/kernels -q [-n 8]                     -> pytest.log
  (3)   $PY decode_bench.py                                       -> decode_bw.json, decode_bw.png
  (4)   $PY scripts/gpu_check_int4_graphs.py                      -> int4_graphs.json, int4_graphs.log
  (5)   $PY scripts/gpu_check_tp.py (tp=2 NCCL vs tp=1; needs 2 GPUs) -> tp.json, tp.log
  (2)   ${BENCH_CMD[*]}
                                                                  -> throughput.json/png, bench.log
  end   summary.json
EOF
}

# ------------------------------------------------------------------------------------------
# --dry-run: parse, import, byte-compile the helpers, print the plan
# ------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    rc=0
    bash -n "$0" && echo "[dry-run] script parses" || rc=1
    "$PY" -c 'import kvserve.kernels.reference' && echo "[dry-run] kvserve.kernels.reference ok" \
        || rc=1
    "$PY" -m py_compile scripts/gpu_check_int4_graphs.py \
        && echo "[dry-run] scripts/gpu_check_int4_graphs.py compiles" || rc=1
    "$PY" -m py_compile scripts/gpu_check_tp.py \
        && echo "[dry-run] scripts/gpu_check_tp.py compiles" || rc=1
    "$PY" -c 'import kvserve.engine.executor, kvserve.distributed.parallel_state' \
        && echo "[dry-run] kvserve.engine.executor + kvserve.distributed import" || rc=1
    "$PY" -c 'import kvserve.engine.cuda_graphs, kvserve.layers.int4.linear' \
        && echo "[dry-run] kvserve.engine.cuda_graphs + kvserve.layers.int4.linear import" || rc=1
    "$PY" -m py_compile "$WORK/make_model.py" "$WORK/decode_bench.py" "$WORK/summary.py" \
        && echo "[dry-run] inline helpers compile" || rc=1
    if "$PY" -c 'import triton' 2>/dev/null; then
        "$PY" -c 'import triton, kvserve.kernels.triton.attention, kvserve.kernels.triton.cache, kvserve.kernels.triton.int4; print("[dry-run] triton", triton.__version__, "+ kernel modules import")' \
            || rc=1
        "$PY" -c 'import kvserve.attention.triton_backend, kvserve.attention.mla_triton' \
            && echo "[dry-run] attention backends triton + mla_triton import" || rc=1
    else
        echo "[dry-run] triton not installed here (kernel modules not imported)"
    fi
    if "$PY" -c 'import kvserve.cli' 2>/dev/null; then
        echo "[dry-run] kvserve.cli imports"
    else
        echo "[dry-run] WARNING: kvserve.cli does not import; step (2) would fail"
    fi
    plan
    rm -rf "$WORK"
    exit $rc
fi

# ------------------------------------------------------------------------------------------
# The real run
# ------------------------------------------------------------------------------------------
mkdir -p "$OUT"
plan
STEPS=$WORK/steps.txt
: >"$STEPS"
record() { echo "$1 $2 $3" >>"$STEPS"; echo "[gpu_check] $1 rc=$2 (${3}s, t=$(elapsed)s)"; }
# timeout for a step before (2): its cap, but never eating the RESERVE_S kept for (2)
RESERVE_S=${GPU_CHECK_RESERVE_S:-150}
cap() { local t=$(( BUDGET_S - $(elapsed) - RESERVE_S )); [ "$t" -gt "$1" ] && t=$1
        [ "$t" -lt 20 ] && t=20; echo "$t"; }

"$PY" "$WORK/make_model.py" "$MODEL_DIR" >"$OUT/bench.log" 2>&1 &
MODEL_PID=$!
MODEL_T0=$(date +%s)

# (1) kernel tests on CUDA
s=$(date +%s)
XDIST=()
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n 8)
timeout "$(cap 200)" "$PY" -m pytest tests/kernels -q -p no:cacheprovider "${XDIST[@]}" \
    >"$OUT/pytest.log" 2>&1
record pytest $? $(( $(date +%s) - s ))
tail -n 5 "$OUT/pytest.log"

# the model must be done before timing anything (its save competes for the machine)
wait "$MODEL_PID"
record make_model $? $(( $(date +%s) - MODEL_T0 ))

# (3) decode micro-benchmark
s=$(date +%s)
timeout "$(cap 150)" "$PY" "$WORK/decode_bench.py" "$OUT" 2>&1 | tee "$WORK/decode_bench.log"
record decode_bench "${PIPESTATUS[0]}" $(( $(date +%s) - s ))

# (4) INT4 on CUDA (Triton vs tinygemm) and decode CUDA graphs (vs --enforce-eager)
s=$(date +%s)
timeout "$(cap 160)" "$PY" scripts/gpu_check_int4_graphs.py "$OUT" 2>&1 | tee "$OUT/int4_graphs.log"
record int4_graphs "${PIPESTATUS[0]}" $(( $(date +%s) - s ))

# (5) tensor parallelism on CUDA / NCCL (skipped with fewer than 2 GPUs)
s=$(date +%s)
timeout "$(cap 120)" "$PY" scripts/gpu_check_tp.py "$OUT" 2>&1 | tee "$OUT/tp.log"
record tp_nccl "${PIPESTATUS[0]}" $(( $(date +%s) - s ))

# (2) end-to-end throughput, whatever budget is left
left=$(( BUDGET_S - $(elapsed) - 15 ))
[ "$left" -lt 60 ] && left=60
s=$(date +%s)
echo "[gpu_check] bench throughput with ${left}s" | tee -a "$OUT/bench.log"
timeout "$left" "${BENCH_CMD[@]}" >>"$OUT/bench.log" 2>&1
record bench_throughput $? $(( $(date +%s) - s ))
tail -n 25 "$OUT/bench.log"

"$PY" "$WORK/summary.py" "$OUT" "$STEPS"
echo "[gpu_check] total $(elapsed)s; results in $OUT"
rm -rf "$WORK"
