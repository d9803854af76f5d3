"""``--verify``: rerun the job and each suggestion in fresh processes and measure what each buys."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from runner.doctor.diagnosis import VERIFY_MEASURED_STEPS, Finding, _get, _num
from runner.doctor.job import Job, _read_json, command, merge_overrides
from runner.errors import ConfigError
from runner.report import stats

#: What every --verify run adds to the job's overrides: quiet, short, no files beyond the figures.
VERIFY_FIXED = ["logger=none", "trainer.progress=off", "trainer.doctor=false", "checkpoint.at_end=false",
                "checkpoint.every_steps=null", "checkpoint.every_minutes=null", "checkpoint.resume=never",
                "trainer.eval_max_batches=1"]


@dataclass
class Trial:
    """One configuration of --verify: its label, overrides added to the job's, and each repeat's samples/s
    (None for a run that failed or measured nothing)."""

    label: str
    overrides: list[str]
    folder: str
    runs: list[float | None] = field(default_factory=list)
    speedup: float | None = None
    interval: stats.Interval | None = None
    verdict: str = ""

    @property
    def measured(self) -> list[float]:
        return [r for r in self.runs if r is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.measured) if self.measured else None


def verify_plan(job: Job, findings: list[Finding], top: int | None = None) -> list[Trial]:
    """The job's own rerun first, then each distinct suggestion with overrides, in the diagnosis's order
    (the first ``top`` of them when given)."""
    trials = [Trial("the job (rerun)", [], "job")]
    seen: set[tuple[str, ...]] = set()
    for f in findings:
        for sug in f.suggestions:
            key = tuple(sug.overrides)
            if sug.overrides and key not in seen:
                seen.add(key)
                trials.append(Trial(" ".join(sug.overrides), list(sug.overrides), f"s{len(trials)}"))
    return trials if top is None else trials[:top + 1]


def verify_steps(job: Job, steps: int | None) -> int:
    """Steps of each --verify run: ``steps``, else the job's ``trainer.max_steps``, else its warm-up +
    ``VERIFY_MEASURED_STEPS``.

    Raises:
        ConfigError: a step count that leaves nothing measured after the warm-up.
    """
    warmup = int(_get(job.config, "trainer.warmup_steps", 0) or 0)
    chosen = steps or _get(job.config, "trainer.max_steps") or warmup + VERIFY_MEASURED_STEPS
    if chosen <= warmup:
        raise ConfigError(f"--steps {chosen} leaves no measured step after the job's trainer.warmup_steps={warmup}; "
                          f"give --steps {warmup + VERIFY_MEASURED_STEPS}")
    return int(chosen)


def compose_job(job: Job, overrides: list[str]):
    """The job's config with ``overrides`` (Hydra's compose API on runner's conf/ and the job's search path),
    resolved, as ``python -m runner`` would compose it.

    Raises:
        ConfigError: the overrides do not compose (Hydra's message).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner import CONF_DIR
    from runner.config import register_configs

    register_configs()
    extra = [f"hydra.searchpath=[{','.join(job.searchpath)}]"] if job.searchpath else []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*extra, *overrides])
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - Hydra's compose errors come in several types; one message
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose: {e}") from e
    return cfg


