"""Suffix drafts after a whitespace shift (kvserve/engine/spec/realign.py): a copy whose
whitespace differs from its source (a hard-wrapped document quoted as one line) is drafted
again from the source's long match right after the shifted token, not from a one-token match;
and the step-cost curve only learns from decode-shaped steps."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import parse_speculative_config
from kvserve.engine.spec.cost import StepCost
from kvserve.engine.spec.drafter import Drafter
from kvserve.engine.spec.realign import TokenText, realign
from kvserve.request import Request

WORDS = [" the", " cat", " sat", " on", "\n", "the", " mat", " and", " dog", " ran", " far",
         " away", "Q", ":", "  When", " When", "\n\n", "\xe2"]
ID = {w: i for i, w in enumerate(WORDS)}


class _Tok:
    def decode(self, ids):
        return "".join("\ufffd" if WORDS[i] == "\xe2" else WORDS[i] for i in ids)


def _ids(*words):
    return [ID[w] for w in words]


def test_realign_finds_the_tokens_one_emitted_token_stands_for():
    text = TokenText(_Tok())
    # " the" where the source has "\n" "the": it stands for both
    assert realign(text, ID[" the"], _ids("\n", "the", " mat"), 0) == 1
    assert realign(text, ID[" When"], _ids("  When", " the"), 0) == 0  # runs of spaces
    assert realign(text, ID[" the"], _ids(" on", "\n", "the"), 1) == 2  # from position a
    assert realign(text, ID[" cat"], _ids("\n", "the"), 0) is None  # other text
    assert realign(text, ID["\n\n"], _ids("\n", "the"), 0) is None  # whitespace alone
    assert realign(text, ID[" the"], _ids("\xe2", "the"), 0) is None  # not whole characters
    assert realign(text, ID[" the"], _ids("\n"), 0) is None  # the draft ends first


def _drafter():
    return Drafter(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8}),
                   tokenizer=_Tok())


def test_a_whitespace_shift_drafts_from_the_source_again():
    doc = _ids(" the", " cat", " sat", " on", "\n", "the", " mat", " and", " the", " dog",
               " ran", " far", " away")
    req = Request("r", "r", 0, doc + _ids("Q", ":"), SamplingParams(max_tokens=50), 50)
    d = _drafter()
    req.output_token_ids += _ids(" the", " cat", " sat", " on")
    assert d._propose_one(req, 8)[:2] == _ids("\n", "the")
    # the model reflows the line: " the" replaces "\n" "the"; the draft goes on with the
    # source after them (an exact match would have only " the" -> " cat"), as far as the
    # aligned match's length (6) allows
    req.output_token_ids += _ids(" the")
    assert d._propose_one(req, 8) == _ids(" mat", " and", " the", " dog", " ran", " far")
    # the copy goes on as drafted: still drafted from the aligned source (the sequence's own
    # match, " the mat ...", never occurred)
    req.output_token_ids += _ids(" mat", " and", " the", " dog")
    assert d._propose_one(req, 8)[:3] == _ids(" ran", " far", " away")
    # one token differs: taken as a substitution, the source goes on after it
    req.output_token_ids += _ids(" ran", "Q")
    assert d._propose_one(req, 8)[:2] == _ids(" away", "Q")
    # the next differs at once too: the output left the source, back to its own matches
    req.output_token_ids += _ids(":")
    d._propose_one(req, 8)
    assert d._states["r"].aligned is None


def test_a_substituted_value_drafts_the_structure_after_it():
    line = _ids("Q", " the", ":", " cat", " and")  # Q the: cat and  (" cat": the value)
    req = Request("r", "r", 0, line * 2 + _ids(" mat"), SamplingParams(max_tokens=50), 50)
    d = _drafter()
    req.output_token_ids += _ids("Q", " the", ":")
    assert d._propose_one(req, 8)[:2] == _ids(" cat", " and")
    req.output_token_ids += _ids(" dog")  # a new value: nothing ever followed " dog"
    assert d._propose_one(req, 8)[:3] == _ids(" and", "Q", " the")


def test_without_a_tokenizer_nothing_is_realigned():
    doc = _ids(" the", " cat", " sat", " on", "\n", "the", " mat", " and")
    req = Request("r", "r", 0, doc, SamplingParams(max_tokens=50), 50)
    d = Drafter(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8}))
    req.output_token_ids += _ids(" the", " cat", " sat", " on", " the")
    assert d._propose_one(req, 8) == _ids(" cat")  # " the" -> " cat", a 1-token match


def test_step_cost_skips_prefill_and_clips_stalls():
    d = _drafter()
    for rows in (1, 5, 9, 1, 5, 9):
        d.observe({}, {}, rows, 0.004 + 0.001 * rows)
    d.observe({}, {}, 400, None)  # a step with a prefill chunk: not a point of the curve
    a, b = d.cost.line()
    assert a == pytest.approx(0.004, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    c = StepCost()
    for rows in (1, 5, 9, 1, 5, 9):
        c.observe(rows, 0.004 + 0.001 * rows)
    c.observe(5, 10.0)  # a stall: counted as 3x the prediction, not 1000x
    assert c(5) < 3 * 0.009


def test_substitutions_first_tokens_are_weighed_at_their_own_rate():
    """The adaptive choice weighs a substitution's first draft token at the recent rate of
    such tokens (prior 0.5), learned apart from the request's per-token acceptance."""
    d = _drafter()
    st = d._state(Request("r", "r", 0, [1], SamplingParams(max_tokens=5), 5))
    st.from_subst = True
    for _ in range(50):
        d.observe({"r": 4}, {"r": 0}, 5, 0.01)  # substitutions rejected at once
    assert d._sub_acc / d._sub_trials < 0.01
    assert d._trials == 0  # the request's and the global acceptance: untouched
    for _ in range(50):
        d.observe({"r": 4}, {"r": 4}, 5, 0.01)
    assert d._sub_acc / d._sub_trials > 0.6 and d._acc / d._trials == pytest.approx(1.0)


