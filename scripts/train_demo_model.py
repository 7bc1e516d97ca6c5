#!/usr/bin/env python
"""Train kvserve's built-in demo model: a small Llama-architecture causal LM, from scratch, on CPU.

The corpus is CPython's own documentation (the reStructuredText sources that the Debian package
``python3.11-doc`` installs under /usr/share/doc/python3.11/html/_sources, PSF License Agreement;
code examples also Zero-Clause BSD).  Any directory of text files (or one text file) can be given
with ``--corpus``.

Pipeline (everything is deterministic given ``--seed`` and ``--steps``):

1. read and clean the documents (strip reST markup), split a held-out set by a hash of the file
   path (independent of the seed), and derive a small synthetic chat set from the *training*
   documents only (``What does len() do?`` -> first paragraph of that entry), so the chat template
   produces on-topic answers;
2. train a byte-level BPE tokenizer (``tokenizers``) on the training split, with special tokens
   ``<|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>``;
3. train ``LlamaForCausalLM`` (GQA, head_dim 64) in fp32 with AdamW and a warmup-stable-decay LR
   schedule on random windows of the token stream (a seeded generator fixes the data order);
4. save a standard Hugging Face folder (bf16 safetensors, tokenizer.json, tokenizer_config.json
   with a chat template, generation_config.json) and a README.md model card with held-out
   perplexity, the unigram baseline perplexity on the same split, and greedy samples.

Schedule modes (all warmup-stable-decay: linear warmup, constant LR, cosine decay to 10%):

* ``--steps N`` -- deterministic; decay over the last ``--decay-steps`` (default 30% of N);
  ``--minutes M`` alongside is only a hard wall-clock cap (stops cleanly and saves).
* ``--minutes M`` alone -- budget mode for a shared CPU whose speed fluctuates: the decay covers
  the last 30% of the wall-clock budget, so the run always ends annealed and on time.  The LR of
  every step is written to ``<out>/lr_schedule.json``.
* ``--lr-schedule FILE`` -- replays a recorded schedule exactly (same data order, same per-step
  LRs), which makes a ``--minutes`` run reproducible after the fact.

``--probe N`` times N steps and saves nothing.

The commands used for the shipped model are recorded in kvserve/demo_model/README.md, e.g.:

    .venv/bin/python scripts/train_demo_model.py --minutes 21
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

DEFAULT_CORPUS = "/usr/share/doc/python3.11/html/_sources"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM_PROMPT = "You are a helpful assistant that answers questions about Python."

# Llama-3-like layout: <|bos|><|role|>\ncontent<|eos|>\n ... ; generation prompt "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|eos|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = [
    "The Python interpreter",
    "def ",
    "A list is",
    "To open a file",
]
CHAT_SAMPLE = [{"role": "user", "content": "What does len() do?"}]


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------

_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
_ROLE = re.compile(r":[\w\-]+(?::[\w\-]+)*:`([^`]*)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{0,2}")
_LITERAL = re.compile(r"``([^`]+?)``")
_INTERP = re.compile(r"`([^`]+?)`_{0,2}")
_BOLD = re.compile(r"\*\*([^*]+?)\*\*")
_EMPH = re.compile(r"(?<![\w*])\*([^\s*](?:[^*\n]*?[^\s*])?)\*(?![\w*])")
_SUBST = re.compile(r"\|([\w\-]+)\|_{0,2}")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:\-]+)::\s?(.*)$")
_OPTION = re.compile(r"^\s+:[\w\-]+:(\s.*)?$")

# directives whose whole block is dropped
_DROP = {
    "index", "toctree", "testsetup", "testcleanup", "raw", "image", "figure", "highlight",
    "sectionauthor", "moduleauthor", "include", "literalinclude", "tabularcolumns", "list-table",
    "csv-table", "table", "productionlist", "audit-event-table", "availability", "only",
    "grammar-snippet",
    "limited-api-list", "c:namespace", "currentmodule", "program", "default-role", "miscnews",
    "opcode-table", "rubric", "centered", "contents", "glossary", "role", "sidebar",
    "audit-event", "versionadded-removed",
}
# API-description directives: the signature is kept as a line, the body is dedented
_DESCR = {
    "function", "method", "classmethod", "staticmethod", "decorator", "decoratormethod", "class",
    "attribute", "data", "exception", "module", "opcode", "cmdoption", "option", "envvar",
    "describe", "pdbcommand", "c:function", "c:macro", "c:type", "c:member", "c:var", "c:data",
    "coroutinefunction", "coroutinemethod", "abstractmethod", "property", "awaitablefunction",
    "awaitablemethod", "fixer", "2to3fixer", "monitoring-event", "object",
}
_ADMONITION = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "impl-detail":
    "CPython implementation detail:", "tip": "Tip:", "important": "Important:",
    "caution": "Caution:", "hint": "Hint:", "attention": "Attention:", "danger": "Danger:",
    "admonition": "", "topic": "", "epigraph": "", "highlights": "",
    "versionadded": "New in version",
    "versionchanged": "Changed in version", "deprecated": "Deprecated since version",
    "deprecated-removed": "Deprecated since version",
}
# code-ish blocks: the directive line goes, the body stays (dedented)
_CODE = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal",
         "productionlist"}


_PEP_RFC = re.compile(r":(pep|rfc):`(\d+)(#[^`]*)?`", re.I)
_FOOTNOTE = re.compile(r"\s*\[#?[\w\-]*\]_")


def _inline(text: str) -> str:
    text = _PEP_RFC.sub(lambda m: f"{m.group(1).upper()} {m.group(2)}", text)
    text = _FOOTNOTE.sub("", text)

    def role(m: re.Match) -> str:
        t = m.group(1)
        if "<" in t and t.endswith(">"):
            t = t[: t.rfind("<")].rstrip() or t[t.rfind("<") + 1 : -1]
        if t.startswith("~"):
            t = t[1:].split(".")[-1]
        return t.lstrip("!")

    text = _ROLE.sub(role, text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERP.sub(r"\1", text)
    text = _BOLD.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    text = _SUBST.sub(r"\1", text)
    return text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _first_paragraph(lines: list[str], max_chars: int = 600) -> str:
    para: list[str] = []
    for ln in lines:
        if not ln.strip():
            if para:
                break
            continue
        para.append(ln.strip())
    text = " ".join(para)
    if len(text) > max_chars:  # cut at a sentence end
        cut = text.rfind(". ", 0, max_chars)
        text = text[: cut + 1] if cut > 80 else text[:max_chars]
    return text


def clean_rst(raw: str) -> tuple[str, list[tuple[str, str, str]]]:
    """reST -> plain-ish text. Returns (text, [(kind, name, first paragraph)]) for chat pairs."""
    lines = raw.expandtabs(8).splitlines()
    out: list[str] = []
    # stack of [directive_indent, shift or None, kind, name, out_start]
    stack: list[list] = []
    entries: list[tuple[str, str, str]] = []
    titles: list[int] = []
    i = 0
    after_directive = False

    def close(entry):
        kind, name, start = entry[2], entry[3], entry[4]
        if kind:
            para = _first_paragraph(out[start:])
            para = _inline(para)
            if para and len(para) >= 40 and para[0].isalpha() and para.endswith("."):
                entries.append((kind, name, para))

    while i < len(lines):
        line = lines[i].rstrip()
        ind = _indent(line)
        if line.strip():
            while stack and ind <= stack[-1][0]:
                close(stack.pop())
            for e in stack:  # first body line fixes each open directive's dedent
                if e[1] is None:
                    e[1] = max(0, ind - e[0])
        shift = sum(e[1] or 0 for e in stack)

        if after_directive and _OPTION.match(line):
            i += 1
            continue
        after_directive = False

        m = _DIRECTIVE.match(line)
        if m or re.match(r"^\s*\.\.(\s|$)", line):
            name = m.group(2) if m else ""
            arg = m.group(3).strip() if m else ""
            is_comment = m is None
            if name in _DROP or is_comment or line.strip().startswith(".. |"):
                i += 1
                while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > ind):
                    i += 1
                continue
            after_directive = True
            pad = " " * max(0, ind - shift)
            if name in _DESCR:
                # signatures may continue with a trailing backslash or list further signatures
                # on the following (more indented) lines, before the first blank line
                sigs = [arg]
                while i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) > ind:
                    nxt = lines[i + 1].strip()
                    i += 1
                    if sigs[-1].endswith("\\"):
                        sigs[-1] = sigs[-1][:-1].rstrip() + " " + nxt
                    elif not _OPTION.match(lines[i]):
                        sigs.append(nxt)
                sigs = [_inline(x.rstrip("\\").strip()) for x in sigs if x.strip()]
                kind = name.split(":")[-1]
                out.extend(pad + x for x in sigs)
                stack.append([ind, None, kind, sigs[0] if sigs else "", len(out)])
            elif name in _ADMONITION:
                label = _ADMONITION[name]
                if name.startswith(("version", "deprecated")):
                    parts = arg.split(None, 1)
                    ver = parts[0] if parts else ""
                    rest = _inline(parts[1]) if len(parts) > 1 else ""
                    text = f"{label} {ver}." + (f" {rest}" if rest else "")
                else:
                    text = " ".join(x for x in (label, _inline(arg)) if x)
                if text:
                    out.append(pad + text)
                stack.append([ind, None, "", "", len(out)])
            else:  # code blocks and anything unknown: keep the body
                if name not in _CODE and arg:
                    out.append(pad + _inline(arg))
                stack.append([ind, None, "", "", len(out)])
            i += 1
            continue

        if _UNDERLINE.match(line):
            # section adornment: remember the title (the previous non-blank output line)
            if out and out[-1].strip() and not _UNDERLINE.match(lines[i - 1]):
                titles.append(len(out) - 1)
            i += 1
            continue
        s = line.strip()
        if s.startswith(("+-", "+=")) or (s.startswith("|") and s.endswith("|") and len(s) > 2):
            i += 1  # grid tables
            continue
        if s == "::":
            i += 1
            continue
        if s.endswith("::"):
            line = line[:-1]  # "Equivalent to::" -> "Equivalent to:"
        out.append(line[min(shift, ind):] if s else "")
        i += 1
    while stack:
        close(stack.pop())
    for t in titles:
        para = _inline(_first_paragraph(out[t + 1 :]))
        title = _inline(out[t].strip())
        if (para and len(para) >= 60 and para[0].isupper() and para.endswith(".")
                and title[:1].isalpha() and len(title) < 80):
            entries.append(("section", title, para))
    text = re.sub(r"\n{3,}", "\n\n", _inline("\n".join(out))).strip() + "\n"
    return text, entries


def _h(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "big")


def chat_question(kind: str, name: str) -> str:
    short = name.split("(")[0].strip()
    if kind in {"function", "method", "classmethod", "staticmethod", "coroutinefunction",
                "coroutinemethod", "abstractmethod", "awaitablefunction", "awaitablemethod",
                "macro", "decorator", "decoratormethod"}:
        forms = [f"What does {short}() do?", f"Explain {short}().", f"What is {short}() for?"]
    elif kind == "class":
        forms = [f"What is the {short} class?", f"Explain the class {short}."]
    elif kind == "exception":
        forms = [f"When is {short} raised?", f"What is the {short} exception?"]
    elif kind == "section":
        forms = [f"Tell me about {name}.", f"Give me an overview of {name}."]
    else:
        forms = [f"What is {short}?", f"Explain {short}."]
    return forms[_h(kind + name) % len(forms)]


def load_corpus(path: str, heldout_pct: float, max_chats: int = 5000):
    """Returns (train_texts, heldout_texts, chat_conversations, n_files, n_bytes)."""
    p = Path(path)
    if p.is_file():
        files = [p]
    else:
        files = sorted(
            f for f in p.rglob("*")
            if f.is_file() and f.name.endswith((".rst.txt", ".rst", ".txt", ".md"))
        )
    if not files:
        raise SystemExit(f"no text files under {path}")
    train, held, chats = [], [], []
    nbytes = 0
    for f in files:
        rel = str(f.relative_to(p)) if p.is_dir() else f.name
        raw = f.read_text(encoding="utf-8", errors="replace")
        nbytes += len(raw.encode())
        text, entries = clean_rst(raw) if f.name.endswith((".rst.txt", ".rst")) else (raw, [])
        if len(text) < 200:
            continue
        is_held = (_h(rel) % 10000) < heldout_pct * 100
        (held if is_held else train).append(text)
        if not is_held:
            for kind, name, para in entries:
                conv = [{"role": "user", "content": chat_question(kind, name)},
                        {"role": "assistant", "content": para}]
                if _h("sys" + name) % 4 == 0:
                    conv.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
                chats.append(conv)
    if len(chats) > max_chats:  # a fixed, hash-chosen subset (order kept)
        keep = set(sorted(range(len(chats)), key=lambda k: _h(json.dumps(chats[k])))[:max_chats])
        chats = [c for k, c in enumerate(chats) if k in keep]
    if p.is_file() and not held:  # single file: hold out the tail
        text = train.pop()
        cut = int(len(text) * (1 - heldout_pct / 100))
        train, held = [text[:cut]], [text[cut:]]
    return train, held, chats, len(files), nbytes


def render_chat(conv: list[dict]) -> str:
    """Python twin of CHAT_TEMPLATE (bos/eos as text; the tokenizer maps them to special ids)."""
    s = BOS
    for m in conv:
        s += f"<|{m['role']}|>\n{m['content'].strip()}{EOS}\n"
    return s


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def encode_stream(tok, texts: list[str], eos_id: int):
    """Each text -> <|bos|> ids <|eos|>, concatenated (texts may already hold chat specials)."""
    import numpy as np

    encs = tok.encode_batch(texts, add_special_tokens=True)
    parts = [np.asarray(e.ids + [eos_id], dtype=np.int32) for e in encs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# --------------------------------------------------------------------------------------------
# model / training
# --------------------------------------------------------------------------------------------

def build_config(args, vocab_size: int, ids: dict):
    from transformers import LlamaConfig

    assert args.hidden % 64 == 0, "head_dim is fixed at 64"
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        use_cache=True,
    )


def lr_at(step: int, total: int | None, decay: int | None, args) -> float:
    """Warmup-stable-decay: linear warmup, constant, then cosine down to min_lr_frac over the
    last `decay` steps. With total=None (time mode, decay not started yet) it stays constant."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if total is None or decay is None or step < total - decay:
        return args.lr
    p = min(1.0, (step - (total - decay)) / max(1, decay))
    floor = args.lr * args.min_lr_frac
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * p))


