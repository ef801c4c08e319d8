"""``best`` in one pass: the seven views of the recommended configuration, fused.

:func:`reference` builds ``best`` from the library's detectors (a :class:`Combiner` of
seven views); :class:`PyBest` computes the same scores, bit for bit, in one Python function
with the state in locals, and :class:`Best` runs that function compiled
(``detectors/_bestc.c``, built by ``pip install``). The generic composition costs ~16 us
per value in CPython (seven objects, each with its own attribute loads, calls and checks,
plus the combiner's); fused in Python ~7 us; compiled well under 1 us
(docs/detectors.md, cost section). tests/test_detector_contract.py checks that all three
give identical scores, and that a state pickled by one loads into the other.

Without a C compiler at install time ``Best`` is :class:`PyBest` (same scores, same
pickled state); :data:`COMPILED` says which one is in use.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from math import inf as _INF
from math import isfinite, log, sqrt
from typing import Any

from detectors._stats import SCORE_CAP, check_layout, refractory_gate, refractory_push
from detectors.base import Detector
from detectors.changepoint import CUSUM
from detectors.combiner import Combiner
from detectors.ewma import EWMA
from detectors.robust import _MAD_TO_STD, RobustZScore, mad_of_sorted
from detectors.seasonal import Seasonal
from detectors.variance import VarianceChange

__all__ = ["Best", "PyBest", "reference", "WEIGHTS", "COMPILED"]

SLOW = 0.0003  #: long memory: the band is the signal's normal range over days of data
#: Weights of the views, in the order of :func:`reference` (tuned on NAB, docs/detectors.md).
WEIGHTS = (0.9, 1.0, 1.0, 1.0, 0.9, 0.6, 0.9)
DECAY = 0.9999
WARMUP = 150
REFRACTORY = 100
SMOOTH = 48  # the level-shift and seasonal-shift views average 48 values
SHORT = 12  # the variance view's short window
ROBUST_WINDOW = 2000
ROBUST_MIN = 100
K = 3.0
_CUSUM_ALPHA, _DRIFT, _H, _CUSUM_MIN = 0.001, 0.5, 5.0, 30
_SEASONAL_MIN = 30


def reference(period: int = 288) -> Combiner:
    """``best`` built from the library's detectors: the definition :class:`Best` fuses.

    EWMA spike band (0.9), level-shift band on a 48-value mean, variance change, median/MAD
    band, CUSUM (0.9), difference to one ``period`` earlier (0.6) and its 48-value mean (0.9).
    """
    return Combiner(
        [
            EWMA(alpha=SLOW, k=K),
            EWMA(alpha=SLOW, k=K, smooth=SMOOTH),
            VarianceChange(short=SHORT, alpha=SLOW, k=K),
            RobustZScore(window=ROBUST_WINDOW, k=K, min_samples=ROBUST_MIN),
            CUSUM(alpha=_CUSUM_ALPHA, drift=_DRIFT, h=_H, min_samples=_CUSUM_MIN),
            Seasonal(period=period, alpha=SLOW, k=K, min_samples=_SEASONAL_MIN),
            Seasonal(period=period, alpha=SLOW, k=K, smooth=SMOOTH, min_samples=_SEASONAL_MIN),
        ],
        weights=WEIGHTS,
        decay=DECAY,
        warmup=WARMUP,
        refractory=REFRACTORY,
    )


# Derived constants, computed exactly as the detectors compute them.
_SA = 2.0 / (SMOOTH + 1)  # EWMA / Seasonal input smoother
_VA = 2.0 / (SHORT + 1)  # VarianceChange short EW weight
_VB = 1.0 - _VA
_KMAD = K * _MAD_TO_STD  # RobustZScore: band = k * 1.4826 * MAD, left to right
_REFRESH = max(1, ROBUST_WINDOW // 8)
_W0, _W4, _W5, _W6 = WEIGHTS[0], WEIGHTS[4], WEIGHTS[5], WEIGHTS[6]
_RB = 1.0 - SLOW  # 1 - alpha, exactly as the detectors compute it
_STEADY = 3340  # counts above which max(alpha, 1/(count + 1)) is alpha for every view
# Best._step writes these as literals (a constant loads faster than a global); keep them
# in step with it. Weights of 1.0 skip their product there.
assert (SLOW, SCORE_CAP, DECAY, K, WARMUP) == (0.0003, 1e9, 0.9999, 3.0, 150)
assert (_CUSUM_ALPHA, _CUSUM_MIN) == (0.001, 30) and 1.0 / _STEADY < SLOW
assert WEIGHTS[1] == WEIGHTS[2] == WEIGHTS[3] == 1.0
# From WARMUP on every view but the daily ones is past its min_samples (EWMA 10,
# VarianceChange 30 after its first value, CUSUM, RobustZScore): _step does not check.
assert max(10, 30 + 1, _CUSUM_MIN, ROBUST_MIN) <= WARMUP

# The scalar state, one list (unpacked into locals once per value): the seven records,
# then each view's statistics (names as in the detectors). detectors/_bestc.c writes the
# same layout out as FIELD_NAMES; importing the compiled Best checks that they are equal.
_FIELDS = (
    "rec_ewma", "rec_shift", "rec_var", "rec_robust", "rec_cusum", "rec_day", "rec_dayshift",
    "ewma_level", "ewma_rmean", "ewma_rvar", "ewma_rstd",
    "shift_smoothed", "shift_level", "shift_rmean", "shift_rvar", "shift_rstd",
    "var_mean", "var_var", "var_lmean", "var_lvar", "var_lstd", "var_absmean",
    "cusum_mean", "cusum_var", "cusum_std", "cusum_pos", "cusum_neg",
    "day_mean", "day_var", "day_std",
    "dayshift_smoothed", "dayshift_mean", "dayshift_var", "dayshift_std",
    "robust_band",
)
_BAND = _FIELDS.index("robust_band")
_LAYOUT = 1  # version of the pickled state


class PyBest(Detector):
    """The recommended single-signal detector, seven views fused into one update (Python).

    Scores are identical to :func:`reference` (``Combiner`` of ``EWMA``, ``EWMA(smooth=48)``,
    ``VarianceChange``, ``RobustZScore``, ``CUSUM``, ``Seasonal``, ``Seasonal(smooth=48)``,
    see docs/detectors.md): a calibrated score in [0, 1), one alarm per event.
    ``period`` is the number of values per day.

    Why it is faster: the views share their counters (each counts the finite values
    learned), the scalar state is one list unpacked into locals, and ``score_one``
    computes the next state along with the score; ``learn_one`` of the same value right
    after (the score-then-learn loop) only commits it. That cache is not state: it is
    left out of the pickle and used only while nothing was learned since.

    >>> d = PyBest(period=24)
    >>> for i in range(600):
    ...     d.learn_one(float(i % 24) + (i % 5) * 0.1)
    >>> d.score_one(0.0) < 0.5 < d.score_one(500.0) < 1.0  # 0.0 is the next value of the cycle
    True
    """

    def __init__(self, period: int = 288) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.period = period
        self._layout = _LAYOUT
        self._n = 0  # finite values learned (every view counts the same values)
        self._v: list[float] = [0.0] * len(_FIELDS)
        self._fifo: deque[float] = deque()  # RobustZScore window, arrival order
        self._sorted: list[float] = []  # ... and sorted
        self._since_mad = 0
        self._past: deque[float] = deque(maxlen=period)  # both seasonal views
        self._recent: deque[tuple[int, float]] = deque()  # refractory: decreasing scores
        # (x, state list, score, next state list) of the last score_one; not state.
        self._next: tuple[float, list[float], float, list[float]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_next"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_layout(state, _LAYOUT, "Best detector")
        self.__dict__.update(state)
        self._next = None

    def state(self) -> dict[str, float]:
        """The scalar statistics by name (for inspection and tests)."""
        return dict(zip(_FIELDS, self._v, strict=True))

    def _step(self, x: float) -> tuple[float, list[float]]:
        """The combined score of ``x`` (before the refractory rule) and the next scalar state.

        Each view's arithmetic is its detector's, in the same order, so the floats are
        identical; only what cannot change a result differs: ``v if v > 0 else -v`` for
        ``abs`` (the sign of a zero never reaches a score), ``var < inf`` for the
        overflow checks (a variance is >= 0 and overflows before its mean does), one
        ``log`` where both floors of the variance view are below the variance, and the
        constants written out (0.0003: ``SLOW``, 3.0: ``K``, 1e9: the score cap,
        0.9999: ``DECAY``, 150: ``WARMUP``).
        """
        n = self._n
        (r0, r1, r2, r3, r4, r5, r6,
         lv1, rm1, rv1, rs1,
         sm2, lv2, rm2, rv2, rs2,
         vm, vv, lm, lvv, lsd, am,
         cm, cv, cs, cp, cn,
         m5, v5, s5,
         sm6, m6, v6, s6,
         band) = self._v
        n1 = n + 1
        # EW weights max(alpha, 1/count): of the levels and |x| mean (a), of the residual
        # and log-variance statistics (ra, rb = 1 - ra) and of the CUSUM reference (ac).
        if n > _STEADY:  # 1/count is below every alpha: the weights are constant
            a = ra = 0.0003
            rb = _RB
            ac = 0.001
        else:
            a = 1.0 / n1
            if a < 0.0003:
                a = 0.0003
            ra = 1.0 / n if n else 1.0
            if ra < 0.0003:
                ra = 0.0003
            rb = 1.0 - ra
            ac = 1.0 / n1
            if ac < 0.001:
                ac = 0.001
        # CUSUM: the value standardised by the reference before it learns x.
        amn = cm if cm > 0.0 else -cm
        if cs <= 1e-12 * (amn if amn > 1.0 else 1.0):
            z = 0.0 if x == cm else (1e9 if x > cm else -1e9)
        else:
            z = (x - cm) / cs
            z = 1e9 if z > 1e9 else (-1e9 if z < -1e9 else z)
        pos = cp + z - _DRIFT
        neg = cn - z - _DRIFT
        # Seasonal views: the difference to one period ago (once a period is stored).
        ns = n - self.period  # >= 0: the seasonal views learn; >= 30: they score
        if ns >= 0:
            y5 = x - self._past[0]
            y6 = sm6 + _SA * (y5 - sm6) if ns else y5
        # VarianceChange's mean of |x| (its floor is taken after learning x)
        am_new = am + a * ((x if x > 0.0 else -x) - am)
        if not am_new < _INF:
            am_new = x if x > 0.0 else -x
        score = 0.0
        if n:
            res1 = x - lv1
            y2 = sm2 + _SA * (x - sm2)
            res2 = y2 - lv2
            d = x - vm
            vm_new = vm + _VA * d
            vv_new = _VB * (vv + _VA * d * d)
            if not vv_new < _INF:
                vv_new = 1e300
            vfloor = 1e-12 * (am_new if am_new > 1e-12 else 1e-12)
            lg = log(vv_new if vv_new > vfloor else vfloor)
            if n >= 150:  # before the warm-up ends the score is 0, records stay 0
                # EWMA spike band (weight 0.9)
                resid = res1 if res1 > 0.0 else -res1
                if resid == 0.0:
                    raw = best = 0.0
                else:
                    den = 3.0 * rs1
                    al = lv1 if lv1 > 0.0 else -lv1
                    floor = 1e-12 * (al if al > 1.0 else 1.0)
                    raw = resid / (den if den > floor else floor)
                    if not raw < 1e9:
                        raw = 1e9
                    best = raw / r0 * _W0 if r0 > 0.0 else 0.0
                m = r0 * 0.9999
                r0 = raw if raw > m else m
                # level shift on the 48-value mean
                resid = res2 if res2 > 0.0 else -res2
                if resid == 0.0:
                    raw = 0.0
                else:
                    den = 3.0 * rs2
                    al = lv2 if lv2 > 0.0 else -lv2
                    floor = 1e-12 * (al if al > 1.0 else 1.0)
                    raw = resid / (den if den > floor else floor)
                    if not raw < 1e9:
                        raw = 1e9
                    if r1 > 0.0:
                        ratio = raw / r1
                        if ratio > best:
                            best = ratio
                m = r1 * 0.9999
                r1 = raw if raw > m else m
                # variance change: log of the short variance, floor from |x| before x
                floor = 1e-12 * (am if am > 1e-12 else 1e-12)
                if vv_new > floor:
                    dev = (lg if vv_new > vfloor else log(vv_new)) - lm
                else:
                    dev = log(floor) - lm
                if dev < 0.0:
                    dev = -dev
                if dev == 0.0:
                    raw = 0.0
                else:
                    den = 3.0 * lsd
                    raw = dev / (den if den > 1e-12 else 1e-12)
                    if not raw < 1e9:
                        raw = 1e9
                    if r2 > 0.0:
                        ratio = raw / r2
                        if ratio > best:
                            best = ratio
                m = r2 * 0.9999
                r2 = raw if raw > m else m
                # median / MAD band
                s = self._sorted
                ln = len(s)
                mid = ln >> 1
                med = s[mid] if ln & 1 else 0.5 * (s[mid - 1] + s[mid])
                dev = x - med
                if dev < 0.0:
                    dev = -dev
                if dev == 0.0:
                    raw = 0.0
                else:
                    al = med if med > 0.0 else -med
                    floor = 1e-12 * (al if al > 1.0 else 1.0)
                    raw = dev / (band if band > floor else floor)
                    if not raw < 1e9:
                        raw = 1e9
                    if r3 > 0.0:
                        ratio = raw / r3
                        if ratio > best:
                            best = ratio
                m = r3 * 0.9999
                r3 = raw if raw > m else m
                # CUSUM (weight 0.9)
                top = pos if pos > neg else neg
                if top <= 0.0:
                    raw = 0.0
                else:
                    raw = top / _H
                    if not raw < 1e9:
                        raw = 1e9
                    if r4 > 0.0:
                        ratio = raw / r4 * _W4
                        if ratio > best:
                            best = ratio
                m = r4 * 0.9999
                r4 = raw if raw > m else m
                # daily pattern: the difference (0.6) and its 48-value mean (0.9)
                raw = raw6 = 0.0
                if ns >= _SEASONAL_MIN:
                    dev = y5 - m5
                    if dev < 0.0:
                        dev = -dev
                    if dev != 0.0:
                        den = 3.0 * s5
                        al = m5 if m5 > 0.0 else -m5
                        floor = 1e-12 * (al if al > 1.0 else 1.0)
                        raw = dev / (den if den > floor else floor)
                        if not raw < 1e9:
                            raw = 1e9
                        if r5 > 0.0:
                            ratio = raw / r5 * _W5
                            if ratio > best:
                                best = ratio
                    dev = y6 - m6
                    if dev < 0.0:
                        dev = -dev
                    if dev != 0.0:
                        den = 3.0 * s6
                        al = m6 if m6 > 0.0 else -m6
                        floor = 1e-12 * (al if al > 1.0 else 1.0)
                        raw6 = dev / (den if den > floor else floor)
                        if not raw6 < 1e9:
                            raw6 = 1e9
                        if r6 > 0.0:
                            ratio = raw6 / r6 * _W6
                            if ratio > best:
                                best = ratio
                m = r5 * 0.9999
                r5 = raw if raw > m else m
                m = r6 * 0.9999
                r6 = raw6 if raw6 > m else m
                score = best / (1.0 + best) if best < _INF else 1.0

            # learn, EWMA views: West's update of the residuals' EW mean / variance
            d = res1 - rm1
            rm1 = rm1 + ra * d
            rv1 = rb * (rv1 + ra * d * d)
            if not rv1 < _INF:
                rm1, rv1 = res1, 1e300
            rs1 = sqrt(rv1)
            lv1 = lv1 + a * res1
            d = res2 - rm2
            rm2 = rm2 + ra * d
            rv2 = rb * (rv2 + ra * d * d)
            if not rv2 < _INF:
                rm2, rv2 = res2, 1e300
            rs2 = sqrt(rv2)
            sm2 = y2
            lv2 = lv2 + a * res2
            # variance change: long-run EW mean / std of the log-variance
            d = lg - lm
            lm = lm + ra * d
            lvv = rb * (lvv + ra * d * d)
            lsd = sqrt(lvv)
            vm, vv = vm_new, vv_new
        else:  # the first value only initialises the level views
            lv1 = sm2 = lv2 = vm = x
        am = am_new
        # CUSUM: the sums (after min_samples), then the reference learns x
        if n >= 30:
            if pos > _H or neg > _H:
                pos = neg = 0.0
            cp = pos if pos > 0.0 else 0.0
            cn = neg if neg > 0.0 else 0.0
        d = x - cm
        cm = cm + ac * d
        cv = (1.0 - ac) * (cv + ac * d * d)
        if not cv < _INF:
            cm, cv = x, 1e300
        cs = sqrt(cv)
        # seasonal views
        if ns >= 0:
            if ns > _STEADY:
                a5 = 0.0003
                b5 = _RB
            else:
                a5 = 1.0 / (ns + 1)
                if a5 < 0.0003:
                    a5 = 0.0003
                b5 = 1.0 - a5
            d = y5 - m5
            m5 = m5 + a5 * d
            v5 = b5 * (v5 + a5 * d * d)
            if not v5 < _INF:
                m5, v5 = (y5 if isfinite(y5) else 0.0), 1e300
            s5 = sqrt(v5)
            sm6 = y6
            d = y6 - m6
            m6 = m6 + a5 * d
            v6 = b5 * (v6 + a5 * d * d)
            if not v6 < _INF:
                m6, v6 = (y6 if isfinite(y6) else 0.0), 1e300
            s6 = sqrt(v6)
        return score, [r0, r1, r2, r3, r4, r5, r6,
                       lv1, rm1, rv1, rs1,
                       sm2, lv2, rm2, rv2, rs2,
                       vm, vv, lm, lvv, lsd, am,
                       cm, cv, cs, cp, cn,
                       m5, v5, s5,
                       sm6, m6, v6, s6,
                       band]

    def score_one(self, x: float) -> float:
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        if self._n < WARMUP:
            return 0.0
        nxt = self._next
        if nxt is not None and nxt[0] is x and nxt[1] is self._v:
            score = nxt[2]
        else:
            score, new = self._step(x)
            self._next = (x, self._v, score, new)
        if self._recent:  # refractory: not above every score of the last values, 0
            return refractory_gate(self._recent, self._n - REFRACTORY - 1, score)
        return score

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        nxt = self._next
        if nxt is not None and nxt[0] is x and nxt[1] is self._v:
            score, new = nxt[2], nxt[3]
        else:
            score, new = self._step(x)
        self._next = None
        n = self._n
        refractory_push(self._recent, n - REFRACTORY, n, score)
        # median / MAD window
        fifo, s = self._fifo, self._sorted
        if n >= ROBUST_WINDOW:
            del s[bisect_left(s, fifo.popleft())]
        fifo.append(x)
        insort(s, x)
        since = self._since_mad + 1
        n8 = len(s) >> 3
        if since >= (_REFRESH if n8 > _REFRESH else (n8 if n8 > 1 else 1)):
            new[_BAND] = _KMAD * mad_of_sorted(s)
            since = 0
        self._since_mad = since
        self._past.append(x)
        self._v = new
        self._n = n + 1


try:
    from detectors import _bestc
except ModuleNotFoundError:  # built without a C compiler: the Python class, same scores
    _bestc = None

if _bestc is not None:
    # A module that is there but stale (built from an older _bestc.c) fails loudly rather
    # than falling back: rebuilding is the fix.
    _BestCore = getattr(_bestc, "BestCore", None)
    _C_CONSTANTS = getattr(_bestc, "CONSTANTS", None)
    _C_FIELDS = getattr(_bestc, "FIELDS", None)
    # The C file writes the constants and the state layout out (C cannot import them):
    # refuse a build that drifted from this file (raised, not asserted: -O keeps it).
    if _C_CONSTANTS != (
        SLOW, DECAY, WARMUP, REFRACTORY, SMOOTH, SHORT, ROBUST_WINDOW, K, _CUSUM_ALPHA,
        _DRIFT, _CUSUM_MIN, _SEASONAL_MIN, _STEADY, _H, SCORE_CAP, _MAD_TO_STD,
        _W0, _W4, _W5, _W6,
    ):
        raise ImportError("detectors/_bestc.c constants differ from detectors/best.py: "
                          "make them equal and rebuild (pip install -e .)")
    if _C_FIELDS != _FIELDS:
        raise ImportError("detectors/_bestc.c's state layout (FIELD_NAMES) differs from "
                          "detectors/best.py's _FIELDS: keep them in the same order and "
                          "rebuild (pip install -e .)")

    class Best(_BestCore, Detector):  # type: ignore[misc,valid-type]
        """The recommended single-signal detector: :class:`PyBest`, compiled.

        Identical scores and the same pickled state as :class:`PyBest` (a state saved by
        either loads into the other); ``score_one`` / ``learn_one`` run in C.

        >>> d = Best(period=24)
        >>> for i in range(600):
        ...     d.learn_one(float(i % 24) + (i % 5) * 0.1)
        >>> d.score_one(0.0) < 0.5 < d.score_one(500.0) < 1.0
        True
        """

        def __init__(self, period: int = 288) -> None:
            super().__init__(period)

        def __getstate__(self) -> dict[str, Any]:
            state = self._export()  # PyBest's __dict__, in its order (equal pickles)
            return {"period": state.pop("period"), "_layout": _LAYOUT, **state, "_next": None}

        def __setstate__(self, state: dict[str, Any]) -> None:
            check_layout(state, _LAYOUT, "Best detector")
            self._import(state)

        def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
            return (_restore, (type(self), self.__getstate__()))

        def state(self) -> dict[str, float]:
            """The scalar statistics by name (for inspection and tests)."""
            return dict(zip(_FIELDS, self._export()["_v"], strict=True))

    COMPILED = True
else:
    Best = PyBest  # type: ignore[misc,assignment]
    COMPILED = False


def _restore(cls: type[Detector], state: dict[str, Any]) -> Detector:
    """Unpickle a compiled :class:`Best` (its C part has no state until ``_import``)."""
    det = cls.__new__(cls)
    det.__setstate__(state)  # type: ignore[attr-defined]
    return det
