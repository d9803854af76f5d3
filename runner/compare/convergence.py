"""Samples to target over seeds, and time to target = samples to target ÷ samples per second.

The ratio config ÷ reference is the Hodges–Lehmann estimate on the log scale with the exact Mann–Whitney interval
(Hodges & Lehmann 1963; Hollander & Wolfe, ch. 4), censored seeds bounding it; time to target divides it by the
throughput ``Interval``, each at 1 - α/2 (Bonferroni). The method and its limits: docs/ablation.md, "Samples to
target and time to target".
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from runner.compare.stats import Interval, at_confidence, t_cdf, t_quantile

#: The fewest seeds per configuration with which samples to target are compared
MIN_SEEDS = 3


@dataclass(frozen=True)
class Seed:
    """One seed's run of one configuration: ``value`` = the global samples trained (or, for a time comparison, the
    training seconds, evaluations excluded) when an evaluation first met the target (``reached``), or, censored (not
    ``reached``), those it trained before it ended. ``seed`` (``trainer.seed``), ``target`` (what was to be met,
    e.g. ``eval_loss <= 1.2``) and ``source`` (the summary.json it was read from) say where it came from."""

    value: float
    reached: bool
    seed: int | None = None
    target: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class TargetRatio:
    """One comparison of samples (``quantity`` ``samples``) or time to target (``time``): ``estimate`` = config ÷
    reference (below 1: faster), ``low``..``high`` at ``confidence`` (0 or inf where censoring leaves an end open),
    the ``p_value`` of "no difference", and the seeds that reached the target on each side (read as an ``Interval``).
    """

    quantity: str
    estimate: float
    low: float
    high: float
    p_value: float
    confidence: float
    reached: int
    seeds: int
    reference_reached: int
    reference_seeds: int

    @property
    def faster(self) -> bool:
        """Whether the configuration needs fewer samples (less time) than its reference."""
        return self.estimate < 1

    @property
    def n(self) -> int:
        """The seeds compared, both sides."""
        return self.seeds + self.reference_seeds

    @property
    def counts(self) -> str:
        """How many seeds reached the target, ``7/8 vs 8/8`` (the configuration's, then the reference's)."""
        return f"{self.reached}/{self.seeds} vs {self.reference_reached}/{self.reference_seeds}"


@lru_cache(maxsize=256)
def null_cdf(m: int, n: int) -> tuple[float, ...]:
    """P(U <= u), u = 0..m·n, for the Mann–Whitney count U (pairs x_i > y_j) of m and n exchangeable continuous
    values: the coefficients of the Gaussian binomial coefficient [m+n choose m]_q, exact in integers
    (prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i)) over C(m+n, m)."""
    poly = [1]
    for i in range(1, m + 1):
        grown = poly + [0] * (n + i)
        for d, c in enumerate(poly):  # x (1 - q^(n+i))
            grown[d + n + i] -= c
        for d in range(i, len(grown)):  # ÷ (1 - q^i): exact, the quotient's coefficients are the running sums
            grown[d] += grown[d - i]
        poly = grown[: len(grown) - i]
    total, running, out = math.comb(m + n, m), 0, []
    for c in poly[: m * n + 1]:
        running += c
        out.append(float(Fraction(running, total)))
    return tuple(out)


class _Shift:
    """The m·n pairwise log differences of a comparison (config - reference), each with the bounds censoring
    leaves it (``low``, ``high``, sorted) and the value the estimate takes (``point``)."""

    def __init__(self, config: Sequence[Seed], reference: Sequence[Seed]):
        low, high, point = [], [], []
        for x in config:
            for y in reference:
                d = math.log(x.value) - math.log(y.value)
                if x.reached and y.reached:
                    bounds = (d, d, d)
                elif y.reached:  # the config's run is censored: it would have needed more than it trained
                    bounds = (d, math.inf, math.inf)
                elif x.reached:
                    bounds = (-math.inf, d, -math.inf)
                else:  # both censored: undecided, a tie for the estimate
                    bounds = (-math.inf, math.inf, 0.0)
                low.append(bounds[0])
                high.append(bounds[1])
                point.append(bounds[2])
        self.low, self.high, self.point = sorted(low), sorted(high), sorted(point)
        self.cdf = null_cdf(len(config), len(reference))

    def estimate(self) -> float:
        """Hodges–Lehmann: the median pairwise difference; of two middle ones, the mean where both are finite, the
        finite one where one is, 0 where they are -inf and inf."""
        n = len(self.point)
        middle = [self.point[(n - 1) // 2], self.point[n // 2]]
        finite = [d for d in middle if math.isfinite(d)]
        return sum(finite) / len(finite) if finite else middle[0] if middle[0] == middle[1] else 0.0

    def interval(self, confidence: float) -> tuple[float, float]:
        """The log-shift interval at ``confidence``: [k-th smallest lower bound, k-th largest upper bound], k the
        largest with P(U <= k - 1) <= α/2; the whole line when even k = 1 is too likely (too few seeds)."""
        k = bisect.bisect_right(self.cdf, (1 - confidence) / 2 * (1 + 1e-12))
        if k == 0:
            return -math.inf, math.inf
        return self.low[k - 1], self.high[len(self.high) - k]

    def p_value(self, shift: float = 0.0) -> float:
        """Two-sided p-value of "the log shift is ``shift``", the inversion of ``interval``: ties and undecided
        pairs count against rejecting on both sides."""
        below = bisect.bisect_right(self.low, shift)  # pairs that may lie at or below the shift
        above = len(self.high) - bisect.bisect_left(self.high, shift)  # pairs that may lie at or above it
        return min(1.0, 2 * min(self.cdf[below], self.cdf[above]))


def _prepared(config: Sequence[Seed], reference: Sequence[Seed], confidence: float) -> _Shift | None:
    """The pairwise differences, or None with too few seeds or none that reached the target.

    Raises:
        ValueError: ``confidence`` outside (0, 1), samples that are not positive and finite, or two targets."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1), e.g. 0.95")
    for s in (*config, *reference):
        if not (math.isfinite(s.value) and s.value > 0):
            raise ValueError(f"samples and seconds must be positive and finite, got {s.value} ({s.source or s})")
    targets = {s.target for s in (*config, *reference) if s.target is not None}
    if len(targets) > 1:
        raise ValueError(
            f"the seeds were run to different targets ({', '.join(sorted(targets))}): samples to "
            f"target compare only for one target"
        )
    if min(len(config), len(reference)) < MIN_SEEDS or not any(s.reached for s in (*config, *reference)):
        return None
    return _Shift(config, reference)


