"""A draft model's passes are priced (kvserve/engine/spec/cost.py ``DraftCost``): the adaptive
choice weighs them with the verify rows before the draft model runs, so a draft model as costly
as the target stops drafting and a cheap one drafts as far as it pays."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import parse_speculative_config
from kvserve.engine.spec.cost import DraftCost
from kvserve.engine.spec.drafter import Drafter
from kvserve.request import Request

K = 5


class _Draft:
    """A draft model that proposes the next k token ids and reports ``pass_s`` seconds a pass
    (the first pass costs ``first_s``)."""

    def __init__(self, first_s: float, pass_s: float) -> None:
        self.first_s, self.pass_s = first_s, pass_s
        self.calls: list[list[int]] = []

    def propose(self, reqs, ks, cost=None):
        self.calls.append(list(ks))
        if cost is not None:
            cost.observe(len(reqs), self.first_s, self.pass_s if max(ks) > 1 else None)
        return [[r.all_token_ids[-1] + 1 + j for j in range(k)]
                for r, k in zip(reqs, ks, strict=True)]

    def forget(self, request_id):
        return None

    def shutdown(self):
        return None


def _drafter(draft: _Draft) -> Drafter:
    cfg = parse_speculative_config({"method": "draft_model", "model": "unused",
                                    "num_speculative_tokens": K})
    d = Drafter(cfg, draft)
    # the target: 4 ms at 1 row, +1 ms per further row (hand-worked below)
    for _ in range(40):
        for rows in range(1, K + 2):
            d.cost.observe(rows, 0.003 + 0.001 * rows)
    return d


def _reqs(n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", f"r{i}", 0, [10 * i + 1, 10 * i + 2],
                    SamplingParams(max_tokens=100), 100)
        r.num_computed_tokens = r.num_tokens - 1  # decoding: one token to compute
        reqs.append(r)
    return reqs


def _accept_all(d: Drafter, reqs: list[Request], steps: int) -> None:
    """Every drafted token accepted, ``steps`` times (alpha -> ~1)."""
    for _ in range(steps):
        d.observe({r.request_id: K for r in reqs}, {r.request_id: K for r in reqs},
                  len(reqs) * (K + 1), None)


def _accepting(pass_s: float) -> tuple[_Draft, Drafter, list[Request]]:
    """One request whose drafts have all been accepted (alpha ~1), a draft model at
    ``pass_s`` a pass."""
    draft = _Draft(pass_s, pass_s)
    d = _drafter(draft)
    reqs = _reqs(1)
    _accept_all(d, reqs, 30)
    return draft, d, reqs


def test_draft_cost_sums_the_first_and_further_passes():
    c = DraftCost()
    assert not c.known and c(1, 3) == 0.0
    for _ in range(10):
        c.observe(1, 0.004, 0.002)
    assert c.known
    assert c(1, 0) == 0.0
    assert c(1, 1) == pytest.approx(0.004)
    assert c(1, 4) == pytest.approx(0.004 + 3 * 0.002)
    only_first = DraftCost()
    only_first.observe(2, 0.003, None)  # no second pass seen yet: priced as the first
    assert only_first(2, 3) == pytest.approx(3 * 0.003)


def test_a_draft_model_as_costly_as_the_target_stops_drafting():
    """Every draft accepted, but each draft pass costs a 1-row target step (4 ms): k passes
    and a (k+1)-row verify take 4k + 4 + k ms for k + 1 tokens, never better than 4 ms a token
    (k = 5: 29 ms for 6 tokens, 207 vs 250 tok/s). After the first (measured) proposal the
    draft model is not run again."""
    draft, d, reqs = _accepting(0.004)
    for _ in range(20):
        d.propose(reqs, 1)
    assert len(draft.calls) == 1  # the probe that measured it
    assert reqs[0].spec_token_ids == []


def test_a_cheap_draft_model_drafts_as_far_as_it_pays():
    """A pass at 0.2 ms, every draft accepted: k = 5 gives 6 tokens in 9 ms (the 6-row verify)
    + 1 ms (5 passes), 0.6 tokens a ms against 0.25 without: the full k, on every step."""
    draft, d, reqs = _accepting(0.0002)
    for _ in range(5):
        d.propose(reqs, 1)
        assert len(reqs[0].spec_token_ids) == K
    assert draft.calls == [[K]] * 5


def test_the_plan_weighs_passes_against_acceptance():
    """At a middling acceptance a mid-priced draft model drafts fewer tokens than k: the plan
    stops where one more pass no longer pays. Hand-worked: pass 1 ms, alpha 0.8; k tokens give
    1 + sum 0.8^j tokens in 4 + k (verify rows) + k (passes) ms: k = 1: 1.8 / 6 = 0.300,
    k = 2: 2.44 / 8 = 0.305, k = 3: 2.95 / 10 = 0.295 tokens a ms (1 / 4 = 0.25 without)."""
    draft = _Draft(0.001, 0.001)
    d = _drafter(draft)
    reqs = _reqs(1)
    d.propose(reqs, 1)  # the probe: measures the passes
    st = d._state(reqs[0])
    st.acc, st.trials = 0.8 * 1e6, 1e6  # alpha 0.8
    d._acc, d._trials = 0.0, 0.0
    d.propose(reqs, 1)
    assert draft.calls[-1] == [2]
    assert len(reqs[0].spec_token_ids) == 2


def test_grammar_forced_tokens_are_drafted_without_the_draft_model():
    """Planned at 0 draft-model tokens, a request whose grammar forces tokens still drafts
    them (they cost no pass)."""

    class _Forcing:
        def forced_tokens(self):
            return [7, 8]

        def validate(self, d):
            return len(d)

    draft, d, reqs = _accepting(0.004)
    d.propose(reqs, 1)
    reqs[0].grammar = _Forcing()
    d.propose(reqs, 1)
    assert len(draft.calls) == 1
    assert reqs[0].spec_token_ids == [7, 8]



def test_seconds_spent_drafting_count_whether_or_not_tokens_are_taken():
    """After the draft model ran, its seconds are part of the step whatever is taken: one
    draft token at p = 0.2 after 20 ms of drafting gives 1.2 tokens in 5 + 20 ms against 1 in
    4 + 20 (0.048 against 0.042 a ms: taken); with nothing spent, 1.2 / 5 = 0.24 against
    1 / 4 (not taken). Pricing the sunk seconds on one side only would waste the passes."""
    d = _drafter(_Draft(0.004, 0.004))
    req = _reqs(1)[0]
    d._state(req)
    d._choose([(req, [9], [0.2])], 1, 1, spent=0.020)
    assert req.spec_token_ids == [9]
    d._choose([(req, [9], [0.2])], 1, 1)
    assert req.spec_token_ids == []


def test_the_plan_drafts_per_request():
    """Two requests, passes at 0.2 ms: the one whose drafts are accepted (alpha 0.95) drafts
    the full k; the other (alpha 0.3) gets none: with the first drafting k, 2 + 4.29 tokens in
    10 ms (7 rows) + ~1 ms of passes is 0.57 a ms; its first token would add 0.3 for a row
    (1 ms) and a second request's passes, 6.59 / ~12.1 = 0.54."""
    draft = _Draft(0.0002, 0.0002)
    d = _drafter(draft)
    good, bad = _reqs(2)
    d.propose([good, bad], 2)  # the probe
    for req, a in ((good, 0.95), (bad, 0.3)):
        st = d._state(req)
        st.acc, st.trials = a * 1e6, 1e6
    d.propose([good, bad], 2)
    assert draft.calls[-1] == [K]
    assert len(good.spec_token_ids) == K and bad.spec_token_ids == []


def test_a_new_prompt_is_not_priced_as_a_pass(tmp_path, make_llm):
    """The real draft engine: a proposal whose catch-up is a new request's prompt (40 tokens,
    more than a steady catch-up's block + k + 1 = 20) does not set the first pass's price; its
    further passes do. The next proposal, two tokens on, is steady and priced."""
    import torch

    from tests.conftest import make_tiny_model

    model = make_tiny_model(str(tmp_path), "llama", save_dtype=torch.bfloat16)
    llm = make_llm(model, speculative_config={
        "method": "draft_model", "model": model, "num_speculative_tokens": 3})
    proposer = llm.engine.drafter.draft_model
    assert proposer.steady_rows == 16 + 3 + 1
    req = Request("p", "p", 0, [(5 * i) % 300 + 3 for i in range(40)],
                  SamplingParams(max_tokens=20), 20)
    cost = DraftCost()
    first = proposer.propose([req], [3], cost)[0]
    assert len(first) == 3
    assert not cost.known and cost.rest.known
    req.output_token_ids += first[:2]  # two of them accepted (the second as the bonus token)
    assert len(proposer.propose([req], [3], cost)[0]) == 3
    assert cost.known
    assert proposer.parts.scheduler.num_unfinished == 0