def verify(job: Job, findings: list[Finding], steps: int | None = None, repeats: int = 3,
           out: Path | None = None, top: int | None = None) -> tuple[list[Trial], Path]:
    """Run the job and each suggestion (the first ``top``) ``repeats`` times (repeat = outer loop) for ``verify_steps`` steps,
    each in a fresh process forked from the ablation's job server (``runner.ablation.fork_train``), in
    the folder the doctor runs in (never the job's recorded folder: a module planted there would run); then each suggestion's speed-up over the job's rerun: median samples/s ÷
    the rerun's median, its 95 % bootstrap interval and verdict (``runner.report.stats``; with one repeat no
    interval). Writes ``verify.json`` and ``verify.md`` into ``out`` (default
    ``<job>/doctor-verify/<date>_<time>``).

    Raises:
        ConfigError: a multi-process job (verify runs one process), bad ``repeats``/``steps``, overrides
            that do not compose, or the job's own rerun measuring nothing.
    """
    from runner.ablation import fork_train

    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: give 1 or more (3 for an interval)")
    if top is not None and top < 1:
        raise ConfigError(f"--top {top}: give 1 or more (or leave it out: every suggestion)")
    if (job.summary.get("world_size") or 1) > 1:
        raise ConfigError(f"{job.folder} ran on {job.summary['world_size']} processes; --verify reruns one "
                          f"process: measure under torchrun with `python -m runner -m +experiment=ablation`")
    n_steps = verify_steps(job, steps)
    trials = verify_plan(job, findings, top)
    if len(trials) == 1:
        raise ConfigError(f"the diagnosis of {job.folder} suggests no override to verify")
    out = Path(out) if out else job.folder / "doctor-verify" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    configs = {t.folder: compose_job(job, merge_overrides(job.overrides, [*t.overrides, f"trainer.max_steps={n_steps}",
                                                                          *VERIFY_FIXED]))
               for t in trials}  # every configuration composes before anything runs
    print(f"verify: {len(trials)} configurations x {repeats} repeat(s), {n_steps} steps each, into {out}", flush=True)
    if job.cwd is not None and job.cwd.resolve() != Path.cwd().resolve():
        # Never import from (or chdir into) a folder the doctor was not started in: a job folder may come from
        # someone else, and a module planted there would run. Relative paths and the user's modules resolve here.
        print(f"verify: the job ran from {job.cwd}; its relative paths and own modules (data._target_, "
              f"model._target_) resolve from here, {Path.cwd()}. To rerun it as it ran: cd {job.cwd}", flush=True)
    for repeat in range(repeats):
        for t in trials:
            folder = (out / t.folder / f"r{repeat}").resolve()
            status = fork_train(configs[t.folder], folder, {}, f"doctor {t.folder}/r{repeat}")
            summary = folder / "summary.json"
            sps = _num(_read_json(summary).get("samples_per_sec")) if status == 0 and summary.is_file() else None
            t.runs.append(sps)
            print(f"verify: {t.label} r{repeat}: " + (f"{sps:,.1f} samples/s" if sps else
                                                      f"no figure (exit status {status})"), flush=True)
    base = trials[0]
    if base.median is None:
        raise ConfigError(f"the job's own rerun measured nothing (see its output above and {out / base.folder}); "
                          f"nothing to compare against")
    for t in trials:
        if t.median is None:
            t.verdict = "failed (see its folder)"
            continue
        t.speedup = t.median / base.median
        if t is base:
            t.verdict = "reference"
            continue
        t.interval = stats.ratio_interval(t.measured, base.measured, name=t.label, reference_name=base.label)
        t.verdict = stats.verdict(t.interval)
    _write_verify(job, trials, n_steps, repeats, out)
    return trials, out


def verify_table(trials: list[Trial]) -> list[str]:
    """The --verify result as markdown table lines (also what the console shows)."""
    lines = ["| configuration | samples/s (median) | runs | × the job's rerun | 95 % CI | verdict |",
             "|---|---:|---:|---:|---|---|"]
    for t in trials:
        ci = f"[{t.interval.low:.2f}, {t.interval.high:.2f}]" if t.interval else "–"
        med = f"{t.median:,.1f}" if t.median is not None else "–"
        ratio = f"{t.speedup:.2f}" if t.speedup is not None else "–"
        lines.append(f"| {t.label} | {med} | {len(t.measured)}/{len(t.runs)} | {ratio} | {ci} | {t.verdict} |")
    return lines


def _write_verify(job: Job, trials: list[Trial], steps: int, repeats: int, out: Path) -> None:
    from runner.track import write_json_atomic

    record = {"job": str(job.folder), "steps": steps, "repeats": repeats, "command": command(job, []),
              "trials": [{"label": t.label, "overrides": t.overrides, "folder": t.folder, "samples_per_sec": t.runs,
                          "median_samples_per_sec": t.median, "speedup": t.speedup,
                          "ci_low": t.interval.low if t.interval else None,
                          "ci_high": t.interval.high if t.interval else None, "verdict": t.verdict,
                          "command": command(job, t.overrides)} for t in trials]}
    write_json_atomic(out / "verify.json", record)
    text = [f"# What the doctor's suggestions buy: {job.folder}", "",
            f"Each configuration ran {repeats} time(s) for {steps} steps (the job's warm-up left out), one fresh "
            f"process each, repeats as the outer loop. Speed-up = median samples/s ÷ the job's rerun's; 95 % "
            f"bootstrap interval of that ratio ({stats.RESAMPLES:,} resamples, runner/report/stats.py); helps/hurts "
            f"when the whole interval lies above/below 1.", "", *verify_table(trials), ""]
    (out / "verify.md").write_text("\n".join(text))