def lr_at_time(step: int, frac: float, args) -> float:
    """Time-mode twin of lr_at: warmup by steps, decay over the last decay_frac of the budget."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    start = 1 - args.decay_frac
    if frac < start:
        return args.lr
    p = min(1.0, (frac - start) / args.decay_frac)
    floor = args.lr * args.min_lr_frac
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * p))


def eval_nll(model, stream, seq_len: int, batch: int, max_windows: int | None = None):
    """Mean NLL over non-overlapping windows; returns (mean_nll, n_targets, target_ids)."""
    import torch
    import torch.nn.functional as F

    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    data = torch.from_numpy(stream[: n * seq_len + 1].astype("int64"))
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for b in range(0, n, batch):
            idx = range(b, min(n, b + batch))
            x = torch.stack([data[j * seq_len : (j + 1) * seq_len] for j in idx])
            y = torch.stack([data[j * seq_len + 1 : (j + 1) * seq_len + 1] for j in idx])
            logits = model(input_ids=x).logits.float()
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += y.numel()
    model.train()
    return total / max(1, count), count, data[1 : n * seq_len + 1]


def unigram_nll(train_stream, targets, vocab_size: int) -> float:
    """Add-one-smoothed unigram model fitted on the training stream, scored on `targets`."""
    import numpy as np

    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[targets.numpy()].mean())


def greedy_samples(model, hf_tok, prompts, max_new_tokens: int):
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:
            enc = hf_tok(p, return_tensors="pt")
            g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=hf_tok.pad_token_id)
            new = g[0, enc["input_ids"].shape[1] :]
            outs.append((p, hf_tok.decode(new, skip_special_tokens=True)))
    return outs


def chat_sample(model, hf_tok, max_new_tokens: int):
    import torch

    prompt = hf_tok.apply_chat_template(CHAT_SAMPLE, add_generation_prompt=True, tokenize=False)
    enc = hf_tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id)
    return prompt, hf_tok.decode(g[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def save_tokenizer(tok, out: Path):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:], model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out))
    # Keep the template inside tokenizer_config.json (what most engines read); newer
    # transformers would otherwise put it only in a separate chat_template.jinja.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["bos_token"], cfg["eos_token"], cfg["pad_token"] = BOS, EOS, PAD
    cfg["add_bos_token"] = True
    # the classic, version-neutral spelling (transformers 5 writes "TokenizersBackend" and
    # "extra_special_tokens", which 4.x does not read)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = SPECIAL_TOKENS[3:]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


_REPRO_FLAGS = ["out", "seed", "corpus", "heldout_pct", "max_chats", "vocab_size", "hidden",
                "layers", "kv_heads", "ffn", "seq_len", "batch", "lr", "warmup_steps",
                "min_lr_frac", "threads"]


def repro_command(args, parser, total: int, decay: int, recorded: bool) -> str:
    """Command that replays this run's data order and LR schedule exactly."""
    parts = ["python scripts/train_demo_model.py"]
    if recorded:
        parts.append(f"--lr-schedule {shlex.quote(str(Path(args.out) / 'lr_schedule.json'))}")
    else:
        parts += [f"--steps {total}", f"--decay-steps {decay}"]
    for name in _REPRO_FLAGS:
        val = getattr(args, name)
        if val != parser.get_default(name):
            parts.append(f"--{name.replace('_', '-')} {shlex.quote(str(val))}")
    return " ".join(parts)


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def write_heldout(out: Path, heldout_texts: list[str]) -> None:
    """The held-out split as plain text, so `kvserve bench quality` measures on it."""
    (out / "heldout.txt").write_text("\n\n".join(heldout_texts), encoding="utf-8")


