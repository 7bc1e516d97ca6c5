"""The drafter: after each step, draft tokens for the requests that decode next, and decide how
many each gets.

Proposals come from the configured method (``ngram``: prompt lookup, ``suffix``: suffix trees,
``draft_model``: a smaller model). With ``adaptive`` (the default) the draft tokens of all
requests compete for rows of the next step: token j of a request is expected to be accepted
with probability p_1 ... p_j, p_i the acceptance of token i given the ones before it were
accepted: for a suffix draft, calibrated online by the tree's evidence for that token
(calibrate.py), falling back to alpha (the request's recent per-token acceptance; before it
has any, all requests' recent acceptance where that is above 0.5); for ngram and draft
model drafts alpha itself. One more row costs the fitted slope of the step-time curve
(``StepCost``). Tokens are taken in order of that probability while the step's expected
tokens per second still rises, so a
request whose drafts keep failing stops drafting (its alpha drifts back to the prior while it
does not draft, so it is tried again later), and a large batch, where a row costs a whole
token's share, drafts only near-certain tokens.

A draft model's proposals cost passes of their own (``DraftCost``, measured around the draft
engine's loop): their number is planned before it runs, the passes' time counted with the
verify step's, so a draft model about as costly as the target does not run at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from kvserve.config import SpeculativeConfig
from kvserve.engine.spec.calibrate import Bucket, Calibration, bucket
from kvserve.engine.spec.cost import DraftCost, StepCost
from kvserve.engine.spec.ngram import NgramIndex
from kvserve.engine.spec.realign import MAX_SHIFT, SUBST_WEIGHT, TokenText, realign
from kvserve.engine.spec.suffix import GlobalSuffixCache, SuffixTree
from kvserve.engine.stats import SpecDecodeCounters
from kvserve.request import Request, RequestStatus

PRIOR = 0.5  # acceptance prior of a request that has no history yet
# a token the grammar forces is drawn unless the model spells the same bytes another way
FORCED = 0.95
_PRIOR_WEIGHT = 2.0  # in trials
_DECAY = 0.8  # per verification: older outcomes count less
_IDLE_DECAY = 0.95  # per step without drafts: back towards the prior
_GLOBAL_DECAY = 0.98  # per verification, for the prior over all requests


class DraftModel(Protocol):
    """A draft model's proposer (kvserve/engine/spec/draft_model.py)."""

    def propose(self, reqs: list[Request], k: list[int], cost: DraftCost | None = None
                ) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...


class _State:
    __slots__ = ("req", "ngram", "tree", "fed", "acc", "trials", "prop", "prop_at", "aligned",
                 "subst", "from_subst", "ev", "sent", "lead")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.ngram: NgramIndex | None = None
        self.tree: SuffixTree | None = None
        self.fed = 0  # tokens of req.all_token_ids appended to the tree
        self.acc = self.trials = 0.0
        # suffix: the last proposal (with a few tokens of lookahead) and the sequence length
        # it continued; the aligned context (realign.py) while the output follows a source
        # with its whitespace shifted (None: the sequence itself is the context)
        self.prop: list[int] = []
        self.prop_at = -1
        self.aligned: list[int] | None = None
        self.subst = False  # the aligned context stands in a substituted token (realign.py)
        self.from_subst = False  # the last proposal came from such a context
        # suffix: the calibration bucket of each token of the last proposal (None: no tree
        # evidence), and of each token of the draft the next step verifies
        self.ev: list[Bucket | None] = []
        self.sent: list[Bucket | None] = []
        self.lead = 0.0  # the estimated acceptance of the last proposal's first token

    def alpha(self, prior: float = PRIOR) -> float:
        return (self.acc + prior * _PRIOR_WEIGHT) / (self.trials + _PRIOR_WEIGHT)


