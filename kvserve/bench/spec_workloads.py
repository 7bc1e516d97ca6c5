"""The speculative-decoding benchmark's workloads, built from text the package ships (the demo
model's held-out text: Python's C-API documentation) and generated records, so the bench needs
no download. Each workload is a few chat prompts of one kind:

- ``edit``: return a JSON document with one field changed (copies nearly everything);
- ``rag``: answer a question by quoting a given document passage;
- ``json``: repetitive structured output (JSON lines, a markdown table);
- ``chat``: open questions (little to copy: speculation must not cost).
"""

from __future__ import annotations

import json
import pathlib

WORKLOADS = ("edit", "rag", "json", "chat")


def _passages(n: int, chars: int = 900) -> list[str]:
    path = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "heldout.txt"
    paras = [p.strip() for p in path.read_text().split("\n\n") if len(p.strip()) > 200]
    out, i = [], 0
    while len(out) < n and i < len(paras):
        text = ""
        while len(text) < chars and i < len(paras):
            text += paras[i] + "\n\n"
            i += 1
        out.append(text.strip())
    return out


_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
          "mallory", "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "victor"]
_CITIES = ["Oslo", "Lima", "Kyoto", "Porto", "Quito", "Turin", "Perth", "Dakar"]


def _records(n: int, seed: int) -> list[dict]:
    return [{"id": 100 + seed * 10 + i, "name": _NAMES[(seed + i) % len(_NAMES)],
             "city": _CITIES[(seed * 3 + i) % len(_CITIES)], "active": (seed + i) % 3 != 0,
             "score": (seed * 37 + i * 11) % 97} for i in range(n)]


def prompts(workload: str) -> list[list[dict]]:
    """Chat messages of ``workload`` (4 prompts)."""
    if workload == "edit":
        out = []
        for s in range(4):
            doc = {"ticket": 4711 + s, "status": "open", "owner": _NAMES[s],
                   "items": _records(4, s), "notes": "check the records before closing"}
            out.append([{"role": "user", "content": (
                "Return this JSON document unchanged except that \"status\" becomes "
                "\"closed\". Output only the JSON.\n\n" + json.dumps(doc, indent=2))}])
        return out
    if workload == "rag":
        qs = ["Quote the sentences of the document that describe what happens on error.",
              "Quote the first paragraph of the document exactly.",
              "Which functions does the document name? Quote the sentences that mention them.",
              "Quote the document's description of the return value."]
        return [[{"role": "user", "content": f"Document:\n{p}\n\nQuestion: {q} Answer only "
                  "with quotes from the document."}] for p, q in zip(_passages(4), qs,
                                                                     strict=True)]
    if workload == "json":
        out = []
        for s in range(4):
            rows = _records(8, s)
            if s % 2:
                text = "\n".join(f"{r['name']},{r['city']},{r['score']}" for r in rows)
                ask = ("Turn these CSV rows (name,city,score) into a markdown table with a "
                       "header row:\n\n" + text)
            else:
                text = "\n".join(json.dumps(r) for r in rows[:3])
                ask = ("Here are JSON lines records:\n" + text + "\n\nWrite 8 more records in "
                       "exactly the same format, ids continuing from the last one.")
            out.append([{"role": "user", "content": ask}])
        return out
    if workload == "chat":
        return [[{"role": "user", "content": q}] for q in (
            "Write a short story about a lighthouse keeper who finds a message in a bottle.",
            "Explain how a refrigerator works to a ten year old.",
            "What are three good habits for learning a new language? Explain each.",
            "Describe a walk through a busy market in the morning.")]
    raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
