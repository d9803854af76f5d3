"""The statistics of every comparison runner makes: paired ratios, their intervals, Holm's verdicts, the A/A noise.

Paired log ratios of samples/s with Student-t intervals (``paired``; Student 1908), the process as the unit
(``between_processes``), Holm's step-down verdicts (Holm 1979, Scand. J. Statist. 6), equivalence (Schuirmann 1987).
Why: docs/ablation.md, "Interleaved measurement". The t distribution: Numerical Recipes 3rd ed. §6.4 (no SciPy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

HELPS, HURTS, NO_EFFECT = "helps", "hurts", "no measurable effect"
#: The verdict of a comparison without an interval
NO_INTERVAL = "no interval (fewer than 2 pairs or processes)"


def _betacf(a: float, b: float, x: float) -> float:
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``, to 1e-10)."""
    if not 0 < p < 1:
        raise ValueError(f"p={p} must lie in (0, 1)")
    low, high = -1e3, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-10:
            break
    return (low + high) / 2


class Comparison(Protocol):
    """What Holm's verdicts read of a comparison: its p-value of "no effect" and which way its estimate points."""

    p_value: float

    @property
    def faster(self) -> bool: ...


@dataclass(frozen=True)
class Interval:
    """One comparison's figure: ``estimate`` = exp(mean log ratio) (a factor; > 1: the job is faster than its
    reference), its interval ``low``..``high`` at ``confidence``, the two-sided ``p_value`` of "no effect", the
    number of pairs ``n`` (of processes, for ``between_processes``), ``se_log`` (the standard error of the mean
    log ratio) and ``df``, the t distribution's degrees of freedom (None: ``n - 1``)."""

    estimate: float
    low: float
    high: float
    p_value: float
    n: int
    se_log: float
    confidence: float
    df: int | None = None

    @property
    def faster(self) -> bool:
        """Whether the job is faster than its reference by the estimate (a ratio of samples/s above 1)."""
        return self.estimate > 1

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the estimate (0.03 = ±3 %)."""
        return (self.high - self.low) / 2 / self.estimate

    def inverted(self) -> "Interval":
        """The same comparison read the other way round (reference ÷ job)."""
        return replace(self, estimate=1 / self.estimate, low=1 / self.high, high=1 / self.low)


def paired(log_ratios: Sequence[float], confidence: float = 0.95) -> Interval | None:
    """The paired comparison of ``log_ratios`` (natural log of job ÷ reference samples/s, one per pass); None
    with fewer than 2 pairs (no interval exists).

    Raises:
        ValueError: a ratio that is not finite, or ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1), e.g. 0.95")
    d = [float(v) for v in log_ratios]
    if not all(math.isfinite(v) for v in d):
        raise ValueError(f"log ratios must be finite, got {d}")
    n = len(d)
    if n < 2:
        return None
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    se = sd / math.sqrt(n)
    t = t_quantile(1 - (1 - confidence) / 2, n - 1)
    p = 1.0 if se == 0 and mean == 0 else 0.0 if se == 0 else 2 * (1 - t_cdf(abs(mean) / se, n - 1))
    return Interval(math.exp(mean), math.exp(mean - t * se), math.exp(mean + t * se), p, n, se, confidence)


def pooled_spread(process_means: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The standard deviation of process means about their configuration's mean, pooled over configurations
    (one-way ANOVA's within-group mean square), and its degrees of freedom, sum(k - 1) over configurations of
    k processes; ``(nan, 0)`` when no configuration has two processes."""
    squares, df = 0.0, 0
    for means in process_means:
        if len(means) > 1:
            centre = sum(means) / len(means)
            squares += sum((m - centre) ** 2 for m in means)
            df += len(means) - 1
    return (math.sqrt(squares / df), df) if df else (math.nan, 0)


def between_processes(
    job: Sequence[float], reference: Sequence[float], sd: float, df: int, confidence: float = 0.95
) -> Interval | None:
    """A configuration against its reference with the *process* as the unit: one mean log samples/s per process,
    ``sd``/``df`` from ``pooled_spread``; exp(mean(job) - mean(reference)) ``± t_df · sd · sqrt(1/k_job + 1/k_ref)``
    (docs/ablation.md). None without a process on either side or a spread.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1), e.g. 0.95")
    if not job or not reference or df < 1 or not math.isfinite(sd):
        return None
    mean = sum(job) / len(job) - sum(reference) / len(reference)
    se = sd * math.sqrt(1 / len(job) + 1 / len(reference))
    t = t_quantile(1 - (1 - confidence) / 2, df)
    p = 1.0 if se == 0 and mean == 0 else 0.0 if se == 0 else 2 * (1 - t_cdf(abs(mean) / se, df))
    return Interval(
        math.exp(mean),
        math.exp(mean - t * se),
        math.exp(mean + t * se),
        p,
        len(job) + len(reference),
        se,
        confidence,
        df,
    )


def at_confidence(c: Interval, confidence: float) -> Interval:
    """The same comparison with its interval at another ``confidence`` (from its ``se_log`` and degrees of
    freedom), e.g. at 1 - α/2 for a Bonferroni combination with another interval."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1), e.g. 0.95")
    t = t_quantile(1 - (1 - confidence) / 2, c.df if c.df is not None else c.n - 1)
    centre = math.log(c.estimate)
    return replace(c, low=math.exp(centre - t * c.se_log), high=math.exp(centre + t * c.se_log), confidence=confidence)


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected with family-wise error at most ``alpha``.

    The p-values are sorted; the k-th smallest (k = 0, 1, ...) is rejected while it is <= alpha / (m - k);
    the first that is not stops the procedure (it and every larger one stand)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for k, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - k):
            break
        rejected[i] = True
    return rejected


def verdicts(comparisons: Sequence[Comparison | None], confidence: float = 0.95) -> list[str]:
    """One verdict per comparison, Holm over those that have an interval: ``helps`` (rejected, faster),
    ``hurts`` (rejected, slower), ``no measurable effect``, or ``""`` without an interval. A comparison is an
    ``Interval`` of samples/s or any figure with a ``p_value`` and ``faster`` (runner/compare/convergence.py's
    samples and time to target, where below 1 is faster), so one family can hold both."""
    alpha = 1 - confidence
    have = [c for c in comparisons if c is not None]
    rejected = iter(holm([c.p_value for c in have], alpha))
    out = []
    for c in comparisons:
        if c is None:
            out.append("")
        elif next(rejected):
            out.append(HELPS if c.faster else HURTS)
        else:
            out.append(NO_EFFECT)
    return out


def equivalence_margin(c: Interval) -> float:
    """The smallest X (relative, rounded up to 0.1 %) such that the interval lies within 1 ± X: "no effect
    larger than ±X %"."""
    return math.ceil(1000 * max(1 - c.low, c.high - 1, 0.0)) / 1000


def minimum_detectable(aa: Interval, power: float = 0.8) -> float:
    """The smallest effect (relative, e.g. 0.02 = 2 %) a comparison with the A/A's standard error and pairs
    would call at the A/A's level with probability ``power``: exp((t_{1-α/2} + t_power) · se) - 1."""
    df = aa.df if aa.df is not None else aa.n - 1
    z = t_quantile(1 - (1 - aa.confidence) / 2, df) + t_quantile(power, df)
    return math.exp(z * aa.se_log) - 1
