"""The report of a plain multirun sweep, and where the time of any sweep went.

``python -m runner.report <multirun folder>`` on a sweep that is not an ablation writes ``report.md``,
``report.csv`` (one row per job, fastest first; jobs without a ``summary.json`` last) and ``sweep.png`` (samples/s
over the swept keys) into the folder: docs/configuration.md, "Sweeps". ``job_times`` says where each job's wall time
went, for this report and the ablation's.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.files import open_own, write_own

if TYPE_CHECKING:
    from omegaconf import DictConfig

#: Columns of a plain sweep's report.csv, after the swept keys (one column each).
#: ``speedup`` .. ``design``: the paired comparison with the sweep's reference job under hydra/launcher=interleaved
#: (runner/report/paired.py); ``design`` is ``sequential`` (and the four before it empty) for other sweeps.
PLAIN_COLUMNS = [
    "job",
    "status",
    "samples_per_sec",
    "speedup",
    "ci_low",
    "ci_high",
    "verdict",
    "design",
    "step_time_ms_median",
    "data_wait_fraction",
    "peak_memory_mb",
    "train_loss",
    "eval_loss",
    "eval_accuracy",
    "setup_s",
    "train_time_s",
    "measured_time_s",
    "overrides",
]


def sweep_command(hydra_cfg: DictConfig) -> str:
    """The command line that started this multirun, rebuilt from Hydra's record of its overrides (the
    ablation records it in ``ablation.json``; the reports rebuild it from ``multirun.yaml``)."""
    overrides = [o for o in (*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task) if o != "hydra.mode=MULTIRUN"]
    return shlex.join(["python", "-m", "runner", "-m", *[str(o) for o in overrides]])


class SweepError(ValueError):
    """A folder that is not a multirun sweep the report can read; the message names the fix."""


# ------------------------------------------------------------------------------------------- timing
def job_times(folder: Path, summary: dict[str, Any] | None) -> dict[str, float | None]:
    """Where one job's wall time went, in seconds (None where the folder cannot tell).

    Keys: ``wall_s``, ``setup_s`` (summary written − job start − train − eval: everything before the first step;
    an interleaved job's ``job.json`` holds its own), ``train_s`` (``train_time_s``), ``measured_s``
    (``measured_time_s``), ``eval_s`` (``eval_time_s``), ``teardown_s`` (summary to process exit; with ``job.json``).
    The job start: ``job.json``'s ``started``, else when Hydra wrote ``.hydra/config.yaml``.
    """
    record: dict[str, Any] = {}
    path = folder / "job.json"
    if path.is_file():
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            record = {}
    started = record.get("started")
    if started is None and (folder / ".hydra" / "config.yaml").is_file():
        started = (folder / ".hydra" / "config.yaml").stat().st_mtime
    finished = record.get("finished")
    summary = summary or {}
    train, evaluation = _num(summary.get("train_time_s")), _num(summary.get("eval_time_s"))
    written = (folder / "summary.json").stat().st_mtime if (folder / "summary.json").is_file() and summary else None
    setup = teardown = None
    if (timed := _num(record.get("setup_s"))) is not None:  # an interleaved job: its coordinator timed it
        setup = timed
    elif started is not None and written is not None and train is not None:
        setup = written - started - train - (evaluation or 0.0)
        setup = setup if setup >= 0 else None  # clocks that disagree say nothing
    if finished is not None and written is not None:
        teardown = max(finished - written, 0.0)
    end = finished if finished is not None else written
    return {
        "wall_s": end - started if started is not None and end is not None else _num(record.get("wall_s")),
        "setup_s": setup,
        "train_s": train,
        "measured_s": _num(summary.get("measured_time_s")),
        "eval_s": evaluation,
        "teardown_s": teardown,
    }


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def time_budget(times: list[dict[str, float | None]], sweep_wall_s: float | None) -> list[tuple[str, float | None]]:
    """The sweep's wall time split into measured steps, the rest of training (warm-up steps, logging),
    evaluation, per-job setup, per-job teardown and the remainder (Hydra, the report, jobs not run),
    each the sum over jobs in seconds. Rows whose figure no job had are None."""

    def total(key: str) -> float | None:
        values = [t[key] for t in times if t.get(key) is not None]
        return sum(values) if values else None

    measured, train = total("measured_s"), total("train_s")
    rows = [
        ("measured steps", measured),
        ("warm-up steps and logging", train - measured if train is not None and measured is not None else None),
        ("evaluation", total("eval_s")),
        ("setup before the first step (process, imports, data, model)", total("setup_s")),
        ("teardown after the summary (W&B, exit)", total("teardown_s")),
    ]
    if sweep_wall_s is not None:
        known = sum(v for _, v in rows if v is not None)
        rows.append(("rest (launcher, Hydra, report, jobs not run)", max(sweep_wall_s - known, 0.0)))
    return rows


def budget_lines(times: list[dict[str, float | None]], sweep_wall_s: float | None, source: str) -> list[str]:
    """Markdown lines: the sweep's wall time against the time spent in measured steps (``time_budget``)."""
    rows = time_budget(times, sweep_wall_s)
    lines = ["## Where the sweep's time went", ""]
    if sweep_wall_s is not None:
        measured = rows[0][1]
        share = f" ({measured / sweep_wall_s:.0%} of it in measured steps)" if measured and sweep_wall_s else ""
        lines += [f"Sweep wall time: {_dur(sweep_wall_s)} ({source}){share}.", ""]
    setups = [t["setup_s"] for t in times if t.get("setup_s") is not None]
    if setups:
        lines += [
            f"Fixed cost per job (setup before the first step): median {statistics.median(setups):.1f} s, "
            f"{min(setups):.1f}–{max(setups):.1f} s over {len(setups)} jobs.",
            "",
        ]
    lines += ["| where | time | share |", "|---|---:|---:|"]
    for name, value in rows:
        share = f"{value / sweep_wall_s:.0%}" if value is not None and sweep_wall_s else "–"
        lines.append(f"| {name} | {_dur(value)} | {share} |")
    return lines + [""]


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# ------------------------------------------------------------------------------------------- plain sweeps
@dataclass
class SweepJob:
    """One job of a plain multirun: its folder (relative), overrides and summary (None: no summary)."""

    folder: Path
    overrides: dict[str, str]
    summary: dict[str, Any] | None
    times: dict[str, float | None] = field(default_factory=dict)
    problem: str = ""  # why there are no figures

    @property
    def samples_per_sec(self) -> float | None:
        return _num((self.summary or {}).get("samples_per_sec"))


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def load_sweep(sweep: Path) -> list[SweepJob]:
    """Every job folder of a multirun (a folder holding ``.hydra/overrides.yaml``) under ``sweep``.

    Raises:
        SweepError: no such folder, no job folder in it, or a corrupt ``summary.json``/overrides file.
    """
    from omegaconf import OmegaConf

    if not sweep.is_dir():
        raise SweepError(f"{sweep} is not a folder; pass a multirun folder (outputs/multirun/<date>/<time>)")
    jobs = []
    for path in sorted(sweep.rglob(".hydra/overrides.yaml")):
        folder = path.parent.parent
        if folder == sweep:
            continue
        try:
            overrides = dict(_split(str(o)) for o in OmegaConf.load(path))
        except Exception as e:  # a truncated YAML file of a killed job
            raise SweepError(f"{path} cannot be read ({e}); delete that job folder or run it again") from e
        summary = None
        if (folder / "summary.json").is_file():
            try:
                summary = json.loads((folder / "summary.json").read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise SweepError(
                    f"{folder / 'summary.json'} cannot be read ({e}); delete that job folder or run it again"
                ) from e
        job = SweepJob(folder.relative_to(sweep), overrides, summary, job_times(folder, summary))
        if summary is None:
            job.problem = _why_no_summary(folder)
        elif job.samples_per_sec is None:
            job.problem = "no speed figure (too few steps after the warm-up)"
        jobs.append(job)
    if not jobs:
        raise SweepError(
            f"{sweep} holds no job folder (<job>/.hydra/overrides.yaml); pass the folder of a "
            f"`python -m runner -m ...` sweep (outputs/multirun/<date>/<time>)"
        )
    return jobs


def _from_slices(jobs: list[SweepJob], record: dict[str, Any]) -> list[SweepJob]:
    """``jobs``, each killed before its summary (Ctrl-C, SIGKILL) given one made of its slices in ``record``."""
    for j in jobs:
        slices = [s for s in record.get("slices", []) if s["job"] == str(j.folder)]
        if j.summary is None and slices:
            j.summary = slice_summary(slices)
            j.problem = "killed before its summary.json: samples/s and step time from its measured slices"
    return jobs


def slice_summary(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """A summary made of a job's measured slices in ``interleave.json`` (a job killed before its ``summary.json``):
    ``samples_per_sec``, ``step_time_ms_median`` (ms), ``steps_measured`` and ``unfinished: true``."""
    seconds = sum(s["seconds"] for s in slices)
    samples = sum(s["samples_per_sec"] * s["seconds"] for s in slices)
    per_step = sorted(1000 * s["seconds"] / s["steps"] for s in slices)
    return {
        "samples_per_sec": samples / seconds,
        "step_time_ms_median": per_step[len(per_step) // 2],
        "steps_measured": sum(s["steps"] for s in slices),
        "unfinished": True,
    }


def _why_no_summary(folder: Path) -> str:
    last = None
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                last = json.loads(line).get("step", last)
            except json.JSONDecodeError:
                break
    where = f" after step {last}" if last is not None else " before its first logged step"
    return f"failed or unfinished: no summary.json, stopped{where} (see {folder.name}/ and the sweep's console)"


def swept_keys(jobs: list[SweepJob]) -> list[str]:
    """The override keys whose value differs between jobs, in the order of the first job's overrides."""
    order: list[str] = []
    for job in jobs:
        order += [k for k in job.overrides if k not in order]
    return [k for k in order if len({job.overrides.get(k) for job in jobs}) > 1]


def _sorted(jobs: list[SweepJob]) -> list[SweepJob]:
    return sorted(jobs, key=lambda j: (j.samples_per_sec is None, -(j.samples_per_sec or 0), str(j.folder)))


def _value(text: str | None) -> Any:
    """An override value as a number where it is one (for the plot's axis), else the text."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def plot_sweep(jobs: list[SweepJob], keys: list[str], path: Path) -> str:
    """``sweep.png`` of samples/s: against the one swept key, or against the first with one line per value of the
    second; with three or more swept keys, one bar per job. Returns what it shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [j for j in jobs if j.samples_per_sec is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if keys and len(keys) <= 2:
        x_key, line_key = keys[0], (keys[1] if len(keys) == 2 else None)
        xs = sorted({_value(j.overrides.get(x_key)) for j in jobs}, key=lambda v: (isinstance(v, str), v))
        numeric = all(isinstance(v, (int, float)) for v in xs)
        lines = (
            sorted({_value(j.overrides.get(line_key)) for j in jobs}, key=lambda v: (isinstance(v, str), v))
            if line_key
            else [None]
        )
        for line in lines:
            points = sorted(
                (
                    (_value(j.overrides.get(x_key)), j.samples_per_sec)
                    for j in measured
                    if line_key is None or _value(j.overrides.get(line_key)) == line
                ),
                key=lambda p: (isinstance(p[0], str), p[0]),
            )
            if not points:
                continue
            px = [p[0] if numeric else xs.index(p[0]) for p in points]
            ax.plot(px, [p[1] for p in points], marker="o", label=f"{line_key}={line}" if line_key else None)
        if numeric and all(v > 0 for v in xs) and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        else:
            ax.set_xticks(xs, [str(v) for v in xs])
            ax.minorticks_off()
        ax.set_xlabel(x_key)
        ax.set_ylabel("samples/s")
        if line_key:
            ax.legend(fontsize=8)
        shown = f"samples/s against {x_key}" + (f", one line per {line_key}" if line_key else "")
    else:
        ordered = _sorted(measured)[::-1]
        labels = [" ".join(f"{k}={j.overrides.get(k)}" for k in keys) or str(j.folder) for j in ordered]
        ax.barh(range(len(ordered)), [j.samples_per_sec for j in ordered])
        ax.set_yticks(range(len(ordered)), labels, fontsize=7)
        ax.set_xlabel("samples/s")
        fig.set_size_inches(8, 0.3 * len(ordered) + 1.5)
        shown = "samples/s of each job" + (f" ({len(keys)} swept keys)" if keys else "")
    ax.set_title(f"{shown} (missing: jobs without figures)" if len(measured) < len(jobs) else shown, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with open_own(path, "wb") as f:  # a link planted at the name is replaced, never written through
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)
    return shown


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def sweep_wall_time(sweep: Path, jobs: list[SweepJob]) -> float | None:
    """From ``multirun.yaml`` (written as the first job starts) to the last job's end, in seconds."""
    start = (sweep / "multirun.yaml").stat().st_mtime if (sweep / "multirun.yaml").is_file() else None
    starts = [
        (sweep / j.folder / ".hydra" / "config.yaml").stat().st_mtime
        for j in jobs
        if (sweep / j.folder / ".hydra" / "config.yaml").is_file()
    ]
    ends = [(sweep / j.folder / "summary.json").stat().st_mtime for j in jobs if j.summary is not None]
    start = start if start is not None else (min(starts) if starts else None)
    return max(ends) - start if start is not None and ends else None


def load_warning(jobs: list[SweepJob]) -> str | None:
    """One sentence when jobs recorded a busy machine while they measured (their summary.json ``warnings``,
    ``runner.measure.machine_load.load_warnings``), as each run's console and the ablation report say; else None."""
    measured = [j for j in jobs if j.samples_per_sec]
    busy = [j for j in measured if (j.summary or {}).get("warnings")]
    if not busy:
        return None
    return (
        f"{len(busy)} of {len(measured)} measured jobs ran on a busy machine (e.g. {busy[0].folder.name}: "
        f"{busy[0].summary['warnings'][0]}): their figures are slower and noisier than on a quiet machine; "
        f"rerun when it is quiet for figures to trust"
    )


def _paired_cells(c: dict[str, Any] | None) -> list[str]:
    if not c or c["speedup"] is None:
        return ["–", "–"]
    ci = f" [{c['ci_low']:.3f}–{c['ci_high']:.3f}]" if c["ci_low"] is not None else ""
    return [f"×{c['speedup']:.3f}{ci}", c["verdict"]]


def _load_plain(sweep: Path) -> tuple[list[SweepJob], dict[str, Any] | None, dict[str, Any]]:
    """The sweep's jobs (fastest first), its interleaved record (None for a sequential sweep) and each job's
    paired comparison from it.

    Raises:
        SweepError: see ``load_sweep``; an unreadable record.
    """
    from runner.compare import record as record_file
    from runner.report import paired

    jobs = load_sweep(sweep)
    try:
        record = record_file.load(sweep)
    except ValueError as e:
        raise SweepError(str(e)) from e
    jobs = _sorted(_from_slices(jobs, record) if record else jobs)
    return jobs, record, paired.job_comparisons(record) if record else {}


def jobs_table(sweep: Path) -> list[str]:
    """report.md's table of the jobs, fastest first, as markdown lines: what a multirun prints at its end.

    Raises:
        SweepError: see ``load_sweep``.
    """
    jobs, record, compared = _load_plain(sweep)
    return _jobs_table(jobs, swept_keys(jobs), record, compared)


def _jobs_table(
    jobs: list[SweepJob], keys: list[str], record: dict[str, Any] | None, compared: dict[str, Any]
) -> list[str]:
    lines = [
        "| "
        + " | ".join(
            [
                *(f"`{k}`" for k in keys),
                "samples/s",
                *(["speed-up [95 % CI]", "verdict"] if record else []),
                "step ms",
                "data wait",
                "peak MiB",
                "train loss",
                "eval loss",
                "eval acc",
                "setup s",
                "job",
            ]
        )
        + " |",
        "|" + "---|" * len(keys) + "---:|" * (10 if record else 8) + "---|",
    ]
    for j in jobs:
        s = j.summary or {}
        cells = [j.overrides.get(k, "–") for k in keys] + [
            _fmt(j.samples_per_sec, ",.1f") if j.summary else "**no summary**",
            *(_paired_cells(compared.get(str(j.folder))) if record else []),
            _fmt(s.get("step_time_ms_median"), ",.1f"),
            _fmt(s.get("data_wait_fraction"), ".1%"),
            _fmt(s.get("peak_memory_mb"), ",.0f"),
            _fmt(s.get("train_loss"), ".3f"),
            _fmt(s.get("eval_loss"), ".3f"),
            _fmt(s.get("eval_accuracy"), ".1%"),
            _fmt(j.times.get("setup_s"), ".1f"),
            f"`{j.folder}`",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def write_plain_report(sweep: Path) -> list[Path]:
    """Write report.md, report.csv and sweep.png of a plain multirun into ``sweep``; returns the paths.

    Raises:
        SweepError: see ``load_sweep``.
    """
    from omegaconf import OmegaConf

    from runner.report import paired

    jobs, record, compared = _load_plain(sweep)
    blank = {"speedup": None, "ci_low": None, "ci_high": None, "verdict": None, "design": "sequential"}
    keys = swept_keys(jobs)
    fixed = {k: v for k, v in jobs[0].overrides.items() if k not in keys}
    written = [sweep / "report.md", sweep / "report.csv", sweep / "sweep.png"]
    with open_own(written[1], newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys + PLAIN_COLUMNS)
        for j in jobs:
            s = j.summary or {}
            values = [j.overrides.get(k, "") for k in keys] + [
                str(j.folder),
                j.problem or "ok",
                j.samples_per_sec,
                *(
                    compared.get(str(j.folder), blank).get(k)
                    for k in ("speedup", "ci_low", "ci_high", "verdict", "design")
                ),
                s.get("step_time_ms_median"),
                s.get("data_wait_fraction"),
                s.get("peak_memory_mb"),
                s.get("train_loss"),
                s.get("eval_loss"),
                s.get("eval_accuracy"),
                j.times.get("setup_s"),
                j.times.get("train_s"),
                j.times.get("measured_s"),
                " ".join(f"{k}={v}" for k, v in j.overrides.items()),
            ]
            writer.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in values])
    shown = plot_sweep(jobs, keys, written[2])

    command = "(not recorded)"
    if (sweep / "multirun.yaml").is_file():
        command = f"`{sweep_command(OmegaConf.load(sweep / 'multirun.yaml').hydra)}`"
    failed = [j for j in jobs if j.summary is None]
    lines = [
        "# Sweep report",
        "",
        "| | |",
        "|---|---|",
        f"| command | {command} |",
        f"| sweep folder | `{sweep}` |",
        f"| jobs | {len(jobs)} ({len(jobs) - len(failed)} with a summary, {len(failed)} without) |",
        f"| swept keys | {', '.join(f'`{k}`' for k in keys) or '(none)'} |",
        f"| fixed overrides | {' '.join(f'`{k}={v}`' for k, v in fixed.items()) or '(none)'} |",
        "",
    ]
    first = next((j.summary for j in jobs if j.summary), {}) or {}
    if record:
        lines += paired.noise_lines(record)
    elif first.get("warmup_steps") is not None:
        lines += [
            f"Each job's figures leave out its first {first['warmup_steps']} step(s) (warm-up); samples/s "
            f"is samples of the measured steps per second of their wall time. Jobs of a Hydra multirun "
            f"run one after the other in one process: only the first pays the imports, and the peak "
            f"memory of a CPU job (peak RSS) never falls below an earlier job's.",
            "",
        ]
    busy = load_warning(jobs)
    if busy:
        lines += [f"**Warning:** {busy}.", ""]
    lines += ["## Jobs, fastest first", "", *_jobs_table(jobs, keys, record, compared)]
    problems = [j for j in jobs if j.problem]
    if problems:
        lines += ["", "## Jobs without figures", ""] + [
            f"- `{j.folder}` ({' '.join(f'{k}={j.overrides.get(k)}' for k in keys)}): {j.problem}" for j in problems
        ]
    if not record:  # interleaved jobs spend most of their wall time waiting: no per-job time budget
        lines += [""] + budget_lines(
            [j.times for j in jobs], sweep_wall_time(sweep, jobs), "multirun.yaml written to the last summary"
        )
    lines += ["## Plot", "", f"{shown}:", "", f"![samples/s]({written[2].name})", ""]
    write_own(written[0], "\n".join(lines))
    return written
