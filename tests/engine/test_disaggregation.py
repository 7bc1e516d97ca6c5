"""Prefill/decode disaggregation through two engines in one process (kvserve/cache/kv_transfer.py):
greedy tokens and logprobs equal a colocated engine's in every KV mode, over the shared
directory and over ZMQ; every fault drill (a flipped bit in transit, a block of another model /
rotation seed, a truncated transfer, a prefill engine gone before it answered) is detected,
counted, recomputed, leaves the output unchanged and leaks no block on either side."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvserve.cache import block_store as bs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.request import FirstToken
from kvserve.sampling_params import SamplingParams

BS = 16
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    """bf16 weights: the batch-invariant 16-bit GEMM on CPU, so outputs do not depend on which
    tokens share a step (a decode engine's first step differs from a colocated one's)."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("pd_bf16")), "llama",
                           save_dtype=torch.bfloat16)


def _prompts(lengths=(40, 16, 37, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(3, 500, (n - 1,), generator=g).tolist() for n in lengths]


def _engine(path: str, mode: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    return LLMEngine(model=path, kv_cache_dtype=mode, block_size=BS, dtype="bf16",
                     progress=False, **kw)


def _drain(eng: LLMEngine) -> dict:
    done = {}
    deadline = time.monotonic() + 120  # bounded: imports that time out take a while
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert not eng.has_unfinished_requests()
    return done


def _colocated(eng: LLMEngine, prompts, sp=SP) -> list:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    done = _drain(eng)
    return [(done[f"r{i}"].outputs[0].token_ids, done[f"r{i}"].outputs[0].logprobs)
            for i in range(len(prompts))]


def _prefill(pre: LLMEngine, prompts, sp=SP) -> dict:
    for i, p in enumerate(prompts):
        pre.add_request(f"r{i}", {"prompt_token_ids": p}, sp.clone(max_tokens=1), kv_export=True)
    return _drain(pre)


def _first(out) -> FirstToken:
    c = out.outputs[0]
    tok = c.token_ids[0]
    lps = c.logprobs[0] if c.logprobs else None
    return FirstToken(tok, lps[tok] if lps else 0.0, lps)


def _decode(dec: LLMEngine, prompts, pre_out: dict, sp=SP, handles=None) -> list:
    for i, p in enumerate(prompts):
        o = pre_out[f"r{i}"]
        h = o.kv_transfer if handles is None else handles[i]
        dec.add_request(f"r{i}", {"prompt_token_ids": p}, sp, kv_transfer=h,
                        first_token=_first(o))
    done = _drain(dec)
    return [(done[f"r{i}"].outputs[0].token_ids, done[f"r{i}"].outputs[0].logprobs)
            for i in range(len(prompts))]


def _pd(pre, dec, prompts, sp=SP) -> list:
    return _decode(dec, prompts, _prefill(pre, prompts, sp), sp)


def _no_leaks(*engines: LLMEngine) -> None:
    for e in engines:
        e.debug.check_no_leaks()
        assert e.kv_manager.connectors["transfer"].transport.outstanding() == 0


@pytest.fixture(scope="module")
def colocated(tiny_bf16):
    cache: dict = {}

    def get(mode: str):
        if mode not in cache:
            eng = _engine(tiny_bf16, mode)
            cache[mode] = _colocated(eng, _prompts())
            eng.shutdown()
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_rot", "int8", "int8_plain"])
def test_directory_transfer_equals_colocated(tiny_bf16, colocated, tmp_path, mode):
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path)}
    pre, dec = _engine(tiny_bf16, mode, **kw), _engine(tiny_bf16, mode, **kw)
    try:
        assert _pd(pre, dec, _prompts()) == colocated(mode)
        st = dec.stats().kv_transfer
        # 40 tokens: 2 full + 1 partial; 16: 1 full; 37: 2 + 1; 5: 1 partial
        assert st["blocks_installed"] == 8 and not st["rejected"] and not st["fallbacks"]
        assert pre.stats().kv_transfer["exported"] == 4
        assert st["bytes_received"] == pre.stats().kv_transfer["bytes_sent"] > 0
        _no_leaks(pre, dec)
        # what is left: the taken transfers' tombstones (deleted a TTL later, or at shutdown)
        assert all(f.endswith(".gone") for f in os.listdir(tmp_path) if not f.startswith("."))
    finally:
        pre.shutdown()
        dec.shutdown()
    assert not [f for f in os.listdir(tmp_path) if not f.startswith(".")]


