"""``python -m runner.report <sweep folder>``: the ablation's report, ranked by speed-up.

Reads every job of an ablation sweep (``python -m runner -m +experiment=ablation``; one
``summary.json`` per job, ``not_run.json``/``failed.json`` for jobs that did not measure) and writes
into the sweep folder:

- ``report.md`` and ``report.csv``: one row per configuration, ranked by speed-up: median samples/s,
  speed-up over the baseline with its min-max across repeats, step time, data-wait fraction, peak
  memory and its change, the final loss, and what was applied or skipped;
- ``speedup.png``: horizontal bars of the speed-ups with their min-max spread (matplotlib, Agg);
- a W&B table of the same rows (and the plot) when the jobs logged to W&B (offline without an API key).

Figures (units in the names): ``samples_per_sec`` is samples of the measured steps / their wall time
(warm-up steps excluded, runner/measure.py); speed-up = a configuration's median samples/s / the
baseline's median. The noise rule (issue 3): a technique whose ratio to its reference lies inside the
reference's own repeat spread [min/median, max/median] has "no measurable effect" and is not ranked as
a win. The reference is the baseline for a technique switched on alone (leave-one-in) and the fast
preset for a technique switched off in it (leave-one-out). Only configurations measurably faster than
the baseline get a rank.

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
from typing import Any

#: Columns of report.csv and of the W&B table, in order.
CSV_COLUMNS = [
    "rank", "configuration", "kind", "technique", "repeats", "batch_size", "samples_per_sec_median",
    "samples_per_sec_min", "samples_per_sec_max", "speedup", "speedup_min", "speedup_max", "technique_effect",
    "verdict", "step_time_ms_median", "data_wait_fraction", "peak_memory_mb", "peak_memory_change_pct",
    "final_loss", "train_loss", "techniques",
]
HELPS, HURTS, NO_EFFECT = "helps", "hurts", "no measurable effect"


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


@dataclass
class Row:
    """One configuration: its jobs' figures (medians over repeats) and how it compares."""

    configuration: str
    kind: str | None
    technique: str | None
    jobs: list[Job] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)  # samples/s of each measured repeat
    speedup: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    effect: float | None = None  # what the technique buys: x >1 helps (see technique_effect)
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
def load_jobs(sweep: Path) -> list[Job]:
    """Every job under ``sweep``: ``summary.json`` (measured), ``not_run.json``, ``failed.json``.

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


# ------------------------------------------------------------------------------------------- the rule
def spread(runs: list[float]) -> tuple[float, float]:
    """A reference's own repeat spread as ratios to its median: ``(min/median, max/median)``."""
    med = statistics.median(runs)
    return min(runs) / med, max(runs) / med


def compare(ratio: float, reference_runs: list[float]) -> str:
    """Where ``ratio`` (a configuration's median / the reference's median) lies relative to the
    reference's own repeat spread: ``"above"``, ``"below"`` or ``"inside"`` (boundaries are inside)."""
    lo, hi = spread(reference_runs)
    if ratio > hi:
        return "above"
    if ratio < lo:
        return "below"
    return "inside"


def technique_effect(kind: str | None, median: float, baseline_median: float, fast_median: float | None) -> float | None:
    """What the row's technique buys, as a factor (>1 = faster with it).

    leave-one-in: this configuration / the baseline; leave-one-out: the fast preset / this
    configuration; fast: fast / baseline; baseline: 1.
    """
    if kind == "leave-one-out":
        return fast_median / median if fast_median else None
    if kind == "baseline":
        return 1.0
    return median / baseline_median


def verdict(kind: str | None, median: float, baseline_runs: list[float], fast_runs: list[float] | None) -> str:
    """The noise rule of issue 3 for one configuration; see the module docstring.

    Returns ``"reference"`` (the baseline), ``"faster"``/``"slower"`` (the fast preset vs the baseline),
    ``"helps"``/``"hurts"`` (the technique of a leave-one-in or leave-one-out row), or
    ``"no measurable effect"`` when the ratio lies inside the reference's repeat spread.
    """
    base = statistics.median(baseline_runs)
    if kind == "baseline":
        return "reference"
    if kind == "leave-one-out":
        if not fast_runs:
            return "no fast reference"
        where = compare(median / statistics.median(fast_runs), fast_runs)
        return {"below": HELPS, "above": HURTS}.get(where, NO_EFFECT)
    where = compare(median / base, baseline_runs)
    if kind == "fast":
        return {"above": "faster", "below": "slower"}.get(where, NO_EFFECT)
    return {"above": HELPS, "below": HURTS}.get(where, NO_EFFECT)


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


