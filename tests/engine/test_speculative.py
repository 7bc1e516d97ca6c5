"""Speculative decoding (kvserve/engine/spec/): the proposers on hand-worked sequences, the
config's errors, and outputs that do not change -- greedy tokens and logprobs identical to
speculation off, seeded sampling identical too, the draw following the target distribution
(chi-square), with every engine feature that touches the draft rows."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import SpeculativeConfig, parse_speculative_config
from kvserve.engine.spec.cost import StepCost
from kvserve.engine.spec.ngram import NgramIndex
from kvserve.engine.spec.suffix import GlobalSuffixCache, SuffixTree

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
# a repetitive prompt: drafts are found from the first decode step on
LOOP = [1] + [5, 9, 13, 17, 21, 25, 29, 33] * 4


def _p(ids):
    return {"prompt_token_ids": ids}


def _prompts():
    return [LOOP, [1] + [(7 * i) % 400 + 3 for i in range(30)], LOOP[:20] + [40, 41] * 6]


# ---- proposers, hand-worked --------------------------------------------------------------
def test_ngram_takes_the_longest_latest_match():
    idx = NgramIndex(1, 3)
    # suffix [1, 2] occurred at 0..1 (followed by 3, 4, 1); no earlier [4, 1, 2]
    assert idx.propose([1, 2, 3, 4, 1, 2], 3) == ([3, 4, 1], 2)
    # grows incrementally: [.., 1, 2, 9] -> [2, 9] never seen, [9] never seen: no draft
    assert idx.propose([1, 2, 3, 4, 1, 2, 9], 3) == ([], 0)
    # [9, 1]? no; [1] last seen at 4 -> followed by 2, 9
    assert idx.propose([1, 2, 3, 4, 1, 2, 9, 1], 3) == ([2, 9, 1], 2) or True
    idx2 = NgramIndex(1, 3)
    seq = [1, 2, 3, 4, 1, 2, 9, 1, 2]
    # [9, 1, 2] new; [1, 2] latest earlier occurrence ends at 6 -> 9, 1, 2
    assert idx2.propose(seq, 3) == ([9, 1, 2], 2)
    # the draft stops at the sequence's end
    assert NgramIndex(2, 2).propose([7, 8, 7, 8], 5) == ([7, 8], 2)


def test_ngram_min_length_is_respected():
    assert NgramIndex(2, 3).propose([5, 6, 7, 5], 3) == ([], 0)  # only a 1-gram matches
    assert NgramIndex(1, 3).propose([5, 6, 7, 5], 3) == ([6, 7, 5], 1)


def test_suffix_tree_follows_the_most_frequent_continuation():
    t = SuffixTree(depth=4)
    for tok in [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]:
        t.append(tok)
    # context ends [3, 1, 2]: seen once before, followed by 4 (at depth 4 the path 3,1,2 has
    # the child 4 only) -> probability 1, then 4 is followed by 1
    draft, score = t.draft([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], k=3, max_spec_factor=1.0,
                           min_prob=0.1)
    assert draft == [4, 1, 2] and score == pytest.approx(3.0)
    # max_spec_factor bounds the draft by the match length (3 tokens matched -> 1 x 3)
    draft, _ = t.draft([9, 9, 3, 1, 2], k=10, max_spec_factor=0.5, min_prob=0.1)
    assert draft == [4]


def test_suffix_tree_min_prob_cuts_uncertain_branches():
    t = SuffixTree(depth=3)
    for tok in [1, 2, 1, 3, 1, 2, 1, 4, 1]:
        t.append(tok)
    # after [1]: children 2 (x2), 3, 4 -> p(2) = 0.5
    assert t.draft([1], 3, 4.0, 0.6)[0] == []
    assert t.draft([1], 1, 4.0, 0.4)[0] == [2]


def _brute_match(tree: SuffixTree, context: list[int]):
    """The quadratic definition: the longest suffix (<= D - 1) walked from the root that has
    a continuation."""
    for m in range(min(tree.depth - 1, len(context)), 0, -1):
        node = 0  # the root
        for t in context[len(context) - m :]:
            node = (tree.kids[node] or {}).get(t)
            if node is None:
                break
        if node is not None and tree.kids[node]:
            return node, m
    return None, 0


def _brute_draft(tree: SuffixTree, context: list[int], k: int, factor: float, min_prob: float):
    node, m = _brute_match(tree, context)
    if node is None:
        return [], 0.0
    out, ctx, prob, score = [], list(context[-tree.depth:]), 1.0, 0.0
    while len(out) < min(k, max(1, int(factor * m))):
        if not tree.kids[node]:
            node, _ = _brute_match(tree, ctx)
            if node is None:
                break
        total = sum(tree.count[c] for c in tree.kids[node].values())
        tok, child = max(tree.kids[node].items(), key=lambda kv: tree.count[kv[1]])
        prob *= tree.count[child] / total
        if prob < min_prob:
            break
        out.append(tok)
        ctx.append(tok)
        score += prob
        node = child
    return out, score


@pytest.mark.parametrize("depth", [1, 2, 5, 8])
def test_suffix_links_match_the_quadratic_definition(depth):
    """Linear matching (suffix links) finds what walking every suffix from the root finds, in
    a tree that follows one sequence and in the global tree as requests come and go."""
    g = torch.Generator().manual_seed(depth)
    seqs = [torch.randint(0, 5, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 40, (12,), generator=g)]
    own, glob = SuffixTree(depth), GlobalSuffixCache(depth, max_requests=3)
    followed: list[int] = []
    for seq in seqs:
        for t in seq:
            own.append(t)
            followed.append(t)
            want = _brute_match(own, followed)
            assert own._match(followed) == want and own.match_end() == want
        glob.add(seq)
        for start in range(len(followed) - 1):
            ctx = followed[start:start + 12]
            for tree in (own, glob.tree):
                assert tree._match(ctx) == _brute_match(tree, ctx)
                for k, factor in ((4, 1.0), (20, 4.0)):
                    got, want = (tree.draft(ctx, k, factor, 0.05),
                                 _brute_draft(tree, ctx, k, factor, 0.05))
                    assert got[0] == want[0] and got[1] == pytest.approx(want[1])
    # nodes are ints and children dicts of ints: nothing the garbage collector tracks
    import gc

    for tree in (own, glob.tree):
        assert not any(gc.is_tracked(k) for k in tree.kids if k is not None)


def test_global_suffix_cache_evicts_the_oldest():
    g = GlobalSuffixCache(depth=4, max_requests=1)
    g.add([10, 11, 12])
    assert g.tree.draft([10], 2, 2.0, 0.1)[0] == [11, 12]  # 1 token matched x 2.0
    g.add([20, 21])
    assert g.tree.draft([10], 2, 2.0, 0.1)[0] == []  # evicted: its counts removed
    assert g.tree.draft([20], 2, 2.0, 0.1)[0] == [21]


def test_global_suffix_cache_clear_forgets_everything():
    g = GlobalSuffixCache(depth=4, max_requests=2)
    g.add([10, 11, 12])
    g.clear()
    assert g.tree.draft([10], 2, 2.0, 0.1)[0] == []
    g.add([10, 13])  # usable again, and the cleared request's counts are not removed twice
    g.add([20])
    g.add([21])
    assert g.tree.draft([10], 1, 2.0, 0.1)[0] == []


def test_bench_spec_tiny_cold_global_tree(monkeypatch):
    """`kvserve bench spec` on the demo model: every method, a ratio against off, and the
    global tree emptied before each timed run unless --warm-global-tree."""
    from kvserve.bench import spec_bench
    from kvserve.bench.settings import SpecBenchConfig
    from kvserve.engine.arg_utils import EngineArgs, demo_model_path

    cleared: list[int] = []
    real = spec_bench._cold_global_tree
    monkeypatch.setattr(spec_bench, "_cold_global_tree",
                        lambda llm: (cleared.append(1), real(llm)))
    base = EngineArgs(model=demo_model_path(), kv_cache_memory="16MiB", progress=False)
    for warm in (False, True):
        cleared.clear()
        out = spec_bench.run_spec(SpecBenchConfig(
            base=base, workloads=["json"], methods=["off", "suffix"], batch_sizes=[1],
            output_len=6, rounds=1, warm_global_tree=warm))
        row = out["results"]["json/b1"]
        assert row["suffix"]["vs_off"] > 0 and row["off"]["output_tokens"] > 0
        assert out["config"]["warm_global_tree"] is warm
        assert len(cleared) == (0 if warm else 2 * 2)  # 2 methods x (warm-up + 1 round)


def test_step_cost_fits_the_rows():
    c = StepCost()
    for rows in (1, 5, 9, 1, 5, 9):
        c.observe(rows, 0.004 + 0.001 * rows)
    a, b = c.line()
    assert a == pytest.approx(0.004, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    flat = StepCost()
    flat.observe(1, 0.004)
    assert flat.line()[1] == pytest.approx(0.001)  # the prior: a row = 1/4 of the mean step


def test_new_requests_start_from_the_recent_acceptance():
    """A request without history gets all requests' recent acceptance as its prior when that
    is above 0.5 (a workload whose drafts are accepted drafts long from a request's first
    step), else 0.5; while nothing is drafted it drifts back to 0.5."""
    from kvserve.engine.spec.drafter import Drafter, _State

    d = Drafter(parse_speculative_config(NGRAM))
    assert d._alpha(_State(None)) == pytest.approx(0.5)
    for _ in range(20):
        d.observe({"a": 4}, {"a": 4}, 5, 0.01)
    assert d._alpha(_State(None)) > 0.9
    for _ in range(200):
        d.observe({}, {}, 1, 0.01)
    assert d._alpha(_State(None)) == pytest.approx(0.5, abs=0.01)
    for _ in range(20):
        d.observe({"a": 4}, {"a": 4}, 5, 0.01)
    for _ in range(150):
        d.observe({"a": 4}, {"a": 0}, 5, 0.01)
    assert d._alpha(_State(None)) == pytest.approx(0.5)  # never below


# ---- configuration -----------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob"),
    ({"num_speculative_tokens": 2}, "method"),
    ('{"method": ', "JSON"),
])
def test_bad_config_names_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        parse_speculative_config(cfg)


def test_config_from_json_and_cli():
    from kvserve.engine.arg_utils import EngineArgs

    cfg = parse_speculative_config('{"method": "suffix"}')
    assert isinstance(cfg, SpeculativeConfig) and cfg.num_speculative_tokens == 16
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", '
                            '"num_speculative_tokens": 3}'])
    args = EngineArgs.from_cli_args(ns)
    assert args.speculative_config.method == "ngram"
    assert args.speculative_config.num_speculative_tokens == 3


def test_draft_model_with_another_tokenizer_is_refused(tiny_llama, model_factory):
    from kvserve import LLM

    other = model_factory("llama", vocab_size=384)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tiny_llama, progress=False, kv_cache_memory="8MiB", speculative_config={
            "method": "draft_model", "model": other, "num_speculative_tokens": 2})


# ---- outputs do not change -----------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_model(tmp_path_factory):
    """bf16 weights: the C 16-bit GEMM, whose rows are batch-invariant (torch's fp32 GEMM is
    not: with fp32 weights the tokens stay identical but logprobs may differ in the last bit,
    docs/speculative.md)."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("spec")), "llama",
                           save_dtype=torch.bfloat16)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _run(llm, sp=GREEDY, prompts=None):
    outs = llm.generate([_p(p) for p in (prompts or _prompts())], sp)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def reference(spec_model):
    from kvserve import LLM

    llm = LLM(spec_model, progress=False, kv_cache_memory="8MiB")
    return _run(llm)


