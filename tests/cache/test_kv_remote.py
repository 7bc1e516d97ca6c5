"""The remote KV tier (kvserve/cache/remote_tier.py) on a real Redis server, started here for
the tests (``redis-server`` from Debian; .ci/run installs it): two engines in separate
processes share a prompt through it; corrupted values are rejected, counted and recomputed;
with the server stopped or unreachable the engine keeps serving with misses and no errors."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.remote_tier import KEY_PREFIX, RETRY_S

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Redis:
    def __init__(self) -> None:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:
            (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
                "redis-server is not installed (apt install redis-server)")
        self.exe, self.port = exe, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        r = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                r.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server():
    srv = _Redis()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("llama_bf16")), "llama",
                           save_dtype=torch.bfloat16)


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    doc = [1] + torch.randint(3, 500, (80,), generator=g).tolist()
    return [doc + torch.randint(3, 500, (5 + i,), generator=g).tolist() for i in range(3)]


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("num_blocks", 200)
    return LLM(path, dtype="bf16", kv_cache_dtype="int8", block_size=16, progress=False, **kw)


def _outs(llm: LLM, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def cold(tiny_bf16):
    llm = _llm(tiny_bf16)
    ref = _outs(llm, _prompts())
    llm.engine.shutdown()
    return ref


def _writer(path: str, url: str, q) -> None:
    """Another process: serve the prompts, then shut down (writes its cached blocks)."""
    llm = _llm(path, kv_offload_url=url)
    q.put(_outs(llm, _prompts()))
    llm.engine.shutdown()


def _write_from_other_process(path: str, url: str):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(path, url, q))
    p.start()
    try:
        out = q.get(timeout=300)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    return out


def _remote(llm: LLM) -> dict:
    return llm.engine.stats().kv_tiers["tiers"]["remote"]


def test_two_processes_share_a_prompt(tiny_bf16, cold, redis_server):
    assert _write_from_other_process(tiny_bf16, redis_server.url) == cold
    keys = list(redis_server.client().scan_iter(KEY_PREFIX + "*"))
    assert keys, "the other process wrote its blocks to the store"
    llm = _llm(tiny_bf16, kv_offload_url=redis_server.url)
    try:
        assert _outs(llm, _prompts()) == cold
        st = _remote(llm)
        assert st["hits"] >= 80 // 16 and not st["rejected"] and st["failures"] == 0
        assert llm.engine.kv_manager.num_restored_tokens > 0
    finally:
        llm.engine.shutdown()


def test_corrupted_values_are_rejected_and_counted(tiny_bf16, cold, redis_server):
    _write_from_other_process(tiny_bf16, redis_server.url)
    r = redis_server.client()
    keys = list(r.scan_iter(KEY_PREFIX + "*"))
    for i, k in enumerate(keys):  # flip one payload byte per value (past the header)
        v = bytearray(r.get(k))
        v[len(v) - 1 - (i % 64)] ^= 0x10
        r.set(k, bytes(v))
    llm = _llm(tiny_bf16, kv_offload_url=redis_server.url)
    try:
        assert _outs(llm, _prompts()) == cold  # recomputed
        st = _remote(llm)
        assert sum(st["rejected"].values()) >= 1 and st["hits"] == 0
    finally:
        llm.engine.shutdown()


def test_stopped_store_is_a_miss_not_an_error(tiny_bf16, cold, redis_server):
    # a pool of 8 blocks: each prompt set evicts the other (write-downs), then looks it up
    llm = _llm(tiny_bf16, kv_offload_url=redis_server.url, num_blocks=8)
    try:
        assert _outs(llm, _prompts()) == cold
        other = _outs(llm, _prompts(4))
        llm.engine.kv_manager.connectors["tiers"].flush()
        assert _outs(llm, _prompts()) == cold
        assert _remote(llm)["hits"] > 0  # restored from the store while it ran
        redis_server.stop()
        t0 = time.monotonic()
        for _ in range(3):  # lookups, restores and write-downs hit the dead store
            assert _outs(llm, _prompts(4)) == other
            assert _outs(llm, _prompts()) == cold
        st = _remote(llm)
        assert st["failures"] >= 1
        # the breaker: after a failed call the store is skipped for RETRY_S; each of the three
        # callers (step loop, writer, restorer) meets at most one failure per window
        assert st["failures"] <= 3 * (1 + (time.monotonic() - t0) / RETRY_S)
    finally:
        llm.engine.shutdown()


def test_unreachable_store_from_the_start(tiny_bf16, cold):
    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    llm = _llm(tiny_bf16, kv_offload_url=url, kv_offload_timeout=0.1)
    try:
        assert _outs(llm, _prompts()) == cold
        assert _remote(llm)["hits"] == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("url", ["http://h:1/0", "redis://", "redis://h:port/0",
                                 "redis://h:6379/x"])
def test_bad_url_names_the_flag(url):
    from kvserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="kv_offload_url"):
        EngineArgs(kv_offload_url=url).cache_config()
