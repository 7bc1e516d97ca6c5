"""Per-token acceptance from a suffix draft's evidence (kvserve/engine/spec/calibrate.py): the
buckets' estimates back off to the fallback without evidence and learn the observed rate
with it; positions past the first rejection are not counted; and the drafter drafts a
repeated stretch long and a new value short, where alpha alone prices both alike."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import parse_speculative_config
from kvserve.engine.spec.calibrate import Calibration, bucket
from kvserve.engine.spec.drafter import Drafter
from kvserve.engine.spec.suffix import SuffixTree
from kvserve.request import Request, RequestStatus


def test_estimate_backs_off_to_the_fallback_and_learns_the_rate():
    c = Calibration()
    sure, vague = bucket(9, 9, 12, 0), bucket(1, 4, 1, 0)
    assert c.estimate(sure, 0.6) == pytest.approx(0.6)  # no evidence: the fallback
    for _ in range(100):
        c.observe([sure, sure, vague], 2)  # the third token (vague) rejected
    assert c.estimate(sure, 0.6) > 0.95
    assert c.estimate(vague, 0.6) < 0.1
    # a bucket never seen whose coarse bucket (same frequency and count) has evidence
    assert c.estimate(bucket(9, 9, 1, 2), 0.6) > 0.85


def test_positions_past_the_first_rejection_are_not_outcomes():
    c = Calibration()
    a, b = bucket(1, 1, 3, 0), bucket(2, 2, 9, 1)
    for _ in range(50):
        c.observe([a, b], 0)  # a rejected: b was never tried
    assert c.estimate(a, 0.5) < 0.1
    assert c.estimate(b, 0.5) == pytest.approx(0.5)
    c.observe([None, b], 2)  # a token without tree evidence (forced) is not counted
    assert c.estimate(b, 0.5) > 0.5


def test_draft_path_reports_each_tokens_evidence():
    t = SuffixTree(depth=8)
    for tok in [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]:
        t.append(tok)
    ev: list = []
    path, limit, _ = t.draft_path([], 3, 1.0, 0.1, match=t.match_end(), evidence=ev)
    # [1, 2, 3, 1, 2] matched (5 tokens), followed once, by 4; then 1 and 2
    assert path[:limit] == [4, 1, 2] and len(ev) == len(path)
    assert ev[0] == (1, 1, 5)
    ev2: list = []
    draft, _ = t.draft([1, 2], 3, 1.0, 0.1, evidence=ev2)
    assert len(ev2) == len(draft) and ev2[0][1] == 3  # [1, 2] went on 3 times (3, 4, 3)


def _running(req: Request) -> Request:
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _measured_drafter() -> Drafter:
    """A suffix drafter with a batch-1 curve like the 2-core host's: 1 row 4.9 ms, 2 rows
    5.3, each row past 2 ~1.5 ms."""
    d = Drafter(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 16}))
    for _ in range(10):
        for rows in range(1, 17):
            d.observe({}, {}, rows, (4.9 if rows == 1 else 5.3 + 1.5 * (rows - 2)) / 1000)
    return d


def test_a_repeated_stretch_drafts_long_once_its_drafts_are_accepted():
    """The request's alpha is middling (its drafts of new values fail), but its drafts of a
    stretch the sequence repeated many times are always accepted: the calibrated estimate
    lets the drafter draft that stretch far past what alpha^j would take."""
    line = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    req = _running(Request("r", "r", 0, [1] + line * 6, SamplingParams(max_tokens=100), 100))
    d = _measured_drafter()
    d.propose([req], 1)
    first = len(req.spec_token_ids)
    st = d._states["r"]
    for _ in range(30):  # this stretch's drafts: all accepted; the request's alpha: 0.5
        d.propose([req], 1)
        k = len(req.spec_token_ids)
        assert k > 0
        d.observe({"r": k}, {"r": k}, 1 + k, None)
        st.acc, st.trials = 1.0, 2.0
    d.propose([req], 1)
    assert first <= 4 and len(req.spec_token_ids) >= 10


def test_a_value_whose_drafts_fail_is_not_drafted():
    """After ``name=`` the sequence had four different values (each continuation 1/4): once
    such drafts are seen to fail, the drafter stops drafting there even at a high alpha."""
    seq = [1]
    for v in (40, 41, 42, 43):
        seq += [5, 6, v, 9]  # "name = <value> ;"
    req = _running(Request("r", "r", 0, seq + [5, 6], SamplingParams(max_tokens=100), 100))
    d = _measured_drafter()
    st = d._state(req)
    st.acc, st.trials = 9.0, 10.0  # alpha ~0.9
    d.propose([req], 1)
    assert req.spec_token_ids  # a quarter's chance: drafted at alpha
    for _ in range(40):
        d.propose([req], 1)
        k = len(req.spec_token_ids)
        if k:
            d.observe({"r": k}, {"r": 0}, 1 + k, None)
        st.acc, st.trials = 9.0, 10.0
    d.propose([req], 1)
    assert req.spec_token_ids == []
