"""Confidence intervals for speed-ups measured over repeats, and the verdict that follows from one.

A speed-up is a ratio of medians: a configuration's median samples/s over its reference's, each over
that configuration's repeats. Its uncertainty comes from the repeats alone, so it is estimated by the
bootstrap (Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, ch. 13 "Confidence intervals
based on bootstrap percentiles"):

1. resample the repeats of the configuration and, independently, those of the reference, each with
   replacement and at its own size;
2. take the ratio of the two resamples' medians;
3. repeat ``resamples`` times; the interval runs between the percentiles that leave (1 - ``confidence``)/2
   of those ratios out on each side (2.5th and 97.5th at 95 %; an ablation's report passes the
   simultaneous level of ``simultaneous_confidence``).

The random generator is seeded from ``seed`` and the two configurations' names, so the same sweep gives
the same report, and adding a configuration to a sweep does not move another one's interval.

With fewer than 2 repeats on either side there is no interval (a single run says nothing about
noise): ``ratio_interval`` returns ``None``. With 3 repeats the percentile interval of a ratio of medians
is in practice [min(a)/max(b), max(a)/min(b)]: the verdict needs the two sets of repeats to be fully
separated. More repeats narrow it (``ablation.repeats=auto``).

Only numpy is used.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: Default number of bootstrap resamples and seed (a report is reproducible with these).
RESAMPLES = 10_000
SEED = 0
CONFIDENCE = 0.95
HELPS, HURTS, NO_EFFECT = "helps", "hurts", "no measurable effect"
NO_INTERVAL = "no interval (fewer than 2 repeats)"


@dataclass(frozen=True)
class Interval:
    """A ratio with its bootstrap confidence interval: ``estimate`` (ratio of medians), ``low``, ``high``
    (dimensionless factors, ``low <= estimate <= high`` in practice), the confidence level and how many
    repeats each side had."""

    estimate: float
    low: float
    high: float
    confidence: float
    n: int  # repeats of the configuration
    n_reference: int  # repeats of the reference

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the estimate (0.05 = ±5 %)."""
        return (self.high - self.low) / 2 / self.estimate


def _clean(values: Sequence[float], what: str) -> np.ndarray:
    arr = np.asarray([float(v) for v in values], dtype=np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr <= 0)):
        raise ValueError(f"{what} must be positive finite samples/s, got {list(values)}")
    return arr


def rng_for(seed: int, name: str, reference: str) -> np.random.Generator:
    """The generator of one comparison: seeded by ``seed`` and a stable hash (CRC-32) of both names."""
    return np.random.default_rng([seed, zlib.crc32(f"{name}\0{reference}".encode())])


def ratio_interval(values: Sequence[float], reference: Sequence[float], *, name: str = "", reference_name: str = "",
                   seed: int = SEED, resamples: int = RESAMPLES, confidence: float = CONFIDENCE) -> Interval | None:
    """Bootstrap percentile interval of ``median(values) / median(reference)`` (see the module docstring).

    Args:
        values: the configuration's samples/s, one per repeat (any positive unit; the ratio has none).
        reference: the reference's samples/s, one per repeat.
        name, reference_name: the two configurations' names; with ``seed`` they seed the generator.
        seed: base seed (the report's ``--seed``); the same inputs and seed give the same interval.
        resamples: bootstrap resamples (10,000 by default: percentiles stable to ~0.5 % of the width).
        confidence: two-sided level, 0.95 by default.

    Returns:
        The ``Interval``, or None when either side has fewer than 2 repeats (no interval exists).

    Raises:
        ValueError: a sample that is not a positive finite number, ``resamples < 100`` or
            ``confidence`` outside (0, 1).
    """
    if resamples < 100:
        raise ValueError(f"resamples={resamples}: use at least 100 (10,000 by default)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1), e.g. 0.95")
    a, b = _clean(values, "values"), _clean(reference, "reference")
    if a.size < 2 or b.size < 2:
        return None
    rng = rng_for(seed, name, reference_name)
    med_a = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    med_b = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(med_a / med_b, [tail, 100 - tail])
    estimate = float(np.median(a) / np.median(b))
    # a percentile of a discrete distribution can sit a rounding error away from the estimate
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), confidence, int(a.size),
                    int(b.size))


def simultaneous_confidence(m: int, family: float = CONFIDENCE) -> float:
    """The level at which each of ``m`` intervals is computed so that all of them hold together with
    probability >= ``family`` (Bonferroni; Dunn 1961, "Multiple comparisons among means", JASA 56).

    An ablation declares a verdict for every technique at once: with ``m`` = 22 intervals at 95 % each
    and no real effect anywhere, about one of them would exclude 1 by chance, and an independent second
    sweep would not reproduce that verdict. At 1 - 0.05/22 = 99.77 % each, the chance of any false
    verdict in the sweep is at most 5 %. ``m`` <= 1 gives ``family`` itself.

    Raises:
        ValueError: ``family`` outside (0, 1).
    """
    if not 0 < family < 1:
        raise ValueError(f"family={family} must lie in (0, 1), e.g. 0.95")
    return 1 - (1 - family) / max(int(m), 1)


def verdict(interval: Interval | None, *, above: str = HELPS, below: str = HURTS) -> str:
    """What an interval of an effect (a factor, >1 = faster with the technique) lets one say.

    ``above`` when the whole interval lies above 1, ``below`` when it lies below 1, ``"no measurable
    effect"`` when it contains 1 (boundaries included), and ``NO_INTERVAL`` without one.
    """
    if interval is None:
        return NO_INTERVAL
    if interval.low > 1:
        return above
    if interval.high < 1:
        return below
    return NO_EFFECT


