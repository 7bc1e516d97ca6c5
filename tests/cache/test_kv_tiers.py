"""KV tiers below the pool (kvserve/cache/kv_tiers.py) through the engine: restored blocks
equal recomputed ones bit for bit and outputs equal a cold run, in every KV mode, with chunked
prefill and preemption; a restart finds the disk tier; every fault drill ends in the cold
output and the right rejection counter; a second process sharing the directory changes
nothing and the cap holds."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache import block_store as bs
from kvserve.cache.kv_tiers import DiskTier, entry_key

MODES = ["bf16", "fp8", "fp8_rot", "fp8_e5m2", "int8", "int8_plain",
         *(pytest.param(m, marks=pytest.mark.slow) for m in ("fp8_e5m2_rot", "fp16", "fp32"))]
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
BS = 16


def _prompts(n: int = 5, doc: int = 90, seed: int = 0) -> list[list[int]]:
    """n conversations: own document, then a question (two prompts share a document)."""
    g = torch.Generator().manual_seed(seed)
    docs = [[1] + torch.randint(3, 500, (doc,), generator=g).tolist() for _ in range(n - 1)]
    docs.append(docs[0])
    return [d + torch.randint(3, 500, (7 + i,), generator=g).tolist()
            for i, d in enumerate(docs)]


def _outs(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _llm(path: str, mode: str, **kw) -> LLM:
    kw.setdefault("num_blocks", 200)
    kw.setdefault("dtype", "bf16")
    return LLM(path, kv_cache_dtype=mode, block_size=BS, progress=False, **kw)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    """A bf16 checkpoint: its linears run the batch-invariant 16-bit GEMM on CPU (fp32 GEMMs
    are not: their blocking depends on the batch), so a restore that changes which tokens are
    batched together leaves logprobs bit-identical."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("llama_bf16")), "llama",
                           save_dtype=torch.bfloat16)


def _tier_stats(llm: LLM) -> dict:
    return llm.engine.stats().kv_tiers["tiers"]


@pytest.fixture(scope="module")
def cold(tiny_bf16):
    """Per mode: a cold engine (big pool, no tiers) and its outputs for round 1 and 2."""
    cache: dict = {}

    def get(mode: str, path: str = tiny_bf16):
        if (mode, path) not in cache:
            llm = _llm(path, mode)
            p1 = _prompts()
            p2 = [p + SP_FOLLOW for p in p1]
            cache[(mode, path)] = (llm, _outs(llm, p1), _outs(llm, p2), p1, p2)
        return cache[(mode, path)]

    yield get
    for llm, *_ in cache.values():
        llm.engine.shutdown()


SP_FOLLOW = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


def _same_block_bytes(cold_llm: LLM, installed: list) -> int:
    """Each installed (restored) block equals the cold engine's block of the same chain hash,
    payload and scales, bit for bit. Returns how many were compared."""
    pool, kv = cold_llm.engine.pool, cold_llm.engine.kv_cache
    n = 0
    for blk in installed:
        bid = pool.lookup(blk.chain_hash, blk.token_ids)
        assert bid is not None, "the cold engine computed every block"
        ref = kv.data[:, bid].contiguous()
        assert torch.equal(blk.payload.view(torch.uint8), ref.view(torch.uint8))
        if kv.scales is not None:
            assert torch.equal(blk.scales.contiguous().view(torch.uint8),
                               kv.scales[:, bid].contiguous().view(torch.uint8))
        n += 1
    return n


@pytest.mark.parametrize("mode", MODES)
def test_restored_equals_recomputed(mode, tiny_bf16, cold, tmp_path):
    cold_llm, ref1, ref2, p1, p2 = cold(mode)
    # Small pool (preemption), small step budget (chunked prefill), both tiers.
    llm = _llm(tiny_bf16, mode, num_blocks=14, max_num_batched_tokens=48,
               kv_offload_memory=0.002, kv_offload_dir=str(tmp_path / "kv"),
               kv_offload_disk=0.01)
    installed: list = []
    tiers = llm.engine.kv_manager.connectors["tiers"]
    orig = tiers.install

    def spy(ids, blocks):
        installed.extend(blocks)
        orig(ids, blocks)

    tiers.install = spy
    try:
        assert _outs(llm, p1) == ref1
        assert _outs(llm, p2) == ref2
        assert _outs(llm, p1) == ref1
        assert llm.engine.scheduler.num_preemptions > 0
        st = _tier_stats(llm)
        assert sum(t["hits"] for t in st.values()) > 0
        assert all(not t["rejected"] for t in st.values())
        assert _same_block_bytes(cold_llm, installed) > 0
        assert llm.engine.kv_manager.num_restored_tokens > 0
        llm.engine.debug.check_no_leaks()
    finally:
        llm.engine.shutdown()


