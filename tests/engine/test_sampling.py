from __future__ import annotations

import math

import torch

from kvserve import SamplingParams
from kvserve.engine.sampler import Sampler, SampleRow, _top_p, argmax_rows


def _p(ids):
    return {"prompt_token_ids": ids}


def test_stop_string_truncates_and_never_streams_partially(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    free = llm.generate([_p([1, 5, 6])], SamplingParams(temperature=0, max_tokens=20,
                                                         ignore_eos=True))[0].outputs[0]
    words = free.text.split()
    stop = " ".join(words[3:5])  # a stop string spanning two tokens
    eng = llm.engine
    eng.add_request("s", _p([1, 5, 6]), SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True, stop=[stop]))
    seen = []
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(out.outputs[0].text)
            final = out
    comp = final.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == free.text[: free.text.index(stop)]
    for t in seen:  # every intermediate text is a prefix of the final one: no partial stop
        assert comp.text.startswith(t) or t.startswith(comp.text) and stop not in t


def test_stop_token_and_min_tokens(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    ref = llm.generate([_p([1, 5, 6])], SamplingParams(temperature=0, max_tokens=10,
                                                        ignore_eos=True))[0].outputs[0]
    t = ref.token_ids[2]
    out = llm.generate([_p([1, 5, 6])], SamplingParams(temperature=0, max_tokens=10,
                                                        stop_token_ids=[t], ignore_eos=True))
    c = out[0].outputs[0]
    assert c.token_ids == ref.token_ids[: ref.token_ids.index(t) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == t
    out = llm.generate([_p([1, 5, 6])], SamplingParams(temperature=0, max_tokens=10,
                                                        stop_token_ids=[t], min_tokens=8,
                                                        ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) >= 8


def test_eos_finishes_with_stop(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    eos = llm.engine.model_config.eos_token_ids
    assert eos == (2,)
    logits = torch.full((1, 512), -10.0)
    logits[0, 2] = 10.0
    s = Sampler(512)
    row = SampleRow(SamplingParams(temperature=0, min_tokens=3), [1], [], eos)
    assert s(logits.clone(), [row]).token_ids[0] != 2  # EOS banned before min_tokens
    row = SampleRow(SamplingParams(temperature=0), [1], [], eos)
    assert s(logits.clone(), [row]).token_ids[0] == 2


def test_logprobs_shape_and_values(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    ids = [1, 5, 6, 7, 8]
    out = llm.generate([_p(ids)], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                 prompt_logprobs=2, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == max(lp.values())  # greedy picks the top token
    assert math.isclose(c.cumulative_logprob, sum(lp[t] for t, lp in
                                                  zip(c.token_ids, c.logprobs, strict=True)),
                        rel_tol=1e-5)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    ref = torch.log_softmax(llm.engine.prompt_logits(ids), -1)
    for i in range(1, len(ids)):
        assert math.isclose(out.prompt_logprobs[i][ids[i]], float(ref[i - 1, ids[i]]),
                            abs_tol=1e-4)


def test_top_k_top_p_min_p_restrict_support():
    s = Sampler(10)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0, 0, 0]]) + 1e-9)
    for kw, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}),
                        ({"min_p": 0.5}, {0, 1})]:
        seen = set()
        for seed in range(60):
            row = SampleRow(SamplingParams(temperature=1.0, seed=seed, **kw), [1], [], ())
            seen.add(s(logits.clone(), [row]).token_ids[0])
        assert seen == allowed, kw


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by sorting the whole vocabulary (what _top_p must equal)."""
    sorted_p, order = probs.sort(descending=True)
    drop = sorted_p.cumsum(0) - sorted_p > top_p
    return probs.scatter(0, order[drop], 0.0)


def test_top_p_equals_the_full_sort():
    g = torch.Generator().manual_seed(0)
    cases = 0
    for vocab in (10, 300, 4096, 49152):
        for scale in (0.1, 1.0, 4.0, 12.0):  # flat (the nucleus needs most of the vocab) .. peaked
            for top_p in (0.05, 0.5, 0.9, 0.999):
                probs = torch.softmax(torch.randn(vocab, generator=g) * scale, dim=-1)
                got, want = _top_p(probs, top_p), _top_p_by_full_sort(probs, top_p)
                assert torch.equal(got, want), (vocab, scale, top_p)
                kept = got > 0
                # the smallest prefix reaching top_p: its sum reaches it, less one token does not
                assert float(got.sum()) >= min(top_p, float(probs.sum())) - 1e-6
                assert float(got.sum() - got[kept].min()) <= top_p + 1e-6
                cases += 1
    assert cases == 64


def test_penalties_change_logits():
    s = Sampler(6)
    base = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 0.0]])
    row = SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [3], ())
    out = base.clone()
    s._apply_penalties(out, [row])
    assert out[0, 0] == 1.0 and out[0, 3] == -2.0 and out[0, 1] == 1.0
    row = SampleRow(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25),
                    [0], [1, 1, 2], ())
    out = base.clone()
    s._apply_penalties(out, [row])
    assert torch.allclose(out[0, :3], torch.tensor([2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]))


def test_chat_uses_template(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    out = llm.chat([{"role": "user", "content": "w5 w6"}],
                   SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    expect = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], add_generation_prompt=True, tokenize=True)
    if isinstance(expect, dict) or hasattr(expect, "input_ids"):
        expect = expect["input_ids"]
    assert out[0].prompt_token_ids == list(expect)


def test_argmax_rows_equals_torch_argmax_with_ties_and_inf():
    torch.manual_seed(0)
    x = torch.randn(37, 4096)
    x[3, [5, 900, 4000]] = 50.0  # ties: the first index wins, as in torch.argmax
    x[4] = float("-inf")
    x[4, 17] = -1e30
    x[5] = float("-inf")  # all -inf: index 0
    x[6] = 1.0  # all equal
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[3] == 5 and got[4] == 17 and got[5] == 0 and got[6] == 0
    assert torch.equal(argmax_rows(x[::2]), x[::2].argmax(dim=-1))  # non-contiguous rows


def test_draw_by_inversion_hand_worked():
    """The first token whose cumulative probability exceeds u x total: cum = [2, 2, 3, 4]
    of total 4, so u < 0.5 -> 0, 0.5 <= u < 0.75 -> 2 (token 1 has probability 0 and is
    skipped), u >= 0.75 -> 3; a leading zero is skipped at u = 0; no positive total -> -1."""
    from kvserve.engine.sampler import draw_by_inversion

    probs = torch.tensor([[2.0, 0.0, 1.0, 1.0]] * 6 + [[0.0, 1.0, 0.0, 0.0],
                                                       [float("nan")] * 4])
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.9999, 0.0, 0.3], dtype=torch.float64)
    assert draw_by_inversion(probs, u) == [0, 0, 2, 2, 3, 3, 1, -1]


def test_random_rows_follow_the_tempered_distribution():
    """20,000 unseeded rows at temperature 0.5 drawn in one call: chi-square against
    softmax(logits / 0.5) (df = 5, p = 0.001)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.25, 0.75])
    p = torch.softmax(logits / 0.5, 0)
    n = 20000
    rows = [SampleRow(SamplingParams(temperature=0.5), [1], [], ()) for _ in range(n)]
    toks = Sampler(6)(logits.repeat(n, 1), rows).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=6).float()
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 < 20.52


def test_seeded_draw_does_not_depend_on_the_batch():
    """A seeded row draws the same token alone and among greedy, unseeded and top-p rows, at
    any batch position; another output position draws anew."""
    torch.manual_seed(1)
    logits = torch.randn(1, 64) * 2
    seeded = SampleRow(SamplingParams(temperature=0.9, seed=7), [1], [5, 6], ())
    alone = Sampler(64)(logits.clone(), [seeded]).token_ids[0]
    others = [SampleRow(SamplingParams(temperature=0.0), [1], [], ()),
              SampleRow(SamplingParams(temperature=1.3), [1], [], ()),
              SampleRow(SamplingParams(temperature=0.7, top_p=0.8), [1], [], ())]
    for at in range(4):
        batch = others[:at] + [seeded] + others[at:]
        noise = torch.randn(4, 64)
        noise[at] = logits[0]
        assert Sampler(64)(noise, batch).token_ids[at] == alone
    draws = {Sampler(64)(logits.clone(), [SampleRow(seeded.params, [1], list(range(k)), ())])
             .token_ids[0] for k in range(40)}
    assert len(draws) > 1
