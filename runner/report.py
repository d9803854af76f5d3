"""``python -m runner.report <multirun folder>``: the report of a sweep.

An **ablation** sweep (``python -m runner -m +experiment=ablation``; one ``summary.json`` per job,
``not_run.json``/``failed.json`` for jobs that did not measure, ``ablation.json`` for the machine and
command) gets the ablation report, written into the sweep folder:

- ``report.md`` and ``report.csv``: one row per configuration, ranked by speed-up: median samples/s,
  speed-up over the baseline with its simultaneous 95 % bootstrap confidence interval, what the technique buys
  (its *effect*, with its interval) and the verdict that follows, step time, data-wait fraction, peak
  memory and its change, the final loss, the fixed cost per job, and what was applied or skipped;
- ``jobs.csv``: one row per job: samples/s and where its wall time went (``setup_s`` before the first
  step, training, measured steps, evaluation);
- ``speedup.png``: horizontal bars of the speed-ups with their confidence intervals (matplotlib, Agg);
- a W&B table of the rows (and the plot) when the jobs logged to W&B (offline without an API key).

Any other multirun folder (``python -m runner -m dataloader.batch_size=64,128 optimizer.lr=0.05,0.1``)
gets one row per job, sorted by samples/s, with a plot over the swept keys (runner/sweep_report.py).

Figures (units in the names): ``samples_per_sec`` is samples of the measured steps / their wall time
(warm-up steps excluded, runner/measure.py). Speed-up = a configuration's median samples/s / the
baseline's median. *Effect* = what the row's technique buys, as a factor (>1: faster with it): the
configuration ÷ the baseline when it is switched on alone (leave-one-in), the fast preset ÷ the
configuration when it is switched off in the fast preset (leave-one-out). Each ratio of medians gets a
bootstrap percentile interval (runner/stats.py; Efron & Tibshirani 1993): the repeats of both
configurations are resampled with replacement 10,000 times, seeded, so the same sweep gives the same
report. The verdict follows from the effect's interval: "helps" (above 1), "hurts" (below 1), "no
measurable effect" (contains 1); with one repeat there is no interval and no verdict. Only
configurations whose speed-up interval lies above 1 get a rank.

``--doc docs/ablation-cpu.md`` also writes the report as a document (plot copied next to it) with a
generated reading of what helped and what hurt, to be completed with the why.

Bad input (no such folder, no summaries, no baseline, a corrupt summary) raises ``ReportError``; the
command prints ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from runner import stats
from runner.stats import HELPS, HURTS, NO_EFFECT, NO_INTERVAL, Interval
from runner.sweep_report import SweepError, budget_lines, job_times, sweep_command, write_plain_report

#: Columns of report.csv and of the W&B table, in order. Intervals are simultaneous 95 % bootstrap percentile
#: intervals; ``effect_ci_half_width`` is relative (0.05 = ±5 %).
CSV_COLUMNS = [
    "rank", "configuration", "kind", "technique", "repeats", "batch_size", "samples_per_sec_median",
    "samples_per_sec_min", "samples_per_sec_max", "speedup", "speedup_ci_low", "speedup_ci_high",
    "technique_effect", "effect_ci_low", "effect_ci_high", "effect_ci_half_width", "verdict",
    "step_time_ms_median", "data_wait_fraction", "peak_memory_mb", "peak_memory_change_pct", "final_loss",
    "train_loss", "setup_s_median", "job_wall_s_median", "techniques",
]
#: Columns of jobs.csv (one row per job; times in s).
JOB_COLUMNS = ["configuration", "repeat", "folder", "status", "samples_per_sec", "wall_s", "setup_s", "train_s",
               "measured_s", "eval_s", "teardown_s"]
__all__ = ["CSV_COLUMNS", "HELPS", "HURTS", "NO_EFFECT", "Job", "ReportError", "Row", "build_rows", "load_jobs",
           "main", "write_report"]


class ReportError(ValueError):
    """A sweep folder the report cannot be made from; the message names the folder and the fix."""


@dataclass
class Job:
    """One job of the sweep: its configuration, repeat index and summary (None if it did not measure)."""

    variant: str
    repeat: int
    folder: Path  # relative to the sweep folder, e.g. baseline+amp/r0
    kind: str | None = None
    technique: str | None = None
    summary: dict[str, Any] | None = None
    not_run: str | None = None  # the reason, from not_run.json
    failed: int | None = None  # the exit status, from failed.json
    times: dict[str, float | None] = field(default_factory=dict)  # sweep_report.job_times

    @property
    def samples_per_sec(self) -> float | None:
        sps = (self.summary or {}).get("samples_per_sec")
        return float(sps) if sps else None


@dataclass
class Row:
    """One configuration: its jobs' figures (medians over repeats) and how it compares."""

    configuration: str
    kind: str | None
    technique: str | None
    jobs: list[Job] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)  # samples/s of each measured repeat
    speedup: float | None = None  # median / the baseline's median
    speedup_ci: Interval | None = None  # of the speed-up, against the baseline's repeats
    effect: float | None = None  # what the technique buys: x >1 helps (see the module docstring)
    effect_ci: Interval | None = None  # of the effect, against the reference's repeats
    verdict: str = ""
    rank: int | None = None
    status: str = ""  # applied/skipped of the techniques this row switches
    all_skipped: bool = False
    figures: dict[str, float | None] = field(default_factory=dict)
    peak_change_pct: float | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None