def test_restart_finds_disk_tier(tiny_bf16, cold, tmp_path):
    cold_llm, ref1, _, p1, _ = cold("int8")
    d = str(tmp_path / "kv")
    first = _llm(tiny_bf16, "int8", kv_offload_dir=d, kv_offload_disk=0.01)
    assert _outs(first, p1) == ref1
    first.engine.shutdown()  # writes its cached blocks down
    assert len(DiskTier(d, 2**30)) > 0
    again = _llm(tiny_bf16, "int8", kv_offload_dir=d, kv_offload_disk=0.01)
    try:
        assert _outs(again, p1) == ref1
        st = _tier_stats(again)["disk"]
        assert st["hits"] >= len(p1[0]) // BS - 1 and not st["rejected"]
    finally:
        again.engine.shutdown()


def test_memory_tier_alone(tiny_bf16, cold):
    """The memory tier by itself, integrity checking off (no seals: the tiers compute the
    sums they store from the bytes)."""
    _, ref1, ref2, p1, p2 = cold("fp8_rot")
    llm = _llm(tiny_bf16, "fp8_rot", num_blocks=20, kv_offload_memory=0.001, kv_integrity="off")
    try:
        assert _outs(llm, p1) == ref1
        assert _outs(llm, p2) == ref2
        st = _tier_stats(llm)
        assert list(st) == ["memory"] and st["memory"]["hits"] > 0
        assert st["memory"]["bytes"] <= st["memory"]["cap_bytes"]
    finally:
        llm.engine.shutdown()


def test_cache_salt_separates_tier_entries(tiny_bf16, cold):
    """Tenants separated by cache_salt never restore each other's blocks (the salt is in the
    chain hash, hence in the entry's name and its stored identity)."""
    _, ref1, _, p1, _ = cold("int8")
    llm = _llm(tiny_bf16, "int8", num_blocks=10, kv_offload_memory=0.01)
    eng = llm.engine

    def run(rid: str, prompt: list[int], salt: str | None) -> list[int]:
        eng.add_request(rid, {"prompt_token_ids": prompt}, SP, cache_salt=salt)
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out = o.outputs[0].token_ids
        return out

    def hits() -> int:
        return _tier_stats(llm)["memory"]["hits"]

    try:
        assert run("a1", p1[0], "tenant-a") == ref1[0][0]
        for i, p in enumerate(p1[1:4]):  # push tenant a's blocks out of the pool
            run(f"x{i}", p, None)
        h = hits()
        assert run("b1", p1[0], "tenant-b") == ref1[0][0]
        assert hits() == h, "tenant b restored tenant a's blocks"
        for i, p in enumerate(p1[1:4]):
            run(f"y{i}", p, None)
        h = hits()
        assert run("a2", p1[0], "tenant-a") == ref1[0][0]
        assert hits() > h
    finally:
        eng.shutdown()