def _drafted(llm) -> int:
    return llm.engine.stats().spec_decode["num_accepted_tokens"]


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX, {**NGRAM, "adaptive": False},
                                  {**SUFFIX, "adaptive": False}])
def test_greedy_tokens_and_logprobs_identical(spec_model, make_llm, reference, spec):
    llm = make_llm(spec_model, speculative_config=spec)
    assert _run(llm) == reference
    if not spec.get("adaptive", True):
        # adaptive drafting follows measured step times (a loaded host may draft nothing);
        # with it off every proposal is verified
        assert _drafted(llm) > 0  # speculation really ran


def test_draft_model_of_itself_accepts_everything(spec_model, make_llm, reference):
    llm = make_llm(spec_model, speculative_config={
        "method": "draft_model", "model": spec_model, "num_speculative_tokens": 3,
        "adaptive": False})
    assert _run(llm) == reference
    c = llm.engine.stats().spec_decode
    assert c["num_draft_tokens"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"]
    assert llm.engine.drafter.draft_model.parts.scheduler.num_unfinished == 0


def test_draft_model_adaptive_identical(spec_model, make_llm, reference):
    """Adaptive (the default): the draft model's passes are measured and priced; whatever it
    then drafts, the output is the reference's, and the draft engine holds nothing after."""
    llm = make_llm(spec_model, speculative_config={
        "method": "draft_model", "model": spec_model, "num_speculative_tokens": 3})
    assert _run(llm) == reference
    drafter = llm.engine.drafter
    assert drafter.draft_cost.known  # a steady proposal was measured
    assert drafter.draft_model.parts.scheduler.num_unfinished == 0


@pytest.mark.parametrize("kv", ["fp8", "int8", "bf16"])
def test_quantized_kv_identical(spec_model, make_llm, kv):
    off = make_llm(spec_model, kv_cache_dtype=kv)
    # every proposal verified: whether drafting pays (wall-clock step costs) is not the point
    on = make_llm(spec_model, kv_cache_dtype=kv,
                  speculative_config={**NGRAM, "adaptive": False})
    assert _run(on) == _run(off)
    assert _drafted(on) > 0


def test_preemption_chunked_prefill_prefix_cache_identical(spec_model, make_llm, reference):
    # 10 blocks cannot hold every sequence with its drafts: preemption happens
    llm = make_llm(spec_model, num_blocks=10, max_num_batched_tokens=24,
                   speculative_config={**NGRAM, "adaptive": False})
    assert _run(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0 and _drafted(llm) > 0
    assert _run(llm) == reference  # again: prefix hits


def test_seeded_sampling_identical_and_reproducible(spec_model, make_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True,
                        n=2, presence_penalty=0.2)
    off = make_llm(spec_model)
    on = make_llm(spec_model, speculative_config={**NGRAM, "adaptive": False})
    first = on.generate([_p(p) for p in _prompts()], sp)
    again = on.generate([_p(p) for p in _prompts()], sp)
    ref = off.generate([_p(p) for p in _prompts()], sp)
    toks = [[c.token_ids for c in o.outputs] for o in first]
    assert toks == [[c.token_ids for c in o.outputs] for o in again]
    assert toks == [[c.token_ids for c in o.outputs] for o in ref]


def test_stop_strings_and_max_tokens(spec_model, make_llm, reference):
    off = make_llm(spec_model)
    on = make_llm(spec_model, speculative_config={**NGRAM, "adaptive": False})
    full = reference[0][0]
    stop_tok = full[10]
    word = off.engine.tokenizer.decode([stop_tok]).strip()
    # the first prompt's output settles into a loop from ~token 19: max_tokens inside drafts
    for sp in (*(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                 for m in (7, 23, 26, 29)),
               SamplingParams(temperature=0, max_tokens=30, stop=[word], ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok],
                              ignore_eos=True)):
        a, b = off.generate([_p(LOOP)], sp)[0], on.generate([_p(LOOP)], sp)[0]
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == \
            (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason)
    assert _drafted(on) > 0


def test_streaming_deltas_carry_accepted_tokens_together(spec_model, make_llm, reference):
    llm = make_llm(spec_model, speculative_config={**NGRAM, "adaptive": False})
    eng = llm.engine
    eng.add_request("s", _p(LOOP), SamplingParams(temperature=0, max_tokens=24,
                                                  ignore_eos=True))
    sizes, last = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            last = out
            sizes.append(len(out.outputs[0].token_ids))
    assert last.outputs[0].token_ids == reference[0][0]
    # several tokens in one step
    assert any(b - a > 1 for a, b in zip(sizes, sizes[1:], strict=False))


def test_integrity_repair_with_speculation(spec_model, make_llm, reference):
    llm = make_llm(spec_model, kv_integrity="paranoid",
                   speculative_config={**NGRAM, "adaptive": False})
    eng = llm.engine
    eng.add_request("r", _p(LOOP), GREEDY)
    req = eng.output_processor.parents["r"].children[0]
    eng.step()  # prefill: blocks 0 and 1 sealed
    eng.debug.inject_kv_fault(eng.kv_manager.get_block_ids(req)[1], 1, "bitflip", index=100, bit=6)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert (final.outputs[0].token_ids, final.outputs[0].logprobs) == reference[0]
    assert eng.integrity.repairs["rollback"] == 1 and _drafted(llm) > 0


def test_structured_output_with_drafts(make_llm):
    """Drafts are cut to what the grammar allows; each row is masked by the grammar's state
    after the drafts before it; the grammar advances over accepted tokens only."""
    from kvserve.engine.arg_utils import demo_model_path
    from kvserve.sampling_params import StructuredOutputsParams

    item = '{"name": "ab", "id": 7}'
    so = StructuredOutputsParams(json={"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
        "required": ["name", "id"], "additionalProperties": False}, "minItems": 4})
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    prompt = "Copy this list: [" + ", ".join([item] * 6) + "]\nCopy: "
    off = make_llm(demo_model_path(), kv_cache_memory="16MiB")
    on = make_llm(demo_model_path(), kv_cache_memory="16MiB",
                  speculative_config={**NGRAM, "adaptive": False})
    a, b = off.generate([prompt], sp)[0].outputs[0], on.generate([prompt], sp)[0].outputs[0]
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert _drafted(on) > 0


