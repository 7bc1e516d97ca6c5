"""Decode speed at fixed batch sizes, prefill excluded, optionally beside peers on the same
weights.

For each batch size B and round, B random-token prompts of ``input_len`` are submitted at once
(greedy, ``ignore_eos``, ``max_tokens=output_len``); only steps in which all B sequences decode
are timed: decode tokens/s = B x (timed steps) / (their seconds). Reported: the median over
``rounds``. Implementations (kvserve and peers) alternate first place between rounds.

Memory floor: before the engine is built a probe streams a buffer far beyond the caches
(``read_bandwidth``; ``env.read_bandwidth.read_gbs`` in the JSON, beside ``env.cpu``). Each
kvserve row then carries ``floor_ms`` = (weight bytes a decode step reads + B x KV bytes of a
sequence at the timed steps' mean context) / that bandwidth, and ``step_over_floor`` = its
median step / ``floor_ms`` (1.0 would be reading every byte at full bandwidth; batch 1 is where
a decode step should come close). Numbers from a loaded, shared host do not count.

Peers: ``hf`` runs ``transformers`` ``generate`` in this process on the same folder and dtype
(batched, left padding, per-token timestamps from a stopping-criteria hook; its decode time is
first token -> last token). ``llamacpp`` and ``vllm`` run a script in the peer's interpreter
(``--peer-python``: one interpreter, or ``llamacpp=PATH,vllm=PATH``; else
``KVSERVE_LLAMACPP_PYTHON`` / ``KVSERVE_VLLM_PYTHON``, else the venvs of
``scripts/setup_peers.sh``: ``kvserve.bench.peers.peer_python``), after kvserve and HF, on
the very prompts kvserve decoded, with kvserve's thread count; a peer that does not import
there is recorded as ``"not installed"``. Each reports the greedy-token agreement of round 0
with kvserve.

- ``vllm``: ``LLM`` with the engine core in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  ``enforce_eager``, no prefix caching, ``VLLM_CPU_KVCACHE_SPACE`` 1 GB unless set, one prefill
  step for all B prompts; dtype = ``peer_dtype`` or the environment variable
  ``KVSERVE_VLLM_DTYPE``, else bf16 for a bf16 checkpoint on an AVX512-BF16 / AMX CPU (vLLM's
  fast path there), else kvserve's compute dtype; ``LLMEngine.step`` is timed per step
  and a step counts when every sequence gained exactly one token.
- ``llamacpp``: the low-level API, one context per B (``n_seq_max`` = B, ``n_ctx`` =
  B x (input + output)), one sequence id per sequence, all prompts prefilled in one
  ``llama_decode``, then one ``llama_decode`` of B tokens per step with host argmax on each
  sequence's logits (timed). The GGUF is ``--peer-model``, else the HF folder converted to GGUF
  (``llamacpp_outtype``, bf16) by llama.cpp's ``convert_hf_to_gguf.py`` named by
  ``llamacpp_convert`` or the environment variable ``KVSERVE_LLAMACPP_CONVERT``, run in
  ``--peer-python``; with neither the peer records a "no converter" error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import subprocess
import tempfile
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from kvserve.bench.common import (
    StepRecorder,
    env_info,
    log,
    make_random_llama,
    median,
    model_label,
    ms,
    peer_importable,
    pyplot,
    random_prompts,
    read_bandwidth,
    resolve_model_path,
    rotated,
    run_peer_script,
)
from kvserve.bench.peers import peer_python, script_path
from kvserve.bench.settings import PEERS, LatencyConfig  # noqa: F401
from kvserve.config import dtype_name
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# kvserve
# --------------------------------------------------------------------------------------------


def kvserve_round(engine: LLMEngine, rec: StepRecorder, prompts: list[list[int]],
                  output_len: int, tag: str) -> dict[str, Any]:
    b = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rec.clear()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    outs: dict[str, list[int]] = {}
    first_decode = None
    while engine.has_unfinished_requests():
        for o in rec.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        if first_decode is None and rec.steps and rec.steps[-1].all_decode:
            first_decode = time.perf_counter() - rec.steps[-1].seconds
    timed = [s for s in rec.steps if s.all_decode and s.batch == b]
    secs = sum(s.seconds for s in timed)
    return {
        "decode_tokens_per_s": b * len(timed) / secs if secs > 0 else None,
        "decode_steps": len(timed),
        "decode_step_ms_median": ms(median(s.seconds for s in timed)),
        "prefill_s": None if first_decode is None else first_decode - t0,
        "tokens": [outs[f"{tag}-{i}"] for i in range(b)],
    }


# --------------------------------------------------------------------------------------------
# HF peer (in process)
# --------------------------------------------------------------------------------------------


class HFPeer:
    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        if path.lower().endswith(".gguf"):  # transformers dequantizes a GGUF's weights
            folder, name = os.path.split(os.path.abspath(path))
            self.model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=dtype, local_files_only=True).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                              local_files_only=True).eval()
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            eos = self.model.config.eos_token_id
            self.pad = (eos[0] if isinstance(eos, list) else eos) or 0

    def round(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        # Left padding: pad every prompt on the left to the longest (they are equal here).
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                min_new_tokens=output_len, do_sample=False, pad_token_id=self.pad,
                stopping_criteria=StoppingCriteriaList([_Stamp()]),
            )
        b = len(prompts)
        secs = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        return {
            "decode_tokens_per_s": b * (len(stamps) - 1) / secs if secs > 0 else None,
            "decode_steps": len(stamps) - 1,
            "decode_step_ms_median": ms(median(b2 - a for a, b2 in zip(stamps, stamps[1:],
                                                                        strict=False))),
            "prefill_s": stamps[0] - t0 if stamps else None,
            "tokens": out[:, width:].tolist(),
        }


# --------------------------------------------------------------------------------------------
# peers in another interpreter
# --------------------------------------------------------------------------------------------
#
# Each runner (kvserve/bench/peers/*_latency.py) reads a JSON payload on stdin: "prompts" maps
# str(B) to one list of B token-id prompts per round (the very prompts kvserve decodes),
# plus input_len, output_len, threads, dtype and the model (a HF folder, or "gguf" for
# llama.cpp). It prints one JSON line: peer, version, threads, dtype and per-batch results
# (decode tokens/s median and per round, median step ms, median prefill s, decode steps per
# round, and the greedy tokens of round 0, which the bench turns into the agreement with
# kvserve). Only steps in which every one of the B sequences decodes one token are timed, as
# for kvserve.



_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def llamacpp_converter(lc: LatencyConfig) -> str | None:
    """llama.cpp's ``convert_hf_to_gguf.py``: ``--llamacpp-convert`` / the config, else the
    environment variable ``KVSERVE_LLAMACPP_CONVERT``; None when neither names one."""
    return lc.llamacpp_convert or os.environ.get("KVSERVE_LLAMACPP_CONVERT") or None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


def _run_converter(python: str, converter: str, model: str, outfile: str, outtype: str,
                   timeout: float) -> str | None:
    try:
        r = subprocess.run([python, converter, model, "--outfile", outfile, "--outtype", outtype],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"GGUF conversion timed out after {timeout:.0f} s"
    if r.returncode != 0 or not os.path.isfile(outfile):
        return f"GGUF conversion exited {r.returncode}: {(r.stderr or r.stdout)[-1500:]}"
    return None


def convert_to_gguf(python: str, converter: str, model: str, outfile: str, outtype: str,
                    timeout: float) -> tuple[str | None, str]:
    """Run llama.cpp's HF -> GGUF converter in ``python``. Returns (error or None, vocab): vocab
    is "checkpoint" when the checkpoint's tokenizer converted, else "placeholder" (a second
    try on a copy of the folder, weights linked, with a placeholder SentencePiece vocab of the
    same size, written by the peer runner ``placeholder_spm``)."""
    if not os.path.isfile(converter):
        return f"no converter at {converter}", ""
    log(f"converting {model} to GGUF ({outtype}) with {converter}")
    err = _run_converter(python, converter, model, outfile, outtype, timeout)
    if err is None:
        return None, "checkpoint"
    log("the checkpoint's tokenizer did not convert; retrying with a placeholder vocab")
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvserve-gguf-src-") as stage:
        for name in os.listdir(model):
            if name not in _TOKENIZER_FILES:
                os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(stage, name))
        spm = run_peer_script(python, script_path("placeholder_spm"),
                              {"vocab": vocab, "out": os.path.join(stage, "tokenizer.model")},
                              timeout)
        err2 = (f"placeholder vocab: {spm}" if "error" in spm else
                _run_converter(python, converter, stage, outfile, outtype, timeout))
    if err2 is not None:
        return f"{err}\nwith a placeholder vocab: {err2}", ""
    return None, "placeholder"


def run_external_peer(name: str, lc: LatencyConfig, model: str,
                      prompts: dict[str, list[list[list[int]]]],
                      dtype: str = "bfloat16") -> dict[str, Any] | str:
    module = {"llamacpp": "llama_cpp", "vllm": "vllm"}[name]
    python = peer_python(name, lc.peer_python)
    if not peer_importable(python, module):
        return "not installed"
    payload = {"model": model, "batch_sizes": lc.batch_sizes, "input_len": lc.input_len,
               "output_len": lc.output_len, "rounds": lc.rounds, "seed": lc.seed,
               "threads": torch.get_num_threads(), "prompts": prompts,
               "dtype": lc.peer_dtype or os.environ.get("KVSERVE_VLLM_DTYPE") or dtype,
               "kv_cache_gb": lc.vllm_kv_cache_gb}
    with contextlib.ExitStack() as stack:
        extra: dict[str, Any] = {}
        if name == "llamacpp":
            gguf = lc.peer_model or (model if model.lower().endswith(".gguf") else None)
            if not gguf:
                converter = llamacpp_converter(lc)
                if converter is None:
                    return {"error": "no converter: pass --peer-model GGUF, or set "
                                     "KVSERVE_LLAMACPP_CONVERT (or --llamacpp-convert) to "
                                     "llama.cpp's convert_hf_to_gguf.py"}
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-gguf-"))
                gguf = os.path.join(tmp, f"model-{lc.llamacpp_outtype}.gguf")
                err, vocab = convert_to_gguf(python or "", converter, model, gguf,
                                             lc.llamacpp_outtype, lc.peer_timeout)
                if err is not None:
                    return {"error": err}
                extra = {"gguf": "converted", "gguf_outtype": lc.llamacpp_outtype,
                         "gguf_vocab": vocab, "converter": converter}
            payload["gguf"] = gguf
            script = script_path("llamacpp_latency")
        else:
            script = script_path("vllm_latency")
        log(f"running the {name} peer in {python}")
        out = run_peer_script(python or "", script, payload, lc.peer_timeout)
        out.update(extra)
        return out


def _attach_agreement(peer: dict[str, Any] | str, ours: dict[int, list[list[int]]]) -> None:
    """Replace each result's round-0 ``tokens`` by the greedy agreement with kvserve's."""
    if not isinstance(peer, dict) or not isinstance(peer.get("results"), list):
        return
    agree = {}
    for row in peer["results"]:
        toks = row.pop("tokens", None)
        b = row.get("batch_size")
        if toks and b in ours and len(toks) == len(ours[b]):
            agree[str(b)] = _agreement(ours[b], toks)
    peer["greedy_token_agreement_with_kvserve"] = agree


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def rss_mib() -> float:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def engine_memory(engine: LLMEngine, rss_before: float) -> dict[str, float]:
    """Weights as held (INT4 packed or dense) and in bf16, the KV pool, and the process's
    resident-memory growth while the engine was built (weights + KV pages + buffers)."""
    from kvserve.model.loader import weight_bytes

    held, bf16 = weight_bytes(engine.model)
    kv = engine.kv_cache.data.numel() * engine.kv_cache.data.element_size()
    return {"weights_mib": held / 2**20, "weights_bf16_mib": bf16 / 2**20,
            "kv_pool_mib": kv / 2**20, "rss_growth_mib": rss_mib() - rss_before}


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: everything the model holds
    (kvserve.model.loader.weight_bytes) except an input-embedding table the LM head does not
    share -- the embedding reads only the batch's rows."""
    from kvserve.model.loader import weight_bytes

    held, _ = weight_bytes(model)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if emb is None or head is None:
        return held
    emb_ids = {id(t) for t in emb.parameters()}
    if emb_ids & {id(t) for t in head.parameters()}:
        return held  # tied: the head reads the whole table every step
    return held - sum(t.numel() * t.element_size() for t in emb.parameters())