@pytest.mark.slow  # ~30 s: the tiny MoE on CPU
def test_mla_latent_cache(tmp_path):
    """The MLA latent cache (one component). The tiny MoE's expert GEMMs are not batch
    invariant, so the restored blocks are compared with the blocks this engine wrote down and
    the tokens with the cold run (logprobs agree to rounding)."""
    from tests.model.test_moe_mla import make_tiny_moe

    path = make_tiny_moe(str(tmp_path / "ds"), "deepseek_v3")
    prompts = _prompts(3, doc=44)[:2]
    ref_llm = _llm(path, "int8")
    ref = _outs(ref_llm, prompts)
    llm = _llm(path, "int8", num_blocks=5, kv_offload_dir=str(tmp_path / "kv"),
               kv_offload_disk=0.01)
    written: dict = {}
    tiers = llm.engine.kv_manager.connectors["tiers"]
    orig_write = tiers._write_one

    def spy(w):
        written[w.ref.chain_hash] = (w.payload.clone(), w.scales.clone())
        orig_write(w)

    tiers._write_one = spy
    installed: list = []
    orig_install = tiers.install
    tiers.install = lambda ids, blocks: (installed.extend(blocks), orig_install(ids, blocks))
    try:
        assert llm.engine.kv_cache.components == 1
        for _ in range(2):
            outs = _outs(llm, prompts)
            assert [o[0] for o in outs] == [r[0] for r in ref]
        assert _tier_stats(llm)["disk"]["hits"] > 0 and installed
        for blk in installed:
            pay, sc = written[blk.chain_hash]
            assert torch.equal(blk.payload.view(torch.uint8), pay.contiguous().view(torch.uint8))
            assert torch.equal(blk.scales, sc)
    finally:
        llm.engine.shutdown()
        ref_llm.engine.shutdown()


# ---- fault drills ----------------------------------------------------------------------------
def _flip_at(section: str):
    def fault(blob: bytes, spec, store) -> bytes:
        s, p, c = _sections(blob, spec)
        off = {"sums": s + 9, "payload": p + 33, "scale": c + 5}[section]
        b = bytearray(blob)
        b[off] ^= 0x04
        return bytes(b)
    return fault


def _sections(blob, spec):
    start = bs.read_header(blob)["_body_start"]
    n_sums, n_pay, _ = spec.nbytes()
    return start, start + n_sums, start + n_sums + n_pay


def _reidentify(**changes):
    """The block's own content, written by another model / KV mode / rotation."""
    def fault(blob: bytes, spec, store) -> bytes:
        hdr = bs.read_header(blob)
        blk = bs.verify(spec, blob, bytes.fromhex(hdr["chain_hash"]), tuple(hdr["token_ids"]))
        assert isinstance(blk, bs.StoredBlock)
        return bs.serialize(dataclasses.replace(spec, **changes), blk)
    return fault


def _old_version(blob: bytes, spec, store) -> bytes:
    hdr = bs.read_header(blob)
    blk = bs.verify(spec, blob, bytes.fromhex(hdr["chain_hash"]), tuple(hdr["token_ids"]))
    saved = bs.FORMAT_VERSION
    bs.FORMAT_VERSION = 0
    try:
        return bs.serialize(spec, blk)
    finally:
        bs.FORMAT_VERSION = saved


def _swap(blob: bytes, spec, store) -> bytes:
    return store["second"]  # the chain's second block's file under the first's name