# ------------------------------------------------------------------------------------------- loading
def is_ablation(sweep: Path) -> bool:
    """Whether ``sweep`` is an ablation sweep: it has ``ablation.json``, a job marker, or a summary of a
    job with ``config.ablation.variant``."""
    if (sweep / "ablation.json").is_file() or any(sweep.rglob("not_run.json")) or any(sweep.rglob("failed.json")):
        return True
    for path in sweep.rglob("summary.json"):
        try:
            return ((json.loads(path.read_text()).get("config") or {}).get("ablation") or {}).get("variant") is not None
        except (OSError, json.JSONDecodeError):
            continue
    return False


def load_jobs(sweep: Path) -> list[Job]:
    """Every job under ``sweep``: ``summary.json`` (measured), ``not_run.json``, ``failed.json``, each with
    its timing (``sweep_report.job_times``).

    Raises:
        ReportError: no such folder, nothing to report, a corrupt file, a summary that is not from an
            ablation job, or the same (configuration, repeat) twice (two sweeps in one folder).
    """
    if not sweep.is_dir():
        raise ReportError(f"{sweep} is not a folder; pass the sweep folder of `python -m runner -m "
                          f"+experiment=ablation` (outputs/ablation/<date>/<time>)")
    jobs: dict[tuple[str, int], Job] = {}
    for name in ("summary.json", "not_run.json", "failed.json"):
        for path in sorted(sweep.rglob(name)):
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ReportError(f"{path} cannot be read ({e}); delete that job folder or run it again") from e
            if name == "summary.json":
                ablation = (data.get("config") or {}).get("ablation") or {}
                variant, repeat = ablation.get("variant"), ablation.get("repeat", 0)
                if variant is None:
                    raise ReportError(f"{path} is not from an ablation job (no config.ablation.variant); the report "
                                      f"reads sweeps of `python -m runner -m +experiment=ablation`")
                job = Job(variant, int(repeat), path.parent.relative_to(sweep), ablation.get("kind"),
                          ablation.get("technique"), data)
            else:
                variant, repeat = data.get("variant"), int(data.get("repeat", 0))
                if variant is None:
                    raise ReportError(f"{path} names no variant; delete that job folder or run it again")
                if (variant, repeat) in jobs:  # a summary wins over a marker of the same job
                    continue
                job = Job(variant, repeat, path.parent.relative_to(sweep), _kind_of(variant), _technique_of(variant))
                job.not_run = data.get("reason") if name == "not_run.json" else None
                job.failed = data.get("returncode") if name == "failed.json" else None
            key = (variant, repeat)
            if key in jobs and name == "summary.json":
                raise ReportError(f"{variant} repeat {repeat} appears twice ({sweep / jobs[key].folder} and "
                                  f"{path.parent}); "
                                  f"pass one sweep folder, not a folder holding several sweeps")
            job.times = job_times(path.parent, job.summary)
            jobs[key] = job
    if not jobs:
        raise ReportError(f"{sweep} holds no summary.json; is it the sweep folder of `python -m runner -m "
                          f"+experiment=ablation` (outputs/ablation/<date>/<time>), and did its jobs finish?")
    return sorted(jobs.values(), key=lambda j: (j.repeat, j.variant))


def _kind_of(variant: str) -> str:
    if variant in ("baseline", "fast"):
        return variant
    return "leave-one-in" if variant.startswith("baseline+") else "leave-one-out"


def _technique_of(variant: str) -> str | None:
    for prefix in ("baseline+", "fast-"):
        if variant.startswith(prefix):
            return variant[len(prefix):]
    return None


