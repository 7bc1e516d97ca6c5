"""An engine publishing KV events (demo model, in process) and the router's index built from
them: every payload decodes with vLLM's schema, and after prefix hits, evictions (a small
pool) and a prefix-cache reset the index holds exactly the blocks the pool has cached, under
the chain keys of their prompts."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_events import decode_batch, external_hash
from kvserve.engine.arg_utils import EngineArgs, demo_model_path
from kvserve.router.prefix_index import PrefixIndex
from tests.cache.test_kv_events import _vllm_schema

pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # slow: loads the demo model (~20 s)
    not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
    reason="demo model not present")]


def _drain(sub: zmq.Socket, idx: PrefixIndex, schema, seqs: list[int],
           quiet_s: float = 0.3) -> None:
    while sub.poll(int(quiet_s * 1000)):
        _, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        msgspec.msgpack.decode(payload, type=schema)  # vLLM's own decoder accepts it
        for ev in decode_batch(payload).events:
            idx.apply("r0", ev)


def test_index_matches_the_engines_pool() -> None:
    args = EngineArgs(model="demo", num_blocks=24, block_size=16, progress=False,
                      kv_events_endpoint="tcp://127.0.0.1:0", kv_events_format="array")
    llm = LLM.from_engine_args(args)
    pub = llm.engine.kv_events
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    schema = _vllm_schema(array_like=True)[0]
    idx, seqs = PrefixIndex(), []
    try:
        time.sleep(0.3)  # the subscription reaches the publisher before anything is cached
        tok = llm.get_tokenizer()
        doc = " ".join(f"line {i} of the shared document." for i in range(20))
        prompts = [doc + " First question?", doc + " Second question?"]
        params = SamplingParams(temperature=0, max_tokens=4)
        llm.generate(prompts, params)
        _drain(sub, idx, schema, seqs)
        pool = llm.engine.pool

        def check() -> None:
            cached = {external_hash(h) for h in pool._cached}
            assert cached, "nothing cached"
            assert set(idx._chain["r0"]) == cached  # engine hashes held in any medium

        check()
        ids = tok.encode(prompts[0] + " more", add_special_tokens=True)
        assert idx.match(ids)["r0"] >= 16 * (len(tok.encode(doc)) // 16 - 1)
        # other documents evict the first one from the 24-block pool
        others = [" ".join(f"{w} {i}" for i in range(60)) for w in ("alpha", "beta", "gamma")]
        llm.generate(others, params)
        _drain(sub, idx, schema, seqs)
        check()
        assert pool.num_evictions > 0
        llm.engine.pool.reset_prefix_cache()
        _drain(sub, idx, schema, seqs)
        assert idx.num_blocks("r0") == 0 and not pool._cached
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
    finally:
        sub.close(0)
        llm.engine.shutdown()


def test_tier_events_keep_an_evicted_prefix_routable(tmp_path) -> None:
    """With a disk tier, a document the pool evicted stays in the index as "disk" (announced by
    the tiers' writer thread, in vLLM's schema), so the replica still matches it."""
    args = EngineArgs(model="demo", num_blocks=24, block_size=16, progress=False,
                      kv_events_endpoint="tcp://127.0.0.1:0", kv_offload_dir=str(tmp_path),
                      kv_offload_disk=0.01)
    llm = LLM.from_engine_args(args)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(llm.engine.kv_events.endpoint)
    schema = _vllm_schema(array_like=True)[0]
    idx, seqs = PrefixIndex(), []
    try:
        time.sleep(0.3)
        doc = " ".join(f"line {i} of the shared document." for i in range(20))
        params = SamplingParams(temperature=0, max_tokens=4)
        llm.generate([doc + " First question?"], params)
        others = [" ".join(f"{w} {i}" for i in range(60)) for w in ("alpha", "beta", "gamma")]
        llm.generate(others, params)  # evicts the document from the 24-block pool
        llm.engine.kv_manager.connectors["tiers"].flush()
        _drain(sub, idx, schema, seqs)
        ids = llm.get_tokenizer().encode(doc + " Second question?", add_special_tokens=True)
        pool_keys = {external_hash(h) for h in llm.engine.pool._cached}
        assert llm.engine.pool.num_evictions > 0 and idx.blocks_by_medium("r0").get("disk")
        doc_blocks = len(llm.get_tokenizer().encode(doc)) // 16 - 1
        # the document's blocks are no longer in the pool, but held on disk at weight 0.5
        assert set(idx._chain["r0"]) - pool_keys
        assert idx.match(ids)["r0"] >= 0.5 * 16 * doc_blocks
    finally:
        sub.close(0)
        llm.engine.shutdown()