class Drafter:
    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None,
                 tokenizer=None) -> None:
        self.config = config
        # token texts for realigning a copy after a whitespace shift (suffix; None: off)
        self.text = TokenText(tokenizer) if tokenizer is not None else None
        self.k = config.num_speculative_tokens
        self.draft_model = draft_model
        assert (config.method == "draft_model") == (draft_model is not None)
        self.cost = StepCost()
        self.draft_cost = DraftCost()  # the draft model's passes (draft_model only)
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * self.k)
        self._states: dict[str, _State] = {}
        # every request's outcomes together: the prior of a request that has none yet
        self._acc = self._trials = 0.0
        # how often a substitution's first draft token is accepted (realign.py)
        self._sub_acc = self._sub_trials = 0.0
        # suffix drafts: acceptance by the tree's evidence for each token (calibrate.py)
        self.calibration = Calibration()
        self.global_tree = (GlobalSuffixCache(config.suffix_decoding_max_tree_depth,
                                              config.suffix_decoding_max_cached_requests)
                            if config.method == "suffix" else None)

    # ---- after a step ---------------------------------------------------------------------
    def observe(self, drafts: dict[str, int], accepted: dict[str, int], rows: int,
                seconds: float | None) -> None:
        """A step's outcome: per request with drafts, how many it drafted and how many were
        accepted; the step's rows and wall time (the cost curve; None: a step with a prefill
        chunk, not a point of the decode curve)."""
        if seconds is not None:
            self.cost.observe(rows, seconds)
        if not drafts:  # nothing verified: back towards the prior, so drafting is tried again
            self._acc *= _IDLE_DECAY
            self._trials *= _IDLE_DECAY
        for rid, k in drafts.items():
            a = accepted.get(rid, 0)
            self.counters.record(k, a)
            st = self._states.get(rid)
            if st is not None and st.sent:
                self.calibration.observe(st.sent[:k], a)
            if st is not None and st.from_subst:
                # the substitution's first token: its own rate; the rest as any draft's
                self._sub_trials = self._sub_trials * _GLOBAL_DECAY + 1
                self._sub_acc = self._sub_acc * _GLOBAL_DECAY + (a > 0)
                if a == 0:
                    continue
                k, a = k - 1, a - 1
                if k == 0:
                    continue
            self._trials = self._trials * _GLOBAL_DECAY + min(k, a + 1)
            self._acc = self._acc * _GLOBAL_DECAY + a
            if st is not None:  # positions reached: the accepted ones and the first rejected
                st.trials = st.trials * _DECAY + min(k, a + 1)
                st.acc = st.acc * _DECAY + a

    def sweep(self, live: set[str]) -> None:
        """Forget the requests that are gone; a finished request's output joins the global
        suffix tree."""
        for rid in [r for r in self._states if r not in live]:
            st = self._states.pop(rid)
            if self.global_tree is not None and st.req.status.finished \
                    and st.req.status is not RequestStatus.FINISHED_ABORTED:
                self.global_tree.add(st.req.output_token_ids)
            if self.draft_model is not None:
                self.draft_model.forget(rid)

    # ---- before the next step ------------------------------------------------------------
    def propose(self, running: list[Request], base_rows: int) -> None:
        """Set ``spec_token_ids`` of every running request: its drafts for the next step
        (empty: none). ``base_rows``: the rows the next step has without drafts."""
        cands: list[tuple[Request, list[int], list[float]]] = []
        decoding = []
        for req in running:
            req.spec_token_ids = []
            room = req.max_tokens - req.num_output_tokens - 1
            if req.num_tokens - req.num_computed_tokens != 1 or room < 1 or req.is_finished:
                continue
            decoding.append((req, min(self.k, room)))
        if not decoding:
            return
        adaptive = self.config.adaptive and self.cost.known
        spent = 0.0  # seconds the draft model took (sunk when the drafts are chosen)
        if self.draft_model is not None:
            drafts, spent = self._propose_draft_model(decoding, base_rows, adaptive)
        elif adaptive and not self._may_pay(decoding, base_rows):
            for req, _ in decoding:  # nothing drafted: back towards the prior
                st = self._state(req)
                st.acc *= _IDLE_DECAY
                st.trials *= _IDLE_DECAY
            return
        else:
            drafts = [self._propose_one(req, k) for req, k in decoding]
        for (req, k), d in zip(decoding, drafts, strict=True):
            st = self._state(req)
            ev = list(st.ev) if self.config.method == "suffix" else []
            st.sent = []
            forced: list[int] = []
            if req.grammar is not None:
                # jump-forward: what the grammar forces leads the draft, the method's draft
                # goes on only where it agrees; then only what the grammar allows
                forced = req.grammar.forced_tokens()[:k]
                if forced and d[: len(forced)] != forced:
                    d = forced
                if d:
                    d = d[: req.grammar.validate(d)]
                ev = [None] * len(forced) + ev[len(forced):]  # forced: no tree evidence
            if not d:
                st.acc *= _IDLE_DECAY
                st.trials *= _IDLE_DECAY
                st.lead = 0.0
                continue
            ev = (ev + [None] * len(d))[: len(d)]
            a, p, ps = self._alpha(st), 1.0, []
            if st.from_subst and not forced:  # the first token at the substitutions' rate
                ev[0] = None
            for j in range(len(d)):
                if j < len(forced):
                    p *= FORCED
                elif j == 0 and st.from_subst:
                    p *= ((self._sub_acc + PRIOR * _PRIOR_WEIGHT)
                          / (self._sub_trials + _PRIOR_WEIGHT))
                elif ev[j] is not None:
                    p *= self.calibration.estimate(ev[j], a)
                else:
                    p *= a
                ps.append(p)
            st.sent, st.lead = ev, ps[0]
            cands.append((req, d, ps))
        if not self.config.adaptive:
            for req, d, _ in cands:
                req.spec_token_ids = d
            return
        self._choose(cands, len(decoding), base_rows, spent)

    def _propose_draft_model(self, decoding: list[tuple[Request, int]], base_rows: int,
                             adaptive: bool) -> tuple[list[list[int]], float]:
        """The draft model's proposals and the seconds they took. Adaptive (once a proposal
        was measured): each request's draft length is planned before the draft model runs,
        weighing its passes with the verify rows (``_plan``, token j expected at alpha^j);
        a request planned at 0 gets no draft-model tokens (what its grammar forces is still
        drafted), and with every request at 0 the draft model does not run. A draft model as
        costly as the target thus stops drafting; a cheap one drafts as far as it pays."""
        assert self.draft_model is not None
        ks = [k for _, k in decoding]
        if adaptive and not self.draft_cost.known and not self._may_pay(decoding, base_rows):
            ks = [0] * len(ks)  # not even the verify rows pay: no proposal to measure yet
        elif adaptive and self.draft_cost.known:
            probs = []
            for req, k in decoding:
                a = self._alpha(self._state(req))
                probs.append([a ** (j + 1) for j in range(k)])
            ks = self._plan(probs, len(decoding), base_rows, self.draft_cost)
        run = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in decoding]
        if not run:
            return drafts, 0.0
        t0 = time.perf_counter()
        got = self.draft_model.propose([decoding[i][0] for i in run], [ks[i] for i in run],
                                       self.draft_cost)
        for i, d in zip(run, got, strict=True):
            drafts[i] = d
        return drafts, time.perf_counter() - t0

    def _may_pay(self, decoding: list[tuple[Request, int]], base_rows: int) -> bool:
        """Whether even the likeliest first draft token (probability: ``_lead``) would
        raise the step's expected tokens per second; if not, no proposal is computed at all
        (a large batch then pays nothing for speculation being on)."""
        best = max(FORCED if req.grammar is not None else self._lead(self._state(req))
                   for req, _ in decoding)
        n, t = len(decoding), self.cost(base_rows)
        return (n + best) * t > n * self.cost.at(base_rows + 1, base_rows)

    def _choose(self, cands: list[tuple[Request, list[int], list[float]]], n_decode: int,
                base_rows: int, spent: float = 0.0) -> None:
        """Take draft tokens by expected acceptance, as many as maximize the step's expected
        tokens per second; ``spent``: seconds already spent proposing (a draft model's
        passes), part of this step's time whatever is taken."""
        if self.cost.known:
            take = self._plan([ps for _, _, ps in cands], n_decode, base_rows,
                              lambda *_: spent)
        else:
            take = [len(d) for _, d, _ in cands]
        for (req, d, _), n in zip(cands, take, strict=True):
            req.spec_token_ids = d[:n]
            st = self._states[req.request_id]
            del st.sent[n:]
            if not n:
                st.acc *= _IDLE_DECAY
                st.trials *= _IDLE_DECAY

    def _plan(self, probs: list[list[float]], n_decode: int, base_rows: int,
              draft: Callable[[int, int], float]) -> list[int]:
        """How many draft tokens each request takes: tokens in order of expected acceptance
        (``probs[i][j]``: token j of request i), the prefix that maximizes the step's
        expected tokens per second, the step's time being the verify step's (the measured
        curve at its rows) plus ``draft(requests drafting, passes)`` (the deepest token
        taken sets the passes). The whole prefix is weighed: the curve has steps, so a token
        that does not pay alone may pay with the next ones."""
        order = sorted(((p, i, j) for i, ps in enumerate(probs) for j, p in enumerate(ps)),
                       key=lambda t: -t[0])
        take = [0] * len(probs)
        gain, rows, depth, active = float(n_decode), base_rows, 0, 0
        picks: list[int] = []
        # drafting nothing still costs draft(0, 0): the seconds already spent (``_choose``)
        best_rate, best_n = gain / (self.cost(rows) + draft(0, 0)), 0
        for p, i, j in order:
            if j != take[i]:  # a later token of a request whose earlier one was not taken
                continue
            active += take[i] == 0
            take[i] += 1
            gain += p
            rows += 1
            depth = max(depth, j + 1)
            picks.append(i)
            rate = gain / (self.cost.at(rows, base_rows) + draft(active, depth))
            if rate > best_rate:
                best_rate, best_n = rate, len(picks)
        take = [0] * len(probs)
        for i in picks[:best_n]:
            take[i] += 1
        return take

    def _lead(self, st: _State) -> float:
        """The likeliest first draft token's probability: alpha, or the estimate of the last
        proposal's first token where its tree evidence says more (a suffix draft; a request
        whose alpha fell while its tree knows a certain continuation still proposes)."""
        return max(self._alpha(st), st.lead)

    def _alpha(self, st: _State) -> float:
        """The request's per-token acceptance; its prior: all requests' recent acceptance
        where that is above PRIOR (a workload that rejects drafts still gives each new
        request PRIOR's chance, its own outcomes turn it down)."""
        recent = (self._acc + PRIOR * _PRIOR_WEIGHT) / (self._trials + _PRIOR_WEIGHT)
        return st.alpha(max(PRIOR, recent))

    def _state(self, req: Request) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.req is not req:
            st = self._states[req.request_id] = _State(req)
        return st

    def _propose_one(self, req: Request, k: int) -> list[int]:
        cfg, st = self.config, self._state(req)
        if cfg.method == "ngram":
            if st.ngram is None:
                st.ngram = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            return st.ngram.propose(req.all_token_ids, k)[0]
        if st.tree is None:
            st.tree = SuffixTree(cfg.suffix_decoding_max_tree_depth)
        n = req.num_tokens
        for t in req.token_range(st.fed, n):
            st.tree.append(t)
        st.fed = n
        args = (k, cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob)
        # the request's own tree follows the sequence: its match needs no walk
        ev: list[tuple[int, int, int]] = []
        path, limit, score = st.tree.draft_path([], *args, match=st.tree.match_end(),
                                                lookahead=MAX_SHIFT, evidence=ev)
        source = 0
        aligned = self._aligned(st, req, n)
        if aligned is not None:
            ev2: list[tuple[int, int, int]] = []
            p2, l2, s2 = st.tree.draft_path(aligned, *args, lookahead=MAX_SHIFT, evidence=ev2)
            if st.subst:
                s2 *= SUBST_WEIGHT
            if s2 > score:
                path, limit, score, ev, source = p2, l2, s2, ev2, 1
            else:
                st.aligned, st.subst = None, False
        best = path[:limit]
        st.from_subst = aligned is not None and st.aligned is not None and st.subst
        if self.global_tree is not None:
            ctx = req.token_range(max(0, n - cfg.suffix_decoding_max_tree_depth), n)
            ev2 = []
            other, s2 = self.global_tree.tree.draft(ctx, *args, evidence=ev2)
            if s2 > score:
                best = path = other
                ev, source = ev2, 2
                st.from_subst = False
        st.prop, st.prop_at = path, n
        st.ev = [bucket(c, t, m, source) for c, t, m in ev[: len(best)]]
        return best

    def _aligned(self, st: _State, req: Request, n: int) -> list[int] | None:
        """The aligned context (realign.py) for drafting after the tokens emitted since the
        last proposal, or None where the sequence itself is the context: the emitted tokens
        followed the proposal, except that the last one may have replaced a few of its tokens
        with the same text up to whitespace (then the proposal's tokens stand in for it)."""
        if self.text is None or st.prop_at < 0 or n <= st.prop_at:
            return st.aligned if n == st.prop_at else None
        new, d = req.token_range(st.prop_at, n), st.prop
        a = 0
        while a < len(new) and a < len(d) and new[a] == d[a]:
            a += 1
        if a == len(new) or a == len(d) == len(new) - 1:  # followed (then a bonus token)
            if st.aligned is None:
                return None
            tail, st.subst = new, False
        elif a == len(new) - 1:
            i = realign(self.text, new[a], d, a)
            # a value that differs: the source's structure may go on after it (not twice in a
            # row: then the output has left the source)
            subst = i is None and a + 1 < len(d) and not (st.subst and a == 0)
            if subst:
                i = a
            if i is None:
                st.aligned, st.subst = None, False
                return None
            tail = new[:a] + d[a : i + 1]
            st.subst = subst
        else:
            st.aligned, st.subst = None, False
            return None
        depth = self.config.suffix_decoding_max_tree_depth
        base = st.aligned if st.aligned is not None else req.token_range(
            max(0, st.prop_at - depth), st.prop_at)
        st.aligned = (base + tail)[-depth:]
        return st.aligned

def make_drafter(args, tokenizer, vocab_size: int) -> Drafter | None:
    """The engine's drafter for ``args.speculative_config`` (None: speculation off)."""
    cfg = args.speculative_config
    if cfg is None:
        return None
    draft = None
    if cfg.method == "draft_model":
        from kvserve.engine.spec.draft_model import DraftModelProposer

        draft = DraftModelProposer.build(args, cfg.model, tokenizer, vocab_size)
    return Drafter(cfg, draft, tokenizer if cfg.method == "suffix" else None)