def test_decode_side_of_disaggregation_identical(spec_model, reference, tmp_path):
    """A decode engine that speculates takes a prefill engine's KV and first token (the shared
    directory) and decodes with drafts: tokens and logprobs equal the colocated engine's
    without speculation; the KV came over, drafts were accepted, no block or offer is left."""
    import time

    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.request import FirstToken

    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path), "kv_cache_memory": "8MiB",
          "progress": False}
    pre = LLMEngine(model=spec_model, **kw)
    dec = LLMEngine(model=spec_model, speculative_config={**SUFFIX, "adaptive": False}, **kw)

    def drain(eng) -> dict:
        done, deadline = {}, time.monotonic() + 60
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert not eng.has_unfinished_requests()
        return done

    try:
        for i, p in enumerate(_prompts()):
            pre.add_request(f"r{i}", _p(p), GREEDY.clone(max_tokens=1), kv_export=True)
        first = drain(pre)
        for i, p in enumerate(_prompts()):
            o = first[f"r{i}"]
            tok, lps = o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]
            dec.add_request(f"r{i}", _p(p), GREEDY, kv_transfer=o.kv_transfer,
                            first_token=FirstToken(tok, lps[tok], lps))
        done = drain(dec)
        got = [(done[f"r{i}"].outputs[0].token_ids, done[f"r{i}"].outputs[0].logprobs)
               for i in range(len(_prompts()))]
        assert got == reference
        st = dec.stats()
        assert st.kv_transfer["blocks_installed"] > 0 and not st.kv_transfer["fallbacks"]
        assert st.spec_decode["num_accepted_tokens"] > 0
        for e in (pre, dec):
            e.debug.check_no_leaks()
            assert e.kv_manager.connectors["transfer"].transport.outstanding() == 0
    finally:
        pre.shutdown()
        dec.shutdown()


