"""Prefill/decode disaggregation between tensor-parallel engines (tp=2 on CPU, rank to rank over
the shared directory): each rank exports its own slice and each decode rank installs its own;
greedy tokens and logprobs equal a colocated tp=2 engine's; a byte flipped in rank 1's slice
of a block is refused there, recomputed, counted, and the output is unchanged; no pool block,
outstanding offer or transfer file is left on either side.

The prefill and the decode engine run at once in two spawned processes (two TP engines cannot
share one process: the process group is global); they hand each other handles and "done"
marks through JSON files in the test's tmp dir."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from tests.distributed.harness import run_driver
from tests.engine.test_disaggregation import _drain, _prompts

pytestmark = pytest.mark.slow  # spawns two tensor-parallel engines (four processes)

BS = 16
WAIT_S = 180  # each side waits at most this long for the other's file


def _engine(path: str, **kw):
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine(model=path, kv_cache_dtype="int8", block_size=BS, dtype="bf16",
                     progress=False, num_blocks=64, tensor_parallel_size=2,
                     distributed_timeout_s=60, **kw)


def _sp(**kw):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True,
                             "logprobs": 2, **kw})


def _wait(path: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    failed = os.path.join(os.path.dirname(path), "failed")
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no {path}"
        assert not os.path.exists(failed), "the other side failed"
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def _put(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _outs(done: dict, tag: str, n: int) -> list:
    return [(done[f"{tag}{i}"].outputs[0].token_ids,
             [{int(k): v for k, v in lp.items()} for lp in done[f"{tag}{i}"].outputs[0].logprobs])
            for i in range(n)]


def _side(fn, *args) -> dict:
    """Run one side; on failure tell the other (a "failed" file) so it stops waiting."""
    try:
        return fn(*args)
    except BaseException:
        _put(os.path.join(args[-1], "failed"), {})
        raise


def _prefill_side(path: str, xdir: str, sync: str) -> dict:
    eng = _engine(path, kv_transfer="dir", kv_transfer_dir=xdir)
    res: dict = {}
    try:
        for tag in ("a", "b"):
            for i, p in enumerate(_prompts()):
                eng.add_request(f"{tag}{i}", {"prompt_token_ids": p}, _sp(max_tokens=1),
                                kv_export=True)
            done = _drain(eng)
            handles = []
            for i in range(len(_prompts())):
                o = done[f"{tag}{i}"]
                c = o.outputs[0]
                tok = c.token_ids[0]
                lps = {int(k): v for k, v in c.logprobs[0].items()}
                handles.append({"handle": o.kv_transfer, "token": tok, "logprob": lps[tok],
                                "logprobs": list(lps.items())})
            _put(os.path.join(sync, f"handles_{tag}.json"), handles)
            _wait(os.path.join(sync, f"decoded_{tag}.json"))
        eng.kv_manager.connectors["transfer"].expire()
        st = eng.stats().kv_transfer
        res["outstanding"] = st["outstanding"]
        res["exported"] = st["exported"]
        eng.debug.check_no_leaks()
    finally:
        eng.shutdown()
    return res


def _decode_side(path: str, xdir: str, sync: str) -> dict:
    from kvserve.request import FirstToken

    prompts = _prompts()
    res: dict = {}
    colo = _engine(path)
    try:
        for i, p in enumerate(prompts):
            colo.add_request(f"c{i}", {"prompt_token_ids": p}, _sp())
        res["colocated"] = _outs(_drain(colo), "c", len(prompts))
    finally:
        colo.shutdown()
    eng = _engine(path, kv_transfer="dir", kv_transfer_dir=xdir)
    try:
        for tag in ("a", "b"):
            handles = _wait(os.path.join(sync, f"handles_{tag}.json"))
            if tag == "b":  # flip one byte in rank 1's slice of the first prompt's block 1
                tid = handles[0]["handle"]["transfer_id"]
                f = os.path.join(xdir, f"{tid}-1.00001.kvb")
                with open(f, "r+b") as fh:
                    fh.seek(-100, os.SEEK_END)
                    b = fh.read(1)
                    fh.seek(-100, os.SEEK_END)
                    fh.write(bytes([b[0] ^ 0x20]))
            for i, (p, h) in enumerate(zip(prompts, handles, strict=True)):
                ft = FirstToken(h["token"], h["logprob"], {int(k): v for k, v in h["logprobs"]})
                eng.add_request(f"{tag}{i}", {"prompt_token_ids": p}, _sp(),
                                kv_transfer=h["handle"], first_token=ft)
            res[tag] = _outs(_drain(eng), tag, len(prompts))
            res[f"stats_{tag}"] = {k: v for k, v in eng.stats().kv_transfer.items()
                                   if k in ("blocks_installed", "rejected", "fallbacks",
                                            "imported")}
            _put(os.path.join(sync, f"decoded_{tag}.json"), {})
        res["outstanding"] = eng.stats().kv_transfer["outstanding"]
        eng.debug.check_no_leaks()
    finally:
        eng.shutdown()
    return res


def test_tp2_prefill_to_tp2_decode(tmp_path, tmp_path_factory):
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("pd_tp")), "llama",
                           save_dtype=torch.bfloat16)
    xdir, sync = str(tmp_path / "kvx"), str(tmp_path / "sync")
    os.makedirs(xdir)
    os.makedirs(sync)
    pre: dict = {}

    def prefill():
        try:
            pre["res"] = run_driver(_side, _prefill_side, path, xdir, sync)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            pre["err"] = e

    t = threading.Thread(target=prefill)
    t.start()
    try:
        dec = run_driver(_side, _decode_side, path, xdir, sync)
    finally:
        t.join(timeout=WAIT_S + 60)
    assert not t.is_alive()
    if "err" in pre:
        raise pre["err"]
    assert dec["a"] == dec["colocated"]
    # 40 tokens: 2 full + 1 partial; 16: 1 full; 37: 2 + 1; 5: 1 partial
    assert dec["stats_a"]["blocks_installed"] == 8
    assert not dec["stats_a"]["rejected"] and not dec["stats_a"]["fallbacks"]
    # round b: rank 1 refused block 1 of prompt 0 -> blocks 1.. of it recomputed
    assert dec["b"] == dec["colocated"]
    assert dec["stats_b"]["rejected"] == {"bad_checksum": 1}
    assert dec["stats_b"]["blocks_installed"] == 8 + 6
    assert not dec["stats_b"]["fallbacks"]
    assert dec["outstanding"] == 0 and pre["res"]["outstanding"] == 0
    assert pre["res"]["exported"] == 8
    assert os.listdir(xdir) == []  # every rank's slice files confirmed (deleted)
