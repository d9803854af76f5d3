"""``--verify``: measure what each suggestion buys, interleaved beside the job's own rerun (runner/compare/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.doctor.diagnosis import Finding
from runner.doctor.job import Job, command, merge_overrides
from runner.errors import ConfigError
from runner.files import write_own

#: What every --verify run adds to the job's overrides (runner.compare.measured_job quiets the rest).
VERIFY_FIXED = ["logger=none", "trainer.progress=off", "trainer.doctor=false"]
#: Measuring time of --verify by default (minutes, start-ups excluded): enough passes for an interval on a CPU.
VERIFY_MINUTES = 1.0


@dataclass
class Trial:
    """One configuration of --verify: its label, the overrides added to the job's, its folder (its name in the
    comparison), its median samples/s per slice, and what it buys over the job's rerun (``interval``: a
    ``runner.compare.Interval``, None for the rerun itself or without two passes) and the verdict."""

    label: str
    overrides: list[str]
    folder: str
    samples_per_sec: float | None = None
    interval: object = None
    verdict: str = ""

    @property
    def speedup(self) -> float | None:
        return self.interval.estimate if self.interval is not None else (1.0 if self.verdict == "reference" else None)


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
    return trials if top is None else trials[: top + 1]


def compose_job(job: Job, overrides: list[str]):
    """The job's config with ``overrides`` (Hydra's compose API on runner's conf/ and the job's search path),
    resolved, as ``python -m runner`` would compose it.

    Raises:
        ConfigError: the overrides do not compose (Hydra's message).
    """
    from omegaconf import OmegaConf

    from runner.techniques import variants

    try:
        cfg = variants.compose(overrides, job.searchpath)
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - Hydra's compose errors come in several types; one message
        raise ConfigError(f"the overrides {' '.join(overrides)} do not compose: {e}") from e
    return cfg


def verify(
    job: Job,
    findings: list[Finding],
    steps: int | None = None,
    repeats: int = 1,
    minutes: float = VERIFY_MINUTES,
    out: Path | None = None,
    top: int | None = None,
) -> tuple[list[Trial], Path]:
    """Measure the job's rerun and each suggestion (the first ``top``) interleaved (``runner.compare.compare``):
    ``repeats`` processes each, slices of ``steps`` steps (default: about ``interleave.slice_seconds``), an A/A copy
    of the rerun, ``minutes`` of measuring; each suggestion's samples/s ÷ the rerun's, with its interval and Holm's
    verdict (docs/tuners-and-doctor.md). Runs in the folder the doctor runs in (never the job's recorded folder: a
    module planted there would run). Writes ``verify.json`` and ``verify.md`` into ``out`` (default
    ``<job>/doctor-verify/<date>_<time>``).

    Raises:
        ConfigError: a multi-process job (verify runs one process), bad ``repeats``/``steps``/``minutes``/``top``,
            overrides that do not compose, or the job's own rerun measuring nothing.
    """
    import time

    from omegaconf import OmegaConf

    from runner import compare
    from runner.config.tools import InterleaveConfig

    _check_options(job, steps, repeats, minutes, top)
    trials = verify_plan(job, findings, top)
    if len(trials) == 1:
        raise ConfigError(f"the diagnosis of {job.folder} suggests no override to verify")
    out = Path(out) if out else job.folder / "doctor-verify" / time.strftime("%Y-%m-%d_%H-%M-%S")
    configs = {
        t.folder: compare.measured_job(compose_job(job, merge_overrides(job.overrides, [*t.overrides, *VERIFY_FIXED])))
        for t in trials
    }  # every configuration composes before anything runs
    settings = OmegaConf.structured(InterleaveConfig(processes=repeats, slice_steps=steps, max_minutes=minutes))
    print(
        f"verify: {len(trials)} configurations, {repeats} process(es) each, interleaved for up to {minutes:g} "
        f"min of measuring, into {out}",
        flush=True,
    )
    if job.cwd is not None and job.cwd.resolve() != Path.cwd().resolve():
        # Never import from (or chdir into) a folder the doctor was not started in: a job folder may come from
        # someone else, and a module planted there would run. Relative paths and the user's modules resolve here.
        print(
            f"verify: the job ran from {job.cwd}; its relative paths and own modules (data._target_, "
            f"model._target_) resolve from here, {Path.cwd()}. To rerun it as it ran: cd {job.cwd}",
            flush=True,
        )
    result = compare.compare(configs, trials[0].folder, out, settings)
    for t in trials:
        t.samples_per_sec = result.samples_per_sec.get(t.folder)
        if t is trials[0]:
            t.verdict = "reference" if t.samples_per_sec else "failed (see its folder)"
            continue
        t.interval = result.intervals.get(t.folder)
        t.verdict = (
            (result.verdicts.get(t.folder) or "no interval (fewer than 2 passes)")
            if t.samples_per_sec
            else f"failed ({result.failed.get(t.folder, 'no figure')}; see its folder)"
        )
    if trials[0].samples_per_sec is None:
        raise ConfigError(
            f"the job's own rerun measured nothing (see its output above and {out / trials[0].folder}); "
            f"nothing to compare against"
        )
    _write_verify(job, trials, result, out)
    return trials, out


def _check_options(job: Job, steps: int | None, repeats: int, minutes: float, top: int | None) -> None:
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: give 1 or more processes per configuration")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: give 1 or more steps per slice (or leave it out: about 4 s of the job)")
    if not minutes > 0:
        raise ConfigError(f"--minutes {minutes}: give the measuring time in minutes, e.g. 1")
    if top is not None and top < 1:
        raise ConfigError(f"--top {top}: give 1 or more (or leave it out: every suggestion)")
    if (job.summary.get("world_size") or 1) > 1:
        raise ConfigError(
            f"{job.folder} ran on {job.summary['world_size']} processes; --verify reruns one "
            f"process: measure under torchrun with `python -m runner -m +experiment=ablation`"
        )


def verify_table(trials: list[Trial]) -> list[str]:
    """The --verify result as markdown table lines (also what the console shows)."""
    lines = [
        "| configuration | samples/s (median slice) | × the job's rerun | 95 % CI | verdict |",
        "|---|---:|---:|---|---|",
    ]
    for t in trials:
        ci = f"[{t.interval.low:.3f}, {t.interval.high:.3f}]" if t.interval else "–"
        sps = f"{t.samples_per_sec:,.1f}" if t.samples_per_sec is not None else "–"
        ratio = f"{t.speedup:.3f}" if t.speedup is not None else "–"
        lines.append(f"| {t.label} | {sps} | {ratio} | {ci} | {t.verdict} |")
    return lines


def _write_verify(job: Job, trials: list[Trial], result, out: Path) -> None:
    from runner.compare import record as record_mod
    from runner.track import write_json_atomic

    aa = result.aa
    record = {
        "job": str(job.folder),
        "command": command(job, []),
        "design": result.design,
        "aa": {"speedup": aa.estimate, "ci_low": aa.low, "ci_high": aa.high} if aa else None,
        "minimum_detectable": result.minimum_detectable,
        "stopped": result.stopped,
        "trials": [
            {
                "label": t.label,
                "overrides": t.overrides,
                "folder": t.folder,
                "samples_per_sec": t.samples_per_sec,
                "speedup": t.speedup,
                "ci_low": t.interval.low if t.interval else None,
                "ci_high": t.interval.high if t.interval else None,
                "verdict": t.verdict,
                "command": command(job, t.overrides),
            }
            for t in trials
        ],
    }
    write_json_atomic(out / "verify.json", record)
    noise = (
        f"The job's rerun against its own copy (A/A): {record_mod.describe(aa)}; effects below about "
        f"±{result.minimum_detectable:.1%} are not resolved."
        if aa
        else "No A/A interval (fewer than 2 passes)."
    )
    text = [
        f"# What the doctor's suggestions buy: {job.folder}",
        "",
        "Every configuration was resident in its own process and they took turns in slices, pass after pass "
        "(runner/compare/); a suggestion's speed-up is the mean log ratio of its samples/s to the job's rerun "
        "in the paired slices, with its 95 % Student-t interval; verdicts are Holm's over the suggestions.",
        "",
        noise,
        "",
        *verify_table(trials),
        "",
        f"Stopped: {'; '.join(result.stopped)}",
        "",
    ]
    write_own(out / "verify.md", "\n".join(text))
