"""The step-time curve the adaptive policy reads: t(T) ~ a + b T seconds for a step of T rows,
fitted by exponentially weighted least squares over recent steps.

On CPU a step's cost grows with its rows almost from the first extra row (the GEMMs turn
compute-bound within a few rows), so whether a draft token pays depends on the batch: at batch
1 one extra row costs a fraction of the step, at batch 16 about a whole row's share.

Only decode-shaped steps are observed (every row a decode or verify row: ``observe`` is not
called for a step with a prefill chunk): a prompt's hundreds of rows run the GEMMs at their
prefill efficiency, and one such point set the slope of the whole fit (at batch 1 a 400-row
prefill, far cheaper per row, pulled the slope down for the ~30 steps it weighed in). A
step far slower than the curve predicts (the host busy elsewhere) is clipped to
``_CLIP`` x the prediction, so one stall does not turn drafting off for the next steps.
"""

from __future__ import annotations

_CLIP = 3.0  # an observation counts at most this multiple of the curve's prediction
_ROWS = 64  # row counts 1.._ROWS keep their own shape factor
_SHAPE_DECAY = 0.9  # per observation of that row count
_SHAPE_PRIOR = 1.0  # weight (in observations) of the line itself (factor 1)
# From _BOUND rows a step is compute-bound: a further row costs at least _BOUND_SHARE of the
# mean row's share (2-core Xeon, 2026-12-07: a 16-row step ~1.8 ms a row, each row past it
# ~1.5 ms; the fitted line alone priced them far lower once the verify GEMMs got cheaper, and
# batch-16 runs drafted 20-80 tokens a step at 0.93x of off)
_BOUND = 16.0
_BOUND_SHARE = 0.8


class StepCost:
    """The line a + b rows, times a per-row-count shape factor: the measured step time over
    the line's prediction, averaged per row count (1.._ROWS) and blended with 1 (the line) by
    how often that count was seen. The GEMMs' cost is a staircase, not a line (AMX-INT8
    tiles from 10 / 16 GEMM rows, 16-row tiles, the wide VNNI pass's 8-row chunks): the line
    carries the level (it follows the host's load), the factors the steps."""

    __slots__ = ("decay", "_s0", "_s1", "_s2", "_sy", "_sxy", "_shape", "_shape_w")

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._s0 = self._s1 = self._s2 = self._sy = self._sxy = 0.0
        self._shape = [1.0] * (_ROWS + 1)
        self._shape_w = [0.0] * (_ROWS + 1)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-shaped step of ``rows`` rows took ``seconds``."""
        if self._s0 > 2.0:
            seconds = min(seconds, _CLIP * self(rows))
        if self.known and rows <= _ROWS:
            a, b = self.line()
            w = self._shape_w[rows] = self._shape_w[rows] * _SHAPE_DECAY + 1.0
            self._shape[rows] += (seconds / max(a + b * rows, 1e-9) - self._shape[rows]) / w
        d = self.decay
        self._s0 = self._s0 * d + 1.0
        self._s1 = self._s1 * d + rows
        self._s2 = self._s2 * d + rows * rows
        self._sy = self._sy * d + seconds
        self._sxy = self._sxy * d + rows * seconds

    @property
    def known(self) -> bool:
        return self._s0 > 0.5

    def line(self) -> tuple[float, float]:
        """(a, b): seconds at 0 rows and per row. With too little spread in the rows seen, the
        slope is a prior (a row = 1/4 of the mean step's time per row), corrected as soon as
        steps of other sizes are measured."""
        s0, s1, s2 = self._s0, self._s1, self._s2
        mean_t, mean_x = self._sy / s0, s1 / s0
        var = s2 / s0 - mean_x * mean_x
        if var > 0.25:
            b = (self._sxy / s0 - mean_x * mean_t) / var
            b = max(b, 0.02 * mean_t / max(mean_x, 1.0))  # noise: never free, never negative
            # large batches are compute-bound: a row costs about its share of the step (the
            # line through small and large steps would make rows past the batch look cheap)
            x = max(mean_x, 1.0)
            b = max(b, _BOUND_SHARE * min(1.0, x / _BOUND) ** 2 * mean_t / x)
        else:
            b = 0.25 * mean_t / max(mean_x, 1.0)
        return max(mean_t - b * mean_x, 0.0), b

    def at(self, rows: int, base: int) -> float:
        """A step of ``rows`` rows that adds ``rows - base`` draft rows to a step of ``base``:
        ``self(rows)``, but each added row costs at least _BOUND_SHARE of a base row's share
        once the base is compute-bound (weighted by (base / _BOUND)^2: nothing at a few
        rows). The fitted line and the factors of rarely seen row counts can price rows past
        a large batch far below that (batch-16 runs drafted at 0.94x of off)."""
        t = self(rows)
        if rows > base > 0:
            tb = self(base)
            share = _BOUND_SHARE * min(1.0, base / _BOUND) ** 2 * tb / base
            t = max(t, tb + (rows - base) * share)
        return t

    def __call__(self, rows: int) -> float:
        a, b = self.line()
        t = a + b * rows
        if rows <= _ROWS:
            w = self._shape_w[rows]
            t *= (w * self._shape[rows] + _SHAPE_PRIOR) / (w + _SHAPE_PRIOR)
        return t


class DraftCost:
    """What a draft model's proposal costs: its first pass (the draft engine catches up on the
    tokens since its last call: the last verify step's accepted tokens and the bonus token,
    plus the partial block its prefix cache does not hold, then samples draft token 1) and
    each further pass (one decode row per request: tokens 2..k), each a ``StepCost`` keyed by
    the number of requests drafted. Both are measured around the draft engine's own loop
    (schedule, forward, update), so its Python counts as well as its GEMMs."""

    __slots__ = ("first", "rest")

    def __init__(self) -> None:
        self.first = StepCost()
        self.rest = StepCost()

    def observe(self, requests: int, first: float, rest: float | None) -> None:
        """One proposal for ``requests`` requests: its first pass took ``first`` seconds,
        each further pass ``rest`` on average (None: there was none)."""
        self.first.observe(requests, first)
        if rest is not None:
            self.rest.observe(requests, rest)

    @property
    def known(self) -> bool:
        return self.first.known

    def __call__(self, requests: int, passes: int) -> float:
        """Seconds for ``passes`` draft tokens for each of ``requests`` requests (0 before
        anything was measured: the first proposal is what measures it)."""
        if passes <= 0 or requests <= 0 or not self.known:
            return 0.0
        t = self.first(requests)
        if passes > 1:  # before a second pass was ever seen: as costly as the first
            t += (passes - 1) * (self.rest(requests) if self.rest.known else t)
        return t