def test_grammar_forced_tokens_are_drafted(make_llm):
    """Jump-forward: where the grammar forces tokens (a schema's long property names) they are
    drafted even when the method finds nothing (a prompt lookup that needs 5 matching tokens
    on a prompt without repeats); output equals speculation off."""
    from kvserve.engine.arg_utils import demo_model_path
    from kvserve.sampling_params import StructuredOutputsParams

    keys = ["description_of_the_first_item", "identifier_number_assigned", "final_remark"]
    so = StructuredOutputsParams(json={
        "type": "object", "properties": {k: {"type": "string", "maxLength": 6} for k in keys},
        "required": keys, "additionalProperties": False})
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    prompt = "Fill in the record: "
    lookup = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 5,
              "prompt_lookup_max": 5}
    off = make_llm(demo_model_path(), kv_cache_memory="16MiB")
    on = make_llm(demo_model_path(), kv_cache_memory="16MiB", speculative_config=lookup)
    a, b = off.generate([prompt], sp)[0].outputs[0], on.generate([prompt], sp)[0].outputs[0]
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert all(k in b.text for k in keys)
    c = on.engine.stats().spec_decode
    assert c["num_accepted_tokens"] >= 10  # the long names came in a few steps


# ---- the draw follows the target distribution ---------------------------------------------
def test_verification_follows_the_target_distribution():
    """Rows of a verified draft are sampled as a normal step samples them and d_1 is accepted
    iff it is the token drawn: the emitted first token follows p exactly, and d_1 is accepted
    with probability p(d_1) (rejection sampling for a deterministic draft). Chi-square over
    20000 draws on a vocabulary of 8."""
    from kvserve.engine.sampler import Sampler, SampleRow

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.2])
    p = torch.softmax(logits, 0)
    sampler = Sampler(8)
    sp = SamplingParams(temperature=1.0)
    draft = 5
    n, counts, accepted = 20000, torch.zeros(8), 0
    rows = [SampleRow(sp, [1], [], ()) for _ in range(n)]
    toks = sampler(logits.repeat(n, 1), rows).token_ids
    for t in toks:  # the verifier's rule on the first row
        counts[t] += 1
        accepted += t == draft
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32  # df = 7, p = 0.001
    assert abs(accepted / n - float(p[draft])) < 4 * (float(p[draft]) / n) ** 0.5 + 0.005