def write_card(out: Path, info: dict):
    cfg = info["config"]
    default_corpus = info["corpus"] == DEFAULT_CORPUS
    spdx, _, note = (info.get("corpus_license") or "").partition("=")
    if default_corpus:
        front = ["license: other", "license_name: psf-2.0"]
        licence = [
            "- Licence: the Python documentation is Copyright Python Software Foundation and is",
            "  licensed under the PSF License Agreement (version 2);",
            "  since Python 3.8.6 its examples and code are dual-licensed PSF-2.0 / Zero-Clause "
            "BSD.",
            "  This model is a derivative of that text and is released under the same PSF-2.0 "
            "terms.",
        ]
    else:  # another corpus: its licence as given by --corpus-license, never the PSF text
        front = [f"license: {spdx or 'unknown'}"]
        licence = [f"- Licence: {note or spdx or 'not stated (see --corpus-license)'}. "
                   "This model is a derivative of that text, under the same terms."]
    kind = "reST, cleaned of most markup" if default_corpus else "text"
    lines = [
        "---",
        *front,
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        "",
        "# kvserve demo model",
        "",
        "A tiny Llama-architecture causal LM trained from scratch on CPU by",
        "`scripts/train_demo_model.py`. It is kvserve's built-in default model: small enough to",
        "ship in the wheel, real enough that generations look like its corpus and that KV-cache",
        "quantisation (FP8 KV, INT4 weights) can be measured on trained weights. It is not a",
        "useful assistant; expect documentation-flavoured text and frequent repetition.",
        "",
        "## Data and licence",
        "",
        f"- Corpus: {info['corpus_desc']} (`{info['corpus']}`), {info['n_files']} files, "
        f"{info['corpus_mb']:.1f} MB of {kind}.",
        *licence,
        f"- Held-out split: {info['heldout_pct']}% of files, chosen by a hash of the file path "
        f"({info['n_held_docs']} files, {info['held_tokens']:,} tokens); training split "
        f"{info['n_train_docs']} files, {info['train_tokens']:,} tokens.",
        f"- Plus {info['n_chats']:,} synthetic chat turns built from the training files only "
        "(question about an API entry or section title -> its first paragraph), so the chat "
        "template yields on-topic text.",
        "",
        "## Architecture",
        "",
        f"- `LlamaForCausalLM`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"FFN {cfg['intermediate_size']} (SwiGLU), {cfg['num_attention_heads']} query heads / "
        f"{cfg['num_key_value_heads']} KV heads (GQA), head_dim {cfg['head_dim']}, RoPE theta "
        f"10000, max_position_embeddings {cfg['max_position_embeddings']}, tied embeddings.",
        f"- Parameters: {info['n_params']:,} ({fmt_params(info['n_params'])}), stored as bf16 "
        f"safetensors ({info['st_mb']:.1f} MB).",
        f"- Tokenizer: byte-level BPE, vocab {cfg['vocab_size']}, special tokens "
        + ", ".join(f"`{t}`" for t in SPECIAL_TOKENS) + ". The tokenizer prepends `<|bos|>`.",
        "- Chat template: `<|bos|><|role|>\\ncontent<|eos|>\\n...` and, with",
        "  `add_generation_prompt=True`, a trailing `<|assistant|>\\n`; generation stops at",
        "  `<|eos|>`.",
        "",
        "## Training",
        "",
        f"- Command run: `{info['command']}`",
        f"- Exact replay (same data order and per-step learning rates, recorded in "
        f"`lr_schedule.json`; bit-identical on the same CPU type and thread count): "
        f"`{info['repro_command']}`",
        f"- Seed {info['seed']}; {info['steps_done']} steps of batch {info['batch']} x "
        f"{info['seq_len']} tokens ({info['tokens_seen']:,} tokens seen, "
        f"{info['epochs']:.2f} epochs of the training stream); "
        f"AdamW (peak lr {info['lr']}, betas 0.9/0.95, weight decay 0.1); warmup-stable-decay "
        f"schedule: {info['warmup_steps']} warmup steps, constant, then cosine to "
        f"{info['min_lr_frac']:.0%} of peak over the last {info['decay_steps']} steps "
        f"({info['schedule_note']}); "
        f"grad-clip 1.0; fp32 on CPU "
        f"({info['threads']} threads), saved as bf16.",
        f"- Wall time: {info['train_minutes']:.1f} min training, {info['total_minutes']:.1f} min "
        f"for the whole script, on {info['machine']}.",
        f"- Final training loss (mean of last 20 steps): {info['final_train_loss']:.3f}.",
        "",
        "## Evaluation (held-out split)",
        "",
        "| model | held-out perplexity |",
        "|---|---|",
        f"| this model, shipped bf16 weights | **{info['ppl_bf16']:.2f}** |",
        f"| this model, fp32 weights before saving | {info['ppl_fp32']:.2f} |",
        f"| unigram baseline, same tokenizer (add-one counts from the training split) | "
        f"{info['ppl_unigram']:.1f} |",
        "",
        f"Both perplexities are per token over the same {info['eval_tokens']:,} target tokens "
        f"(non-overlapping {info['seq_len']}-token windows of the held-out stream).",
        "",
        "## Greedy samples (shipped weights, transformers `generate`, `do_sample=False`)",
        "",
    ]
    for prompt, cont in info["samples"]:
        lines += [f"**Prompt:** `{prompt}`", "", "```text", prompt + cont, "```", ""]
    cp, cc = info["chat"]
    lines += [
        f"**Chat** (`{json.dumps(CHAT_SAMPLE)}`, rendered prompt `{cp!r}`):",
        "",
        "```text",
        cc,
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kvserve/demo_model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None,
                    help="number of optimizer steps (reproducible mode)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall-clock cap for training; schedule follows time if --steps is unset")
    ap.add_argument("--corpus", default=DEFAULT_CORPUS,
                    help="directory of .rst.txt/.rst/.txt/.md files, or one text file")
    ap.add_argument("--corpus-license", default=None, metavar="SPDX=NOTE",
                    help="licence of a --corpus other than the default, for the model card: an "
                         "SPDX id and a sentence, e.g. 'mit=Node.js docs, Copyright Node.js "
                         "contributors, MIT license'")
    ap.add_argument("--heldout-pct", type=float, default=3.0)
    ap.add_argument("--max-chats", type=int, default=5000,
                    help="cap on synthetic chat pairs mixed into the training stream")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256,
                    help="model width; query heads = hidden / 64 (head_dim is fixed at 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-schedule", default=None, metavar="JSON",
                    help="replay the per-step LRs recorded in an lr_schedule.json (exact replay)")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--decay-steps", type=int, default=None,
                    help="length of the final LR decay (default: --decay-frac of --steps)")
    ap.add_argument("--decay-frac", type=float, default=0.3,
                    help="fraction of the run (steps; time in --minutes-only mode) spent decaying")
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--probe", type=int, default=0, metavar="N",
                    help="time N training steps, print tokens/s, save nothing")
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None and not args.probe and not args.lr_schedule:
        ap.error("give --steps N or --lr-schedule FILE (reproducible) and/or --minutes M")

    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    def log(msg: str):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- data + tokenizer
    train_texts, held_texts, chats, n_files, nbytes = load_corpus(
        args.corpus, args.heldout_pct, args.max_chats)
    log(f"corpus: {n_files} files, {nbytes / 1e6:.1f} MB raw; train {len(train_texts)} docs "
        f"({sum(map(len, train_texts)) / 1e6:.1f} M chars), held-out {len(held_texts)} docs, "
        f"{len(chats)} chat pairs")
    chat_texts = [render_chat(c) for c in chats]
    tok = train_tokenizer(train_texts + chat_texts, args.vocab_size)
    V = tok.get_vocab_size()
    ids = {"pad": tok.token_to_id(PAD), "bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS)}
    log(f"tokenizer: vocab {V}, ids {ids}")
    # chat texts carry their own <|bos|>; encode without the post-processor's extra one
    doc_stream = encode_stream(tok, train_texts, ids["eos"])
    chat_enc = tok.encode_batch(chat_texts, add_special_tokens=False)
    chat_stream = (np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in chat_enc])
                   if chat_enc else np.zeros(0, dtype=np.int32))
    # fixed, seed-dependent interleaving of documents and chats is unnecessary: windows are
    # sampled at random positions of one stream
    train_stream = np.concatenate([doc_stream, chat_stream])
    held_stream = encode_stream(tok, held_texts, ids["eos"])
    log(f"tokens: train {len(train_stream):,} (docs {len(doc_stream):,} + chat "
        f"{len(chat_stream):,}), held-out {len(held_stream):,}; "
        f"{sum(map(len, train_texts)) / max(1, len(doc_stream)):.2f} chars/token")

    # ---- model
    config = build_config(args, V, ids)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} params ({fmt_params(n_params)}), {args.layers}L h{args.hidden} "
        f"heads {config.num_attention_heads}/{args.kv_heads} ffn {args.ffn}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    data = torch.from_numpy(train_stream.astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)
    L, B = args.seq_len, args.batch
    # Three schedule modes (all warmup-stable-decay, LRs rounded to 6 significant digits):
    #  * --lr-schedule FILE: replay a recorded per-step LR list exactly (deterministic);
    #  * --steps N: decay over the last --decay-steps (deterministic); --minutes is a hard cap;
    #  * --minutes M alone: decay over the last decay_frac of the *wall-clock* budget, which
    #    stays on budget on a shared, fluctuating CPU. The LRs used are recorded, so the run
    #    can be replayed exactly with --lr-schedule <out>/lr_schedule.json.
    replay = None
    if args.lr_schedule:
        rec = json.loads(Path(args.lr_schedule).read_text())
        if (rec.get("batch"), rec.get("seq_len"), rec.get("seed")) != (args.batch, args.seq_len,
                                                                       args.seed):
            raise SystemExit(f"{args.lr_schedule} was recorded with batch/seq_len/seed "
                             f"{rec.get('batch')}/{rec.get('seq_len')}/{rec.get('seed')}")
        replay = rec["lr"]
        decay_steps = sum(1 for x in replay[args.warmup_steps:] if x < args.lr)
    total_steps = len(replay) if replay else (args.probe or args.steps)
    if not replay:
        decay_steps = None
    if total_steps is not None and not replay:
        decay_steps = args.decay_steps if args.decay_steps is not None else max(
            1, round(args.decay_frac * total_steps))
    budget_s = args.minutes * 60 if args.minutes else None
    time_mode = total_steps is None
    stopped_early = False
    lr_trace: list[float] = []

    t_train = time.time()
    step, tokens_seen, recent = 0, 0, []
    t_log, tok_log = time.time(), 0
    while True:
        elapsed = time.time() - t_train
        if total_steps is not None and step >= total_steps:
            break
        if budget_s is not None and elapsed >= budget_s:
            if not time_mode:
                log(f"time cap of {args.minutes} min reached at step {step}; stopping")
                stopped_early = True
            break
        if replay:
            lr = replay[step]
        elif time_mode:
            lr = lr_at_time(step, elapsed / budget_s, args)
            if decay_steps is None and elapsed >= budget_s * (1 - args.decay_frac):
                decay_steps = -step  # marks the first decay step; fixed up after the loop
                log(f"decay phase starts at step {step}")
        else:
            lr = lr_at(step, total_steps, decay_steps, args)
        lr = float(f"{lr:.6g}")
        lr_trace.append(lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - L - 1, (B,), generator=gen)
        idx = starts[:, None] + torch.arange(L + 1)[None, :]
        batch = data[idx]
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += B * L
        tok_log += B * L
        recent.append(loss.item())
        recent = recent[-20:]
        if step % args.log_every == 0 or step == 1 or (args.probe and step == args.probe):
            now = time.time()
            tps = tok_log / max(1e-9, now - t_log)
            t_log, tok_log = now, 0
            eta = ""
            if time_mode:
                eta = f" {(budget_s - (now - t_train)) / 60:.1f} min left"
            elif total_steps:
                eta = f" eta {(total_steps - step) * B * L / max(tps, 1e-9) / 60:.1f} min"
            log(f"step {step}/{total_steps or '?'} loss {loss.item():.3f} "
                f"(avg20 {sum(recent) / len(recent):.3f}) lr {lr:.2e} {tps:.0f} tok/s{eta}")
        if args.eval_every and step % args.eval_every == 0 and not args.probe:
            nll, _, _ = eval_nll(model, held_stream, L, B, max_windows=32)
            log(f"  eval (32 held-out windows): loss {nll:.3f} ppl {math.exp(nll):.1f}")
    train_s = time.time() - t_train
    if time_mode:
        decay_steps = step + decay_steps if decay_steps is not None else 0
    if args.probe:
        log(f"probe: {step} steps, {tokens_seen / train_s:.0f} tok/s overall, "
            f"{train_s / step:.2f} s/step")
        return 0

    # ---- save
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lr_schedule.json").write_text(json.dumps(
        {"note": "per-step learning rates of the run that produced this folder; replay with "
                 "scripts/train_demo_model.py --lr-schedule <this file>",
         "seed": args.seed, "batch": B, "seq_len": L, "lr": lr_trace},
        separators=(",", ":")) + "\n")
    for stale in ("model.safetensors", "chat_template.jinja", "special_tokens_map.json"):
        if (out / stale).exists():
            (out / stale).unlink()
    log("evaluating fp32 weights on the full held-out split")
    nll32, n_eval, targets = eval_nll(model, held_stream, L, B)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)  # flat key for older readers next to rope_parameters
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        do_sample=False, max_new_tokens=128,
    ).save_pretrained(str(out))
    save_tokenizer(tok, out)
    for f in out.iterdir():
        f.chmod(0o644)

    # ---- reload the shipped folder exactly as a user would, evaluate, sample
    log("reloading the saved folder for evaluation and samples")
    m2 = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    nll16, _, _ = eval_nll(m2, held_stream, L, B)
    nll_uni = unigram_nll(train_stream, targets, V)
    log(f"held-out ppl: fp32 {math.exp(nll32):.2f}, bf16 {math.exp(nll16):.2f}, "
        f"unigram {math.exp(nll_uni):.1f} ({n_eval:,} tokens)")
    m2.eval()
    samples = greedy_samples(m2, hf_tok, SAMPLE_PROMPTS, 48)
    chat = chat_sample(m2, hf_tok, 64)
    for p, c in samples:
        log(f"sample {p!r} -> {c!r}")
    log(f"chat {chat[0]!r} -> {chat[1]!r}")

    corpus_desc = ("CPython 3.11 documentation, reStructuredText sources from the Debian package "
                   "python3.11-doc") if args.corpus == DEFAULT_CORPUS else "custom corpus"
    info = {
        "config": cfg,
        "corpus": args.corpus,
        "corpus_desc": corpus_desc,
        "corpus_license": args.corpus_license,
        "n_files": n_files,
        "corpus_mb": nbytes / 1e6,
        "heldout_pct": args.heldout_pct,
        "n_held_docs": len(held_texts),
        "n_train_docs": len(train_texts),
        "held_tokens": len(held_stream),
        "train_tokens": len(train_stream),
        "n_chats": len(chats),
        "n_params": n_params,
        "st_mb": (out / "model.safetensors").stat().st_size / 1e6,
        "command": "python scripts/train_demo_model.py " + " ".join(map(shlex.quote, sys.argv[1:]))
        if argv is None else "python scripts/train_demo_model.py " + " ".join(argv),
        "seed": args.seed,
        "steps_done": step,
        "batch": B,
        "seq_len": L,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / max(1, len(train_stream)),
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "decay_steps": decay_steps,
        "schedule_note": "replayed from a recorded schedule" if replay else (
            f"the last {args.decay_frac:.0%} of a {args.minutes}-minute wall-clock budget"
            if time_mode else "step-based"),
        "min_lr_frac": args.min_lr_frac,
        "threads": args.threads,
        "train_minutes": train_s / 60,
        "total_minutes": (time.time() - t_start) / 60,
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "final_train_loss": sum(recent) / max(1, len(recent)),
        "ppl_bf16": math.exp(nll16),
        "ppl_fp32": math.exp(nll32),
        "ppl_unigram": math.exp(nll_uni),
        "eval_tokens": n_eval,
        "samples": samples,
        "chat": chat,
    }
    info["stopped_early"] = stopped_early
    info["repro_command"] = repro_command(args, ap, step, decay_steps, time_mode or replay)
    if stopped_early:
        info["command"] += f"   (stopped by the time cap at step {step} of {total_steps or '?'})"
    write_card(out, info)
    write_heldout(out, held_texts)
    log(f"wrote {out}: " + ", ".join(
        f"{f.name} {f.stat().st_size / 1e6:.2f} MB" for f in sorted(out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