def build_rows(jobs: list[Job]) -> list[Row]:
    """Group jobs by configuration, compare each with its reference and rank them by speed-up.

    Raises:
        ReportError: no baseline, or a baseline without a measured repeat.
    """
    rows: dict[str, Row] = {}
    for job in jobs:
        row = rows.setdefault(job.variant, Row(job.variant, job.kind or _kind_of(job.variant),
                                               job.technique if job.kind else _technique_of(job.variant)))
        row.jobs.append(job)
        sps = (job.summary or {}).get("samples_per_sec")
        if sps:
            row.runs.append(float(sps))
    if "baseline" not in rows:
        raise ReportError(f"no baseline among the configurations {sorted(rows)}; every speed-up is measured "
                          f"against it: include `baseline` in ablation/variant=...")
    baseline = rows["baseline"]
    if not baseline.runs:
        raise ReportError(f"the baseline has no measured repeat ({_job_problems(baseline)}); run it again")
    fast = rows.get("fast")
    fast_runs = fast.runs if fast and fast.runs else None
    base_med = baseline.median
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
        }
        if row.figures["peak_memory_mb"] is not None and base_peak:
            row.peak_change_pct = 100 * (row.figures["peak_memory_mb"] - base_peak) / base_peak
        row.status, row.all_skipped = technique_status(row.kind, techniques[row.configuration],
                                                       techniques["baseline"], techniques.get("fast"))
        if not row.runs:
            row.verdict, row.status = _job_problems(row), ""
            continue
        row.speedup = row.median / base_med
        row.speedup_min, row.speedup_max = min(row.runs) / base_med, max(row.runs) / base_med
        row.effect = technique_effect(row.kind, row.median, base_med, statistics.median(fast_runs) if fast_runs else None)
        row.verdict = verdict(row.kind, row.median, baseline.runs, fast_runs)
        if row.all_skipped:
            row.verdict = "skipped here"
    ordered = sorted(rows.values(), key=lambda r: (r.speedup is None, -(r.speedup or 0), r.configuration))
    _, hi = spread(baseline.runs)
    rank = 0
    for row in ordered:
        if row.speedup is not None and row.speedup > hi and not row.all_skipped and row.kind != "baseline":
            rank += 1
            row.rank = rank
    return ordered


def _techniques(row: Row) -> dict[str, str]:
    for job in row.jobs:
        if job.summary:
            return dict(job.summary.get("techniques") or {})
    return {}


def _job_problems(row: Row) -> str:
    reasons = sorted({f"not run: {j.not_run}" if j.not_run else f"failed (exit status {j.failed}), see {j.folder}/"
                      if j.failed is not None else f"no figures in {j.folder}/" for j in row.jobs if not
                      (j.summary and j.summary.get("samples_per_sec"))})
    return "; ".join(reasons)


# ------------------------------------------------------------------------------------------- writing
def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def csv_rows(rows: list[Row]) -> list[list[Any]]:
    """The rows as plain values, in ``CSV_COLUMNS`` order (for report.csv and the W&B table)."""
    out = []
    for r in rows:
        fig = r.figures
        out.append([
            r.rank, r.configuration, r.kind, r.technique, len(r.runs),
            int(fig["batch_size"]) if fig.get("batch_size") else None,
            r.median, min(r.runs) if r.runs else None, max(r.runs) if r.runs else None,
            r.speedup, r.speedup_min, r.speedup_max, r.effect, r.verdict,
            fig.get("step_time_ms_median"), fig.get("data_wait_fraction"), fig.get("peak_memory_mb"),
            r.peak_change_pct, fig.get("final_loss"), fig.get("train_loss"), r.status,
        ])
    return out