def memory_floor(engine: LLMEngine, lc: LatencyConfig, bandwidth: dict[str, Any]
                 ) -> dict[str, Any]:
    """The memory floor of a decode step: (weight bytes + the batch's KV bytes) / the
    measured read bandwidth. KV bytes per sequence: the cache's bytes per token (all layers,
    K and V, scales) times the mean context of the timed steps, input_len + output_len / 2."""
    weights = decode_weight_bytes(engine.model)
    per_token = engine.kv_cache.bytes_per_token
    context = lc.input_len + lc.output_len / 2
    gbs = bandwidth["read_gbs"]
    return {"weight_bytes_per_step": weights, "kv_bytes_per_token": per_token,
            "mean_context_tokens": context, "read_gbs": gbs,
            "floor_ms": {str(b): ms((weights + b * per_token * context) / (gbs * 1e9))
                         for b in lc.batch_sizes}}


def vllm_default_dtype(engine: LLMEngine) -> str:
    """The vLLM peer's dtype unless one is named: bfloat16 for a bf16 checkpoint on a CPU with
    AVX512-BF16 / AMX (vLLM's own fast path there), else the dtype kvserve computes in (fp32
    for a 16-bit checkpoint: vLLM computes bf16 with slow torch ops without AVX512-BF16)."""
    from kvserve.cbuild import cpu_kind

    storage = engine.executor.driver.loaded.storage
    if storage == torch.bfloat16 and cpu_kind() in ("avx512_bf16", "amx"):
        return "bfloat16"
    return _TORCH_DTYPE_NAMES.get(dtype_name(engine.model_config.dtype), "bfloat16")


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