DRILLS = {
    "payload_bit": (_flip_at("payload"), "bad_checksum"),
    "scale_bit": (_flip_at("scale"), "bad_checksum"),
    "sums_bit": (_flip_at("sums"), "bad_checksum"),
    "truncated": (lambda blob, spec, store: blob[: len(blob) * 2 // 3], "short_file"),
    "swapped": (_swap, "wrong_block"),
    "other_model": (_reidentify(model="0" * 32), "wrong_model"),
    "other_kv_mode": (_reidentify(kv_mode="int8_plain"), "wrong_kv_mode"),
    "other_rotation_seed": (_reidentify(rotation="hadamard:16:seed=7"), "wrong_rotation"),
    "older_format": (_old_version, "wrong_version"),
}


def test_fault_drills(tiny_bf16, cold, tmp_path):
    """One engine (disk tier only); per drill: the clean directory, one damaged entry (the
    chain's first block of prompt 0), the pool's prefix cache dropped, prompt 0 again."""
    _, ref1, _, p1, _ = cold("int8")
    d = str(tmp_path / "kv")
    llm = _llm(tiny_bf16, "int8", kv_offload_dir=d, kv_offload_disk=0.01)
    eng = llm.engine
    try:
        assert _outs(llm, p1) == ref1
        assert eng.kv_manager.write_down_cached() > 0
        spec = eng.kv_manager.connectors["tiers"].spec
        req_hashes = _chain(eng, p1[0])
        first, second = (os.path.join(d, entry_key(spec, h) + ".kvb") for h in req_hashes[:2])
        clean = {f: _read(os.path.join(d, f)) for f in os.listdir(d)}
        store = {"second": clean[os.path.basename(second)]}
        for name, (fault, reason) in DRILLS.items():
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            for f, blob in clean.items():
                with open(os.path.join(d, f), "wb") as fh:
                    fh.write(blob)
            with open(first, "wb") as fh:
                fh.write(fault(clean[os.path.basename(first)], spec, store))
            eng.pool.reset_prefix_cache()
            before = dict(_tier_stats(llm)["disk"]["rejected"])
            assert _outs(llm, [p1[0]]) == [ref1[0]], name
            after = _tier_stats(llm)["disk"]["rejected"]
            assert after.get(reason, 0) == before.get(reason, 0) + 1, (name, before, after)
            assert not os.path.exists(first), f"{name}: the bad entry was not dropped"
        # and a clean directory restores again
        eng.pool.reset_prefix_cache()
        with open(first, "wb") as fh:
            fh.write(clean[os.path.basename(first)])
        hits = _tier_stats(llm)["disk"]["hits"]
        assert _outs(llm, [p1[0]]) == [ref1[0]]
        assert _tier_stats(llm)["disk"]["hits"] > hits
        _check_metrics(eng)
    finally:
        eng.shutdown()


def _check_metrics(eng) -> None:
    """/metrics shows each tier's counters, the rejections by reason, the queue and the
    restore-latency histogram."""
    from kvserve.server.metrics import ServerMetrics

    text = ServerMetrics(eng.stats).render()[0].decode()
    st = eng.stats().kv_tiers
    disk = st["tiers"]["disk"]
    assert f'kvserve_kv_tier_hits_total{{tier="disk"}} {float(disk["hits"])}' in text
    assert ('kvserve_kv_tier_rejected_total{reason="bad_checksum",tier="disk"} 3.0' in text
            or 'kvserve_kv_tier_rejected_total{tier="disk",reason="bad_checksum"} 3.0' in text)
    assert "kvserve_kv_offload_queue_depth 0.0" in text
    n = sum(st["restore_counts"])
    assert n > 0 and f'kvserve_kv_restore_seconds_bucket{{le="+Inf"}} {float(n)}' in text
    assert 'kvserve_kv_tier_bytes{tier="disk"}' in text


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _chain(eng, prompt: list[int]) -> list[bytes]:
    from kvserve.cache.kv_cache_manager import BLOCK_HASH_FN

    out, parent = [], eng.kv_manager.salt
    for i in range(len(prompt) // BS):
        parent = BLOCK_HASH_FN(parent, tuple(prompt[i * BS: (i + 1) * BS]))
        out.append(parent)
    return out


# ---- a second process in the same directory --------------------------------------------------
def _other_writer(directory: str, cap: int, stop, iters: int) -> None:
    """Another process: fills the directory with its own entries (so the cap evicts the
    engine's files under it) and rewrites existing files in place (tmp + rename)."""
    import random

    tier = DiskTier(directory, cap)
    rnd = random.Random(1)
    for i in range(iters):
        if stop.is_set():
            break
        tier.put(f"{i:032x}", bytes(rnd.getrandbits(8) for _ in range(2000)))
        names = [n for n in os.listdir(directory) if n.endswith(".kvb")]
        if names:
            src = os.path.join(directory, rnd.choice(names))
            try:
                blob = _read(src)
            except FileNotFoundError:
                continue
            tmp = os.path.join(directory, f".tmp-other-{i}")
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, src)
    tier.trim()


def test_second_process_shares_directory(tiny_bf16, cold, tmp_path):
    _, ref1, ref2, p1, p2 = cold("int8")
    d = str(tmp_path / "kv")
    cap_gib = 0.0002  # ~210 KB: ~90 blocks of this model; the other writer evicts too
    cap = int(cap_gib * 2**30)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=_other_writer, args=(d, cap, stop, 3000), daemon=True)
    llm = _llm(tiny_bf16, "int8", num_blocks=20, kv_offload_dir=d, kv_offload_disk=cap_gib)
    proc.start()
    try:
        for _ in range(2):
            assert _outs(llm, p1) == ref1
            assert _outs(llm, p2) == ref2
    finally:
        stop.set()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        llm.engine.shutdown()
    assert proc.exitcode == 0
    files = DiskTier(d, 2**40).scan()
    assert sum(f[1] for f in files) <= cap
    spec = llm.engine.kv_manager.connectors["tiers"].spec
    for _, _, path in files:  # no torn file: each is a whole entry (ours verify entirely)
        blob = _read(path)
        hdr = bs.read_header(blob)
        if isinstance(hdr, dict):
            out = bs.verify(spec, blob, bytes.fromhex(hdr["chain_hash"]),
                            tuple(hdr["token_ids"]))
            assert isinstance(out, bs.StoredBlock), (path, out)
        else:
            assert len(blob) == 2000  # the other process's own entries


def test_full_queue_drops_writes_not_steps(tiny_bf16, cold):
    """A writer stuck on slow storage: the queue fills, further write-downs are dropped and
    counted, the steps go on, the output is unchanged."""
    import threading

    _, ref1, _, p1, _ = cold("bf16")
    llm = _llm(tiny_bf16, "bf16", num_blocks=12, kv_offload_memory=0.01, kv_offload_queue=2)
    tiers = llm.engine.kv_manager.connectors["tiers"]
    gate = threading.Event()
    orig = tiers._write_one

    def stuck(w):
        gate.wait(60)
        orig(w)

    tiers._write_one = stuck
    try:
        assert _outs(llm, p1) == ref1
        st = llm.engine.stats().kv_tiers
        assert st["queue_capacity"] == 2 and st["dropped_writes"] > 0
        assert st["queue_depth"] <= 2
    finally:
        gate.set()
        llm.engine.shutdown()


def test_flags_and_user_errors(tiny_bf16, tmp_path):
    from kvserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="kv_offload_memory"):
        EngineArgs(kv_offload_memory=-1).cache_config()
    with pytest.raises(ValueError, match="kv_offload_disk"):
        EngineArgs(kv_offload_dir=str(tmp_path), kv_offload_disk=0).cache_config()
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_offload_memory=1, enable_prefix_caching=False).cache_config()
    cfg = EngineArgs(kv_offload_memory=0.5, kv_offload_dir="x", kv_offload_disk=2)
    c = cfg.cache_config()
    assert (c.kv_offload_memory_bytes, c.kv_offload_disk_bytes) == (2**29, 2**31)
    assert not EngineArgs().cache_config().kv_offload_enabled
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        DiskTier(str(tmp_path / "file"), 2**20)