def test_zmq_transfer_equals_colocated(tiny_bf16, colocated):
    kw = {"kv_transfer": "zmq"}
    pre, dec = _engine(tiny_bf16, "int8", **kw), _engine(tiny_bf16, "int8", **kw)
    try:
        assert _pd(pre, dec, _prompts()) == colocated("int8")
        st = dec.stats().kv_transfer
        assert st["blocks_installed"] == 8 and not st["rejected"] and not st["fallbacks"]
        _no_leaks(pre, dec)
    finally:
        pre.shutdown()
        dec.shutdown()


def _flip(path: str, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("fault", ["bitflip", "truncate", "partial_bitflip"])
def test_directory_faults_recompute(tiny_bf16, colocated, tmp_path, fault):
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path)}
    pre, dec = _engine(tiny_bf16, "int8", **kw), _engine(tiny_bf16, "int8", **kw)
    prompts = _prompts()
    try:
        pre_out = _prefill(pre, prompts)
        tid = pre_out["r0"].kv_transfer["transfer_id"]  # 40 tokens: blocks 0, 1 and partial 2
        if fault == "bitflip":  # in the payload of block 1, in transit
            _flip(os.path.join(tmp_path, f"{tid}.00001.kvb"), 40)
        elif fault == "partial_bitflip":
            _flip(os.path.join(tmp_path, f"{tid}.00002.kvb"), 60)
        else:
            p = os.path.join(tmp_path, f"{tid}.00001.kvb")
            os.truncate(p, os.path.getsize(p) // 2)
        assert _decode(dec, prompts, pre_out) == colocated("int8")
        st = dec.stats().kv_transfer
        want = {"truncate": "short_file"}.get(fault, "bad_checksum")
        assert st["rejected"] == {want: 1}
        # r0 keeps what came before the refused block; the others arrive whole
        assert st["blocks_installed"] == 8 - (2 if fault != "partial_bitflip" else 1)
        _no_leaks(pre, dec)
    finally:
        pre.shutdown()
        dec.shutdown()


@pytest.mark.parametrize("other", [{"kv_rotation_seed": 7}, {"model": "other"}])
def test_block_of_another_engine_refused(tiny_bf16, colocated, tmp_path, other):
    """A prefill engine with another rotation seed / other weights: every block is refused by
    identity, the decode engine prefills itself, the output is its own colocated one."""
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path / "x")}
    mode = "int8"
    if "model" in other:
        pre = _engine(_perturbed(tiny_bf16, str(tmp_path / "m2")), mode, **kw)
    else:
        pre = _engine(tiny_bf16, mode, **kw, **other)
    dec = _engine(tiny_bf16, mode, **kw)
    prompts = _prompts()
    try:
        pre_out = _prefill(pre, prompts)
        outs = _decode(dec, prompts, pre_out)
        st = dec.stats().kv_transfer
        reason = "wrong_rotation" if "kv_rotation_seed" in other else "wrong_model"
        assert set(st["rejected"]) == {reason} and st["blocks_installed"] == 0
        # each sequence continues from the prefill engine's first token; recomputed locally
        ref = _engine(tiny_bf16, mode)
        try:
            for i, p in enumerate(prompts):
                tok = pre_out[f"r{i}"].outputs[0].token_ids[0]
                got = outs[i][0]
                assert got[0] == tok
                ref.add_request(f"x{i}", {"prompt_token_ids": p + [tok]},
                                SP.clone(max_tokens=5))
            done = _drain(ref)
            for i in range(len(prompts)):
                assert outs[i][0][1:] == done[f"x{i}"].outputs[0].token_ids
        finally:
            ref.shutdown()
        _no_leaks(pre, dec)
    finally:
        pre.shutdown()
        dec.shutdown()