def run_latency(lc: LatencyConfig) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        spec = None
        model = lc.base.model
        if model is None and lc.make_random_llama is not None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-randllama-"))
            log(f"making a random-init Llama ({lc.make_random_llama}) in {tmp}")
            spec = make_random_llama(tmp, lc.make_random_llama)
            model = tmp
        model = resolve_model_path(model)
        result = _run(lc, model)
        result["random_llama"] = spec
        return result


def _run(lc: LatencyConfig, model: str) -> dict[str, Any]:
    max_b = max(lc.batch_sizes)
    base = dataclasses.replace(lc.base, model=model, progress=False,
                               max_num_seqs=max(max_b, lc.base.max_num_seqs))
    if base.kv_cache_memory is None and base.num_blocks is None:
        per_seq = math.ceil((lc.input_len + lc.output_len) / base.block_size)
        base = dataclasses.replace(base, num_blocks=max_b * per_seq + 1)
    log("read-bandwidth probe")
    bandwidth = read_bandwidth(lc.bandwidth_probe_mib)
    rss0 = rss_mib()
    engine = LLMEngine(base)
    engines = {"kvserve": (engine, StepRecorder(engine), engine_memory(engine, rss0))}
    if lc.compare_model:
        rss0 = rss_mib()
        other = LLMEngine(dataclasses.replace(base, model=resolve_model_path(lc.compare_model)))
        engines["kvserve_compare"] = (other, StepRecorder(other), engine_memory(other, rss0))
    if lc.input_len + lc.output_len > engine.model_config.max_model_len:
        raise ValueError(f"input_len + output_len exceeds max_model_len "
                         f"{engine.model_config.max_model_len}")
    rec = engines["kvserve"][1]
    vocab = engine.model_config.vocab_size
    impls: list[str] = list(engines)
    hf = None
    peers: dict[str, Any] = {}
    if "hf" in lc.peers:
        hf = HFPeer(model, engine.model_config.dtype)
        impls.append("hf")

    if lc.warmup:
        w = random_prompts(min(max_b, 4), min(lc.input_len, 32), vocab, lc.seed + 999)
        for eng, erec, _ in engines.values():
            kvserve_round(eng, erec, w, 4, "warmup")
        if hf is not None:
            hf.round(w, 4)

    rows: dict[str, dict[int, list[dict]]] = {i: {b: [] for b in lc.batch_sizes} for i in impls}
    seq = 0
    bar = tqdm(total=lc.rounds * len(lc.batch_sizes) * len(impls), desc="latency",
               unit="run", disable=not lc.progress)
    for r in range(lc.rounds):
        for bi, b in enumerate(lc.batch_sizes):
            prompts = random_prompts(b, lc.input_len, vocab, lc.seed + 1000 * r + bi)
            for impl in rotated(impls, r + bi):
                if impl in engines:
                    eng, erec, _ = engines[impl]
                    res = kvserve_round(eng, erec, prompts, lc.output_len, f"r{seq}")
                    seq += 1
                else:
                    assert hf is not None
                    res = hf.round(prompts, lc.output_len)
                rows[impl][b].append(res)
                tps = res["decode_tokens_per_s"] or 0.0
                bar.set_postfix_str(f"{impl} B={b}: {tps:.0f} tok/s")
                bar.update(1)
    bar.close()

    def table(impl: str) -> list[dict[str, Any]]:
        out = []
        for b in lc.batch_sizes:
            rs = rows[impl][b]
            tps = [x["decode_tokens_per_s"] for x in rs if x["decode_tokens_per_s"]]
            out.append({
                "batch_size": b,
                "decode_tokens_per_s": median(tps),
                "decode_tokens_per_s_rounds": tps,
                "decode_step_ms_median": median(x["decode_step_ms_median"] for x in rs
                                                if x["decode_step_ms_median"] is not None),
                "prefill_s_median": median(x["prefill_s"] for x in rs
                                           if x["prefill_s"] is not None),
                "decode_steps_per_round": rs[0]["decode_steps"] if rs else 0,
            })
        return out

    ours = table("kvserve")
    floor = memory_floor(engine, lc, bandwidth)
    for row in ours:  # how close each step comes to reading its bytes at full bandwidth
        f = floor["floor_ms"][str(row["batch_size"])]
        row["floor_ms"] = f
        step = row["decode_step_ms_median"]
        row["step_over_floor"] = step / f if step and f else None
    summary: dict[str, Any] = {}
    if hf is not None:
        hf_rows = table("hf")
        agree = {str(b): _agreement(rows["kvserve"][b][0]["tokens"], rows["hf"][b][0]["tokens"])
                 for b in lc.batch_sizes}
        peers["hf"] = {"results": hf_rows, "greedy_token_agreement_with_kvserve": agree}
        summary["kvserve_over_hf"] = {
            str(a["batch_size"]): (a["decode_tokens_per_s"] / h["decode_tokens_per_s"])
            if a["decode_tokens_per_s"] and h["decode_tokens_per_s"] else None
            for a, h in zip(ours, hf_rows, strict=True)
        }
    result: dict[str, Any] = {
        "bench": "latency",
        "model": model_label(model),
        "model_dtype": dtype_name(engine.model_config.dtype),
        "kv_cache_dtype": engine.kv_mode,
        "kv_integrity": base.kv_integrity,
        "input_len": lc.input_len,
        "output_len": lc.output_len,
        "rounds": lc.rounds,
        "batch_sizes": lc.batch_sizes,
        "env": {**env_info(), "read_bandwidth": bandwidth},
        "memory_floor": floor,
        "kvserve": ours,
        "memory": engines["kvserve"][2],
        "peers": peers,
        "summary": summary,
    }
    if "kvserve_compare" in engines:
        other = engines["kvserve_compare"][0]
        cmp_rows = table("kvserve_compare")
        peers["kvserve_compare"] = {
            "model": model_label(other.model_config.path),
            "model_dtype": dtype_name(other.model_config.dtype),
            "kv_cache_dtype": dtype_name(other.kv_dtype), "results": cmp_rows,
            "memory": engines["kvserve_compare"][2],
            "greedy_token_agreement_with_kvserve": {
                str(b): _agreement(rows["kvserve"][b][0]["tokens"],
                                   rows["kvserve_compare"][b][0]["tokens"])
                for b in lc.batch_sizes}}
        summary["kvserve_over_compare"] = {
            str(a["batch_size"]): (a["decode_tokens_per_s"] / c["decode_tokens_per_s"])
            if a["decode_tokens_per_s"] and c["decode_tokens_per_s"] else None
            for a, c in zip(ours, cmp_rows, strict=True)}
    peer_dtype = vllm_default_dtype(engine)
    del engine, rec, hf, engines
    gc.collect()
    external = [n for n in ("llamacpp", "vllm") if n in lc.peers]
    if external:
        # the very prompts kvserve decoded, per batch size and round
        prompts = {str(b): [random_prompts(b, lc.input_len, vocab, lc.seed + 1000 * r + bi)
                            for r in range(lc.rounds)]
                   for bi, b in enumerate(lc.batch_sizes)}
        ours_tokens = {b: rows["kvserve"][b][0]["tokens"] for b in lc.batch_sizes}
        for name in external:
            peers[name] = run_external_peer(name, lc, model, prompts, peer_dtype)
            _attach_agreement(peers[name], ours_tokens)
    return result