# ---- the tiers without an engine ---------------------------------------------------------
def _cache_and_tiers(tmp_path, mode: str = "int8"):
    from kvserve.cache.kv_cache import PagedKVCache
    from kvserve.cache.kv_tiers import KVTiers, TierConfig
    from kvserve.config import parse_kv_mode

    m = parse_kv_mode(mode)
    kv = PagedKVCache(2, 8, BS, 2, 16, 2, m, rotation_seed=0 if m.rotate else None)
    g = torch.Generator().manual_seed(0)
    kv.data.view(torch.uint8).copy_(torch.randint(0, 256, kv.data.view(torch.uint8).shape,
                                                  generator=g, dtype=torch.uint8))
    if kv.scales is not None:
        kv.scales.copy_(torch.randint(-40, 40, kv.scales.shape, generator=g).to(kv.scales.dtype))
    spec = bs.StoreSpec(model="m", kv_mode=kv.mode.name, rotation="r", fingerprint="f",
                        block_size=BS, num_layers=2, components=2, num_kv_heads=2, head_dim=16,
                        dtype=bs.dtype_str(kv.dtype),
                        scale_dtype="" if kv.scales is None else bs.dtype_str(kv.scales.dtype))
    cfg = TierConfig(memory_bytes=2**20, disk_dir=str(tmp_path / "kv"), disk_bytes=2**20)
    return kv, KVTiers(cfg, spec, kv)


