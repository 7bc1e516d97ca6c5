"""The GGUF GEMMs' tolerance of a busy core: a decode step's weight stream timed alone and beside
a process that takes a core in short bursts, with the kernel's OpenMP loops split statically
and with work stealing (kvserve/csrc/kvs_sched.h), one run, JSON out.

    .venv/bin/python benchmarks/omp_contention.py [--threads 2] [--rounds 5] [--rows 1,16]
        [--chunks 4,8,16] [--busy-us 200] [--period-us 1500] [--replays 20] [--layers 30]
        [--json docs/bench/omp_contention.json]

Why: on a 2-core host with 2 OpenMP threads a server's event loop and a streaming client run
on the same cores. Whenever they take a core from one thread during a loop split statically,
the other thread finishes its half and waits at the loop's barrier: the step loses the burst
on both cores. With work stealing the running thread takes the chunks of the other's share it
has not started.

The stream is benchmarks/wq_gemm.py's (the default model's 30 layers of 4-bit tiles and its
8-bit head, random codes, recorded into a CPU graph and replayed as the engine replays it);
``--rows 16`` with the default 2 int8 terms is a 16-sequence decode step's 32 GEMM rows (the
AMX-INT8 tiles where the CPU has them), ``--rows 1`` a batch-1 step (the VNNI passes). The
kernel is built from this checkout's wq_gemm.c once per variant: ``static``
(-DKVS_SCHED_STATIC: each thread its share, no stealing: the split before) and ``steal_cN``
(KVS_CHUNKS_PER_THREAD=N chunks per share; the engine's build uses kvs_sched.h's default).
``identical`` says whether every variant's outputs are bit for bit the static one's.
``other_processes_cores``: the CPU the rest of the host used meanwhile (/proc/stat), in cores:
figures taken beside other work are worthless.

The burner is another process: ``--busy-us`` of spinning every ``--period-us`` (its measured
share of a core in ``burner_cpu_share``). Each round times every variant alone, then every
variant with the burner running (variants rotated per round); per variant and mode the JSON
holds the mean and median ms of a pass over all rounds' replays, and ``contended_over_alone``
(the means' ratio: what a burst costs the pass).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wq_gemm import HEAD_SHAPE, LAYER_SHAPES, make_table, record  # noqa: E402

from kvserve.bench.common import env_info, log, write_json  # noqa: E402
from kvserve.cbuild import CSRC, build_source  # noqa: E402
from kvserve.kernels.cpu import graph  # noqa: E402
from kvserve.kernels.cpu import wq_gemm as wq_cpu  # noqa: E402

# spins busy_s, then sleeps the rest of the period, until killed
_BURNER = """
import sys, time
busy, period = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6
pc = time.perf_counter
while True:
    t0 = pc()
    while pc() - t0 < busy:
        pass
    rest = period - (pc() - t0)
    if rest > 0:
        time.sleep(rest)
