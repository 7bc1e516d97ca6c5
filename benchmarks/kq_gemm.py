"""The integer-dot GEMM for GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weights kept packed
(kvserve/csrc/kq_gemm.c) over a decode step's weight stream, per type and batch, against the
16-bit GEMM (kvserve/csrc/w16_gemm.c, bf16 weights) and this machine's read bandwidth; one
run, JSON out.

    .venv/bin/python benchmarks/kq_gemm.py [--threads 2] [--rounds 5] [--rows 1,16,64]
        [--types Q4_K,Q5_K,Q6_K,Q5_0,Q5_1] [--layers 2] [--hidden 2048] [--inter 8192]
        [--terms 2] [--amx] [--baseline-source OLD.c] [--no-w16] [--bandwidth-mib 64]
        [--json docs/bench/kq_gemm.json]

The stream: ``layers`` transformer layers of a Llama-shaped model (fused qkv 3 h x h, o h x h,
fused gate_up 2 i x h, down h x i; h = 2048, i = 8192 by default: ~61 M weights a layer, ~35 MB
in Q4_K), random codes and scales, in each type. Every build's calls are recorded into a CPU
graph (kvserve.kernels.cpu.graph) and replayed, as the engine replays them. Per type and number
of rows M, median of ``rounds``: milliseconds, GB/s of the packed bytes read, ``over_floor``
(time x read bandwidth / bytes: 1.0 is the memory floor; ``read_gbs`` is torch.sum's streaming
rate on the same threads) and ``vs_w16`` (the 16-bit GEMM's time on the same shapes / this
one's). ``resident_over_file`` is the packed bytes over the GGUF file's bytes of the same
weights.

``--amx`` (CPUs with AMX-INT8) also replays each type's tape with the VNNI pass for every row
count (``vnni_ms``) and with the AMX-INT8 tiles for every row count (``amx_ms``), and checks
that the two give bit for bit the same outputs (``identical_amx``); ``ms`` is the kernel's
default (tiles from ``amx_rows_default`` rows).

``--baseline-source OLD.c`` also builds another version of the kernel (e.g. ``git show
REV:kvserve/csrc/kq_gemm.c > old.c``) and replays the same calls on it, the two builds rotated per
round: ``baseline_ms``, ``speedup`` (baseline_ms / ms) and ``identical_to_baseline`` (bit for bit
the same outputs: a change of speed only). ``--no-w16`` skips the 16-bit GEMM (``vs_w16`` null).
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
from kvserve.kernels.cpu import kq_gemm as kq_cpu
from kvserve.kernels.cpu import w16_gemm as w16_cpu
from kvserve.kernels.cpu.wq_gemm import amx_rows as wq_amx_rows
from kvserve.kernels.cpu.wq_gemm import set_amx
from kvserve.quant import kq


def shapes(hidden: int, inter: int) -> list[tuple[str, int, int]]:
    return [("qkv", 3 * hidden, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter)]


def random_parts(qtype: int, n: int, k: int, g: torch.Generator) -> kq.KqParts:
    """Random codes and sane scales of ``qtype`` (timing only: any bytes run the same)."""
    _, block, _, bits, _ = kq.TYPES[qtype]
    u = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // block, generator=g) * 1e-3).half()
    dm = (torch.rand(n, k // block, generator=g) * 1e-3).half() if qtype in (7, 12, 13) else None
    sc = mn = None
    if qtype in (12, 13):
        sc = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
        mn = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
    elif qtype == 14:
        sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
    return kq.KqParts(qtype, u, d, dm, sc, mn)


def timed(tape: graph.Tape, m: int, rounds: int) -> float:
    return timed_ab({"only": tape}, m, rounds)["only"]


def timed_ab(tapes: dict[str, graph.Tape], m: int, rounds: int) -> dict[str, float]:
    """Median seconds per replay of each tape, the tapes rotated per round (round 0 warms up)."""
    names = list(tapes)
    ts: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            tapes[name].replay(m)
            if r:
                ts[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in ts.items()}


def _same_bits(us: list[torch.Tensor], vs: list[torch.Tensor]) -> bool:
    return all(torch.equal(u.view(torch.int32), v.view(torch.int32))
               for u, v in zip(us, vs, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q5_1")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--terms", type=int, choices=(1, 2), default=2,
                    help="int8 passes per activation (2: the engine's default int8x2)")
    ap.add_argument("--bandwidth-mib", type=int, default=0,
                    help="read-bandwidth probe buffer (0: max(512 MiB, 8x the last-level cache))")
    ap.add_argument("--amx", action="store_true",
                    help="also time the VNNI pass and the AMX-INT8 tiles for every row count")
    ap.add_argument("--baseline-source", default=None,
                    help="another version of kq_gemm.c, timed beside this one (A/B)")
    ap.add_argument("--no-w16", action="store_true", help="skip the 16-bit GEMM's timings")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads < 1 or a.rounds < 1 or a.layers < 1:
        raise SystemExit("--threads, --rounds and --layers must be >= 1")
    if a.hidden % 256 or a.inter % 256:
        raise SystemExit("--hidden and --inter must be multiples of 256 (K-quant blocks)")
    types = [kq.type_id(t) for t in a.types.split(",")]
    rows = [int(v) for v in a.rows.split(",")]
    torch.set_num_threads(a.threads)
    lib, w16 = kq_cpu.kq_library(), w16_cpu.w16_library()
    if lib is None or w16 is None or not graph.available():
        raise SystemExit("the C kernels did not build here (no compiler?)")
    amx_default = wq_amx_rows(lib)
    if a.amx and not amx_default:
        raise SystemExit("--amx: this CPU (or its build, or Linux) has no AMX-INT8")
    g = torch.Generator().manual_seed(0)
    shp = shapes(a.hidden, a.inter) * a.layers
    bw = read_bandwidth(a.bandwidth_mib)
    log(f"kq_gemm: {a.layers} layers of h={a.hidden}, i={a.inter}; read bandwidth "
        f"{bw['read_gbs']:.1f} GB/s ({a.threads} threads)")
    xs = {m: {k: torch.randn(m, k, generator=g) for k in {a.hidden, a.inter}} for m in rows}
    # the 16-bit baseline: bf16 weights of the same shapes
    w16s = [] if a.no_w16 else [torch.randn(n, k, generator=g).bfloat16() for _, n, k in shp]
    w16_bytes = sum(w.numel() * 2 for w in w16s)
    w16_ms: dict[int, float | None] = dict.fromkeys(rows)
    for m in rows if w16s else []:
        with graph.recording() as tape:
            for w in w16s:
                w16_cpu.w16_gemm(w16, xs[m][w.shape[1]], w, w16_cpu.bf16_dot_rows(w16))
        w16_ms[m] = timed(tape, m, a.rounds) * 1e3
        log(f"w16 M={m:3d}: {w16_ms[m]:.2f} ms ({w16_bytes / w16_ms[m] / 1e6:.1f} GB/s)")
    del w16s
    tmp = tempfile.TemporaryDirectory()
    libs = {"kvserve": lib}
    if a.baseline_source:
        libs["baseline"] = kq_cpu.bind(build_source(a.baseline_source, tmp.name))
    results = []
    for t in types:
        name = kq.TYPES[t][0]
        packed = [(kq.pack(random_parts(t, n, k, g)), n, k) for _, n, k in shp]
        tables = [kq_cpu.shard_table([(t, n, p)]) for p, n, _ in packed]
        nbytes = sum(p.numel() for p, _, _ in packed)
        fbytes = sum(kq.file_bytes(t, n, k) for _, n, k in shp)
        for m in rows:
            tapes, outs = {}, {}
            for lname, d in libs.items():
                with graph.recording() as tapes[lname]:
                    outs[lname] = [kq_cpu.kq_linear(d, xs[m][k], table, n, a.terms)
                                   for (_, n, k), table in zip(packed, tables, strict=True)]
            sec = timed_ab(tapes, m, a.rounds)
            ms = sec["kvserve"] * 1e3
            ys = outs["kvserve"]
            amx = {}
            if a.amx:  # the tiles change speed only: bit for bit the VNNI outputs?
                tape = tapes["kvserve"]
                set_amx(lib, False)
                amx["vnni_ms"] = timed(tape, m, a.rounds) * 1e3
                vnni = [y.clone() for y in ys]
                set_amx(lib, True, 1)
                amx["amx_ms"] = timed(tape, m, a.rounds) * 1e3
                amx["identical_amx"] = _same_bits(vnni, ys)
                amx["amx_speedup"] = amx["vnni_ms"] / amx["amx_ms"]
                set_amx(lib, True, amx_default)
            base = {}
            if "baseline" in libs:  # a change of speed only: bit for bit the same outputs?
                base = {"baseline_ms": sec["baseline"] * 1e3,
                        "speedup": sec["baseline"] / sec["kvserve"],
                        "identical_to_baseline": _same_bits(ys, outs["baseline"])}
            w16m = w16_ms[m]
            row = {"type": name, "rows": m, "ms": ms, "gbs": nbytes / ms / 1e6,
                   "over_floor": ms * 1e-3 * bw["read_gbs"] * 1e9 / nbytes,
                   "w16_ms": w16m, "vs_w16": w16m / ms if w16m else None,
                   "packed_bytes": nbytes, "file_bytes": fbytes,
                   "resident_over_file": nbytes / fbytes, **base, **amx}
            results.append(row)
            log(f"{name} M={m:3d}: {ms:.2f} ms ({row['gbs']:.1f} GB/s, "
                f"{row['over_floor']:.2f}x floor"
                + (f", {row['vs_w16']:.2f}x w16)" if w16m else ")")
                + (f"; baseline {base['baseline_ms']:.2f} ms ({base['speedup']:.3f}x, "
                   f"identical: {base['identical_to_baseline']})" if base else "")
                + (f"; VNNI {amx['vnni_ms']:.2f} / AMX {amx['amx_ms']:.2f} ms "
                   f"({amx['amx_speedup']:.2f}x, identical: {amx['identical_amx']})"
                   if amx else ""))
    tmp.cleanup()
    write_json(a.json, {"bench": "kq_gemm", "threads": a.threads, "rounds": a.rounds,
                        "layers": a.layers, "hidden": a.hidden, "inter": a.inter,
                        "terms": a.terms, "shape_list": shapes(a.hidden, a.inter),
                        "amx": a.amx, "amx_rows_default": amx_default,
                        "baseline_source": a.baseline_source, "w16_bytes": w16_bytes,
                        "read_bandwidth": bw, "results": results,
                        "env": env_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