def _ratio(
    quantity: str,
    config: Sequence[Seed],
    reference: Sequence[Seed],
    estimate: float,
    low: float,
    high: float,
    p: float,
    confidence: float,
) -> TargetRatio:
    return TargetRatio(
        quantity,
        math.exp(estimate),
        math.exp(low),
        math.exp(high),
        p,
        confidence,
        sum(s.reached for s in config),
        len(config),
        sum(s.reached for s in reference),
        len(reference),
    )


def samples_to_target(
    config: Sequence[Seed], reference: Sequence[Seed], confidence: float = 0.95, quantity: str = "samples"
) -> TargetRatio | None:
    """Samples (``quantity`` ``time``: seconds) to target of ``config``'s seeds ÷ ``reference``'s: the Hodges–Lehmann
    ratio with the Mann–Whitney interval at ``confidence``, censored seeds bounding it (the module docstring). None
    with fewer than ``MIN_SEEDS`` seeds on a side or no seed that reached the target.

    Raises:
        ValueError: ``confidence`` outside (0, 1), values that are not positive and finite, or seeds run to
            different targets.
    """
    shift = _prepared(config, reference, confidence)
    if shift is None:
        return None
    return _ratio(
        quantity, config, reference, shift.estimate(), *shift.interval(confidence), shift.p_value(), confidence
    )


def lognormal_ratio(
    config: Sequence[Seed], reference: Sequence[Seed], confidence: float = 0.95, quantity: str = "time"
) -> TargetRatio | None:
    """``config`` ÷ ``reference`` as the ratio of geometric means with Welch's t interval on the log scale (Welch
    1947): exact where each side's values are log-normal, and firm from 3 seeds a side where the rank test needs 5.
    None where a seed missed the target (censored: use ``samples_to_target``), with fewer than ``MIN_SEEDS`` seeds a
    side, or where neither side varies.

    Raises:
        ValueError: as ``samples_to_target``.
    """
    if _prepared(config, reference, confidence) is None or not all(s.reached for s in (*config, *reference)):
        return None
    logs = [[math.log(s.value) for s in side] for side in (config, reference)]
    means = [sum(v) / len(v) for v in logs]
    squares = [statistics.variance(v) / len(v) for v in logs]  # each mean's squared standard error
    se = math.sqrt(sum(squares))
    if se == 0:
        return None
    df = se**4 / sum(q * q / (len(v) - 1) for q, v in zip(squares, logs))  # Welch–Satterthwaite
    shift, t = means[0] - means[1], t_quantile(1 - (1 - confidence) / 2, df)
    p = 2 * (1 - t_cdf(abs(shift) / se, df))
    return _ratio(quantity, config, reference, shift, shift - t * se, shift + t * se, p, confidence)