def write_csv(rows: list[Row], path: Path) -> None:
    """Write ``rows`` to ``path`` as CSV with the ``CSV_COLUMNS`` header (one row per configuration)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for values in csv_rows(rows):
            writer.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in values])


def plot(rows: list[Row], baseline_runs: list[float], path: Path) -> None:
    """``speedup.png``: one horizontal bar per measured configuration, from 1.0 (the baseline) to its
    speed-up, a whisker for its min-max across repeats, the baseline's own spread as a grey band.
    The x axis is logarithmic when the speed-ups span more than 8x, so 0.5x and 2x look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.speedup is not None][::-1]  # fastest on top
    colors = {HELPS: "tab:green", "faster": "tab:green", HURTS: "tab:red", "slower": "tab:red",
              "reference": "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(shown) + 1.6))
    y = list(range(len(shown)))
    ax.barh(y, [r.speedup - 1 for r in shown], left=1.0, color=[colors.get(r.verdict, "0.65") for r in shown])
    ax.errorbar([r.speedup for r in shown], y, fmt="none", ecolor="black", elinewidth=0.8, capsize=2,
                xerr=[[r.speedup - r.speedup_min for r in shown], [r.speedup_max - r.speedup for r in shown]])
    lo, hi = spread(baseline_runs)
    ax.axvspan(lo, hi, color="0.85", zorder=0, label="baseline repeat spread")
    ax.axvline(1.0, color="black", linewidth=0.8)
    values = [v for r in shown for v in (r.speedup_min, r.speedup_max)] + [1.0]
    if max(values) / min(values) > 8:
        ax.set_xscale("log")
    ax.set_yticks(y, [r.configuration for r in shown], fontsize=8)
    ax.set_xlabel("speed-up over the baseline (x, median samples/s; whiskers: min-max over repeats)")
    ax.set_title("green: helps, red: hurts, grey: no measurable effect or skipped", fontsize=9)
    ax.legend(loc="best", fontsize=8)
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

        from runner.ablation import sweep_command

        record["command"] = sweep_command(OmegaConf.load(multirun).hydra)
    from runner.ablation import describe_machine

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


def markdown(rows: list[Row], jobs: list[Job], sweep: Path, record: dict[str, Any], image: str,
             title: str = "Ablation report: what each technique buys") -> str:
    """report.md's text (also the body of ``--doc``)."""
    baseline = next(r for r in rows if r.configuration == "baseline")
    fast = next((r for r in rows if r.configuration == "fast"), None)
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
    lines.append(f"| measurement | {', '.join(map(str, repeats))} repeat(s) per configuration (the repeat is the "
                 f"sweep's outer loop); every job: {step_text}, warm-up excluded from every figure; one fresh "
                 f"process per job |")
    b_lo, b_hi = spread(baseline.runs)
    noise = (f"baseline {min(baseline.runs):.4g}–{max(baseline.runs):.4g} samples/s "
             f"({(b_lo - 1) * 100:+.1f}% … {(b_hi - 1) * 100:+.1f}% around its median)")
    if fast and fast.runs:
        f_lo, f_hi = spread(fast.runs)
        noise += f"; fast {min(fast.runs):.4g}–{max(fast.runs):.4g} ({(f_lo - 1) * 100:+.1f}% … {(f_hi - 1) * 100:+.1f}%)"
    lines.append(f"| repeat spread (noise) | {noise} |")
    lines.append("")
    if len(steps) > 1:
        lines += [f"**Warning:** the jobs measured different step counts ({step_text}); rerun with one "
                  f"trainer.max_steps / trainer.warmup_steps.", ""]
    cores = machine.get("cpu_cores")
    if load[0] is not None and cores and load[0] > cores / 2:
        lines += [f"**Warning:** the machine was busy when the sweep started (load average {load[0]} on {cores} "
                  f"cores): other processes share the cores, so figures are slower and noisier than on a quiet "
                  f"machine. Rerun when it is quiet for figures to publish.", ""]
    if min(repeats) < 2:
        lines += ["**Warning:** a configuration ran once: a single repeat has no spread, so every difference counts "
                  "as an effect here. Use ablation.repeats=3 or more before reading verdicts.", ""]

    lines += ["## Configurations ranked by speed-up", "",
              "Speed-up = median samples/s ÷ the baseline's (min–max over repeats). *Effect* = what the "
              "technique buys: on alone, this ÷ baseline; off in fast (leave-one-out), fast ÷ this. A technique "
              "whose ratio lies inside its reference's own repeat spread (the baseline's for leave-one-in, "
              "fast's for leave-one-out) has **no measurable effect**; only configurations measurably faster "
              "than the baseline are ranked.", "",
              "| rank | configuration | speed-up × (min–max) | effect × | verdict | samples/s | step ms | data wait "
              "| peak MiB (Δ) | final loss | techniques (applied / skipped) |",
              "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fig = r.figures
        speed = (f"{r.speedup:.2f} ({r.speedup_min:.2f}–{r.speedup_max:.2f})" if r.speedup is not None else "–")
        peak = fig.get("peak_memory_mb")
        peak_text = "–" if peak is None else f"{peak:,.0f}" + (
            f" ({r.peak_change_pct:+.0f}%)" if r.peak_change_pct is not None and r.kind != "baseline" else "")
        verdict_text = f"**{r.verdict}**" if r.verdict in (HELPS, "faster") else r.verdict
        status = r.status.replace("|", "/") if r.runs else "–"
        lines.append(f"| {r.rank or '–'} | {r.configuration} | {speed} | {_f(r.effect, '.2f')} | {verdict_text} | "
                     f"{_f(r.median, ',.1f')} | {_f(fig.get('step_time_ms_median'), ',.1f')} | "
                     f"{_f(fig.get('data_wait_fraction'), '.1%')} | {peak_text} | {_f(fig.get('final_loss'), '.3f')} | "
                     f"{status} |")
    lines += ["", "## What each technique buys", "",
              "| technique | on alone (baseline + it) | off in fast (fast − it) |", "|---|---|---|"]
    by_technique: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.technique:
            by_technique.setdefault(r.technique, {})[r.kind] = r
    for tech, pair in sorted(by_technique.items(), key=lambda kv: -max(
            (r.effect or 0) for r in kv[1].values())):
        cells = []
        for kind in ("leave-one-in", "leave-one-out"):
            r = pair.get(kind)
            cells.append("(not in the sweep)" if r is None else (
                f"×{r.effect:.2f}, {r.verdict}" if r.effect is not None else r.verdict))
        lines.append(f"| {tech} | {cells[0]} | {cells[1]} |")
    skipped = sorted({(k, v) for j in jobs if j.summary for k, v in (j.summary.get("techniques") or {}).items()
                      if v.startswith("skipped")})
    if skipped:
        lines += ["", "## Skipped on this machine (and why)", ""] + [f"- `{k}`: {v[len('skipped: '):]}" for k, v in skipped]
    problems = [r for r in rows if not r.runs]
    if problems:
        lines += ["", "## Not measured", ""] + [f"- {r.configuration}: {r.verdict}" for r in problems]
    lines += ["", "## Plot", "", f"![speed-up over the baseline]({image})", ""]
    return "\n".join(lines)


def reading(rows: list[Row]) -> str:
    """A generated first reading for ``--doc``: which techniques helped, hurt, did nothing, were skipped."""
    groups: dict[str, list[str]] = {HELPS: [], HURTS: [], NO_EFFECT: [], "skipped here": []}
    for r in rows:
        if r.technique and r.verdict in groups:
            where = "on alone" if r.kind == "leave-one-in" else "off in fast"
            groups[r.verdict].append(f"{r.technique} ({where}, ×{r.effect:.2f})" if r.effect else
                                     f"{r.technique} ({where})")
    fast = next((r for r in rows if r.configuration == "fast"), None)
    lines = ["## Reading", ""]
    if fast and fast.speedup:
        lines.append(f"The fast preset ran at ×{fast.speedup:.2f} the baseline ({fast.verdict}).")
    for key, label in ((HELPS, "Helped"), (HURTS, "Hurt"), (NO_EFFECT, "No measurable effect"),
                       ("skipped here", "Skipped here")):
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


def write_report(sweep: Path, doc: Path | None = None, use_wandb: bool = True) -> list[Path]:
    """Write report.md, report.csv and speedup.png into ``sweep`` (and ``doc`` if given); log the W&B
    table when the jobs' logger was W&B. Returns the written paths.

    Raises:
        ReportError: see ``load_jobs`` and ``build_rows``.
    """
    sweep = Path(sweep)
    jobs = load_jobs(sweep)
    rows = build_rows(jobs)
    baseline = next(r for r in rows if r.configuration == "baseline")
    record = _record(sweep)
    written = [sweep / "report.md", sweep / "report.csv", sweep / "speedup.png"]
    plot(rows, baseline.runs, written[2])
    written[0].write_text(markdown(rows, jobs, sweep, record, "speedup.png"))
    write_csv(rows, written[1])
    if doc is not None:
        doc = Path(doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        image = doc.with_suffix(".png")
        shutil.copyfile(written[2], image)
        text = markdown(rows, jobs, sweep, record, image.name,
                        title=f"Ablation on {record.get('machine', {}).get('cpu', 'this machine')}")
        doc.write_text(text.replace("## Configurations ranked", reading(rows) + "\n## Configurations ranked", 1))
        written += [doc, image]
    logger = (baseline.jobs[0].summary or {}).get("config", {}).get("logger", {})
    if use_wandb and logger.get("name") == "wandb":
        written.append(Path(log_to_wandb(rows, sweep, logger, written[2])))
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.report SWEEP [--doc PATH] [--no-wandb]``; returns the exit status (2: bad sweep)."""
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep folder (outputs/ablation/<date>/<time>)")
    parser.add_argument("--doc", type=Path, help="also write the report as a document, e.g. docs/ablation-cpu.md")
    parser.add_argument("--no-wandb", action="store_true", help="do not log the W&B table even if the jobs used W&B")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.sweep, doc=args.doc, use_wandb=not args.no_wandb)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