def technique_status(kind: str | None, own: dict[str, str], baseline: dict[str, str],
                     fast: dict[str, str] | None) -> tuple[str, bool]:
    """``(text, all_skipped)``: what this configuration switched, from summary.json ``techniques``.

    leave-one-in: the entries that differ from the baseline's; leave-one-out: the fast preset's entries
    this configuration lacks or changes; baseline/fast: all of its own. ``all_skipped`` is True when
    every switched entry was skipped (the technique cannot act here), so the row is not a finding.
    """
    if kind == "leave-one-in":
        changed = {k: v for k, v in own.items() if baseline.get(k) != v}
    elif kind == "leave-one-out":
        changed = {k: v for k, v in (fast or {}).items() if own.get(k) != v}
    else:
        applied = [k for k, v in own.items() if v == "applied"]
        skipped = [k for k, v in own.items() if v != "applied"]
        text = "; ".join(p for p in ("applied: " + ", ".join(applied) if applied else "",
                                     "skipped: " + ", ".join(skipped) if skipped else "") if p)
        return text or "none", False
    if not changed:
        return "no status recorded", False
    return "; ".join(f"{k}: {v}" for k, v in changed.items()), all(v.startswith("skipped") for v in changed.values())


# ------------------------------------------------------------------------------------------- the rows
def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def compare_rows(row: Row, baseline: Row, fast: Row | None, seed: int = stats.SEED,
                 resamples: int = stats.RESAMPLES, confidence: float = stats.CONFIDENCE) -> None:
    """Fill ``row``'s speed-up, effect, their intervals (each at ``confidence``) and its verdict (the rule
    of the module docstring).

    Verdicts: ``"reference"`` (the baseline); ``"faster"``/``"slower"``/``"no measurable effect"`` (the
    fast preset against the baseline); ``"helps"``/``"hurts"``/``"no measurable effect"`` (the technique
    of a leave-one-in or leave-one-out row); ``NO_INTERVAL`` with fewer than 2 repeats on a side; ``"no
    fast reference"`` for a leave-one-out row of a sweep whose fast preset did not measure.
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
    baseline, not skipped here), each is computed at ``stats.simultaneous_confidence(m)``, so that all
    the sweep's verdicts hold together at 95 %. Rows are sorted by speed-up (fastest first; rows without
    figures last). A rank goes to the configurations whose speed-up interval lies above 1 (measurably
    faster than the baseline), except the baseline and rows whose every technique was skipped here.

    Raises:
        ReportError: no baseline, or a baseline without a measured repeat.
    """
    rows: dict[str, Row] = {}
    for job in jobs:
        row = rows.setdefault(job.variant, Row(job.variant, job.kind or _kind_of(job.variant),
                                               job.technique if job.kind else _technique_of(job.variant)))
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
    confidence = stats.simultaneous_confidence(_verdicts(rows.values()))
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


def _verdicts(rows: Iterable[Row]) -> int:
    """How many verdicts a sweep declares at once (the ``m`` of its simultaneous intervals): measured
    configurations other than the baseline whose techniques were not all skipped here."""
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
    reasons = sorted({f"not run: {j.not_run}" if j.not_run else f"failed (exit status {j.failed}), see {j.folder}/"
                      if j.failed is not None else f"no figures in {j.folder}/" for j in row.jobs
                      if not j.samples_per_sec})
    return "; ".join(reasons)


# ------------------------------------------------------------------------------------------- writing
def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _ci_text(ci: Interval | None) -> str:
    return "–" if ci is None else f"{ci.low:.2f}–{ci.high:.2f}"


def csv_rows(rows: list[Row]) -> list[list[Any]]:
    """The rows as plain values, in ``CSV_COLUMNS`` order (for report.csv and the W&B table)."""
    out = []
    for r in rows:
        fig, s, e = r.figures, r.speedup_ci, r.effect_ci
        out.append([
            r.rank, r.configuration, r.kind, r.technique, len(r.runs),
            int(fig["batch_size"]) if fig.get("batch_size") else None,
            r.median, min(r.runs) if r.runs else None, max(r.runs) if r.runs else None,
            r.speedup, s and s.low, s and s.high, r.effect, e and e.low, e and e.high, e and e.half_width,
            r.verdict, fig.get("step_time_ms_median"), fig.get("data_wait_fraction"), fig.get("peak_memory_mb"),
            r.peak_change_pct, fig.get("final_loss"), fig.get("train_loss"), fig.get("setup_s"), fig.get("wall_s"),
            r.status,
        ])
    return out


def _cell(v: Any) -> Any:
    return "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)


def write_csv(rows: list[Row], path: Path) -> None:
    """Write ``rows`` to ``path`` as CSV with the ``CSV_COLUMNS`` header (one row per configuration)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for values in csv_rows(rows):
            writer.writerow([_cell(v) for v in values])


def write_jobs_csv(jobs: list[Job], path: Path) -> None:
    """Write one row per job (``JOB_COLUMNS``): samples/s and where its wall time went (s)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(JOB_COLUMNS)
        for j in jobs:
            status = "ok" if j.samples_per_sec else f"not run: {j.not_run}" if j.not_run else (
                f"failed (exit status {j.failed})" if j.failed is not None else "no figures")
            writer.writerow([_cell(v) for v in [j.variant, j.repeat, str(j.folder), status, j.samples_per_sec,
                                                *(j.times.get(k) for k in JOB_COLUMNS[5:])]])


