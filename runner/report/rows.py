"""An ablation sweep's rows: one per configuration, compared with its reference, with a verdict and a rank.

Figures (units in the names): ``samples_per_sec`` is samples of the measured steps / their wall time
(warm-up steps excluded, runner/measure.py). Speed-up = a configuration's median samples/s / the
baseline's median. *Effect* = what the row's technique buys, as a factor (>1: faster with it): the
configuration ÷ the baseline when it is switched on alone (leave-one-in), the fast preset ÷ the
configuration when it is switched off in the fast preset (leave-one-out). Each ratio of medians gets a
bootstrap percentile interval (runner/report/stats.py; Efron & Tibshirani 1993): the repeats of both
configurations are resampled with replacement 10,000 times, seeded, so the same sweep gives the same
report. The intervals are simultaneous over the sweep's verdicts (Bonferroni; ``build_rows``). The
verdict follows from the effect's interval: "helps" (above 1), "hurts" (below 1), "no measurable effect"
(contains 1); with one repeat there is no interval and no verdict. Only configurations whose speed-up
interval lies above 1 get a rank.

``pending`` names the configurations whose interval is still too wide: the ablation launcher
(runner/ablation.py, ``ablation.repeats=auto``) runs another round of them.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from runner.report import stats
from runner.report.load import Job, ReportError, Row, kind_of, technique_of, technique_status
from runner.report.stats import Interval


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def compare_rows(row: Row, baseline: Row, fast: Row | None, seed: int = stats.SEED,
                 resamples: int = stats.RESAMPLES, confidence: float = stats.CONFIDENCE) -> None:
    """Fill ``row``'s speed-up, effect (dimensionless factors), their bootstrap intervals (each at
    ``confidence``; ``stats.ratio_interval``, Efron & Tibshirani 1993) and its verdict (the rule of the
    module docstring).

    Verdicts: ``"reference"`` (the baseline); ``"faster"``/``"slower"``/``"no measurable effect"`` (the
    fast preset against the baseline); ``"helps"``/``"hurts"``/``"no measurable effect"`` (the technique
    of a leave-one-in or leave-one-out row); ``NO_INTERVAL`` with fewer than 2 repeats on a side; ``"no
    fast reference"`` for a leave-one-out row of a sweep whose fast preset did not measure.

    Raises:
        ValueError: from ``stats.ratio_interval`` (a sample that is not positive and finite, too few
            resamples, a confidence outside (0, 1)).
    """
    def interval(a: Row, b: Row) -> Interval | None:
        return stats.ratio_interval(a.runs, b.runs, name=a.configuration, reference_name=b.configuration,
                                    seed=seed, resamples=resamples, confidence=confidence)

    row.speedup = row.median / baseline.median
    row.speedup_ci = interval(row, baseline)
    if row.kind == "baseline":
        row.effect, row.verdict = 1.0, "reference"
    elif row.kind == "leave-one-out":
        if fast is None or not fast.runs:
            row.verdict = "no fast reference"
            return
        row.effect, row.effect_ci = fast.median / row.median, interval(fast, row)
        row.verdict = stats.verdict(row.effect_ci)
    else:
        row.effect, row.effect_ci = row.speedup, row.speedup_ci
        row.verdict = stats.verdict(row.effect_ci, **({"above": "faster", "below": "slower"}
                                                        if row.kind == "fast" else {}))


def build_rows(jobs: list[Job], seed: int = stats.SEED, resamples: int = stats.RESAMPLES) -> list[Row]:
    """Group jobs by configuration, compare each with its reference (``compare_rows``), rank them.

    The intervals are simultaneous: with ``m`` configurations that give a verdict (measured, not the
    baseline, not skipped here; ``count_verdicts``), each is computed at ``stats.simultaneous_confidence(m)``
    (Bonferroni), so that all the sweep's verdicts hold together at 95 %. Rows are sorted by speed-up
    (fastest first; rows without figures last). A rank goes to the configurations whose speed-up interval
    lies above 1 (measurably faster than the baseline), except the baseline and rows whose every technique
    was skipped here. Figures: step time in ms, peak memory in MiB (and its change in % of the baseline's),
    setup and wall time in s, medians over the measured repeats.

    Raises:
        ReportError: no baseline, or a baseline without a measured repeat.
    """
    rows: dict[str, Row] = {}
    for job in jobs:
        row = rows.setdefault(job.variant, Row(job.variant, job.kind or kind_of(job.variant),
                                               job.technique if job.kind else technique_of(job.variant)))
        row.jobs.append(job)
        if job.samples_per_sec:
            row.runs.append(job.samples_per_sec)
    if "baseline" not in rows:
        raise ReportError(f"no baseline among the configurations {sorted(rows)}; every speed-up is measured "
                          f"against it: include `baseline` in ablation/variant=...")
    baseline = rows["baseline"]
    if not baseline.runs:
        raise ReportError(f"the baseline has no measured repeat ({_job_problems(baseline)}); run it again")
    fast = rows.get("fast")
    techniques = {name: _techniques(row) for name, row in rows.items()}
    base_peak = _median([(j.summary or {}).get("peak_memory_mb") for j in baseline.jobs])
    for row in rows.values():
        summaries = [j.summary for j in row.jobs if j.summary and j.summary.get("samples_per_sec")]
        row.figures = {
            "step_time_ms_median": _median([s.get("step_time_ms_median") for s in summaries]),
            "data_wait_fraction": _median([s.get("data_wait_fraction") for s in summaries]),
            "peak_memory_mb": _median([s.get("peak_memory_mb") for s in summaries]),
            "final_loss": _median([s.get("eval_loss") if s.get("eval_loss") is not None else s.get("train_loss")
                                   for s in summaries]),
            "train_loss": _median([s.get("train_loss") for s in summaries]),
            "batch_size": _median([s.get("global_batch_size") for s in summaries]),
            "setup_s": _median([j.times.get("setup_s") for j in row.jobs if j.summary]),
            "wall_s": _median([j.times.get("wall_s") for j in row.jobs if j.summary]),
        }
        if row.figures["peak_memory_mb"] is not None and base_peak:
            row.peak_change_pct = 100 * (row.figures["peak_memory_mb"] - base_peak) / base_peak
        row.status, row.all_skipped = technique_status(row.kind, techniques[row.configuration],
                                                       techniques["baseline"], techniques.get("fast"))
    confidence = stats.simultaneous_confidence(count_verdicts(rows.values()))
    for row in rows.values():
        if not row.runs:
            row.verdict, row.status = _job_problems(row), ""
            continue
        compare_rows(row, baseline, fast, seed, resamples, confidence)
        if row.all_skipped:
            row.verdict = "skipped here"
    ordered = sorted(rows.values(), key=lambda r: (r.speedup is None, -(r.speedup or 0), r.configuration))
    rank = 0
    for row in ordered:
        if row.speedup_ci and row.speedup_ci.low > 1 and not row.all_skipped and row.kind != "baseline":
            rank += 1
            row.rank = rank
    return ordered


def count_verdicts(rows: Iterable[Row]) -> int:
    """How many verdicts a sweep declares at once (the ``m`` of its simultaneous intervals, Bonferroni):
    measured configurations other than the baseline whose techniques were not all skipped here."""
    return sum(1 for r in rows if r.runs and r.kind != "baseline" and not r.all_skipped)


def pending(rows: list[Row], target_ci: float) -> list[str]:
    """The configurations whose effect is not yet known to ``target_ci`` (relative half-width of the
    interval, e.g. 0.05): measured rows (baseline excluded) without an interval or with a wider one. Rows
    that did not measure at all (not run, failed) are not pending: more repeats would not help them; nor
    are rows whose every technique was skipped here (no finding to sharpen)."""
    out = []
    for r in rows:
        if r.kind == "baseline" or not r.runs or r.all_skipped or r.verdict == "no fast reference":
            continue
        if r.effect_ci is None or r.effect_ci.half_width >= target_ci:
            out.append(r.configuration)
    return out


def _techniques(row: Row) -> dict[str, str]:
    for job in row.jobs:
        if job.summary:
            return dict(job.summary.get("techniques") or {})
    return {}


def _job_problems(row: Row) -> str:
    """Why a configuration has no figures: its jobs' not-run reasons, exit statuses or folders, joined."""
    reasons = sorted({f"not run: {j.not_run}" if j.not_run else f"failed (exit status {j.failed}), see {j.folder}/"
                      if j.failed is not None else f"no figures in {j.folder}/" for j in row.jobs
                      if not j.samples_per_sec})
    return "; ".join(reasons)
