"""The report of a sweep: ``python -m runner.report <multirun folder> [--doc PATH [--replication SWEEP2]]``.

An ablation sweep (``+experiment=ablation``) gets the ablation report (docs/ablation.md), a convergence sweep
(``+experiment=convergence``) its report of time to target over seeds, and any other multirun one row per job
(docs/configuration.md, "Sweeps").

Its modules: docs/design.md ("The layers", "Where each concern lives"). This package reads what runner/compare/
measured and never imports a tool (runner/sweeps/ablation.py imports it).
"""

from __future__ import annotations

from runner.compare.stats import HELPS, HURTS, NO_EFFECT, NO_INTERVAL, Interval
from runner.report.convergence import build_variants, is_convergence
from runner.report.convergence_text import write_convergence_report
from runner.report.load import Job, ReportError, Row, is_ablation, load_jobs, load_record, technique_status
from runner.report.markdown import FIRM, agreement, markdown, reading
from runner.report.rows import build_rows, point_figures
from runner.report.sweep import (
    PLAIN_COLUMNS,
    SweepError,
    budget_lines,
    job_times,
    load_sweep,
    sweep_command,
    swept_keys,
    write_plain_report,
)
from runner.report.write import CSV_COLUMNS, JOB_COLUMNS, write_report

__all__ = [
    "CSV_COLUMNS",
    "FIRM",
    "HELPS",
    "HURTS",
    "JOB_COLUMNS",
    "NO_EFFECT",
    "NO_INTERVAL",
    "PLAIN_COLUMNS",
    "Interval",
    "Job",
    "ReportError",
    "Row",
    "SweepError",
    "agreement",
    "budget_lines",
    "build_rows",
    "build_variants",
    "is_ablation",
    "is_convergence",
    "job_times",
    "load_jobs",
    "load_record",
    "load_sweep",
    "markdown",
    "point_figures",
    "reading",
    "sweep_command",
    "swept_keys",
    "technique_status",
    "write_convergence_report",
    "write_plain_report",
    "write_report",
]