def _staircase(rows: int) -> float:
    return 0.010 + 0.001 * rows + (0.007 if rows >= 9 else 0.0)


def test_step_cost_learns_the_staircase():
    """The GEMMs' cost is a staircase (tiles): per-row-count factors on the fitted line."""
    c = StepCost()
    for _ in range(20):
        for rows in range(1, 17):
            c.observe(rows, _staircase(rows))
    for rows in range(1, 17):
        assert c(rows) == pytest.approx(_staircase(rows), rel=0.05)
    assert c(9) - c(8) > 0.006 and c(10) - c(9) < 0.002


def test_rows_past_a_large_batch_are_not_cheap():
    """A compute-bound batch (each row ~1.8 ms at 16 rows) whose nearby row counts happen to
    cost alike (a flat local fit: 14 and 16 rows ~29 ms): rows past the batch still cost most
    of a row's share (priced at a tenth of it, batch-16 runs drafted 20-80 tokens a step at
    0.93x of off)."""
    c = StepCost()
    for _ in range(60):
        c.observe(16, 0.0288)
        c.observe(14, 0.0286)
    assert c.line()[1] > 0.8 * (0.0287 / 15) * (15 / 16) ** 2 * 0.99
    assert c(20) - c(16) > 4 * 0.0012
    # whatever the line and factors say (here: a line through cheap steps and a learned
    # factor), a draft row past a large base costs most of a base row's share
    flat = StepCost()
    for _ in range(40):
        for rows in (1, 2, 3, 16, 20):
            flat.observe(rows, 0.005 + 0.0002 * rows)
    assert flat.at(20, 16) - flat(16) >= 4 * 0.8 * flat(16) / 16 * 0.999
    assert flat.at(3, 1) == flat(3)  # a few rows: the curve itself


def test_the_choice_weighs_whole_prefixes():
    """A curve whose second row costs a whole step and the next ones almost nothing: one
    draft token does not pay alone, sixteen likely ones do (a first-token break would take
    none)."""
    d = _drafter()
    for _ in range(20):
        for rows in range(1, 18):
            d.cost.observe(rows, 0.010 if rows == 1 else 0.020 + 0.0001 * rows)
    req = Request("r", "r", 0, [1], SamplingParams(max_tokens=50), 50)
    d._state(req)
    ps = [0.9 ** (j + 1) for j in range(16)]
    d._choose([(req, list(range(16)), ps)], 1, 1)
    assert req.spec_token_ids == list(range(16))
    d._choose([(req, list(range(16)), [0.3 ** (j + 1) for j in range(16)])], 1, 1)
    assert req.spec_token_ids == []  # ~0.4 tokens gained: not worth the second row
