"""Structured outputs, in one package (as vLLM's ``structured_output``): what a constraint is
(``params``), the backend that compiles it (``backend``: llguidance), the compiled-grammar cache
(``compiler``), one sequence's grammar state (``matcher``), the allowed-token bitmasks and the
masking of logits (``bitmask``), and strict JSON schemas (``schema``).

Who calls it: ``SamplingParams.structured_outputs`` holds the params; ``LLMEngine.add_request``
compiles them and gives each sequence a matcher; the sampler (engine/sampler.py) masks with
its bitmask; the scheduler advances it with each accepted token; the server translates
``response_format`` / ``tools`` into params (server/structured.py, server/tool_parsers.py).
The package imports nothing of kvserve's outside itself, so every layer may use it.
"""