def _perturbed(src: str, dst: str) -> str:
    """A copy of the checkpoint at ``src`` with one weight changed (another model id)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = next(os.path.join(dst, x) for x in os.listdir(dst) if x.endswith(".safetensors"))
    t = load_file(f)
    k = next(iter(sorted(t)))
    t[k] = t[k] * 1.5
    save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("transport", ["dir", "zmq"])
def test_prefill_gone_falls_back(tiny_bf16, colocated, tmp_path, transport):
    """The prefill engine shuts down (its outbox dropped) before the decode engine fetches:
    the fetch fails or times out, the decode engine prefills itself; output unchanged."""
    kw = {"kv_transfer": transport, "kv_transfer_timeout": 1.0}
    if transport == "dir":
        kw["kv_transfer_dir"] = str(tmp_path)
    pre, dec = _engine(tiny_bf16, "bf16", **kw), _engine(tiny_bf16, "bf16", **kw)
    prompts = _prompts()
    try:
        pre_out = _prefill(pre, prompts)
        pre.debug.check_no_leaks()
        pre.shutdown()  # dir: deletes its files; zmq: the socket is gone
        assert _decode(dec, prompts, pre_out) == colocated("bf16")
        st = dec.stats().kv_transfer
        assert sum(st["fallbacks"].values()) == 4 and st["blocks_installed"] == 0
        assert set(st["fallbacks"]) <= {"timeout", "unknown_transfer"}
        dec.debug.check_no_leaks()
    finally:
        dec.shutdown()


def test_tp_mismatch_falls_back(tiny_bf16, colocated, tmp_path):
    """A handle from a prefill replica of another tensor-parallel size (one slice per rank):
    the decode engine prefills itself, counted (``tp_mismatch``); output unchanged."""
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path), "kv_transfer_timeout": 1.0}
    pre, dec = _engine(tiny_bf16, "bf16", **kw), _engine(tiny_bf16, "bf16", **kw)
    prompts = _prompts()
    try:
        pre_out = _prefill(pre, prompts)
        handles = [{**pre_out[f"r{i}"].kv_transfer, "num_ranks": 2} for i in range(len(prompts))]
        assert _decode(dec, prompts, pre_out, handles=handles) == colocated("bf16")
        st = dec.stats().kv_transfer
        assert st["fallbacks"] == {"tp_mismatch": 4} and st["blocks_installed"] == 0
        dec.debug.check_no_leaks()
        pre.debug.check_no_leaks()
    finally:
        pre.shutdown()
        dec.shutdown()


def test_zmq_refused_with_tensor_parallel(tiny_bf16):
    """ZMQ carries one sender's outbox; tensor-parallel replicas use the directory (each rank
    its own slice files): refused at start-up, before any rank starts."""
    with pytest.raises(ValueError, match="kv_transfer zmq .*tensor_parallel_size"):
        _engine(tiny_bf16, "bf16", kv_transfer="zmq", tensor_parallel_size=2)


def test_bad_requests(tiny_bf16, tmp_path):
    eng = _engine(tiny_bf16, "bf16")
    try:
        with pytest.raises(ValueError, match="kv_transfer"):
            eng.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SP, kv_export=True)
    finally:
        eng.shutdown()
    dec = _engine(tiny_bf16, "bf16", kv_transfer="dir", kv_transfer_dir=str(tmp_path))
    try:
        h = {"version": 1, "transfer_id": "ab", "transport": "dir", "address": str(tmp_path),
             "num_tokens": 3, "num_blocks": 1, "nbytes": 10}
        with pytest.raises(ValueError, match="first_token"):
            dec.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SP, kv_transfer=h)
        with pytest.raises(ValueError, match="kv_transfer.num_blocks"):
            dec.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SP,
                            kv_transfer={**h, "num_blocks": "x"}, first_token=FirstToken(5))
        with pytest.raises(ValueError, match="n must be 1"):
            dec.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SP.clone(n=2),
                            kv_transfer=h, first_token=FirstToken(5))
        assert not dec.has_unfinished_requests()
    finally:
        dec.shutdown()


def test_partial_block_format_roundtrip():
    """block_store takes a partly filled block (the prompt's last) and verify checks its tokens."""
    spec = bs.StoreSpec("m", "bf16", "", "f", 4, 1, 2, 1, 2, "bfloat16", "")
    pay = torch.zeros(1, 2, 4, 1, 2, dtype=torch.bfloat16)
    pay[:, :, :2] = 1.5
    sums = bs.block_sums(pay.unsqueeze(1), None)[0]
    blob = bs.serialize(spec, bs.StoredBlock(b"h" * 16, (7, 8), pay, None, sums))
    ok = bs.verify(spec, blob, b"h" * 16, (7, 8))
    assert isinstance(ok, bs.StoredBlock) and torch.equal(ok.payload, pay)
    assert bs.verify(spec, blob, b"h" * 16, (7, 9)).reason is bs.Reason.WRONG_TOKENS


@pytest.mark.parametrize("fault", ["bitflip", "truncate", "drop_last"])
def test_zmq_faults_recompute(tiny_bf16, colocated, fault):
    """The same drills over ZMQ: the prefill engine's outbox is damaged before the decode
    engine fetches (a flipped bit in block 1, block 1 cut short, the last block missing)."""
    kw = {"kv_transfer": "zmq"}
    pre, dec = _engine(tiny_bf16, "int8", **kw), _engine(tiny_bf16, "int8", **kw)
    prompts = _prompts()
    try:
        pre_out = _prefill(pre, prompts)
        tid = pre_out["r0"].kv_transfer["transfer_id"]  # 40 tokens: blocks 0, 1, partial 2
        outbox = pre.kv_manager.connectors["transfer"].transport._outbox
        deadline, blobs = outbox[tid]
        if fault == "bitflip":
            b = bytearray(blobs[1])
            b[len(b) // 2] ^= 0x04
            blobs = [blobs[0], bytes(b), blobs[2]]
        elif fault == "truncate":
            blobs = [blobs[0], blobs[1][: len(blobs[1]) - 100], blobs[2]]
        else:
            blobs = blobs[:2]
        outbox[tid] = (deadline, blobs)
        assert _decode(dec, prompts, pre_out) == colocated("int8")
        st = dec.stats().kv_transfer
        want = {"bitflip": "bad_checksum", "truncate": "short_file", "drop_last": "missing"}
        assert st["rejected"] == {want[fault]: 1}
        assert st["blocks_installed"] == 8 - (2 if fault != "drop_last" else 1)
        _no_leaks(pre, dec)
    finally:
        pre.shutdown()
        dec.shutdown()


def test_handle_is_checked():
    from kvserve.cache.kv_transfer import TransferHandle

    h = TransferHandle("ab12", "zmq", "tcp://127.0.0.1:5", 40, 3, 1000)
    assert TransferHandle.from_dict(h.to_dict()) == h
    old = {k: v for k, v in h.to_dict().items() if k != "num_ranks"}  # a single-rank sender
    assert TransferHandle.from_dict(old).num_ranks == 1
    for bad, field in (({"version": 9}, "version"), ({"num_tokens": -1}, "num_tokens"),
                       ({"transport": "ftp"}, "transport"),
                       ({"transfer_id": "../x"}, "transfer_id"),
                       ({"nbytes": True}, "nbytes"), ({"num_ranks": 0}, "num_ranks")):
        with pytest.raises(ValueError, match=f"kv_transfer.{field}"):
            TransferHandle.from_dict({**h.to_dict(), **bad})


def test_abort_while_importing_leaks_nothing(tiny_bf16, tmp_path):
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path), "kv_transfer_timeout": 30.0}
    dec = _engine(tiny_bf16, "bf16", **kw)
    try:
        h = {"version": 1, "transfer_id": "feed", "transport": "dir", "address": str(tmp_path),
             "num_tokens": 40, "num_blocks": 3, "nbytes": 100}
        dec.add_request("a", {"prompt_token_ids": _prompts()[0]}, SP, kv_transfer=h,
                        first_token=FirstToken(7))
        for _ in range(5):
            assert dec.step() == []  # waiting for a transfer that never comes
        dec.abort_request("a")
        dec.debug.check_no_leaks()
        assert not dec.kv_manager.connectors["transfer"].loading("a")
    finally:
        dec.shutdown()


