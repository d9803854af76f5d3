"""The report of a sweep: ``python -m runner.report <multirun folder> [--doc PATH [--replication SWEEP2]]``.

An ablation sweep (``python -m runner -m +experiment=ablation``) gets the ablation report: one row per
configuration with its speed-up over the baseline, what its technique buys, simultaneous 95 % bootstrap
intervals (Efron & Tibshirani 1993; Bonferroni) and a verdict. Any other multirun gets one row per job.

Where each concern lives:

- ``load``: the sweep folder's jobs (``Job``, ``load_jobs``, ``is_ablation``), the per-configuration
  ``Row``, what each configuration switched (``technique_status``) and the sweep's record (``load_record``);
- ``rows``: comparing each row with its reference, verdicts, ranks (``build_rows``, ``compare_rows``) and
  which configurations need another round of ``ablation.repeats=auto`` (``pending``);
- ``stats``: the bootstrap interval of a ratio of medians, the Bonferroni level and the verdict rule;
- ``write``: report.md/report.csv/jobs.csv/speedup.png, the ``--doc`` document and the W&B table
  (``write_report``); ``markdown``: the report's text, the reading and the agreement table;
- ``sweep``: the plain-sweep report (``write_plain_report``), where a sweep's time went (``job_times``,
  ``budget_lines``) and the multirun's command (``sweep_command``);
- ``__main__``: the command line.

This package never imports the ablation launcher (runner/ablation.py imports it).
"""

from __future__ import annotations

from runner.report import stats
from runner.report.load import Job, ReportError, Row, is_ablation, load_jobs, load_record, technique_status
from runner.report.markdown import FIRM, agreement, markdown, reading
from runner.report.rows import build_rows, compare_rows, count_verdicts, pending
from runner.report.stats import HELPS, HURTS, NO_EFFECT, NO_INTERVAL, Interval
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

__all__ = ["CSV_COLUMNS", "FIRM", "HELPS", "HURTS", "JOB_COLUMNS", "NO_EFFECT", "NO_INTERVAL", "PLAIN_COLUMNS",
           "Interval", "Job", "ReportError", "Row", "SweepError", "agreement", "budget_lines", "build_rows",
           "compare_rows", "count_verdicts", "is_ablation", "job_times", "load_jobs", "load_record", "load_sweep",
           "markdown", "pending", "reading", "stats", "sweep_command", "swept_keys", "technique_status",
           "write_plain_report", "write_report"]
