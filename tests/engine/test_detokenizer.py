"""Incremental detokenization: streamed text == one-shot decode; stop strings never leak."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kvserve.engine.arg_utils import demo_model_path
from kvserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.mark.parametrize("raw", [True, False])
def test_stream_equals_one_shot_decode(tok, raw: bool) -> None:
    rng = random.Random(0)
    text = "def f(x):\n    return x  # café ünïcode — “quotes” 日本語\n" * 3
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for _ in range(5):
        cut = rng.randrange(1, len(ids) - 1)
        while "\ufffd" in tok.decode(ids[:cut]):  # cut on a whole character
            cut -= 1
        prompt, out = ids[:cut], ids[cut:]
        d = IncrementalDetokenizer(tok, prompt)
        assert (d._raw is not None) == (tok.clean_up_tokenization_spaces is False)
        if not raw:
            d._raw = None  # the transformers decode path
        pieces = []
        for t in out:
            before = d.output_text(False)
            d.update([t])
            pieces.append(d.output_text(False)[len(before):])
        full = tok.decode(prompt + out, skip_special_tokens=True)
        head = tok.decode(prompt, skip_special_tokens=True)
        assert "".join(pieces) == d.text
        assert full.startswith(head) and d.text == full[len(head):]
        assert "\ufffd" not in d.text


def test_stop_string_never_streamed_partially(tok) -> None:
    ids = tok("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, ids[:1], stop=("gamma",))
    seen = ""
    stop = None
    for t in ids[1:]:
        stop = d.update([t])
        seen = d.output_text(stop is not None)
        assert "gam" not in seen or stop is not None
        if stop is not None:
            break
    full, head = tok.decode(ids), tok.decode(ids[:1])
    assert stop == "gamma" and seen == full[len(head): full.index("gamma")]
