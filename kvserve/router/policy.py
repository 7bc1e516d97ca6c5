"""The routing decision: which healthy replica takes a request, and why.

``auto`` (the default) goes in order: (a) an ``x-session-affinity`` header pins the session by
consistent hashing with bounded load; (b) otherwise the replica with the best score
``matched_prompt_tokens - load_cost_tokens * load`` among those under the bounded-load capacity,
when some replica holds a prefix of the prompt; (c) otherwise the least loaded (KV usage, then
a rotating turn, break ties). ``session`` / ``prefix`` use only their rule (then least loaded);
``least-loaded`` and ``round-robin`` ignore sessions and prefixes. With prefill replicas
(docs/disaggregation.md) ``plan`` splits what it can into a prefill leg, picked by prefix hits
against load (no session pins it: the KV moves on), and a decode leg to the least loaded decode
replica (KV room and running batch matter there, prefixes do not).

A replica's load is the larger of the requests this router has in flight on it and the
running + waiting sequences its last ``/metrics`` scrape reported (other routers' work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.router.hashing import HashRing, capacity

POLICIES = ("auto", "session", "prefix", "least-loaded", "round-robin")


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    load: int
    kv_usage: float = 0.0  # fraction of KV blocks in use


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str  # session | prefix | least_loaded | round_robin
    matched_tokens: int = 0


def splittable(payload: object) -> bool:
    """Whether a request can run as a prefill leg + a decode leg: one sequence, more than one
    token to generate (the replicas check the rest and refuse a leg they cannot take)."""
    if not isinstance(payload, dict) or "kv_transfer" in payload:
        return False
    if payload.get("n", 1) != 1 or payload.get("echo"):
        return False
    max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return max_tokens is None or (isinstance(max_tokens, int) and max_tokens > 1)


def plan(routing: str, disaggregated: bool, payload: object) -> tuple[str | None, str]:
    """The rules of a request's prefill leg (None: there is none) and of the leg that answers."""
    if not disaggregated:
        return None, routing
    prefill = "prefix" if routing in ("auto", "session") else routing
    return (prefill if splittable(payload) else None), "least-loaded"


def least_loaded(cands: Sequence[Candidate], turn: int = 0) -> Candidate:
    """Least load, then least KV usage; exact ties rotate with ``turn`` (idle replicas share
    sequential requests instead of the first one taking them all)."""
    names = sorted(c.name for c in cands)
    pos = {n: (i - turn) % len(names) for i, n in enumerate(names)}
    return min(cands, key=lambda c: (c.load, c.kv_usage, pos[c.name]))


def decide(policy: str, cands: Sequence[Candidate], *, session: str | None,
           matches: Mapping[str, int], ring: HashRing, rr_turn: int, load_factor: float,
           load_cost_tokens: float) -> Decision:
    """``cands``: the healthy replicas not yet tried for this request (non-empty);
    ``matches``: replica -> matched prompt tokens; ``rr_turn``: a counter for round-robin."""
    assert cands, "no candidate replica"
    if policy not in POLICIES:
        raise ValueError(f"routing must be one of {POLICIES}, got {policy!r}")
    by_name = {c.name: c for c in cands}
    if policy == "round-robin":
        names = sorted(by_name)
        return Decision(names[rr_turn % len(names)], "round_robin")
    if policy in ("auto", "session") and session:
        loads = {c.name: c.load for c in cands}
        name = ring.assign(session, loads, load_factor, allowed=set(by_name))
        if name is not None:
            return Decision(name, "session")
    if policy in ("auto", "prefix"):
        cap = capacity(sum(c.load for c in cands), len(cands), load_factor)
        scored = [(matches.get(c.name, 0) - load_cost_tokens * c.load, c)
                  for c in cands if matches.get(c.name, 0) > 0 and c.load < cap]
        if scored:
            best = max(scored, key=lambda sc: (sc[0], -sc[1].load, -sc[1].kv_usage))[1]
            # A held prefix only wins over an idle replica when it is worth its load.
            idle = least_loaded(cands, rr_turn)
            if matches.get(best.name, 0) - load_cost_tokens * best.load >= \
                    matches.get(idle.name, 0) - load_cost_tokens * idle.load:
                return Decision(best.name, "prefix", matches[best.name])
    return Decision(least_loaded(cands, rr_turn).name, "least_loaded")
