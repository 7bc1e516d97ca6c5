"""A tiny reasoning model for the tests: the session's tiny random Llama with a byte-level
word tokenizer (``" w0"``..) in which two ids are the tags ``<think>`` and ``</think>`` (added,
not special: kept in the text, as Qwen3's and DeepSeek-R1's are), and a chat template that
opens the reasoning (DeepSeek-R1's style) or honours ``enable_thinking`` (Qwen3's)."""

from __future__ import annotations

import os
import shutil

THINK_ID = 511  # "<think>"
DEEPSEEK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                     "{% if add_generation_prompt %}assistant <think>{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}assistant"
                  "{% if enable_thinking is defined and enable_thinking is false %}"
                  " <think> </think>{% endif %}{% endif %}")


def reasoning_model(tiny_llama: str, path: str, end_id: int, template: str) -> str:
    """A copy of ``tiny_llama``'s weights at ``path`` whose tokenizer reads id ``end_id`` as
    ``</think>`` and ``THINK_ID`` as ``<think>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tiny_llama):
        if not name.startswith("tokenizer") and name != "special_tokens_map.json":
            shutil.copy(os.path.join(tiny_llama, name), path)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"\u0120w{i}" for i in range(509)])}
    names = {i: t for t, i in vocab.items()}
    for i, tag in ((THINK_ID, "<think>"), (end_id, "</think>")):
        del vocab[names[i]]
        vocab[tag] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # " w1 w2" -> "Ġw1", "Ġw2"
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<think>", normalized=False),
                    AddedToken("</think>", normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(path)
    return path
