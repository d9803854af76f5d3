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
from runner.report.load import Job, ReportError, Row, is_ablation, load_jobs
from runner.report.markdown import agreement, markdown
from runner.report.rows import build_rows
from runner.report.sweep import sweep_command
from runner.report.write import CSV_COLUMNS, JOB_COLUMNS, write_report

__all__ = [
    "CSV_COLUMNS",
    "HELPS",
    "HURTS",
    "JOB_COLUMNS",
    "NO_EFFECT",
    "NO_INTERVAL",
    "Interval",
    "Job",
    "ReportError",
    "Row",
    "agreement",
    "build_rows",
    "build_variants",
    "is_ablation",
    "is_convergence",
    "load_jobs",
    "markdown",
    "sweep_command",
    "write_convergence_report",
    "write_report",
]