def plot(rows: list[Row], path: Path) -> None:
    """``speedup.png``: one horizontal bar per measured configuration, from 1.0 (the baseline) to its
    speed-up, a whisker for its simultaneous 95 % bootstrap interval (none with one repeat), and the baseline's
    interval against itself (what noise alone gives) as a grey band. The x axis is logarithmic when the
    speed-ups span more than 8x, so 0.5x and 2x look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.speedup is not None][::-1]  # fastest on top
    colors = {HELPS: "tab:green", "faster": "tab:green", HURTS: "tab:red", "slower": "tab:red",
              "reference": "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(shown) + 1.6))
    y = list(range(len(shown)))
    ax.barh(y, [r.speedup - 1 for r in shown], left=1.0, color=[colors.get(r.verdict, "0.65") for r in shown])
    with_ci = [(i, r) for i, r in zip(y, shown) if r.speedup_ci is not None]
    if with_ci:
        ax.errorbar([r.speedup for _, r in with_ci], [i for i, _ in with_ci], fmt="none", ecolor="black",
                    elinewidth=0.8, capsize=2, xerr=[[r.speedup - r.speedup_ci.low for _, r in with_ci],
                                                     [r.speedup_ci.high - r.speedup for _, r in with_ci]])
    base = next((r for r in shown if r.kind == "baseline"), None)
    if base is not None and base.speedup_ci is not None:
        ax.axvspan(base.speedup_ci.low, base.speedup_ci.high, color="0.85", zorder=0,
                   label="baseline against itself (95 % CI: noise alone)")
        ax.legend(loc="best", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    values = [v for r in shown for v in ((r.speedup_ci.low, r.speedup_ci.high) if r.speedup_ci else (r.speedup,))]
    if max(values + [1.0]) / min(values + [1.0]) > 8:
        from matplotlib.ticker import FormatStrFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.set_yticks(y, [r.configuration for r in shown], fontsize=8)
    ax.set_xlabel("speed-up over the baseline (x, ratio of median samples/s; whiskers: simultaneous 95 % bootstrap CI)")
    ax.set_title("green: helps, red: hurts, grey: no measurable effect, no interval or skipped", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _record(sweep: Path) -> dict[str, Any]:
    """``ablation.json`` (machine, command, times), or what can be rebuilt without it."""
    path = sweep / "ablation.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    record: dict[str, Any] = {}
    multirun = sweep / "multirun.yaml"
    if multirun.is_file():
        from omegaconf import OmegaConf

        record["command"] = sweep_command(OmegaConf.load(multirun).hydra)
    from runner.hardware import describe_machine  # imports torch: only when the record must be rebuilt

    record["machine"] = describe_machine()
    record["machine_note"] = "the machine this report was made on (the sweep folder has no ablation.json)"
    return record


def describe(machine: dict[str, Any]) -> str:
    """One line: CPU (cores), memory, GPUs, native bf16, versions; parts the record lacks are left out."""
    m = machine
    parts = [f"{m['cpu']}, {m.get('cpu_cores', '?')} cores" if m.get("cpu") else None,
             f"{m['memory_gib']} GiB RAM" if m.get("memory_gib") else None,
             ", ".join(m["gpus"]) if m.get("gpus") else "no GPU" if "gpus" in m else None,
             f"CPU native bf16: {'yes' if m['cpu_native_bf16'] else 'no'}" if "cpu_native_bf16" in m else None,
             f"torch {m['torch']}, Python {m.get('python')}" if m.get("torch") else None, m.get("os")]
    return "; ".join(p for p in parts if p) or "(not recorded)"


INTERVAL_TEXT = (
    "How the intervals are computed: a speed-up is a ratio of medians over repeats (this configuration's "
    "median samples/s ÷ its reference's). Its confidence interval is a bootstrap percentile interval "
    "(Efron & Tibshirani 1993, ch. 13): the repeats of both configurations are resampled with replacement, "
    "independently, {resamples:,} times (seed {seed}), the ratio of the resamples' medians is taken each "
    "time, and the interval runs between the percentiles that leave {tail:.3g} % of them out on each side. "
    "The intervals are simultaneous 95 % intervals: the sweep gives {m} verdicts at once, so each interval is "
    "computed at {level:.2%} (Bonferroni, 1 − 0.05/{m}; Dunn 1961), and all of them hold together with "
    "probability at least 95 %; at 95 % each, about one verdict in twenty would be a chance result that an "
    "independent sweep does not reproduce. With 3 repeats an interval is in practice [slowest ÷ fastest "
    "reference repeat, fastest ÷ slowest reference repeat]; more repeats narrow it. "
    "*Effect* = what the technique buys (>1: faster with it): on alone, this ÷ the baseline; off in the "
    "fast preset (leave-one-out), fast ÷ this. Verdict: **helps** when the effect's whole interval lies "
    "above 1, **hurts** when it lies below 1, **no measurable effect** when it contains 1. Only "
    "configurations whose speed-up interval lies above 1 are ranked.")


def _auto_text(record: dict[str, Any]) -> str | None:
    auto = record.get("auto")
    if not auto:
        return None
    rounds = auto.get("rounds") or []
    extra = "; ".join(f"repeat {r['repeat']}: {len(r['variants'])} configuration(s)" for r in rounds) or "none"
    return (f"ablation.repeats=auto: first round {auto.get('first_round')} repeat(s), then further rounds until "
            f"every effect's interval is within ±{auto.get('target_ci', 0):.1%} or {auto.get('max_repeats')} "
            f"repeats; extra rounds: {extra}; stopped: {auto.get('stopped', '?')}")


def markdown(rows: list[Row], jobs: list[Job], sweep: Path, record: dict[str, Any], image: str,
             title: str = "Ablation report: what each technique buys", seed: int = stats.SEED,
             resamples: int = stats.RESAMPLES) -> str:
    """report.md's text (also the body of ``--doc``)."""
    baseline = next(r for r in rows if r.configuration == "baseline")
    measured = [j.summary for j in jobs if j.summary and j.summary.get("samples_per_sec")]
    base_cfg = baseline.jobs[0].summary["config"] if baseline.jobs[0].summary else {}
    steps = sorted({(s.get("warmup_steps"), s.get("measured_steps")) for s in measured}, key=str)
    repeats = sorted({len(r.runs) for r in rows if r.runs})
    machine = record.get("machine") or {}
    lines = [f"# {title}", "", "| | |", "|---|---|"]
    lines.append(f"| command | `{record.get('command', '(not recorded)')}` |")
    lines.append(f"| sweep folder | `{sweep}` |")
    note = f" ({record['machine_note']})" if record.get("machine_note") else ""
    lines.append(f"| machine | {describe(machine)}{note} |")
    load = [machine.get("load_average_1min"), record.get("load_average_1min_at_end")]
    if load[0] is not None:
        lines.append(f"| load average (1 min) | {load[0]} at the start, {load[1] if load[1] is not None else '?'} "
                     f"at the end |")
    if record.get("started"):
        lines.append(f"| ran | {record['started']} to {record.get('finished', '?')} |")
    model, data = base_cfg.get("model", {}), base_cfg.get("data", {})
    stem = " (cifar_stem)" if model.get("cifar_stem") else ""
    first = baseline.jobs[0].summary or {}
    dev = first.get("device_name") if first.get("device") == "cuda" else first.get("device")
    lines.append(f"| job | model `{model.get('_target_')}`{stem}, data `{data.get('name')}`, optimizer "
                 f"`{base_cfg.get('optimizer', {}).get('_target_')}`, baseline batch "
                 f"{_f(baseline.figures.get('batch_size'), '.0f')}, device {dev} |")
    step_text = ", ".join(f"{w} warm-up + {m} measured steps" for w, m in steps)
    process = {"forkserver": "forked from a job server that has imported torch and runner (no torch op run, "
                             "no CUDA context)", "exec": "`python -m runner`"}.get(record.get("job_process"), "")
    lines.append(f"| measurement | {', '.join(map(str, repeats))} repeat(s) per configuration (the repeat is the "
                 f"sweep's outer loop); every job: {step_text}, warm-up excluded from every figure; one fresh "
                 f"process per job{': ' + process if process else ''} |")
    auto = _auto_text(record)
    if auto:
        lines.append(f"| repeats | {auto} |")
    if baseline.speedup_ci is not None:
        lines.append(f"| noise | the baseline against itself: simultaneous 95 % interval {_ci_text(baseline.speedup_ci)} "
                     f"(±{baseline.speedup_ci.half_width:.0%}); baseline repeats {min(baseline.runs):.4g}–"
                     f"{max(baseline.runs):.4g} samples/s |")
    lines.append("")
    if len(steps) > 1:
        lines += [f"**Warning:** the jobs measured different step counts ({step_text}); rerun with one "
                  f"trainer.max_steps / trainer.warmup_steps.", ""]
    cores = machine.get("cpu_cores")
    if load[0] is not None and cores and load[0] > cores / 2:
        lines += [f"**Warning:** the machine was busy when the sweep started (load average {load[0]} on {cores} "
                  f"cores): other processes share the cores, so figures are slower and noisier than on a quiet "
                  f"machine. Rerun when it is quiet for figures to publish.", ""]
    noisy = [j for j in jobs if j.summary and j.summary.get("warnings")]
    if noisy:
        first = noisy[0]
        lines += [f"**Warning:** {len(noisy)} of {len(measured)} measured jobs recorded a busy machine while they "
                  f"measured (summary.json `warnings`; e.g. {first.variant} r{first.repeat}: "
                  f"{first.summary['warnings'][0]}): their figures are slower and noisier than on a quiet machine.",
                  ""]
    if min(repeats) < 2:
        lines += ["**Warning:** a configuration ran once: with a single repeat there is no confidence interval, "
                  "so no verdict and no rank. Use ablation.repeats=3 or more (or ablation.repeats=auto).", ""]

    lines += ["## Configurations ranked by speed-up", "", _interval_text(rows, resamples, seed), "",
              "| rank | configuration | speed-up × | 95 % CI | effect × | effect 95 % CI | verdict | samples/s | "
              "step ms | data wait | peak MiB (Δ) | final loss | setup s | techniques (applied / skipped) |",
              "|---:|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fig = r.figures
        peak = fig.get("peak_memory_mb")
        peak_text = "–" if peak is None else f"{peak:,.0f}" + (
            f" ({r.peak_change_pct:+.0f}%)" if r.peak_change_pct is not None and r.kind != "baseline" else "")
        verdict_text = f"**{r.verdict}**" if r.verdict in (HELPS, "faster") else r.verdict
        status = r.status.replace("|", "/") if r.runs else "–"
        effect_ci = _ci_text(r.effect_ci) if r.kind != "baseline" else "–"
        lines.append(f"| {r.rank or '–'} | {r.configuration} | {_f(r.speedup, '.2f')} | {_ci_text(r.speedup_ci)} | "
                     f"{_f(r.effect, '.2f')} | {effect_ci} | {verdict_text} | {_f(r.median, ',.1f')} | "
                     f"{_f(fig.get('step_time_ms_median'), ',.1f')} | {_f(fig.get('data_wait_fraction'), '.1%')} | "
                     f"{peak_text} | {_f(fig.get('final_loss'), '.3f')} | {_f(fig.get('setup_s'), '.1f')} | "
                     f"{status} |")
    lines += ["", "## What each technique buys", "",
              "Effect × (95 % interval), verdict.", "",
              "| technique | on alone (baseline + it) | off in fast (fast − it) |", "|---|---|---|"]
    by_technique: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.technique:
            by_technique.setdefault(r.technique, {})[r.kind] = r
    for tech, pair in sorted(by_technique.items(), key=lambda kv: -max((r.effect or 0) for r in kv[1].values())):
        cells = []
        for kind in ("leave-one-in", "leave-one-out"):
            r = pair.get(kind)
            cells.append("(not in the sweep)" if r is None else (
                f"×{r.effect:.2f} ({_ci_text(r.effect_ci)}), {r.verdict}" if r.effect is not None else r.verdict))
        lines.append(f"| {tech} | {cells[0]} | {cells[1]} |")
    skipped = sorted({(k, v) for j in jobs if j.summary for k, v in (j.summary.get("techniques") or {}).items()
                      if v.startswith("skipped")})
    if skipped:
        lines += ["", "## Skipped on this machine (and why)", ""] + [f"- `{k}`: {v[len('skipped: '):]}" for k, v in skipped]
    problems = [r for r in rows if not r.runs]
    if problems:
        lines += ["", "## Not measured", ""] + [f"- {r.configuration}: {r.verdict}" for r in problems]
    lines += [""] + budget_lines([j.times for j in jobs], _sweep_wall_s(record), "ablation.json: start to end")
    lines += ["Per job (jobs.csv has every figure): setup = process start, imports, dataset load, model build "
              "and FLOP count, before the first step.", "",
              "| configuration | repeat | samples/s | job s | setup s | training s | measured s | eval s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for j in sorted(jobs, key=lambda j: (j.variant, j.repeat)):
        t = j.times
        lines.append(f"| {j.variant} | {j.repeat} | {_f(j.samples_per_sec, ',.1f')} | {_f(t.get('wall_s'), '.1f')} | "
                     f"{_f(t.get('setup_s'), '.1f')} | {_f(t.get('train_s'), '.1f')} | "
                     f"{_f(t.get('measured_s'), '.1f')} | {_f(t.get('eval_s'), '.1f')} |")
    lines += ["", "## Plot", "", f"![speed-up over the baseline]({image})", ""]
    return "\n".join(lines)


def _interval_text(rows: list[Row], resamples: int, seed: int) -> str:
    """``INTERVAL_TEXT`` with the sweep's number of verdicts and the per-interval level they imply."""
    m = _verdicts(rows)
    level = stats.simultaneous_confidence(m)
    return INTERVAL_TEXT.format(resamples=resamples, seed=seed, m=m, level=level, tail=100 * (1 - level) / 2)


def _sweep_wall_s(record: dict[str, Any]) -> float | None:
    start, end = record.get("started_s"), record.get("finished_s")
    return end - start if isinstance(start, (int, float)) and isinstance(end, (int, float)) else None


def reading(rows: list[Row]) -> str:
    """A generated first reading for ``--doc``: which techniques helped, hurt, did nothing, were skipped."""
    groups: dict[str, list[str]] = {HELPS: [], HURTS: [], NO_EFFECT: [], "skipped here": [], NO_INTERVAL: []}
    for r in rows:
        if r.technique and r.verdict in groups:
            where = "on alone" if r.kind == "leave-one-in" else "off in fast"
            groups[r.verdict].append(f"{r.technique} ({where}, ×{r.effect:.2f} [{_ci_text(r.effect_ci)}])"
                                     if r.effect else f"{r.technique} ({where})")
    fast = next((r for r in rows if r.configuration == "fast"), None)
    lines = ["## Reading", ""]
    if fast and fast.speedup:
        lines.append(f"The fast preset ran at ×{fast.speedup:.2f} the baseline (95 % interval "
                     f"{_ci_text(fast.speedup_ci)}; {fast.verdict}).")
    for key, label in ((HELPS, "Helped"), (HURTS, "Hurt"), (NO_EFFECT, "No measurable effect"),
                       ("skipped here", "Skipped here"), (NO_INTERVAL, "No interval")):
        if groups[key] or key != NO_INTERVAL:
            lines.append(f"- **{label}:** " + (", ".join(groups[key]) or "none"))
    lines += ["", "<!-- Why: add one or two sentences per finding (hardware, model size, what the technique "
                  "changes). -->", ""]
    return "\n".join(lines)


def log_to_wandb(rows: list[Row], sweep: Path, logger_cfg: dict[str, Any], image: Path) -> str:
    """Log the rows as a W&B table (``ablation/report``) and the plot, in a run of the sweep's group.

    Mode: ``WANDB_MODE`` if set, else online when an API key is found and the server answers, offline otherwise. Returns the run's
    folder or URL.
    """
    import wandb

    from runner.track import wandb_offline_reason

    mode = os.environ.get("WANDB_MODE") or ("offline" if wandb_offline_reason() else "online")
    run = wandb.init(project=logger_cfg.get("project", "runner"), entity=logger_cfg.get("entity"),
                     group=sweep.name, job_type="ablation-report", name=f"{sweep.name}/report", dir=str(sweep),
                     mode=mode, settings=wandb.Settings(quiet=True, console="off", x_disable_stats=True))
    table = wandb.Table(columns=CSV_COLUMNS, data=csv_rows(rows))
    run.log({"ablation/report": table, "ablation/speedup": wandb.Image(str(image))})
    where = run.url if mode == "online" and run.url else run.dir
    run.finish()
    return str(where)


#: verdicts a replication must reproduce (a firm claim); "no measurable effect" may turn either way
FIRM = (stats.HELPS, stats.HURTS, "faster", "slower")


def agreement(rows: list[Row], replication: list[Row], name: str = "replication") -> tuple[str, list[str]]:
    """Compare the verdicts of two independent sweeps of the same job, configuration by configuration.

    Returns a markdown section (a table: each configuration's effect, its 95 % interval and verdict in both
    sweeps, and whether they agree) and the configurations where this sweep's verdict is firm (``FIRM``:
    helps, hurts, faster, slower) and the replication's differs -- the disagreements that matter. A
    configuration this sweep calls "no measurable effect" may come out either way in the other (its
    interval contains 1), so it is shown but not counted against agreement.
    """
    theirs = {r.configuration: r for r in replication}
    lines = [f"| configuration | effect [95 % CI], this sweep | verdict | effect [95 % CI], {name} | verdict | "
             f"agree |", "|---|---:|---|---:|---|---|"]
    disagree = []
    for r in rows:
        if r.kind == "baseline":
            continue
        o = theirs.get(r.configuration)
        same = o is not None and o.verdict == r.verdict
        if r.verdict in FIRM and not same:
            disagree.append(r.configuration)
        mark = "yes" if same else ("**no**" if r.verdict in FIRM else "—")
        other = (f"{_f(o.effect, '.2f')} {_ci_text(o.effect_ci)} | {o.verdict}" if o is not None else "— | not run")
        lines.append(f"| {r.configuration} | {_f(r.effect, '.2f')} {_ci_text(r.effect_ci)} | {r.verdict} | "
                     f"{other} | {mark} |")
    firm = [r for r in rows if r.verdict in FIRM]
    head = (f"The {name} agrees on all {len(firm)} configurations this sweep gives a firm verdict "
            f"({', '.join(FIRM)})." if not disagree else
            f"The {name} disagrees on {len(disagree)} of the {len(firm)} configurations this sweep gives a firm "
            f"verdict: {', '.join(disagree)}.")
    return "\n".join([head, "", *lines]), disagree


def write_report(sweep: Path, doc: Path | None = None, use_wandb: bool = True, seed: int = stats.SEED,
                 resamples: int = stats.RESAMPLES, replication: Path | None = None) -> list[Path]:
    """Write report.md, report.csv, jobs.csv and speedup.png of an ablation sweep into ``sweep`` (and
    ``doc`` if given); log the W&B table when the jobs' logger was W&B. Returns the written paths.

    Args:
        seed, resamples: of the bootstrap (runner/stats.py); the defaults make the report reproducible.

    Raises:
        ReportError: see ``load_jobs`` and ``build_rows``.
    """
    sweep = Path(sweep)
    jobs = load_jobs(sweep)
    rows = build_rows(jobs, seed, resamples)
    baseline = next(r for r in rows if r.configuration == "baseline")
    record = _record(sweep)
    written = [sweep / "report.md", sweep / "report.csv", sweep / "speedup.png", sweep / "jobs.csv"]
    plot(rows, written[2])
    written[0].write_text(markdown(rows, jobs, sweep, record, "speedup.png", seed=seed, resamples=resamples))
    write_csv(rows, written[1])
    write_jobs_csv(jobs, written[3])
    if doc is not None:
        doc = Path(doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        image = doc.with_suffix(".png")
        shutil.copyfile(written[2], image)
        text = markdown(rows, jobs, sweep, record, image.name, seed=seed, resamples=resamples,
                        title=f"Ablation on {record.get('machine', {}).get('cpu', 'this machine')}")
        text = text.replace("## Configurations ranked", reading(rows) + "\n## Configurations ranked", 1)
        if replication is not None:
            other = build_rows(load_jobs(Path(replication)), seed, resamples)
            rec = _record(Path(replication))
            table, _ = agreement(rows, other)
            text += (f"\n## Replication: an independent second sweep of the same job\n\n"
                     f"`{rec.get('command', '(command not recorded)')}` in `{replication}`, ran "
                     f"{rec.get('started', '?')} to {rec.get('finished', '?')}; load average (1 min) "
                     f"{(rec.get('machine') or {}).get('load_average_1min', '?')} at the start, "
                     f"{rec.get('load_average_1min_at_end', '?')} at the end.\n\n{table}\n")
        doc.write_text(text)
        written += [doc, image]
    logger = (baseline.jobs[0].summary or {}).get("config", {}).get("logger", {})
    if use_wandb and logger.get("name") == "wandb":
        written.append(Path(log_to_wandb(rows, sweep, logger, written[2])))
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.report SWEEP [--doc PATH [--replication SWEEP2]] [--no-wandb] [--seed N] [--resamples N]``;
    returns the exit
    status (2: a folder that cannot be reported)."""
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="a multirun folder: an ablation (outputs/ablation/<date>/<time>) "
                                                 "or any sweep (outputs/multirun/<date>/<time>)")
    parser.add_argument("--doc", type=Path, help="ablation: also write the report as a document, e.g. "
                                                 "docs/ablation-cpu.md")
    parser.add_argument("--replication", type=Path, help="with --doc: an independent second ablation sweep of the "
                                                        "same job; the document gets the agreement table")
    parser.add_argument("--no-wandb", action="store_true", help="do not log the W&B table even if the jobs used W&B")
    parser.add_argument("--seed", type=int, default=stats.SEED, help="bootstrap seed (default %(default)s)")
    parser.add_argument("--resamples", type=int, default=stats.RESAMPLES,
                        help="bootstrap resamples (default %(default)s)")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples {args.resamples}: use at least 100")
    try:
        if args.sweep.is_dir() and not is_ablation(args.sweep):
            if args.doc:
                raise ReportError("--doc is for ablation sweeps; the report of this sweep is its report.md")
            written = write_plain_report(args.sweep)
        else:
            if args.replication and not args.doc:
                raise ReportError("--replication adds the agreement table to the document: give --doc PATH too")
            written = write_report(args.sweep, doc=args.doc, use_wandb=not args.no_wandb, seed=args.seed,
                                   resamples=args.resamples, replication=args.replication)
    except (ReportError, SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
