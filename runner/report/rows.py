"""An ablation sweep's rows: one per configuration, compared with its reference, with a verdict and a rank.

Speed-up = a configuration against the baseline; *effect* = what the row's technique buys, as a factor (>1: faster
with it; docs/ablation.md, "Speed-ups, intervals and verdicts"). ``build_rows`` fills the point figures; the
intervals, verdicts and ranks come from the interleaved record (runner/report/paired.py ``apply_to_rows``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from runner.compare.stats import NO_INTERVAL
from runner.report.load import Job, ReportError, Row, kind_of, technique_of, technique_status


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def point_figures(row: Row, baseline: Row, fast: Row | None) -> None:
    """Fill ``row``'s point speed-up and effect (ratios of medians, dimensionless) and a verdict without an
    interval: ``"reference"`` (the baseline), ``NO_INTERVAL`` or ``"no fast reference"`` (a leave-one-out row of
    a sweep whose fast preset did not measure); ``runner.report.paired.apply_to_rows`` replaces them with the
    paired figures where the sweep was interleaved."""
    row.speedup = row.median / baseline.median
    if row.kind == "baseline":
        row.effect, row.verdict = 1.0, "reference"
    elif row.kind == "leave-one-out":
        if fast is None or not fast.runs:
            row.verdict = "no fast reference"
            return
        row.effect, row.verdict = fast.median / row.median, NO_INTERVAL
    else:
        row.effect, row.verdict = row.speedup, NO_INTERVAL


def build_rows(jobs: list[Job]) -> list[Row]:
    """Group jobs by configuration, fill each row's figures and point speed-up (``point_figures``), sort them.

    Rows are sorted by speed-up (fastest first; rows without figures last); ranks come with the intervals
    (``runner.report.paired.apply_to_rows``). Figures: step time in ms, peak memory in MiB (and its change in %
    of the baseline's), setup and wall time in s, medians over the measured processes.

    Raises:
        ReportError: no baseline, or a baseline without a measured process.
    """
    rows: dict[str, Row] = {}
    for job in jobs:
        row = rows.setdefault(
            job.variant,
            Row(
                job.variant, job.kind or kind_of(job.variant), job.technique if job.kind else technique_of(job.variant)
            ),
        )
        row.jobs.append(job)
        if job.samples_per_sec:
            row.runs.append(job.samples_per_sec)
    if "baseline" not in rows:
        raise ReportError(
            f"no baseline among the configurations {sorted(rows)}; every speed-up is measured "
            f"against it: include `baseline` in ablation/variant=..."
        )
    baseline = rows["baseline"]
    if not baseline.runs:
        raise ReportError(f"the baseline has no measured process ({_job_problems(baseline)}); run it again")
    fast = rows.get("fast")
    techniques = {name: _techniques(row) for name, row in rows.items()}
    base_peak = _median([(j.summary or {}).get("peak_memory_mb") for j in baseline.jobs])
    for row in rows.values():
        summaries = [j.summary for j in row.jobs if j.summary and j.summary.get("samples_per_sec")]
        row.figures = {
            "step_time_ms_median": _median([s.get("step_time_ms_median") for s in summaries]),
            "data_wait_fraction": _median([s.get("data_wait_fraction") for s in summaries]),
            "peak_memory_mb": _median([s.get("peak_memory_mb") for s in summaries]),
            "final_loss": _median(
                [s.get("eval_loss") if s.get("eval_loss") is not None else s.get("train_loss") for s in summaries]
            ),
            "train_loss": _median([s.get("train_loss") for s in summaries]),
            "batch_size": _median([s.get("global_batch_size") for s in summaries]),
            "setup_s": _median([j.times.get("setup_s") for j in row.jobs if j.summary]),
            "wall_s": _median([j.times.get("wall_s") for j in row.jobs if j.summary]),
        }
        if row.figures["peak_memory_mb"] is not None and base_peak:
            row.peak_change_pct = 100 * (row.figures["peak_memory_mb"] - base_peak) / base_peak
        row.status, row.all_skipped = technique_status(
            row.kind, techniques[row.configuration], techniques["baseline"], techniques.get("fast")
        )
    for row in rows.values():
        if not row.runs:
            row.verdict, row.status = _job_problems(row), ""
            continue
        point_figures(row, baseline, fast)
        if row.all_skipped:
            row.verdict = "skipped here"
    return sorted(rows.values(), key=lambda r: (r.speedup is None, -(r.speedup or 0), r.configuration))


def _techniques(row: Row) -> dict[str, str]:
    for job in row.jobs:
        if job.summary:
            return dict(job.summary.get("techniques") or {})
    return {}


def _job_problems(row: Row) -> str:
    """Why a configuration has no figures: its jobs' not-run reasons, exit statuses or folders, joined."""
    reasons = sorted(
        {
            f"not run: {j.not_run}"
            if j.not_run
            else f"failed (exit status {j.failed}), see {j.folder}/"
            if j.failed is not None
            else f"no figures in {j.folder}/"
            for j in row.jobs
            if not j.samples_per_sec
        }
    )
    return "; ".join(reasons)
