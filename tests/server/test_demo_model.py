"""The demo model's server (byte-level BPE that adds ``<|bos|>``): ``echo`` + ``logprobs``
text offsets (issue 15, item 5) and the empty prompt (item 6), which a tokenizer that adds a
BOS token used to turn into a valid one-token prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

ECHO = {"model": MODEL_NAME, "prompt": "The dict", "max_tokens": 2, "logprobs": 1,
        "echo": True, "temperature": 0}


def _check_offsets(text: str, lp: dict) -> None:
    """Every token sits at its offset in the text, except special tokens the text omits."""
    assert len(lp["tokens"]) == len(lp["text_offset"])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets)
    for tok, off in zip(lp["tokens"], offsets, strict=True):
        if tok == "<|bos|>":
            assert off == 0
        elif tok.startswith("<|") and tok.endswith("|>"):  # e.g. <|eos|>: skipped in the text
            assert off <= len(text)
        else:
            assert text[off:off + len(tok)] == tok, (tok, off, text)


def test_echo_logprobs_text_offsets(demo_server):
    r = httpx.post(demo_server.url + "/v1/completions", json=ECHO, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith("The dict")
    assert lp["tokens"][:3] == ["<|bos|>", "The", " dict"]
    assert lp["text_offset"][:4] == [0, 0, 3, 8]  # <|bos|> is not in the text
    _check_offsets(text, lp)

    plain = httpx.post(demo_server.url + "/v1/completions", json=dict(ECHO, echo=False),
                       timeout=60).json()["choices"][0]
    assert plain["logprobs"]["text_offset"][0] == 0
    _check_offsets(plain["text"], plain["logprobs"])


def test_echo_logprobs_text_offsets_streaming(demo_server):
    body = dict(ECHO, stream=True, max_tokens=6, ignore_eos=True)
    r = httpx.post(demo_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    tokens, offsets = [], []
    for e in events:
        lp = e["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]
            offsets += lp["text_offset"]
    assert offsets[:4] == [0, 0, 3, 8]
    _check_offsets(text, {"tokens": tokens, "text_offset": offsets})
    assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("prompt", ["", ["The dict", ""]], ids=["empty", "empty-in-batch"])
def test_empty_prompt_is_400(demo_server, prompt):
    r = httpx.post(demo_server.url + "/v1/completions",
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ("prompt" if prompt == "" else "prompt[1]")
    assert "empty" in err["message"]
