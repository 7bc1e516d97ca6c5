"""The integer-dot GEMM for GGUF weights (kvserve/csrc/wq_gemm.c) over a decode step's weight
stream, against this machine's read bandwidth, one run, JSON out.

    .venv/bin/python benchmarks/wq_gemm.py [--threads 2] [--rounds 7] [--rows 1,16,64]
        [--terms 2] [--baseline-source OLD.c] [--amx] [--baseline-amx] [--layers 30]
        [--head 49152,576]
        [--json docs/bench/wq_gemm.json]

The stream is the default model's (SmolLM2-135M Q4_1, as the engine holds it): per layer the
fused qkv (960 x 576), o (576 x 576), fused gate_up (3072 x 576) and down (576 x 1536) in 4-bit
tiles with a (scale, min) per 32 columns, 30 layers (~66 MB), then the tied Q8_0 LM head
(49,152 x 576, ~30 MB) -- random codes, so a pass reads ~96 MB from DRAM like a batch-1 decode
step does (more than the L3). Each build's calls are recorded into CPU graphs
(kvserve.kernels.cpu.graph) and replayed, as the engine replays them: no Python between calls.

For each number of rows M and each build (``kvserve``: this checkout's kernel; ``baseline``:
the same kernel built from another source file, e.g. ``git show REV:kvserve/csrc/wq_gemm.c >
old.c``), rotated per round, median of ``rounds``: milliseconds for the layers and for the
head, and GB/s of weight bytes read. With a baseline, ``identical_to_baseline`` says whether
the two builds' outputs are bit for bit the same (they should be, for a change of speed only).
``read_gbs`` is torch.sum's streaming read rate on the same threads
(kvserve.bench.common.read_bandwidth): the floor of a pass is bytes / read_gbs, and
``pass_over_floor`` how far the pass is above it.

``--amx`` (CPUs with AMX-INT8) times this checkout's kernel twice: ``kvserve`` with the AVX-512
VNNI pass for every row count, ``kvserve_amx`` with the AMX-INT8 tiles for every row count
(threshold 1), and checks that the two are bit for bit the same (``identical_amx``). With
``--layers 0 --head 262144,640`` it times Gemma 3's tied Q8_0 head alone (one thread:
``--threads 1``). ``--baseline-amx`` runs the baseline build on its AMX-INT8 tiles for every row
count too (an A/B of two versions of the tile path; with ``--amx``, ``identical_to_baseline``
then compares the two tile paths bit for bit).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from kvserve.bench.common import env_info, log, read_bandwidth, write_json
from kvserve.cbuild import build_source
from kvserve.kernels.cpu import graph
from kvserve.kernels.cpu import wq_gemm as wq_cpu
from kvserve.quant import wq

LAYER_SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
HEAD_SHAPE = ("lm_head", 49152, 576)
GROUP = 32


def make_table(n: int, k: int, bits: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random codes and (scale, min) in the kernel's tile layout: (codes, sm)."""
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // GROUP, generator=g) * 0.01
    m = -s * (2 ** (bits - 1))
    return wq.pack_codes(u, bits), wq.pack_scales(s, m)


def set_amx(lib, on: bool) -> None:
    """AMX-INT8 tiles for every row count (on) or the VNNI pass for every row count (off), on a
    build that has the switch (a baseline source may not)."""
    if hasattr(lib, "kvs_wq_amx"):
        wq_cpu.set_amx(lib, on, 1)


def table_bytes(t: tuple[torch.Tensor, ...]) -> int:
    return sum(x.numel() * x.element_size() for x in t)