"""


class Burner:
    """A process spinning ``busy_us`` every ``period_us`` while running."""

    def __init__(self, busy_us: int, period_us: int) -> None:
        self.args = [sys.executable, "-c", _BURNER, str(busy_us), str(period_us)]
        self.cpu_s = self.wall_s = 0.0

    def __enter__(self) -> Burner:
        self.proc = subprocess.Popen(self.args)
        time.sleep(0.1)  # past the interpreter's start
        self.c0, self.t0 = self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s += self._cpu() - self.c0
        self.wall_s += time.perf_counter() - self.t0
        self.proc.kill()
        self.proc.wait()

    def _cpu(self) -> float:
        """The burner's CPU seconds so far (Linux /proc: utime + stime, in clock ticks)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds every process on the host has used (Linux /proc/stat: all but idle and
    iowait), to tell how much of the run's CPU went to processes other than this one."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def build_variant(tmp: str, name: str, defines: dict[str, str]):
    """This checkout's wq_gemm.c built with ``defines`` (a wrapper source that includes it)."""
    src = os.path.join(tmp, f"wq_gemm_{name}.c")
    with open(src, "w") as f:
        f.writelines(f"#define {k} {v}\n" for k, v in defines.items())
        f.write(f'#include "{os.path.join(CSRC, "wq_gemm.c")}"\n')
    return wq_cpu.bind(build_source(src, tmp))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--terms", type=int, choices=(1, 2), default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--chunks", default="8",
                    help="stealing variants: KVS_CHUNKS_PER_THREAD values, comma-separated")
    ap.add_argument("--busy-us", type=int, default=200)
    ap.add_argument("--period-us", type=int, default=1500)
    ap.add_argument("--replays", type=int, default=20, help="timed passes per variant and round")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads < 1 or a.rounds < 1 or a.layers < 0 or a.replays < 1:
        raise SystemExit("--threads, --rounds and --replays must be >= 1, --layers >= 0")
    if not 0 < a.busy_us < a.period_us:
        raise SystemExit("--busy-us must be > 0 and below --period-us")
    chunks = [int(c) for c in a.chunks.split(",") if c]
    torch.set_num_threads(a.threads)
    if wq_cpu.wq_library() is None or not graph.available():
        raise SystemExit("the C kernels did not build here (no compiler?)")
    g = torch.Generator().manual_seed(0)
    calls = [(*make_table(n, k, 4, g), n, k, 4) for _ in range(a.layers)
             for _, n, k in LAYER_SHAPES]
    calls.append((*make_table(HEAD_SHAPE[1], HEAD_SHAPE[2], 8, g), HEAD_SHAPE[1],
                  HEAD_SHAPE[2], 8))
    results = []
    burner = Burner(a.busy_us, a.period_us)
    host0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"static": build_variant(tmp, "static", {"KVS_SCHED_STATIC": "1"})}
        for c in chunks:
            libs[f"steal_c{c}"] = build_variant(tmp, f"c{c}", {"KVS_CHUNKS_PER_THREAD": str(c)})
        amx_rows = {name: wq_cpu.amx_rows(lib) for name, lib in libs.items()}
        log(f"omp_contention: {a.layers} layers + head, variants {list(libs)}, AMX-INT8 rows "
            f"{amx_rows['static'] or 'off'}; burner {a.busy_us} us every {a.period_us} us")
        for m in [int(v) for v in a.rows.split(",")]:
            xs = {k: torch.randn(m, k, generator=g) for k in {c[3] for c in calls}}
            recs = {name: record(lib, calls, xs, a.terms) for name, lib in libs.items()}
            times = {name: {"alone": [], "contended": []} for name in libs}
            for r in range(a.rounds + 1):  # round 0 warms up
                order = list(libs)[r % len(libs):] + list(libs)[:r % len(libs)]
                for mode in ("alone", "contended"):
                    ctx = burner if mode == "contended" and r else contextlib.nullcontext()
                    with ctx:
                        for name in order:
                            tape = recs[name][0]
                            for _ in range(a.replays):
                                t0 = time.perf_counter()
                                tape.replay(m)
                                if r:
                                    times[name][mode].append(time.perf_counter() - t0)
            ref = recs["static"][1]
            row: dict = {"rows": m, "gemm_rows": m * a.terms,
                         "identical": all(torch.equal(u, v) for name, (_, ys) in recs.items()
                                          for u, v in zip(ref, ys, strict=True))}
            for name, t in times.items():
                row[name] = {mode: {"mean_ms": statistics.fmean(v) * 1e3,
                                    "median_ms": statistics.median(v) * 1e3,
                                    "p90_ms": statistics.quantiles(v, n=10)[-1] * 1e3}
                             for mode, v in t.items()}
                row[name]["contended_over_alone"] = (row[name]["contended"]["mean_ms"]
                                                     / row[name]["alone"]["mean_ms"])
            results.append(row)
            log(f"M={m} (identical: {row['identical']}): " + "; ".join(
                f"{name} alone {row[name]['alone']['mean_ms']:.2f} ms, contended "
                f"{row[name]['contended']['mean_ms']:.2f} ms "
                f"({row[name]['contended_over_alone']:.3f}x)" for name in libs))
    share = burner.cpu_s / burner.wall_s if burner.wall_s else 0.0
    # CPU the rest of the host took meanwhile, in cores (should be ~0: a quiet host)
    others = (busy_cpu_s() - host0 - (own_cpu_s() - own0)) / (time.perf_counter() - wall0)
    log(f"burner: {share:.3f} of a core; other processes: {others:.3f} cores")
    write_json(a.json, {"bench": "omp_contention", "threads": a.threads, "rounds": a.rounds,
                        "replays": a.replays, "layers": a.layers, "terms": a.terms,
                        "chunks_per_thread": chunks, "busy_us": a.busy_us,
                        "period_us": a.period_us, "burner_cpu_share": share,
                        "other_processes_cores": others,
                        "amx_rows": amx_rows, "load_avg": os.getloadavg(),
                        "results": results, "env": env_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