def test_round_trip_sets_write_state(tmp_path):
    """Write-down, restore and install without an engine; where the fused (Triton) writer keeps
    per-block checksum state, install sets it to the verified sums (what sealing reads)."""
    from kvserve.cache.integrity import block_sums
    from kvserve.cache.kv_connector import BlockRef

    kv, tiers = _cache_and_tiers(tmp_path)
    kv.csum_state = torch.zeros((kv.num_layers, kv.num_blocks + 1, 4), dtype=torch.int64)
    try:
        ev = [BlockRef(b, bytes([b]) * 16, tuple(range(b, b + BS))) for b in (1, 2, 3)]
        tiers.write_down(ev, [None] * 3)
        tiers.flush()
        assert tiers.num_loadable(ev, None) == 3
        tiers.start_load("r", ev, None)
        tiers._jobs.get("r").done.wait(10)
        got = tiers.finished("r").blocks
        assert [b.chain_hash for b in got] == [e.chain_hash for e in ev]
        want = block_sums(kv, [1, 2, 3])
        tiers.install([5, 6, 7], got)
        assert torch.equal(kv.data[:, 5:8].view(torch.uint8), kv.data[:, 1:4].view(torch.uint8))
        assert torch.equal(kv.scales[:, 5:8], kv.scales[:, 1:4])
        assert (block_sums(kv, [5, 6, 7]) == want).all()
        assert torch.equal(kv.csum_state[:, 5:8].permute(1, 0, 2), torch.from_numpy(want))
        assert tiers.stats()["tiers"]["memory"]["hits"] == 3
    finally:
        tiers.close()


def test_restore_does_not_hold_up_others(tiny_bf16, cold):
    """While one request waits for a (slow) restore, another runs to completion; then the
    waiting one is served from the tier, with the cold run's output."""
    import threading

    _, ref1, _, p1, _ = cold("int8")
    llm = _llm(tiny_bf16, "int8", num_blocks=12, kv_offload_memory=0.01)
    eng = llm.engine
    tiers = eng.kv_manager.connectors["tiers"]
    try:
        assert _outs(llm, [p1[0]]) == [ref1[0]]
        assert eng.kv_manager.write_down_cached() > 0  # prompt 0's blocks in the memory tier ...
        eng.pool.reset_prefix_cache()  # ... and no longer in the pool
        gate = threading.Event()
        orig = tiers._read_one

        def slow(h, t):
            gate.wait(60)
            return orig(h, t)

        tiers._read_one = slow
        eng.add_request("waits", {"prompt_token_ids": p1[0]}, SP)
        eng.add_request("runs", {"prompt_token_ids": p1[3]}, SP)
        done = {}
        for _ in range(200):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            if "runs" in done:
                break
        assert done == {"runs": ref1[3][0]}
        assert tiers.loading("waits") and tiers.finished("waits") is None
        gate.set()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        assert done["waits"] == ref1[0][0]
        assert eng.kv_manager.num_restored_tokens > 0
    finally:
        gate.set()
        eng.shutdown()


def test_bad_memory_entry_falls_back_to_disk(tiny_bf16, cold, tmp_path):
    """Memory first, then disk: a damaged memory entry is refused (tier=memory) and the disk
    copy serves the block."""
    _, ref1, _, p1, _ = cold("int8")
    llm = _llm(tiny_bf16, "int8", kv_offload_memory=0.01, kv_offload_dir=str(tmp_path / "kv"),
               kv_offload_disk=0.01)
    eng = llm.engine
    try:
        assert _outs(llm, [p1[0]]) == [ref1[0]]
        assert eng.kv_manager.write_down_cached() > 0
        mem = eng.kv_manager.connectors["tiers"].memory
        key = entry_key(eng.kv_manager.connectors["tiers"].spec, _chain(eng, p1[0])[0])
        blob = bytearray(mem._d[key])
        blob[len(blob) // 2] ^= 0x01
        mem._d[key] = bytes(blob)
        eng.pool.reset_prefix_cache()
        assert _outs(llm, [p1[0]]) == [ref1[0]]
        st = _tier_stats(llm)
        assert st["memory"]["rejected"] == {"bad_checksum": 1}
        assert st["disk"]["hits"] >= 1 and not st["disk"]["rejected"]
    finally:
        eng.shutdown()