def record(lib, calls, xs, terms: int) -> tuple[graph.Tape, list[torch.Tensor]]:
    """One tape of ``calls`` [(codes, sm, N, K, bits)] on ``lib``, x from ``xs[K]``, and the
    outputs its replays write."""
    with graph.recording() as tape:
        ys = [wq_cpu.wq_linear(lib, xs[k], codes, sm, n, GROUP, bits, terms)
              for codes, sm, n, k, bits in calls]
    return tape, ys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--terms", type=int, choices=(1, 2), default=2,
                    help="int8 passes per activation (2: the engine's default int8x2)")
    ap.add_argument("--baseline-source", default=None)
    ap.add_argument("--amx", action="store_true",
                    help="also time the AMX-INT8 tiles (kvserve: VNNI only, kvserve_amx: tiles)")
    ap.add_argument("--baseline-amx", action="store_true",
                    help="the baseline build on its AMX-INT8 tiles for every row count")
    ap.add_argument("--head", default=f"{HEAD_SHAPE[1]},{HEAD_SHAPE[2]}",
                    help="the 8-bit head's N,K (Gemma 3 270M: 262144,640)")
    ap.add_argument("--bandwidth-mib", type=int, default=0,
                    help="read-bandwidth probe buffer (0: max(512 MiB, 8x the last-level cache))")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads < 1 or a.rounds < 1 or a.layers < 0:
        raise SystemExit("--threads and --rounds must be >= 1, --layers >= 0")
    head_n, head_k = (int(v) for v in a.head.split(","))
    if head_n % 16 or head_k % GROUP:
        raise SystemExit(f"--head: N must be a multiple of 16 and K of {GROUP}")
    torch.set_num_threads(a.threads)
    lib = wq_cpu.wq_library()
    if lib is None or not graph.available():
        raise SystemExit("the C kernels did not build here (no compiler?)")
    g = torch.Generator().manual_seed(0)
    log(f"wq_gemm: {a.layers} layers of 4-bit tiles and an 8-bit head")
    layer_tabs = [[(*make_table(n, k, 4, g), n, k, 4) for _, n, k in LAYER_SHAPES]
                  for _ in range(a.layers)]
    head = (*make_table(head_n, head_k, 8, g), head_n, head_k, 8)
    layer_calls = [c for cs in layer_tabs for c in cs]
    layer_bytes = sum(table_bytes(c[:2]) for c in layer_calls)
    head_bytes = table_bytes(head[:2])
    bw = read_bandwidth(a.bandwidth_mib)
    log(f"read bandwidth {bw['read_gbs']:.1f} GB/s ({a.threads} threads); layers "
        f"{layer_bytes / 1e6:.1f} MB, head {head_bytes / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"kvserve": lib}
        amx = {"kvserve": False}  # variant -> AMX-INT8 tiles for every row count
        amx_default = wq_cpu.amx_rows(lib)
        if a.baseline_source:
            libs["baseline"] = wq_cpu.bind(build_source(a.baseline_source, tmp))
            amx["baseline"] = a.baseline_amx
        if a.amx:
            if not amx_default:
                raise SystemExit("--amx: this CPU (or its build, or Linux) has no AMX-INT8")
            libs["kvserve_amx"], amx["kvserve_amx"] = lib, True
        results = []
        for m in [int(v) for v in a.rows.split(",")]:
            xs = {k: torch.randn(m, k, generator=g)
                  for k in {c[3] for c in layer_calls} | {head_k}}
            recs = {}
            for name, d in libs.items():
                set_amx(d, amx[name])
                recs[name] = (record(d, layer_calls, xs, a.terms), record(d, [head], xs, a.terms))
            tapes = {name: (lr[0], hr[0]) for name, (lr, hr) in recs.items()}
            times: dict[str, dict[str, list[float]]] = {n: {"layers": [], "head": []}
                                                        for n in libs}
            for r in range(a.rounds + 1):  # round 0 warms up
                order = list(libs)[r % len(libs):] + list(libs)[:r % len(libs)]
                for name in order:
                    set_amx(libs[name], amx[name])
                    t_layers, t_head = tapes[name]
                    t0 = time.perf_counter()
                    if layer_calls:  # (--layers 0: the head alone)
                        t_layers.replay(m)
                    t1 = time.perf_counter()
                    t_head.replay(m)
                    t2 = time.perf_counter()
                    if r:
                        times[name]["layers"].append(t1 - t0)
                        times[name]["head"].append(t2 - t1)
            row: dict = {"rows": m}
            if "baseline" in libs:  # a change that should not alter results: does it?
                outs = {name: lr[1] + hr[1] for name, (lr, hr) in recs.items()}
                mine = "kvserve_amx" if a.amx and a.baseline_amx else "kvserve"
                row["identical_to_baseline"] = all(
                    torch.equal(u.view(torch.int32), v.view(torch.int32))
                    for u, v in zip(outs[mine], outs["baseline"], strict=True))
            if a.amx:  # the tiles change speed only: bit for bit the VNNI outputs?
                outs = {name: lr[1] + hr[1] for name, (lr, hr) in recs.items()}
                row["identical_amx"] = all(
                    torch.equal(u.view(torch.int32), v.view(torch.int32))
                    for u, v in zip(outs["kvserve"], outs["kvserve_amx"], strict=True))
            for name, t in times.items():
                tl, th = statistics.median(t["layers"]), statistics.median(t["head"])
                row[name] = {"layers_ms": tl * 1e3,
                             "layers_gbs": layer_bytes / tl / 1e9 if layer_bytes else 0.0,
                             "head_ms": th * 1e3, "head_gbs": head_bytes / th / 1e9,
                             "pass_over_floor": (tl + th) * bw["read_gbs"] * 1e9
                             / (layer_bytes + head_bytes)}
            results.append(row)
            if a.amx:
                row["amx_speedup"] = {
                    part: row["kvserve"][f"{part}_ms"] / row["kvserve_amx"][f"{part}_ms"]
                    for part in (("layers", "head") if layer_bytes else ("head",))}
            log(f"M={m:4d}" + (f" (identical: {row['identical_to_baseline']})"
                                if "baseline" in libs else "")
                + (f" (AMX identical: {row['identical_amx']}, speedup "
                   + ", ".join(f"{k} {v:.2f}x" for k, v in row["amx_speedup"].items()) + ")"
                   if a.amx else "") + ": " + ", ".join(
                f"{name} layers {row[name]['layers_ms']:.2f} ms ({row[name]['layers_gbs']:.1f} "
                f"GB/s), head {row[name]['head_ms']:.2f} ms ({row[name]['head_gbs']:.1f} GB/s), "
                f"{row[name]['pass_over_floor']:.2f}x floor" for name in libs))
        wq_cpu.set_amx(lib, bool(amx_default), amx_default)
    write_json(a.json, {"bench": "wq_gemm", "threads": a.threads, "rounds": a.rounds,
                        "layers": a.layers, "terms": a.terms, "group": GROUP,
                        "shape_list": LAYER_SHAPES + [("lm_head", head_n, head_k)],
                        "amx": a.amx, "amx_rows_default": amx_default,
                        "layer_bytes": layer_bytes, "head_bytes": head_bytes,
                        "baseline_source": a.baseline_source, "baseline_amx": a.baseline_amx,
                        "read_bandwidth": bw,
                        "results": results, "env": env_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