def test_directory_transfer_taken_or_expired_fails_at_once(tmp_path):
    """A second fetch of a taken transfer, or a fetch of an expired one, is refused at once
    (``unknown_transfer``, as the ZMQ sender answers) instead of waiting out its timeout
    (here 30 s: a wait would end as ``timeout``); the sender deletes the tombstones a TTL
    later, and a new sender deletes orphans past the TTL."""

    from kvserve.cache.kv_transfer import DirectoryTransport, TransferFailed, TransferHandle

    tx = DirectoryTransport(str(tmp_path), ttl_s=60.0)
    blobs = [b"a" * 10, b"b" * 20]
    h = TransferHandle("t1", "dir", tx.offer("t1", blobs), 32, 2, 30)
    assert tx.fetch(h, 30.0, 1 << 20) == blobs
    with pytest.raises(TransferFailed) as e:
        tx.fetch(h, 30.0, 1 << 20)
    assert e.value.reason == "unknown_transfer"
    assert tx.outstanding() == 0 and os.path.exists(tmp_path / "t1.gone")

    other = tmp_path / "other"
    short = DirectoryTransport(str(other), ttl_s=0.0)
    h2 = TransferHandle("t2", "dir", short.offer("t2", blobs), 32, 2, 30)
    time.sleep(0.01)
    assert short.expire() == 1  # past its deadline: files deleted, a tombstone left
    with pytest.raises(TransferFailed) as e:
        short.fetch(h2, 30.0, 1 << 20)
    assert e.value.reason == "unknown_transfer"
    time.sleep(0.01)
    short.expire()  # a TTL later: the tombstone is deleted
    assert os.listdir(other) == []

    os.utime(tmp_path / "t1.gone", (1.0, 1.0))  # its sender died long ago
    DirectoryTransport(str(tmp_path), ttl_s=60.0)
    assert sorted(os.listdir(tmp_path)) == ["other"]
