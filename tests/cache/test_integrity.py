"""Integrity: every injected fault is detected, repaired, and the output is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.kernels import reference as ref

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFIX = [1] + list(range(30, 63))  # 34 tokens: 2 full blocks of 16
TAILS = [[5, 6], [7, 8, 9]]
# every KV mode: 16-bit, FP8 and INT8, plain and rotated (stored rotated K/V, per-row scales)
KV_MODES = ["bf16", "fp8", "int8", "int8_plain", "fp8_rot", "fp8_e5m2_rot"]


def _p(ids):
    return {"prompt_token_ids": ids}


def _run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([_p(p) for p in prompts], GREEDY)]


# ---- the checksum itself ----------------------------------------------------------------
def _s(words):
    w = torch.tensor(np.asarray(words, dtype=np.int16)).reshape(1, 1, 4, -1)
    return tuple(ref.block_checksum_state(w, None, 0, torch.tensor([0]))[0, :2].tolist())


@given(st.lists(st.integers(-(2**15), 2**15 - 1), min_size=16, max_size=16),
       st.integers(0, 15), st.integers(0, 15), st.integers(0, 15))
@settings(max_examples=300, deadline=None)
def test_checksum_catches_single_double_flips_and_swaps(words, i, j, bit):
    base = _s(words)
    flip = list(words)
    flip[i] = int(np.int16(np.uint16(np.int16(flip[i]).view(np.uint16) ^ (1 << bit))
                           .view(np.int16)))
    assert _s(flip) != base
    if i != j:
        two = list(flip)
        two[j] = int(np.uint16(np.int16(two[j]).view(np.uint16) ^ (1 << bit)).view(np.int16))
        assert _s(two) != base
        if words[i] != words[j]:
            sw = list(words)
            sw[i], sw[j] = sw[j], sw[i]
            assert _s(sw) != base
            x = np.bitwise_xor.reduce(np.asarray(words, np.int16))
            assert x == np.bitwise_xor.reduce(np.asarray(sw, np.int16))  # XOR misses it


# ---- engine-level detection and repair ----------------------------------------------------
@pytest.fixture(scope="module")
def clean(tiny_llama):
    from kvserve import LLM

    out = {}
    for kv in KV_MODES:
        llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype=kv, kv_cache_memory="8MiB",
                  progress=False, enable_prefix_caching=False)
        out[kv] = _run(llm, [PREFIX + t for t in TAILS])
    return out


def _cached_prefix_blocks(engine):
    from kvserve.cache.kv_cache_manager import hash_block

    h = engine.fingerprint
    ids = []
    for i in range(2):
        h = hash_block(h, tuple(PREFIX[i * 16:(i + 1) * 16]))
        ids.append(engine.pool.lookup(h, tuple(PREFIX[i * 16:(i + 1) * 16])))
    assert None not in ids
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("kv", KV_MODES)
@given(data=st.data())
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fault_in_cached_prefix_detected_and_repaired(tiny_llama, make_llm, clean, kv, data):
    llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, kv_integrity="on")
    eng = llm.engine
    assert _run(llm, [PREFIX + TAILS[0]]) == clean[kv][:1]
    blocks = _cached_prefix_blocks(eng)
    kinds = ["bitflip", "swap", "stale"] + (["scale"] if kv != "bf16" else [])
    kind = data.draw(st.sampled_from(kinds))
    block = data.draw(st.sampled_from(blocks))
    layer = data.draw(st.integers(0, eng.kv_cache.num_layers - 1))
    nbytes = eng.kv_cache.data[layer, block].numel() * eng.kv_cache.data.element_size()
    index = data.draw(st.integers(0, nbytes - 1))
    if kv.startswith("fp8") and kind == "bitflip" and data.draw(st.booleans()):
        # exponent bits: e4m3 s eeee mmm, e5m2 s eeeee mm
        bit = data.draw(st.sampled_from([2, 3, 4, 5, 6] if "e5m2" in kv else [3, 4, 5, 6]))
    else:
        bit = data.draw(st.integers(0, 7))
    other = data.draw(st.integers(0, nbytes // 4 - 1))
    if kind == "swap":  # swapping equal words is not a corruption
        w = eng.kv_cache.data[layer, block].reshape(-1).view(torch.int32)
        i, j = (index // 4) % w.numel(), other % w.numel()
        if i == j or w[i] == w[j]:
            return
        index = i
    eng.debug.inject_kv_fault(block, layer, kind, index=index, bit=bit, other_index=other)
    fails_before = sum(eng.integrity.failures.values())
    assert _run(llm, [PREFIX + TAILS[1]]) == clean[kv][1:]
    assert sum(eng.integrity.failures.values()) == fails_before + 1
    assert eng.pool.blocks[block].quarantined


@pytest.mark.parametrize("kv", KV_MODES)
def test_fault_in_running_request_repaired_in_paranoid_mode(tiny_llama, make_llm, clean, kv):
    llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype=kv, kv_integrity="paranoid")
    eng = llm.engine
    eng.add_request("r", _p(PREFIX + TAILS[0]), GREEDY)
    req = eng.output_processor.parents["r"].children[0]
    eng.step()  # prefill: blocks 0 and 1 sealed
    eng.debug.inject_kv_fault(eng.kv_manager.get_block_ids(req)[1], 1, "bitflip", index=100, bit=6)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert final.outputs[0].token_ids == clean[kv][0]
    assert eng.integrity.failures["paranoid"] == 1
    assert eng.integrity.repairs["rollback"] == 1


@pytest.mark.slow
def test_scrubber_finds_fault_in_idle_cached_block(tiny_llama, make_llm, clean):
    llm = make_llm(tiny_llama, dtype="float32", kv_cache_dtype="bf16",
                   scrub_blocks_per_step=4)
    eng = llm.engine
    _run(llm, [PREFIX + TAILS[0]])
    block = _cached_prefix_blocks(eng)[0]
    eng.debug.inject_kv_fault(block, 0, "bitflip", index=7, bit=1)
    _run(llm, [[1, 2, 3, 4]] * 4)  # unrelated traffic: the scrubber cycles through sealed blocks
    assert eng.integrity.failures["scrub"] == 1
    assert eng.pool.blocks[block].quarantined
    assert _run(llm, [PREFIX + TAILS[1]]) == clean["bf16"][1:]


@pytest.mark.slow
def test_forced_hash_collision_gets_no_hit(tiny_llama, make_llm, monkeypatch):
    import kvserve.cache.kv_cache_manager as m

    monkeypatch.setattr(m, "BLOCK_HASH_FN", lambda parent, toks: b"\x00" * 16)
    llm = make_llm(tiny_llama, dtype="float32")
    a = [1] + list(range(100, 140))
    b = [1] + list(range(200, 240))
    ref = make_llm(tiny_llama, dtype="float32", enable_prefix_caching=False)
    _run(llm, [a])
    assert _run(llm, [b]) == _run(ref, [b])
    assert llm.engine.kv_manager.num_hit_tokens == 0


@pytest.mark.slow
def test_paranoid_and_on_outputs_equal_off(tiny_llama, make_llm):
    prompts = [PREFIX + t for t in TAILS] + [PREFIX]
    outs = [_run(make_llm(tiny_llama, dtype="float32", kv_integrity=m), prompts)
            for m in ("off", "on", "paranoid")]
    assert outs[0] == outs[1] == outs[2]