def plot_latency(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {"kvserve": result["kvserve"]}
    for name, peer in result["peers"].items():
        if isinstance(peer, dict) and isinstance(peer.get("results"), list):
            series[name] = peer["results"]
    labels = {"kvserve": f"kvserve ({os.path.basename(result['model'])})"}
    cmp_ = result["peers"].get("kvserve_compare")
    if isinstance(cmp_, dict):
        labels["kvserve_compare"] = f"kvserve ({os.path.basename(cmp_.get('model', '?'))})"
    for name, rows in series.items():
        pts = [(r["batch_size"], r.get("decode_tokens_per_s")) for r in rows]
        pts = [(b, t) for b, t in pts if t]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=labels.get(name, name))
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["batch_sizes"], [str(b) for b in result["batch_sizes"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (prefill excluded)")
    spec = result.get("random_llama")
    name = result["model"] if not spec else "random-init Llama " + ",".join(
        f"{k}={v}" for k, v in spec.items() if k != "seed")
    ax.set_title(f"{name}\nin {result['input_len']} / out {result['output_len']}, "
                 f"median of {result['rounds']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'impl':<10}{'batch':>6}{'decode tok/s':>14}{'step ms':>10}{'prefill s':>11}"
             f"{'floor ms':>10}{'step/floor':>11}"]
    series = {"kvserve": result["kvserve"]}
    for name, peer in result["peers"].items():
        if isinstance(peer, dict) and isinstance(peer.get("results"), list):
            series[name] = peer["results"]
        else:
            lines.append(f"{name:<10} {peer if isinstance(peer, str) else peer.get('error')}")
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for name, rows in series.items():
        for r in rows:
            lines.append(f"{name:<10}{r['batch_size']:>6}{f(r.get('decode_tokens_per_s')):>14}"
                         f"{f(r.get('decode_step_ms_median'), 2):>10}"
                         f"{f(r.get('prefill_s_median'), 3):>11}"
                         f"{f(r.get('floor_ms'), 2):>10}{f(r.get('step_over_floor'), 2):>11}")
    bw = result.get("env", {}).get("read_bandwidth")
    if bw:
        lines.append(f"memory floor: (weight + KV bytes) / {bw['read_gbs']:.1f} GB/s read "
                     f"bandwidth ({bw['buffer_mib']} MiB streamed, {bw['threads']} thread(s))")
    return "\n".join(lines)
