"""llama-cpp-python with and without prompt-lookup speculation (``LlamaPromptLookupDecoding``)
on a GGUF: greedy chat completions of the payload's workloads at batch 1, output tokens/s
(``kvserve bench spec --peer llamacpp``)."""

# ruff: noqa: E402 - a standalone script: the payload is read before the heavy imports

import json
import statistics
import sys
import time

cfg = json.load(sys.stdin)
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

kw = {"model_path": cfg["gguf"], "n_ctx": 4096, "n_threads": cfg["threads"],
      "n_threads_batch": cfg["threads"], "verbose": False}
# logits_all for the lookup engine: llama-cpp-python 0.3.36 turns it on in the context when a
# draft model is given but sizes its score array by the argument (n_batch rows), so a verify
# past row 512 fails ("could not broadcast ... into shape (0,)") unless it is passed here
engines = {"plain": Llama(**kw),
           "lookup": Llama(**kw, logits_all=True, draft_model=LlamaPromptLookupDecoding(
               num_pred_tokens=cfg["num_pred_tokens"]))}
out = {}
for wl, msgs in cfg["workloads"].items():
    rates = {"plain": [], "lookup": []}
    for r in range(cfg["rounds"] + 1):  # round 0: warm-up
        for name in (["plain", "lookup"] if r % 2 else ["lookup", "plain"]):
            llm = engines[name]
            n, t0 = 0, time.perf_counter()
            for m in msgs:
                llm.reset()
                res = llm.create_chat_completion(messages=m, max_tokens=cfg["max_tokens"],
                                                 temperature=0.0)
                n += res["usage"]["completion_tokens"]
            if r:
                rates[name].append(n / (time.perf_counter() - t0))
    out[wl] = {"plain_tok_s": statistics.median(rates["plain"]),
               "lookup_tok_s": statistics.median(rates["lookup"]),
               "plain_rounds": rates["plain"], "lookup_rounds": rates["lookup"]}
print(json.dumps(out))
