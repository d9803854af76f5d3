"""Writing an ablation sweep's report into its folder (``write_report``): report.md, report.csv, jobs.csv,
speedup.png (``plot``), the W&B table (``log_to_wandb``) and ``--doc``. What the rows hold: docs/ablation.md.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from runner.compare import record as record_file
from runner.compare.stats import HELPS, HURTS
from runner.files import open_own, write_own
from runner.report import paired
from runner.report.load import Job, ReportError, Row, load_jobs, load_record, unfinished_jobs
from runner.report.markdown import agreement, markdown, reading
from runner.report.rows import build_rows

#: Columns of report.csv and of the W&B table, in order. Intervals are 95 % intervals from the paired slices
#: (runner/compare/stats.py); ``effect_ci_half_width`` is relative (0.05 = ±5 %); ``repeats``: measured processes.
CSV_COLUMNS = [
    "rank",
    "configuration",
    "kind",
    "technique",
    "repeats",
    "batch_size",
    "samples_per_sec_median",
    "samples_per_sec_min",
    "samples_per_sec_max",
    "speedup",
    "speedup_ci_low",
    "speedup_ci_high",
    "technique_effect",
    "effect_ci_low",
    "effect_ci_high",
    "effect_ci_half_width",
    "verdict",
    "step_time_ms_median",
    "data_wait_fraction",
    "peak_memory_mb",
    "peak_memory_change_pct",
    "final_loss",
    "train_loss",
    "setup_s_median",
    "job_wall_s_median",
    "techniques",
    "ci_low",
    "ci_high",
    "design",
]
#: Columns of jobs.csv (one row per job; times in s).
JOB_COLUMNS = [
    "configuration",
    "repeat",
    "folder",
    "status",
    "samples_per_sec",
    "wall_s",
    "setup_s",
    "train_s",
    "measured_s",
    "eval_s",
    "teardown_s",
]


def csv_rows(rows: list[Row]) -> list[list[Any]]:
    """The rows as plain values, in ``CSV_COLUMNS`` order (for report.csv and the W&B table)."""
    out = []
    for r in rows:
        fig, s, e = r.figures, r.speedup_ci, r.effect_ci
        out.append(
            [
                r.rank,
                r.configuration,
                r.kind,
                r.technique,
                len(r.runs),
                int(fig["batch_size"]) if fig.get("batch_size") else None,
                r.median,
                min(r.runs) if r.runs else None,
                max(r.runs) if r.runs else None,
                r.speedup,
                s and s.low,
                s and s.high,
                r.effect,
                e and e.low,
                e and e.high,
                e and e.half_width,
                r.verdict,
                fig.get("step_time_ms_median"),
                fig.get("data_wait_fraction"),
                fig.get("peak_memory_mb"),
                r.peak_change_pct,
                fig.get("final_loss"),
                fig.get("train_loss"),
                fig.get("setup_s"),
                fig.get("wall_s"),
                r.status,
                e and e.low,
                e and e.high,
                r.design,
            ]
        )
    return out


def _cell(v: Any) -> Any:
    return "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)


def write_csv(rows: list[Row], path: Path) -> None:
    """Write ``rows`` to ``path`` as CSV with the ``CSV_COLUMNS`` header (one row per configuration)."""
    with open_own(path, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for values in csv_rows(rows):
            writer.writerow([_cell(v) for v in values])


def write_jobs_csv(jobs: list[Job], path: Path) -> None:
    """Write one row per job (``JOB_COLUMNS``): samples/s and where its wall time went (s)."""
    with open_own(path, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(JOB_COLUMNS)
        for j in jobs:
            status = (
                "ok"
                if j.samples_per_sec
                else f"not run: {j.not_run}"
                if j.not_run
                else (f"failed (exit status {j.failed})" if j.failed is not None else "no figures")
            )
            writer.writerow(
                [
                    _cell(v)
                    for v in [
                        j.variant,
                        j.repeat,
                        str(j.folder),
                        status,
                        j.samples_per_sec,
                        *(j.times.get(k) for k in JOB_COLUMNS[5:]),
                    ]
                ]
            )


def plot(rows: list[Row], path: Path) -> None:
    """``speedup.png``: one horizontal bar per measured configuration, from 1.0 (the baseline) to its
    speed-up, a whisker for its 95 % interval (none without one), and the baseline's
    interval against itself (what noise alone gives) as a grey band. The x axis is logarithmic when the
    speed-ups span more than 8x, so 0.5x and 2x look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.speedup is not None][::-1]  # fastest on top
    colors = {HELPS: "tab:green", "faster": "tab:green", HURTS: "tab:red", "slower": "tab:red", "reference": "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(shown) + 1.6))
    y = list(range(len(shown)))
    ax.barh(y, [r.speedup - 1 for r in shown], left=1.0, color=[colors.get(r.verdict, "0.65") for r in shown])
    # the baseline's interval is its copy's (the A/A), drawn as the band below: it need not contain 1
    with_ci = [(i, r) for i, r in zip(y, shown) if r.speedup_ci is not None and r.kind != "baseline"]
    if with_ci:
        ax.errorbar(
            [r.speedup for _, r in with_ci],
            [i for i, _ in with_ci],
            fmt="none",
            ecolor="black",
            elinewidth=0.8,
            capsize=2,
            xerr=[
                [r.speedup - r.speedup_ci.low for _, r in with_ci],
                [r.speedup_ci.high - r.speedup for _, r in with_ci],
            ],
        )
    base = next((r for r in shown if r.kind == "baseline"), None)
    if base is not None and base.speedup_ci is not None:
        ax.axvspan(
            base.speedup_ci.low,
            base.speedup_ci.high,
            color="0.85",
            zorder=0,
            label="baseline against itself (95 % CI: noise alone)",
        )
        ax.legend(loc="best", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    values = [v for r in shown for v in ((r.speedup_ci.low, r.speedup_ci.high) if r.speedup_ci else (r.speedup,))]
    if max(values + [1.0]) / min(values + [1.0]) > 8:
        from matplotlib.ticker import FormatStrFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.set_yticks(y, [r.configuration for r in shown], fontsize=8)
    ax.set_xlabel("speed-up over the baseline (x, paired samples/s ratio; whiskers: 95 % CI)")
    ax.set_title("green: helps, red: hurts, grey: no measurable effect, no interval or skipped", fontsize=9)
    fig.tight_layout()
    with open_own(path, "wb") as f:  # a link planted at the name is replaced, never written through
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


#: The sweep's file holding the id of its W&B report run: a rebuilt report updates that run, not a new one.
WANDB_RUN_FILE = "wandb_report.json"


def report_run_id(sweep: Path) -> str:
    """The W&B run id of ``sweep``'s report: ``run_id`` of ``<sweep>/wandb_report.json``, or made (8 random
    lowercase letters and digits, like W&B's own) and written there (atomically) by the first report."""
    import json
    import secrets
    import string

    from runner.track import write_json_atomic

    path, allowed = sweep / WANDB_RUN_FILE, string.ascii_lowercase + string.digits
    try:
        found = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        found = None  # absent or damaged: a new id
    if isinstance(found, str) and found and all(c in allowed for c in found):
        return found
    run_id = "".join(secrets.choice(allowed) for _ in range(8))
    write_json_atomic(path, {"run_id": run_id})
    return run_id


def log_to_wandb(rows: list[Row], sweep: Path, logger_cfg: dict[str, Any], image: Path) -> str:
    """Log the rows as a W&B table (``ablation/report``) and the plot, in a run of the sweep's group: one run
    per sweep, its id kept in ``<sweep>/wandb_report.json`` (``report_run_id``), so rebuilding the report resumes and
    updates that run (``resume="allow"``; offline run folders of one id sync into that run).

    Mode: ``WANDB_MODE`` if set, else online when an API key is found and the server answers, offline otherwise.
    Returns the run's folder or URL.
    """
    import wandb

    from runner.track import wandb_offline_reason

    mode = os.environ.get("WANDB_MODE") or ("offline" if wandb_offline_reason() else "online")
    run = wandb.init(
        project=logger_cfg.get("project", "runner"),
        entity=logger_cfg.get("entity"),
        group=sweep.name,
        job_type="ablation-report",
        name=f"{sweep.name}/report",
        dir=str(sweep),
        id=report_run_id(sweep),
        resume="allow",
        mode=mode,
        settings=wandb.Settings(quiet=True, console="off", x_disable_stats=True),
    )
    table = wandb.Table(columns=CSV_COLUMNS, data=csv_rows(rows))
    run.log({"ablation/report": table, "ablation/speedup": wandb.Image(str(image))})
    where = run.url if mode == "online" and run.url else run.dir
    run.finish()
    return str(where)


def _load(sweep: Path) -> tuple[list[Job], dict | None]:
    """``sweep``'s jobs and its interleaved record (None without one); the jobs include those killed before their
    summary, from their slices (``runner.report.load.unfinished_jobs``)."""
    jobs = load_jobs(sweep)
    try:
        interleaved = record_file.load(sweep)
    except ValueError as e:
        raise ReportError(str(e)) from e
    return jobs + (unfinished_jobs(sweep, interleaved, jobs) if interleaved else []), interleaved


def _rows(jobs: list[Job], interleaved: dict | None) -> list[Row]:
    """The report's rows, with the paired figures of the slices where the sweep has an interleaved record
    (runner/report/paired.py)."""
    rows = build_rows(jobs)
    if interleaved:
        paired.apply_to_rows(rows, interleaved)
    return rows


def write_report(
    sweep: Path, doc: Path | None = None, use_wandb: bool = True, replication: Path | None = None
) -> list[Path]:
    """Write report.md, report.csv, jobs.csv and speedup.png of an ablation sweep into ``sweep`` (and
    ``doc`` if given); with ``use_wandb``, log the W&B table when the jobs' logger was W&B. Returns the paths.

    Args:
        doc: also write the report as a document there (``reading`` added, plot copied next to it as .png).
        replication: with ``doc``, an independent second sweep of the same job: the document gets the
            ``agreement`` table.

    Raises:
        ReportError: see ``load_jobs`` and ``build_rows`` (of ``sweep`` or of ``replication``).
    """
    sweep = Path(sweep)
    jobs, interleaved = _load(sweep)
    rows = _rows(jobs, interleaved)
    baseline = next(r for r in rows if r.configuration == "baseline")
    record = load_record(sweep)
    if interleaved:
        record["interleave"] = interleaved
    written = [sweep / "report.md", sweep / "report.csv", sweep / "speedup.png", sweep / "jobs.csv"]
    plot(rows, written[2])
    write_own(written[0], markdown(rows, jobs, sweep, record, "speedup.png"))
    write_csv(rows, written[1])
    write_jobs_csv(jobs, written[3])
    if doc is not None:
        doc = Path(doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        image = doc.with_suffix(".png")
        write_own(image, written[2].read_bytes())
        text = markdown(
            rows,
            jobs,
            sweep,
            record,
            image.name,
            title=f"Ablation on {record.get('machine', {}).get('cpu', 'this machine')}",
        )
        text = text.replace("## Configurations ranked", reading(rows) + "\n## Configurations ranked", 1)
        if replication is not None:
            other = _rows(*_load(Path(replication)))
            rec = load_record(Path(replication))
            table, _ = agreement(rows, other)
            text += (
                f"\n## Replication: an independent second sweep of the same job\n\n"
                f"`{rec.get('command', '(command not recorded)')}` in `{replication}`, ran "
                f"{rec.get('started', '?')} to {rec.get('finished') or '? (it did not record its end: killed)'}; "
                f"load average (1 min) {(rec.get('machine') or {}).get('load_average_1min', '?')} at the start, "
                f"{rec.get('load_average_1min_at_end', '?')} at the end.\n\n{table}\n"
            )
        write_own(doc, text)
        written += [doc, image]
    logger = (baseline.jobs[0].summary or {}).get("config", {}).get("logger", {})
    if use_wandb and (logger.get("wandb") is not None or logger.get("name") == "wandb"):  # name: older sweeps
        written.append(Path(log_to_wandb(rows, sweep, logger, written[2])))
    return written
