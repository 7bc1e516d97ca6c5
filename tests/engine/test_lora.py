"""Multi-LoRA serving in the engine: greedy output equal to transformers + peft with the
adapter merged (fp32, full forwards), rows of different adapters (and the base) in one step,
fewer slots than adapters, adapters over GGUF packed weights, the adapter in every block's
identity (prefix cache, KV events), and bad adapters refused with a clear error."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch

from kvserve import LoRARequest, SamplingParams
from tests.lora_util import make_adapter, merged_hf
from tests.model.parity import assert_greedy_equal

pytest.importorskip("peft")

PROMPTS = [[1, 5, 9, 33, 40, 2, 7], [1, 300, 12, 8, 77, 91, 4, 4, 100, 21, 3, 17, 60, 61, 62,
                                      63, 64, 65, 66, 67]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from tests.conftest import make_tiny_model

    d = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(str(d / "base"))
    a1 = make_adapter(base, str(d / "a1"), r=8, alpha=16, seed=1)
    a2 = make_adapter(base, str(d / "a2"), r=4, alpha=8, targets=["q_proj", "v_proj",
                                                                    "down_proj"], seed=2)
    a3 = make_adapter(base, str(d / "a3"), r=16, alpha=4, seed=3, use_rslora=True)
    return base, {"a1": a1, "a2": a2, "a3": a3}


def _hf(base):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


_REF: dict = {}  # (base, adapter or None, prompt) -> greedy tokens of HF + peft merged


def _reference(base, adapter, ids):
    key = (base, adapter, tuple(ids))
    if key not in _REF:
        hf = _hf(base) if adapter is None else merged_hf(_hf(base), adapter)
        _REF[key] = _greedy_hf(hf, ids)
    return _REF[key]


def _greedy_hf(hf, ids, n=12):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _lora_llm(make_llm, base, adapters, **kw):
    kw.setdefault("dtype", "fp32")
    kw.setdefault("kv_cache_dtype", "fp32")
    kw.setdefault("lora_dtype", "float32")  # exact: auto is bf16 on CPU
    return make_llm(base, lora_modules=[f"{n}={p}" for n, p in adapters.items()], **kw)


def test_mixed_step_matches_peft_merged(adapters, make_llm):
    """Three adapters (rank 8 / 4 / 16, rsLoRA, a subset of modules) and the base model in
    one batch: each sequence's greedy output equals transformers + peft with its adapter
    merged; the adapters really change the output."""
    base, ads = adapters
    llm = _lora_llm(make_llm, base, ads)
    names = [None, "a1", "a2", "a3"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in names]
    loras = [None if n is None else LoRARequest(n) for _ in PROMPTS for n in names]
    seen = []

    def observe(sched, n_running):
        seen.append({s.req.lora.lora_name if s.req.lora else None for s in sched.scheduled})

    llm.engine.debug.on_schedule = observe
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert any(len(s) == 4 for s in seen), "the adapters never shared a step"
    got = {}
    for i, ids in enumerate(PROMPTS):
        for j, n in enumerate(names):
            got[i, n] = outs[i * len(names) + j].outputs[0].token_ids
            assert got[i, n] == _reference(base, ads.get(n), ids), (ids, n)
    assert len({tuple(got[0, n]) for n in names}) == 4


def test_fewer_slots_than_adapters(adapters, make_llm):
    """max_loras=1: the scheduler runs one adapter at a time (the others wait), outputs still
    right; a LoRARequest with a path registers the adapter on first use."""
    base, ads = adapters
    llm = make_llm(base, dtype="fp32", kv_cache_dtype="fp32", enable_lora=True, max_loras=1,
                   lora_dtype="float32")
    seen = []
    llm.engine.debug.on_schedule = lambda sched, n: seen.append(
        {s.req.lora.lora_name for s in sched.scheduled if s.req.lora})
    reqs = [LoRARequest("a1", 7, ads["a1"]), LoRARequest("a2", 0, ads["a2"])]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, lora_request=reqs)
    assert max(len(s) for s in seen) == 1
    assert dict(llm.engine.list_loras()) == {"a1": 7, "a2": 1}
    for out, n in zip(outs, ("a1", "a2"), strict=True):
        assert out.outputs[0].token_ids == _reference(base, ads[n], PROMPTS[0])


def test_adapter_is_part_of_block_identity(adapters, make_llm):
    """The same prompt under the base, a1 and a2 shares no KV block (each run gets its own
    output, a repeat hits only its own blocks), and KV events carry lora_id / lora_name."""
    base, ads = adapters
    llm = _lora_llm(make_llm, base, ads, block_size=4)
    stored = []

    class Sink:
        def stored(self, h, parent, tokens, lora=None):
            stored.append(lora)

        def removed(self, h):
            pass

        def cleared(self):
            pass

    llm.engine.pool.event_sink = Sink()
    ids = {"prompt_token_ids": PROMPTS[1]}
    first = {}
    for n in (None, "a1", "a2"):
        lr = None if n is None else LoRARequest(n)
        hits = llm.engine.kv_manager.num_hit_tokens
        first[n] = llm.generate(ids, GREEDY, lora_request=lr)[0].outputs[0].token_ids
        assert llm.engine.kv_manager.num_hit_tokens == hits  # nothing shared with the others
    for n in (None, "a1", "a2"):  # a repeat hits its own prefix, same output
        lr = None if n is None else LoRARequest(n)
        hits = llm.engine.kv_manager.num_hit_tokens
        assert llm.generate(ids, GREEDY, lora_request=lr)[0].outputs[0].token_ids == first[n]
        assert llm.engine.kv_manager.num_hit_tokens > hits
    assert len(set(map(tuple, first.values()))) == 3
    refs = {r.lora_name: r for r in stored if r is not None}
    assert set(refs) == {"a1", "a2"} and None in stored
    ids_by_name = dict(llm.engine.list_loras())
    assert all(refs[n].lora_id == ids_by_name[n] for n in refs)


def test_kv_event_fields(adapters):
    from kvserve.cache.kv_events import BlockStored, KVEventPublisher
    from kvserve.request import AdapterRef

    pytest.importorskip("zmq")
    pub = KVEventPublisher("tcp://127.0.0.1:*", block_size=4)
    try:
        pub.stored(b"h" * 16, None, (1, 2, 3, 4), AdapterRef(3, "a1", b"d"))
        pub.stored(b"i" * 16, b"h" * 16, (5, 6, 7, 8), AdapterRef(3, "a1", b"d"))
        pub.stored(b"j" * 16, b"i" * 16, (5, 6, 7, 8))
        evs = pub._drain()
    finally:
        pub.close()
    assert [type(e) for e in evs] == [BlockStored, BlockStored]  # base block not merged in
    assert (evs[0].lora_id, evs[0].lora_name, len(evs[0].block_hashes)) == (3, "a1", 2)
    assert (evs[1].lora_id, evs[1].lora_name) == (None, None)


@pytest.mark.slow  # writes a GGUF and loads it twice
def test_adapter_over_gguf_packed_weights(adapters, tmp_path, make_llm):
    """Q4_0 / Q8_0 base weights kept packed, the adapter fp32 on top: greedy output equals
    transformers' dequantized reading of the file with the adapter merged."""
    from tests.model.gguf_writer import dequantized_hf, write_gguf

    base, ads = adapters
    path = write_gguf(base, str(tmp_path / "m.gguf"),
                      lambda g: "Q8_0" if "attn_v" in g or g.startswith("output") else "Q4_0")
    llm = make_llm(path, dtype="float32", kv_cache_dtype="fp32", gguf_activations="fp32",
                   lora_dtype="float32", lora_modules=[f"a1={ads['a1']}"])
    prompts = [[1, 5, 9, 33, 40, 2, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=LoRARequest("a1"))
    ref = _greedy_hf(merged_hf(dequantized_hf(path), ads["a1"]), prompts[0])
    assert outs[0].outputs[0].token_ids == ref
    assert_greedy_equal(llm, dequantized_hf(path), prompts, max_tokens=12)  # base rows too


@pytest.mark.slow  # two engines, one recording its decode graph
def test_decode_graphs_stay_on_with_lora(adapters, tmp_path, make_llm):
    """With LoRA on, the CPU decode graph records the grouped LoRA GEMM (4 calls a layer, each
    row's slot a graph input): steps mixing the base and three adapters -- one registered after
    the recording -- replay to the eager engine's tokens and logprobs bit for bit, and each
    sequence's greedy output equals transformers + peft merged (fp32 over the bf16 weights)."""
    from tests.conftest import make_tiny_model

    _, ads = adapters  # same shapes as this base
    base = make_tiny_model(str(tmp_path / "bf16"), save_dtype=torch.bfloat16)
    kw = dict(kv_cache_dtype="fp32", lora_modules=[f"a1={ads['a1']}", f"a2={ads['a2']}"],
              max_num_batched_tokens=16, cpu_bf16_dot_rows=0, lora_dtype="float32")
    fast = make_llm(base, **kw)
    eager = make_llm(base, enforce_eager=True, **kw)
    g = fast.engine.runner.graphs
    assert eager.engine.runner.graphs is None
    assert g is not None and g.refused is None, "decode graph refused (see the log)"
    with open(os.path.join(base, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert g.tape.names.count("kvs_lora_gemm") == 4 * layers
    names = [None, "a1", "a2", "a3"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in names]
    loras = [None if n is None else LoRARequest(n) for _ in PROMPTS for n in names]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for label, llm in (("eager", eager), ("fast", fast)):
        llm.engine.add_lora("a3", ads["a3"])  # after the recording: a slot filled later
        outs[label] = [o.outputs[0] for o in llm.generate(prompts, sp, lora_request=loras)]
    assert g.runs > 0
    assert [o.token_ids for o in outs["fast"]] == [o.token_ids for o in outs["eager"]]
    assert [o.logprobs for o in outs["fast"]] == [o.logprobs for o in outs["eager"]]
    for i, ids in enumerate(PROMPTS):
        for j, n in enumerate(names):
            got = outs["fast"][i * len(names) + j].token_ids
            assert got == _reference(base, ads.get(n), ids), (i, n)
    assert len({tuple(outs["fast"][j].token_ids) for j in range(len(names))}) == 4


def _bf16_rounded(src: str, dst) -> str:
    """A copy of the PEFT folder ``src`` with every weight rounded to bf16 (kept fp32)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(f).items()}, f)
    return str(dst)


@pytest.mark.slow  # an engine and peft references
def test_bf16_adapter_weights(adapters, tmp_path, make_llm):
    """``lora_dtype=auto`` on CPU (the default) is bfloat16: the slots hold bf16 (half the
    bytes a mixed step reads), the decode graph still records, and each greedy output equals
    transformers + peft merged with the adapter's weights rounded to bf16 (the C kernel widens
    them exactly)."""
    from tests.conftest import make_tiny_model

    _, ads = adapters
    base = make_tiny_model(str(tmp_path / "bf16"), save_dtype=torch.bfloat16)
    llm = make_llm(base, kv_cache_dtype="fp32", cpu_bf16_dot_rows=0,
                   lora_modules=[f"a1={ads['a1']}", f"a3={ads['a3']}"])
    g = llm.engine.runner.graphs
    assert g is not None and g.refused is None
    lin = next(iter(llm.engine.runner.lora.wrapped.values()))
    assert lin.lora_a.dtype == lin.lora_b.dtype == torch.bfloat16
    names = ["a1", "a3"]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 2, GREEDY,
                        lora_request=[LoRARequest(n) for n in names])
    assert g.runs > 0
    for out, n in zip(outs, names, strict=True):
        rounded = _bf16_rounded(ads[n], tmp_path / f"{n}_bf16")
        assert out.outputs[0].token_ids == _reference(base, rounded, PROMPTS[1]), n
    with pytest.raises(ValueError, match="lora_dtype"):
        make_llm(base, enable_lora=True, lora_dtype="int8")


def test_lora_dtype_auto_resolves_per_device():
    """auto: bf16 slots on CPU (the C kernel's half-size weights), the compute dtype on CUDA
    (vLLM's auto); an explicit dtype is kept (float32: exact, what the peft tests pin)."""
    from kvserve.engine.builder import resolve_lora_dtype

    assert resolve_lora_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert resolve_lora_dtype("auto", torch.float16, "cuda") == torch.float16
    assert resolve_lora_dtype("auto", torch.bfloat16, "cuda:0") == torch.bfloat16
    assert resolve_lora_dtype("float32", torch.float32, "cpu") == torch.float32
    assert resolve_lora_dtype("float16", torch.float32, "cpu") == torch.float16


def _broken(src: str, dst, edit=None, drop=None) -> str:
    shutil.copytree(src, dst)
    if drop:
        os.remove(os.path.join(dst, drop))
    if edit:
        p = pathlib.Path(dst, "adapter_config.json")
        cfg = json.loads(p.read_text())
        edit(cfg)
        p.write_text(json.dumps(cfg))
    return str(dst)


def test_bad_adapters_are_refused(adapters, tmp_path, make_llm, model_factory):
    base, ads = adapters
    llm = make_llm(base, dtype="fp32", enable_lora=True, max_lora_rank=8)
    cases = {
        "no adapter_config.json": _broken(ads["a1"], tmp_path / "c", drop="adapter_config.json"),
        "no adapter_model.safetensors": _broken(ads["a1"], tmp_path / "w",
                                                drop="adapter_model.safetensors"),
        "over max_lora_rank 8": ads["a3"],
        "not supported": _broken(ads["a1"], tmp_path / "t",
                                 edit=lambda c: c.update(target_modules=["lm_head"])),
        "use_dora": _broken(ads["a1"], tmp_path / "d", edit=lambda c: c.update(use_dora=True)),
        "not a directory": str(tmp_path / "nowhere"),
    }
    other = model_factory("llama", hidden_size=96)  # another base: shapes differ
    cases["the base model needs"] = make_adapter(other, str(tmp_path / "shape"), r=4)
    for msg, path in cases.items():
        with pytest.raises(ValueError, match=msg):
            llm.engine.add_lora("bad", path)
    assert llm.engine.list_loras() == []
    llm.engine.add_lora("a1", ads["a1"])
    with pytest.raises(ValueError, match="already loaded"):
        llm.engine.add_lora("a1", ads["a1"])
    with pytest.raises(ValueError, match="no adapter 'zz'"):
        llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, lora_request=LoRARequest("zz"))
    llm.engine.remove_lora("a1")
    with pytest.raises(ValueError, match="no adapter 'a1'"):
        llm.engine.remove_lora("a1")
    with pytest.raises(ValueError, match="lora_modules"):
        make_llm(base, lora_modules=["noequals"])
    with pytest.raises(ValueError, match="lora_modules x"):  # a start-up error names it
        make_llm(base, lora_modules=[f"x={tmp_path / 'nowhere'}"])
    plain = make_llm(base)
    with pytest.raises(ValueError, match="LoRA is off"):
        plain.generate({"prompt_token_ids": [1, 2]}, GREEDY, lora_request=LoRARequest("a1"))
