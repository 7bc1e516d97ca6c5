"""Tensor-parallel engine (tensor_parallel_size=2) against the single-process engine, on CPU
with gloo. Each test runs one spawned driver process that builds the TP=1 engine and then the
TP=2 engine (which spawns its worker rank), one thread per rank, so both see the same
conditions."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.harness import run_driver

# slow: spawns tensor-parallel rank processes
pytestmark = pytest.mark.slow

PROMPTS = [list(range(3, 40)), [5, 9, 11, 300, 301, 7, 7, 42], list(range(100, 170))]
SHARED = list(range(10, 58))  # 48 tokens = 3 full blocks of 16: a prefix-cache hit


def _kw(tp: int, **kw) -> dict:
    base = dict(dtype="float32", kv_cache_dtype="fp32", num_blocks=64, progress=False,
                tensor_parallel_size=tp, distributed_timeout_s=60)
    base.update(kw)
    return base


def _engine_outputs(path: str, kw: dict) -> dict:
    from kvserve import LLM, SamplingParams

    res = {}
    for tp in (1, 2):
        llm = LLM(path, **_kw(tp, **kw))
        try:
            r: dict = {"logits": [llm.engine.prompt_logits(p) for p in PROMPTS[:2]]}
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            r["greedy"] = [o.outputs[0].token_ids for o in outs]
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=1.0, top_p=0.9, seed=1234,
                                               max_tokens=16, ignore_eos=True))
            r["seeded"] = [o.outputs[0].token_ids for o in outs]
            outs = llm.generate({"prompt_token_ids": PROMPTS[1]},
                                SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                               prompt_logprobs=2))
            r["logprobs"] = [sorted(d.items()) for d in outs[0].outputs[0].logprobs]
            r["prompt_logprobs"] = [None if d is None else sorted(d.items())
                                    for d in outs[0].prompt_logprobs]
            llm.engine.debug.check_no_leaks()
        finally:
            llm.engine.shutdown()
        res[tp] = r
    return res


def _assert_same(res: dict) -> None:
    one, two = res[1], res[2]
    for a, b in zip(one["logits"], two["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert two["greedy"] == one["greedy"]
    assert two["seeded"] == one["seeded"]
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        torch.testing.assert_close(torch.tensor([x for _, x in b]),
                                   torch.tensor([x for _, x in a]), atol=1e-4, rtol=1e-4)
    assert len(one["prompt_logprobs"]) == len(two["prompt_logprobs"])


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 1}),  # tp > num_kv_heads: the KV head is replicated
    ("qwen3", {}),  # per-head q/k norm
    ("qwen2", {}),  # q/k/v bias (column parallel), added once per shard
])
def test_tp2_matches_tp1(model_factory, arch, overrides):
    path = model_factory(arch, **overrides)
    _assert_same(run_driver(_engine_outputs, path, {}))


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory):
    from kvserve.quant.quantizer import quantize_checkpoint
    from tests.conftest import make_tiny_model
    from tests.model.gguf_writer import write_gguf

    d = tmp_path_factory.mktemp("int4")
    hf = make_tiny_model(str(d / "hf"), "llama")
    ct = str(d / "ct")
    quantize_checkpoint(hf, ct, group_size=32, symmetric=False, progress=False)
    gguf = write_gguf(hf, str(d / "tiny.gguf"),
                      lambda n: "Q8_0" if n.startswith("token_embd") or n.startswith("output.")
                      else ("F32" if "norm" in n else "Q4_1"))
    return {"compressed-tensors": ct, "gguf-q4_1": gguf}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gguf-q4_1"])
def test_tp2_int4_matches_tp1(int4_models, fmt):
    """INT4 shards: rows of column-parallel weights, whole quant groups of row-parallel ones.
    GGUF with fp32 activations: int8 ones round x per 32-column block, so a last-bit
    difference in x (TP sums partial products in another order) can move a rounding step and
    the logits by more than fp32 noise (see the next test)."""
    kw = {"gguf_activations": "fp32"} if fmt.startswith("gguf") else {}
    _assert_same(run_driver(_engine_outputs, int4_models[fmt], kw))


def test_tp2_gguf_int8_activations_match_tp1(int4_models):
    """The default int8x2 activations under TP: shards quantize whole 32-column blocks of
    their slice (the same blocks as TP=1), so TP=2 tracks TP=1 within a rounding step of the
    second int8 pass -- greedy tokens equal, logits within 1e-3."""
    res = run_driver(_engine_outputs, int4_models["gguf-q4_1"], {})
    for a, b in zip(res[1]["logits"], res[2]["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    assert res[2]["greedy"] == res[1]["greedy"]


def _fp8_caches(path: str) -> dict:
    from kvserve import LLM, SamplingParams

    res = {}
    for tp in (1, 2):
        llm = LLM(path, **_kw(tp, kv_cache_dtype="fp8", kv_integrity="off"))
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            kv = llm.engine.kv_cache
            shape = (tuple(kv.data.shape), tuple(kv.scales.shape))
            if tp == 1:
                ranks = [torch.cat([kv.data.reshape(-1).view(torch.uint8),
                                    kv.scales.reshape(-1).view(torch.uint8)])]
            else:
                ranks = llm.engine.debug.gather_kv()
            res[tp] = {"tokens": [o.outputs[0].token_ids for o in outs], "ranks": ranks,
                       "shape": shape}
        finally:
            llm.engine.shutdown()
    return res


def _split(raw: torch.Tensor, data_shape, scale_shape):
    n = 1
    for s in data_shape:
        n *= s
    data = raw[:n].view(torch.float8_e4m3fn).reshape(data_shape)
    scales = raw[n:].view(torch.bfloat16).reshape(scale_shape)
    return data, scales


def test_fp8_kv_slices_match_tp1(model_factory):
    """Rank r's FP8 cache (and its per-token-head scales) is the TP=1 cache's slice of its
    KV heads: same block ids on every rank, heads split."""
    res = run_driver(_fp8_caches, model_factory("llama"))
    assert res[2]["tokens"] == res[1]["tokens"]
    full_data, full_scales = _split(res[1]["ranks"][0], *res[1]["shape"])
    assert full_data.shape[-2] == 2
    for r, raw in enumerate(res[2]["ranks"]):
        data, scales = _split(raw, *res[2]["shape"])
        want, want_s = full_data[..., r : r + 1, :], full_scales[..., r : r + 1]
        torch.testing.assert_close(data.float(), want.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(scales.float(), want_s.float(), rtol=1e-2, atol=1e-6)
        same = (data.view(torch.uint8) == want.view(torch.uint8)).float().mean()
        assert same >= 0.99, f"rank {r}: only {same:.4f} of the FP8 bytes equal"


def _scheduling(path: str) -> dict:
    """Prefix hits, chunked prefill (16-token chunks) and preemption (8 blocks for 4
    requests) under TP."""
    from kvserve import LLM, SamplingParams

    prompts = [SHARED + [400 + i, 401 + i] for i in range(4)]
    res = {}
    for tp in (1, 2):
        llm = LLM(path, **_kw(tp, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=4))
        try:
            sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            first = llm.generate({"prompt_token_ids": prompts[0]}, sp)
            rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp)
            outs = first + rest
            res[tp] = {"tokens": [o.outputs[0].token_ids for o in outs],
                       "cached": [o.num_cached_tokens for o in outs],
                       "preempted": llm.engine.scheduler.num_preemptions}
            llm.engine.debug.check_no_leaks()
        finally:
            llm.engine.shutdown()
    return res


def test_prefix_chunked_preemption_under_tp(model_factory):
    res = run_driver(_scheduling, model_factory("llama"))
    assert res[2]["tokens"] == res[1]["tokens"]
    assert res[2]["cached"] == res[1]["cached"]
    assert max(res[2]["cached"][1:]) >= 32  # later prompts hit the shared prefix blocks
    assert res[2]["preempted"] == res[1]["preempted"] > 0


def _drill(path: str) -> dict:
    """Seal the shared prefix, flip one bit of a sealed block on rank 1 only, reuse the
    prefix: every rank must agree the block is bad, and recompute must give the clean
    output."""
    from kvserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": SHARED + [400, 401]}
    llm = LLM(path, **_kw(2))
    try:
        clean = llm.generate(prompt, sp)[0].outputs[0].token_ids
        block = sorted(llm.engine.integrity.seals)[0]  # the shared prefix's first block
        llm.engine.debug.inject_kv_fault(block, layer=1, kind="bitflip", rank=1, index=5, bit=3)
        again = llm.generate(prompt, sp)[0]
        stats = llm.engine.integrity.stats()
        llm.engine.debug.check_no_leaks()
    finally:
        llm.engine.shutdown()
    return {"clean": clean, "again": again.outputs[0].token_ids, "stats": stats,
            "cached": again.num_cached_tokens}


def test_integrity_drill_rank1_bitflip(model_factory):
    res = run_driver(_drill, model_factory("llama"))
    assert res["again"] == res["clean"]
    assert sum(res["stats"]["failures"].values()) >= 1  # detected (agreed via all-reduce)
    assert res["stats"]["quarantined_blocks"] >= 1
    assert res["cached"] < len(SHARED)  # the bad block and what follows were recomputed


def _replica_drill(path: str) -> dict:
    """Replicated KV (MLA latent, or KV heads when tp > num_key_value_heads): corrupt rank
    1's copy of a block *before* it is sealed, so rank 1's own seal covers the bad bytes and
    only the cross-rank comparison at seal time can see it. The block must be quarantined on
    the agreed verdict, its holder recomputed, and the output equal the clean run's.

    Prompt of 20 tokens, 16-token prefill chunks: step 1 fills and seals block 0, step 2
    writes tokens 16-19 into block 1, which decode then fills. The flip hits the lowest
    mantissa bit of token 17's first value in layer 1, too small to change a greedy token
    while it is read before the seal."""
    from kvserve import LLM, SamplingParams

    prompt = {"prompt_token_ids": SHARED[:20]}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, **_kw(2, max_num_batched_tokens=16, enable_prefix_caching=False))
    try:
        engine = llm.engine
        clean = llm.generate(prompt, sp)[0].outputs[0].token_ids
        assert sum(engine.integrity.stats()["failures"].values()) == 0
        engine.add_request("drill", prompt, sp)
        engine.step()
        engine.step()
        req = engine.scheduler.running[0]
        assert req.num_computed_tokens == 20
        block = engine.kv_manager.get_block_ids(req)[1]
        row = engine.kv_cache.data[1, block, 0, 0].numel() * engine.kv_cache.data.element_size()
        engine.debug.inject_kv_fault(block, layer=1, kind="bitflip", rank=1, index=row, bit=0)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = o.outputs[0].token_ids
        stats = engine.integrity.stats()
        engine.debug.check_no_leaks()
    finally:
        llm.engine.shutdown()
    return {"clean": clean, "again": out, "stats": stats, "replica": engine.executor.driver
            .replica_key}


def test_replicated_kv_heads_compared_across_ranks(model_factory):
    """tp=2 > num_key_value_heads=1: both ranks hold KV head 0; a copy that differs on rank
    1 only is caught at seal and repaired by recompute."""
    res = run_driver(_replica_drill, model_factory("llama", num_key_value_heads=1))
    assert res["replica"] == 0
    assert res["again"] == res["clean"]
    assert res["stats"]["failures"] == {"replica": 1}, res["stats"]
    assert res["stats"]["repairs"].get("rollback", 0) >= 1, res["stats"]
    assert res["stats"]["quarantined_blocks"] == 1


def test_validation_before_any_process(model_factory):
    """tp must divide the heads: a ValueError naming the parameter and the sizes that work,
    raised before a worker is spawned (fast, in-process)."""
    from kvserve import LLM

    path = model_factory("llama")
    with pytest.raises(ValueError, match=r"num_attention_heads=4.*\[1, 2, 4\]"):
        LLM(path, tensor_parallel_size=3, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        LLM(path, tensor_parallel_size=0, progress=False)
    path = model_factory("llama", intermediate_size=90)
    with pytest.raises(ValueError, match=r"intermediate_size=90.*\[1, 2\]"):
        LLM(path, tensor_parallel_size=4, progress=False)


def _worker_death(path: str) -> str:
    import time

    from kvserve import LLM, SamplingParams
    from kvserve.distributed.parallel_state import DistributedError

    llm = LLM(path, **_kw(2, distributed_timeout_s=20))
    llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
    proc = llm.engine.executor.procs[0]
    os.kill(proc.pid, 9)
    proc.join(10)
    t0 = time.monotonic()
    try:
        llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=2))
    except DistributedError as e:
        msg = f"{e} after {time.monotonic() - t0:.1f}s"
    else:
        msg = "no error"
    llm.engine.shutdown()
    return msg


def test_worker_death_is_a_clear_error(model_factory):
    msg = run_driver(_worker_death, model_factory("llama"))
    assert "worker rank 1" in msg and "exited with code -9" in msg, msg


def _worker_fails_mid_generate(path: str, sig: int) -> tuple[str, float]:
    """``sig`` reaches the worker rank while ``generate`` is decoding (from a timer thread):
    ``generate`` must raise, within the collective timeout, not hang."""
    import signal
    import threading
    import time

    from kvserve import LLM, SamplingParams
    from kvserve.distributed.parallel_state import DistributedError

    llm = LLM(path, **_kw(2, distributed_timeout_s=5))
    pid = llm.engine.executor.procs[0].pid
    sent: list[float] = []

    def fail() -> None:
        os.kill(pid, sig)
        sent.append(time.monotonic())

    timer = threading.Timer(1.0, fail)
    timer.start()
    try:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                     SamplingParams(max_tokens=100000, ignore_eos=True))
        msg = "no error"
    except DistributedError as e:
        msg = str(e)
    took = time.monotonic() - sent[0] if sent else -1.0
    timer.join()
    llm.engine.shutdown()  # kills a stopped worker too
    if sig == signal.SIGSTOP:
        assert llm.engine.executor.procs[0].exitcode is not None, "the stopped worker lives"
    return msg, took


def test_worker_killed_mid_generate_raises(model_factory):
    import signal

    msg, took = run_driver(_worker_fails_mid_generate, model_factory("llama"), signal.SIGKILL)
    assert "worker rank 1" in msg and "exited with code -9" in msg, msg
    assert 0 <= took < 5, took  # a dead peer fails the collective at once


def test_worker_hung_mid_generate_raises_after_timeout(model_factory):
    import signal

    msg, took = run_driver(_worker_fails_mid_generate, model_factory("llama"), signal.SIGSTOP)
    assert "rank 1" in msg and "stopped" in msg and "cannot continue" in msg, msg
    assert 4 < took < 30, took  # the 5 s collective timeout


def _sequential_engines(path: str) -> list:
    """Two TP engines one after the other in one process: the first is shut down when it is
    collected (no explicit shutdown); two alive at once is a clear error."""
    import gc

    from kvserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    toks = []
    for _ in range(2):
        llm = LLM(path, **_kw(2))
        toks.append(llm.generate({"prompt_token_ids": PROMPTS[0]}, sp)[0].outputs[0].token_ids)
        try:
            LLM(path, **_kw(2))
            toks.append("second engine accepted")
        except ValueError as e:
            toks.append(str(e))
        del llm
        gc.collect()
    return toks


def test_sequential_engines_in_one_process(model_factory):
    a, err, b, _ = run_driver(_sequential_engines, model_factory("llama"))
    assert a == b
    assert "another tensor-parallel engine is alive" in err


def test_replica_mismatch_groups_by_copy():
    """Four ranks, two replicated KV heads (keys 0, 0, 1, 1): a block is flagged only where
    two ranks holding the same copy disagree; different copies never compare."""
    from kvserve.engine.executor import replica_mismatch

    parts = [torch.tensor([0, 11, 12, 13]), torch.tensor([0, 11, 99, 13]),
             torch.tensor([1, 21, 22, 23]), torch.tensor([1, 21, 22, 98])]
    assert replica_mismatch(parts, [5, 6, 7]) == [False, True, True]
    assert replica_mismatch(parts[:1] + parts[2:3], [5, 6, 7]) == [False] * 3


def _weight_bytes(path: str) -> dict:
    from kvserve import LLM
    from kvserve.model.loader import weight_bytes

    out = {}
    for tp in (1, 2):
        llm = LLM(path, **_kw(tp))
        try:
            model = llm.engine.model
            held = weight_bytes(model)[0]
            norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if p.dim() == 1)
            out[tp] = {"held": held, "replicated": norms}
        finally:
            llm.engine.shutdown()
    return out


def test_per_rank_weight_memory_is_half(model_factory):
    """Each rank holds 1/tp of every sharded weight (q/k/v/o, gate/up/down, vocab-parallel
    embedding and LM head); only the 1-D norms are replicated: rank 0 at tp=2 holds
    (total - norms) / 2 + norms, exactly."""
    res = run_driver(_weight_bytes, model_factory("llama"))
    one, two = res[1], res[2]
    assert two["replicated"] == one["replicated"]
    assert two["held"] == (one["held"] - one["replicated"]) // 2 + one["replicated"], res
    assert 0.5 <= two["held"] / one["held"] < 0.52, res


def _speculative(path: str) -> dict:
    """TP=2 engines without and with speculation (bf16 weights: the batch-invariant 16-bit
    GEMM, so a verify step's rows equal decode steps' bit for bit)."""
    from kvserve import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in (*PROMPTS, [1] + [5, 9, 13, 17, 21] * 6)]
    res: dict = {}
    for name, spec in (("off", None),
                       ("ngram", {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 1, "adaptive": False}),
                       ("suffix", {"method": "suffix", "num_speculative_tokens": 6,
                                   "adaptive": False})):
        llm = LLM(path, **_kw(2, dtype="bf16", kv_cache_dtype="bf16",
                              speculative_config=spec))
        try:
            outs = llm.generate(prompts, sp)
            res[name] = [(o.outputs[0].token_ids,
                          [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]
            sd = llm.engine.stats().spec_decode
            res[f"{name}_accepted"] = sd["num_accepted_tokens"] if sd else 0
            llm.engine.debug.check_no_leaks()
        finally:
            llm.engine.shutdown()
    return res


def test_speculation_under_tp_equals_off(tmp_path_factory):
    """Greedy tokens and logprobs with speculation on (ngram, suffix) equal off under TP=2:
    every rank computes the verify step's draft rows as decode rows."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("tp_spec")), "llama",
                           save_dtype=torch.bfloat16)
    res = run_driver(_speculative, path)
    assert res["ngram"] == res["off"] and res["suffix"] == res["off"]
    assert res["ngram_accepted"] > 0 and res["suffix_accepted"] > 0
