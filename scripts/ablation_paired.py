"""What a paired-by-round interval would say about ablation sweeps: an exploration the report did NOT adopt.

    python scripts/ablation_paired.py outputs/ablation/cpu-A outputs/ablation/cpu-B ...

An ablation's repeat is its outer loop, so every round runs each configuration once, and a slow round
(another tenant on the host) slows all of them. The report (runner/report/) resamples each
configuration's repeats independently, so such a round widens every interval. Pairing instead divides
each configuration's samples/s by its reference's *in the same round* and bootstraps the median of those
per-round ratios, at the same simultaneous (Bonferroni) level as the report.

This prints, for every configuration, the paired effect, its interval and verdict next to the report's
unpaired verdict, one column per sweep. On resnet18/CIFAR-10 on a 2-core CPU (sweeps A-D, 4-5 rounds
each) the paired intervals are far too narrow: the median of n ratios resampled n at a time can only take
the n values, so with 4-5 rounds the interval is about their range, and it calls the same technique
"helps" in one sweep and "hurts" in another (docs/ablation-cpu-16steps.md). Percentile-bootstrap
intervals of a median need many more rounds than an ablation can afford.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from runner.report import build_rows, load_jobs, stats


def paired_interval(values: dict[int, float], reference: dict[int, float], confidence: float, name: str,
                    reference_name: str) -> stats.Interval | None:
    """Bootstrap percentile interval (Efron & Tibshirani 1993, ch. 13) of the median of
    ``values[r] / reference[r]`` over the rounds ``r`` both measured.

    Args:
        values, reference: samples/s by round (repeat index), each a positive float.
        confidence: two-sided level of each interval, e.g. the report's simultaneous level.
        name, reference_name: seed the generator, as in ``runner.report.stats.ratio_interval``.

    Returns:
        The ``runner.report.stats.Interval`` of the factor (dimensionless), or None with fewer than 2 shared rounds.
    """
    rounds = sorted(set(values) & set(reference))
    ratios = np.array([values[r] / reference[r] for r in rounds])
    if ratios.size < 2:
        return None
    rng = stats.rng_for(stats.SEED, name, reference_name)
    medians = np.median(ratios[rng.integers(0, ratios.size, (stats.RESAMPLES, ratios.size))], axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(medians, [tail, 100 - tail])
    estimate = float(np.median(ratios))
    return stats.Interval(estimate, min(float(low), estimate), max(float(high), estimate), confidence,
                          int(ratios.size), int(ratios.size))


def paired_verdicts(sweep: Path) -> dict[str, tuple[stats.Interval | None, str, str]]:
    """{configuration: (paired interval, paired verdict, the report's verdict)} of one ablation sweep."""
    jobs = load_jobs(sweep)
    rows = build_rows(jobs)
    by_round: dict[str, dict[int, float]] = {}
    for job in jobs:
        if job.samples_per_sec:
            by_round.setdefault(job.variant, {})[job.repeat] = job.samples_per_sec
    # the report's own simultaneous level, read back from its intervals rather than recounted here
    level = next((r.effect_ci.confidence for r in rows if r.effect_ci), stats.CONFIDENCE)
    out = {}
    for row in rows:
        if row.kind == "baseline" or not row.runs or row.all_skipped or "fast" not in by_round:
            continue
        if row.kind == "leave-one-out":  # the effect is fast / this
            ci = paired_interval(by_round["fast"], by_round[row.configuration], level, "fast", row.configuration)
        else:
            ci = paired_interval(by_round[row.configuration], by_round["baseline"], level, row.configuration,
                                 "baseline")
        out[row.configuration] = (ci, stats.verdict(ci), row.verdict)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    sweeps = {Path(s).name: paired_verdicts(Path(s)) for s in argv}
    print("| configuration | " + " | ".join(f"{name}: paired effect [CI] verdict (report's verdict)"
                                           for name in sweeps) + " |")
    print("|---|" + "---|" * len(sweeps))
    for config in next(iter(sweeps.values())):
        cells = []
        for found in sweeps.values():
            ci, paired, unpaired = found.get(config, (None, "not run", "not run"))
            cells.append(f"{ci.estimate:.2f} [{ci.low:.2f}–{ci.high:.2f}] {paired} ({unpaired})" if ci else paired)
        print(f"| {config} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
