"""Collectives and weight sharding at world size 2 (spawned gloo ranks, file:// rendezvous)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.harness import run_world

# slow: spawns tensor-parallel rank processes
pytestmark = pytest.mark.slow


def _collectives(rank: int, world: int) -> dict:
    from kvserve.distributed import parallel_state as ps

    ones = ps.tp_all_reduce(torch.ones(3, dtype=torch.float64))
    ids = ps.tp_all_reduce(torch.full((2,), float(rank)))
    gathered = ps.tp_all_gather(torch.full((1, 2), float(rank)), dim=-1)
    to0 = ps.tp_gather(torch.full((2, 1), float(rank + 1)), dim=-1)
    mx = ps.cpu_all_reduce_max(torch.tensor([rank, 1 - rank]))
    bc = ps.cpu_broadcast(torch.tensor([7, 8]) if rank == 0 else torch.zeros(2, dtype=torch.int64))
    return {"ones": ones, "ids": ids, "gathered": gathered, "to0": to0, "max": mx, "bc": bc}


def test_collectives_exact(tmp_path):
    res = run_world(_collectives, 2, tmp_path)
    for r, out in enumerate(res):
        assert torch.equal(out["ones"], torch.full((3,), 2.0, dtype=torch.float64))
        assert torch.equal(out["ids"], torch.full((2,), 1.0))  # 0 + 1
        assert torch.equal(out["gathered"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
        assert torch.equal(out["max"], torch.tensor([1, 1]))
        assert torch.equal(out["bc"], torch.tensor([7, 8]))
        if r == 0:
            assert torch.equal(out["to0"], torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
        else:
            assert out["to0"] is None


def _idle_header(rank: int, world: int) -> float | str:
    """The driver's message header (``idle=True``): a worker may wait for it far past the
    collective timeout (an idle engine), but the driver's send must not wait for a worker
    that stopped between two messages (a gloo send completes only once the receiver posts)."""
    import time

    from kvserve.distributed import parallel_state as ps

    if rank == 0:
        time.sleep(4)  # idle for twice the timeout: the worker keeps waiting
    got = ps.cpu_broadcast(torch.tensor([5, 6]) if rank == 0 else torch.zeros(2, dtype=torch.int64),
                           idle=True)
    assert got.tolist() == [5, 6]
    if rank == 1:
        time.sleep(8)  # "stopped" before posting the next receive
        return "slept"
    t0 = time.monotonic()
    try:
        ps.cpu_broadcast(torch.tensor([7, 8]), idle=True)
    except ps.DistributedError:
        return time.monotonic() - t0
    return "sent to a worker that never received"


def test_idle_header_waits_on_workers_not_on_the_driver(tmp_path):
    took, slept = run_world(_idle_header, 2, tmp_path, collective_timeout_s=2.0)
    assert slept == "slept"
    assert isinstance(took, float) and 1.5 < took < 7.5, took  # before the worker wakes (8 s)


def _load_shards(rank: int, world: int, path: str) -> dict:
    from kvserve.model import loader, sources

    real, whole = sources.safe_open, []

    class Spy:  # records the tensors read whole (get_tensor) rather than sliced (get_slice)
        def __init__(self, *a, **k) -> None:
            self.cm = real(*a, **k)

        def __enter__(self):
            self.f = self.cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

    sources.safe_open = Spy
    model = loader.load_model(path, "float32", progress=False).model
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["__read_whole__"] = whole
    return out


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_loader_shards_exact(tmp_path, model_factory, kv_heads):
    """Each rank holds exactly its slice; the ranks' slices concatenate to the checkpoint
    tensor (KV heads replicated when tp > num_key_value_heads; vocab padded with zeros)."""
    from safetensors.torch import load_file

    path = model_factory("qwen2", num_key_value_heads=kv_heads)  # qkv bias too
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    shards = run_world(_load_shards, 2, tmp_path, path)
    h, d, inter, vocab = 4, 16, 128, 512
    pre = "model.layers.0."
    for kind in ("weight", "bias"):
        q = ckpt[f"{pre}self_attn.q_proj.{kind}"]
        k = ckpt[f"{pre}self_attn.k_proj.{kind}"]
        v = ckpt[f"{pre}self_attn.v_proj.{kind}"]
        hq = h // 2 * d
        hk = max(kv_heads // 2, 1) * d
        parts = [s[f"{pre}self_attn.qkv_proj.{kind}"] for s in shards]
        assert all(p.shape[0] == hq + 2 * hk for p in parts)
        assert torch.equal(torch.cat([p[:hq] for p in parts]), q)
        if kv_heads == 1:  # replicated: every rank holds the one KV head
            for p in parts:
                assert torch.equal(p[hq : hq + hk], k) and torch.equal(p[hq + hk :], v)
        else:
            assert torch.equal(torch.cat([p[hq : hq + hk] for p in parts]), k)
            assert torch.equal(torch.cat([p[hq + hk :] for p in parts]), v)
    o = [s[f"{pre}self_attn.o_proj.weight"] for s in shards]
    assert torch.equal(torch.cat(o, dim=1), ckpt[f"{pre}self_attn.o_proj.weight"])
    gu = [s[f"{pre}mlp.gate_up_proj.weight"] for s in shards]
    half = inter // 2
    assert torch.equal(torch.cat([g[:half] for g in gu]), ckpt[f"{pre}mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([g[half:] for g in gu]), ckpt[f"{pre}mlp.up_proj.weight"])
    down = [s[f"{pre}mlp.down_proj.weight"] for s in shards]
    assert torch.equal(torch.cat(down, dim=1), ckpt[f"{pre}mlp.down_proj.weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.cat([s[name] for s in shards])
        assert rows.shape[0] == 512  # 512 is already a multiple of 64 x 2: no padding
        assert torch.equal(rows[:vocab], ckpt[name])
    for s in shards:  # sharded weights are read as this rank's slice only
        read_whole = s["__read_whole__"]
        assert not [n for n in read_whole if any(p in n for p in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))]
        assert "model.norm.weight" in read_whole  # replicated: whole
    norm = [s["model.norm.weight"] for s in shards]
    assert torch.equal(norm[0], norm[1])  # replicated


def _padded_vocab(rank: int, world: int, path: str) -> dict:
    from kvserve.model.loader import load_model

    model = load_model(path, "float32", progress=False).model
    return {"embed": model.model.embed_tokens.weight.detach().clone()}


def test_vocab_padding(tmp_path, model_factory):
    from safetensors.torch import load_file

    path = model_factory("llama", vocab_size=500)
    ckpt = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
    shards = run_world(_padded_vocab, 2, tmp_path, path)
    rows = torch.cat([s["embed"] for s in shards])
    assert rows.shape[0] == 512  # padded to a multiple of 64 x tp
    assert torch.equal(rows[:500], ckpt)
    assert not rows[500:].any()
