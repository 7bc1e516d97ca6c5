"""xgrammar vs llguidance on CPU: grammar compile time and per-token mask cost for a ~20-field
JSON schema over a tokenizer's vocabulary (SmolLM2's 49,152 tokens by default).

Each backend walks the same path through the grammar: per step it computes the allowed-token
bitmask, checks that the next token is allowed and advances the matcher. The path is a valid
20-field instance tokenized as the model would write it, then EOS (``--mode instance``), or
the allowed token with the best score from a fixed pseudo-random table (``--mode random``).
Reported: median / p90 microseconds per mask, per advance, compile time, and the number of
tokens walked. How kvserve chose its backend is recorded in
docs/structured-outputs.md.

    pip install --target /tmp/gb/llg llguidance
    pip install --no-deps --target /tmp/gb/xg xgrammar apache-tvm-ffi
    .venv/bin/python benchmarks/grammar_backends.py --tokenizer TOKENIZER_DIR \
        --path /tmp/gb/llg --path /tmp/gb/xg --json-out OUT.json

The JSON records the backends' versions and this machine (``env``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "age": {"type": "integer", "minimum": 0},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "JP"]}},
            "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "phone": {"type": "string"},
        "company": {"type": "string"},
        "title": {"type": "string"},
        "manager_id": {"type": ["integer", "null"]},
        "created": {"type": "string"},
        "updated": {"type": "string"},
        "notes": {"type": "string"},
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "verified": {"type": "boolean"},
        "languages": {"type": "array", "items": {"enum": ["en", "de", "fr", "ja"]}},
        "rating": {"type": "number"},
    },
    "required": ["id", "name", "email", "age", "active", "role", "score", "tags", "address",
                 "phone", "company", "title", "manager_id", "created", "updated", "notes",
                 "level", "verified", "languages", "rating"],
    "additionalProperties": False,
}


INSTANCE = {
    "id": 1042, "name": "Ada Lovelace", "email": "ada@example.com", "age": 36, "active": True,
    "role": "admin", "score": 97.5, "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001",
                "country": "US"},
    "phone": "+44 20 7946 0018", "company": "Analytical Engines Ltd", "title": "Analyst",
    "manager_id": None, "created": "1842-09-01", "updated": "1843-07-10",
    "notes": "Wrote the first published program.", "level": 9, "verified": True,
    "languages": ["en", "fr"], "rating": 4.9,
}


def forced_tokens(hf_tok) -> list[int]:
    """INSTANCE as the model would write it under the grammar's separators, then EOS."""
    text = json.dumps(INSTANCE, separators=(", ", ": "))
    return hf_tok.encode(text, add_special_tokens=False) + [hf_tok.eos_token_id]


def pick(scores: np.ndarray, words: np.ndarray, step: int) -> int:
    """The allowed token with the highest score (scores rotated per step)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: scores.shape[0]]
    s = np.where(bits.astype(bool), np.roll(scores, step), -np.inf)
    return int(np.argmax(s))


def run_llguidance(hf_tok, vocab: int, scores: np.ndarray, max_steps: int,
                    mode: str) -> dict:
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                      "key_separator": ": "})
    m = llguidance.LLMatcher(tok, grammar)
    first = np.zeros((vocab + 31) // 32, np.int32)
    m.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    words = np.zeros((vocab + 31) // 32, np.int32)
    masks, advances, out = [], [], []
    forced = forced_tokens(hf_tok) if mode == "instance" else None
    for step in range(len(forced) if forced else max_steps):
        if m.is_stopped():
            break
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        masks.append(time.perf_counter() - t0)
        t = forced[step] if forced else pick(scores, words, step)
        assert words[t // 32] >> (t % 32) & 1, (step, t)
        t0 = time.perf_counter()
        ok = m.consume_token(t)
        advances.append(time.perf_counter() - t0)
        assert ok, m.get_error()
        out.append(t)
    return dict(backend=f"llguidance {llguidance.__version__}", tokenizer_s=t_tok,
                compile_s=t_compile, masks=masks, advances=advances,
                text=hf_tok.decode(out))


def run_xgrammar(hf_tok, vocab: int, scores: np.ndarray, max_steps: int,
                    mode: str) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                     separators=(", ", ": "))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    masks, advances, out = [], [], []
    forced = forced_tokens(hf_tok) if mode == "instance" else None
    for step in range(len(forced) if forced else max_steps):
        if m.is_terminated():
            break
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - t0)
        t = forced[step] if forced else pick(scores, bitmask[0].numpy(), step)
        assert bitmask[0, t // 32] >> (t % 32) & 1, (step, t)
        t0 = time.perf_counter()
        ok = m.accept_token(t)
        advances.append(time.perf_counter() - t0)
        assert ok
        out.append(t)
    del torch
    from importlib.metadata import version

    return dict(backend=f"xgrammar {version('xgrammar')}", tokenizer_s=t_tok, compile_s=t_compile,
                masks=masks, advances=advances, text=hf_tok.decode(out))


def summary(r: dict) -> dict:
    def us(xs: list[float], q: float) -> float:
        return round(float(np.quantile(xs, q)) * 1e6, 1) if xs else 0.0

    return dict(backend=r["backend"], tokens=len(r["masks"]),
                tokenizer_setup_s=round(r["tokenizer_s"], 3),
                compile_s=round(r["compile_s"], 4),
                mask_us_median=us(r["masks"], 0.5), mask_us_p90=us(r["masks"], 0.9),
                mask_us_mean=round(statistics.fmean(r["masks"]) * 1e6, 1),
                advance_us_median=us(r["advances"], 0.5), text_head=r["text"][:120])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer folder")
    ap.add_argument("--path", action="append", default=[], help="extra sys.path entries")
    ap.add_argument("--backend", action="append", choices=["llguidance", "xgrammar"])
    ap.add_argument("--max-steps", type=int, default=400, help="random mode: steps")
    ap.add_argument("--mode", choices=["instance", "random"], default="instance",
                    help="instance: teacher-force a valid 20-field object then EOS; random: "
                    "pick the best-scoring allowed token per step (mostly long strings)")
    ap.add_argument("--json-out", help="write the summary here")
    a = ap.parse_args(argv)
    sys.path[:0] = a.path
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(a.tokenizer)
    vocab = len(hf_tok)
    scores = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    res = []
    for b in a.backend or ["llguidance", "xgrammar"]:
        fn = run_llguidance if b == "llguidance" else run_xgrammar
        res.append(summary(fn(hf_tok, vocab, scores, a.max_steps, a.mode)))
        print(json.dumps(res[-1]), flush=True)
    if a.json_out:
        from importlib.metadata import PackageNotFoundError, version

        from kvserve.bench.common import env_info, write_json

        def ver(name: str) -> str | None:
            try:
                return version(name)
            except PackageNotFoundError:
                return None

        write_json(a.json_out, {"bench": "grammar_backends", "vocab": vocab, "mode": a.mode,
                                "versions": {b: ver(b) for b in ("llguidance", "xgrammar")},
                                "results": res, "env": env_info()})


if __name__ == "__main__":
    main()