def time_to_target(
    config: Sequence[Seed],
    reference: Sequence[Seed],
    throughput: Interval | float | None = 1.0,
    confidence: float = 0.95,
    samples_share: float = 0.5,
) -> TargetRatio | None:
    """Time to target of ``config`` ÷ ``reference`` = samples-to-target ratio ÷ ``throughput`` (samples/s ratio: an
    ``Interval``, combined by Bonferroni: the samples interval at 1 - ``samples_share``·α, the throughput's at
    1 - (1 - ``samples_share``)·α; or an exact number). None where ``samples_to_target`` is, or for a throughput of
    None.

    Raises:
        ValueError: as ``samples_to_target``; a throughput that is not positive and finite.
    """
    shift = _prepared(config, reference, confidence)
    if shift is None or throughput is None:
        return None
    if not isinstance(throughput, Interval):
        if not (math.isfinite(throughput) and throughput > 0):
            raise ValueError(f"throughput ratio must be positive and finite, got {throughput}")
        c = math.log(throughput)
        low, high = shift.interval(confidence)
        return _ratio("time", config, reference, shift.estimate() - c, low - c, high - c, shift.p_value(c), confidence)

    def bounds(alpha: float) -> tuple[float, float]:
        (low, high) = shift.interval(1 - samples_share * alpha)
        t = at_confidence(throughput, 1 - (1 - samples_share) * alpha)
        return low - math.log(t.high), high - math.log(t.low)

    def excludes_one(alpha: float) -> bool:
        low, high = bounds(alpha)
        return low > 0 or high < 0

    lo, hi = 0.0, 1.0 - 1e-9
    if not excludes_one(hi):
        p = 1.0
    else:
        for _ in range(40):  # the interval narrows as α grows: bisect for the α where it first excludes 1
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if excludes_one(mid) else (mid, hi)
        p = hi
    return _ratio(
        "time",
        config,
        reference,
        shift.estimate() - math.log(throughput.estimate),
        *bounds(1 - confidence),
        p,
        confidence,
    )


def _target(trainer: dict[str, Any]) -> str | None:
    said = []
    if trainer.get("target_accuracy") is not None:
        said.append(f"eval_accuracy >= {trainer['target_accuracy']:g}")
    if trainer.get("target_loss") is not None:
        said.append(f"eval_loss <= {trainer['target_loss']:g}")
    return " and ".join(said) or None


def read_seed(folder: Path | str, quantity: str = "samples") -> Seed:
    """The ``Seed`` of one finished run: its summary.json's ``samples_to_target`` where the target was reached,
    else the samples it trained (``steps`` × ``global_batch_size``, censored), its ``config.trainer.seed`` and
    target; ``quantity`` ``time``: its ``time_to_target_s``, else the seconds it trained (``train_time_s``).

    Raises:
        FileNotFoundError: no summary.json (a run that failed, e.g. diverged, writes none: it never reached the
            target, so count it as ``Seed(<its limit in samples>, reached=False)`` rather than dropping it).
        ValueError: the summary has no target figures: the run had no ``trainer.target_accuracy`` /
            ``trainer.target_loss``, or was written by a runner that did not record ``samples_to_target``.
    """
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no summary.json; a seed whose run failed never reached the target: count "
            f"it as Seed(<its limit in samples>, reached=False) instead of dropping it"
        )
    summary = json.loads(path.read_text())
    trainer = (summary.get("config") or {}).get("trainer") or {}
    target = _target(trainer)
    if target is None:
        raise ValueError(
            f"{path}: the run had no target (trainer.target_accuracy and trainer.target_loss unset), "
            f"so it has no samples to target; run the seeds with one"
        )
    if "samples_to_target" not in summary:
        raise ValueError(f"{path}: no samples_to_target (written by a runner that did not record it); rerun it")
    reached = summary.get("time_to_target_s") is not None
    if reached and summary["samples_to_target"] is None:
        raise ValueError(
            f"{path}: the target was reached (time_to_target_s) but samples_to_target is null (resumed "
            f"from a checkpoint written before runner recorded it); rerun it"
        )
    if quantity == "time":
        value = summary["time_to_target_s"] if reached else summary["train_time_s"]
    else:
        value = summary["samples_to_target"] if reached else summary["steps"] * summary["global_batch_size"]
    return Seed(value, reached, trainer.get("seed"), target, str(path))


def read_seeds(folders: Iterable[Path | str]) -> list[Seed]:
    """``read_seed`` of every run folder in ``folders`` (one configuration's seeds).

    Raises:
        ValueError: as ``read_seed``; two folders of the same seed (a repeat measures nothing new here).
    """
    seeds = [read_seed(f) for f in folders]
    known = [s.seed for s in seeds if s.seed is not None]
    if len(known) != len(set(known)):
        repeated = sorted({s for s in known if known.count(s) > 1})
        raise ValueError(
            f"seed(s) {repeated} appear more than once ({', '.join(str(s.source) for s in seeds)}): "
            f"samples to target vary between seeds, each seed counts once"
        )
    return seeds
