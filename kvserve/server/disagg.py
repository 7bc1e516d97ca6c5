"""Prefill/decode disaggregation at the HTTP boundary (docs/disaggregation.md).

A request body may carry ``kv_transfer`` (set by ``kvserve router``, not by clients):

  * ``{"role": "prefill"}``: run the prompt and its first token only (max_tokens 1) and offer
    the prompt's KV; the response carries ``kv_transfer: {"handle", "first_token"}``.
  * ``{"role": "decode", "handle", "first_token"}``: fetch and verify that KV, append the
    first token as if sampled here, and generate on: the response is the whole, ordinary one.

One prompt and n = 1 per leg (the router sends other requests whole to a decode replica).
"""

from __future__ import annotations

from typing import Any

from kvserve.http.errors import bad_request
from kvserve.http.protocol import KVTransferLeg
from kvserve.outputs import RequestOutput
from kvserve.request import FirstToken
from kvserve.sampling_params import SamplingParams

ROLES = ("both", "prefill", "decode")


def kv_leg(leg: KVTransferLeg | None, num_prompts: int, params: SamplingParams,
           role: str) -> tuple[SamplingParams, dict[str, Any]]:
    """The params and the engine's extra ``add_request`` arguments for this leg."""
    if leg is None:
        return params, {}
    if role not in ("both", leg.role):
        raise bad_request(f"this server's role is {role}; it takes no {leg.role} leg",
                          "kv_transfer.role")
    if num_prompts != 1:
        raise bad_request("kv_transfer takes exactly one prompt", "prompt")
    if params.n != 1:
        raise bad_request("n must be 1 with kv_transfer", "n")
    if leg.role == "prefill":
        return params.clone(max_tokens=1), {"kv_export": True}
    if leg.handle is None or leg.first_token is None:
        raise bad_request("a decode leg needs handle and first_token", "kv_transfer.handle")
    ft = leg.first_token
    top = None
    if ft.top_logprobs is not None:
        if any(len(pair) != 2 or pair[0] != int(pair[0]) for pair in ft.top_logprobs):
            raise bad_request("top_logprobs holds [token id, logprob] pairs",
                              "kv_transfer.first_token.top_logprobs")
        top = {int(t): float(lp) for t, lp in ft.top_logprobs}
    return params, {"kv_transfer": leg.handle,
                    "first_token": FirstToken(ft.id, ft.logprob, top)}


def prefill_result(out: RequestOutput) -> dict | None:
    """What a prefill leg answers besides the ordinary response: the handle and the token."""
    if out.kv_transfer is None or not out.outputs or not out.outputs[0].token_ids:
        return None
    c = out.outputs[0]
    tok = c.token_ids[0]
    lps = c.logprobs[0] if c.logprobs else None
    return {"handle": out.kv_transfer, "cached_tokens": out.num_cached_tokens, "first_token": {
        "id": tok, "logprob": float(lps[tok]) if lps else 0.0,
        "top_logprobs": [[int(t), float(lp)] for t, lp in lps.items()] if lps else None}}
