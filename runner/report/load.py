"""Reading an ablation sweep folder: its jobs (``Job``), the per-configuration ``Row`` they are grouped
into (runner/report/rows.py fills it), and the sweep's record (``ablation.json``).

A job that measured holds ``summary.json``, one that did not ``not_run.json`` or ``failed.json``; the
configurations (``baseline``, ``fast``, ``baseline+<technique>``, ``fast-<technique>``): docs/ablation.md. Bad
input raises ``ReportError``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.compare.stats import Interval
from runner.report.sweep import job_times, slice_summary, sweep_command


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
    times: dict[str, float | None] = field(default_factory=dict)  # runner.report.sweep.job_times, in s

    @property
    def samples_per_sec(self) -> float | None:
        """The job's samples/s over its measured steps (summary.json), None when it has no figure."""
        sps = (self.summary or {}).get("samples_per_sec")
        return float(sps) if sps else None


@dataclass
class Row:
    """One configuration: its jobs' figures (medians over its processes) and how it compares (runner/report/rows.py)."""

    configuration: str
    kind: str | None
    technique: str | None
    jobs: list[Job] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)  # samples/s of each measured process
    speedup: float | None = None  # against the baseline (runner/report/paired.py), or median / the baseline's median
    speedup_ci: Interval | None = None  # of the speed-up, from the interleaved record
    effect: float | None = None  # what the technique buys: x >1 helps (see runner/report/rows.py)
    effect_ci: Interval | None = None  # of the effect, against the row's own reference
    verdict: str = ""
    rank: int | None = None
    status: str = ""  # applied/skipped of the techniques this row switches
    all_skipped: bool = False
    figures: dict[str, float | None] = field(default_factory=dict)
    peak_change_pct: float | None = None
    design: str = ""  # how the figures were measured: interleaved | rounds (the fallback, runner/compare/fallback.py)

    @property
    def median(self) -> float | None:
        """The median samples/s over the measured processes, None without one."""
        return statistics.median(self.runs) if self.runs else None


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
    its timing (``runner.report.sweep.job_times``), sorted by (repeat, configuration).

    Raises:
        ReportError: no such folder, nothing to report, a corrupt file, a summary that is not from an
            ablation job, or the same (configuration, repeat) twice (two sweeps in one folder).
    """
    if not sweep.is_dir():
        raise ReportError(
            f"{sweep} is not a folder; pass the sweep folder of `python -m runner -m "
            f"+experiment=ablation` (outputs/ablation/<date>/<time>)"
        )
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
                    raise ReportError(
                        f"{path} is not from an ablation job (no config.ablation.variant); the report "
                        f"reads sweeps of `python -m runner -m +experiment=ablation`"
                    )
                job = Job(
                    variant,
                    int(repeat),
                    path.parent.relative_to(sweep),
                    ablation.get("kind"),
                    ablation.get("technique"),
                    data,
                )
            else:
                variant, repeat = data.get("variant"), int(data.get("repeat", 0))
                if variant is None:
                    raise ReportError(f"{path} names no variant; delete that job folder or run it again")
                if (variant, repeat) in jobs:  # a summary wins over a marker of the same job
                    continue
                job = Job(variant, repeat, path.parent.relative_to(sweep), kind_of(variant), technique_of(variant))
                job.not_run = data.get("reason") if name == "not_run.json" else None
                job.failed = data.get("returncode") if name == "failed.json" else None
            key = (variant, repeat)
            if key in jobs and name == "summary.json":
                raise ReportError(
                    f"{variant} repeat {repeat} appears twice ({sweep / jobs[key].folder} and "
                    f"{path.parent}); "
                    f"pass one sweep folder, not a folder holding several sweeps"
                )
            job.times = job_times(path.parent, job.summary)
            jobs[key] = job
    if not jobs:
        raise ReportError(
            f"{sweep} holds no summary.json; is it the sweep folder of `python -m runner -m "
            f"+experiment=ablation` (outputs/ablation/<date>/<time>), and did its jobs finish?"
        )
    return sorted(jobs.values(), key=lambda j: (j.repeat, j.variant))


def unfinished_jobs(sweep: Path, record: dict[str, Any], jobs: list[Job]) -> list[Job]:
    """Jobs of ``record`` that measured slices but left no summary.json, failed.json or not_run.json in
    ``sweep`` (their process was killed: SIGKILL, a machine restart, the out-of-memory killer), each with a summary
    made of its slices (``runner.report.sweep.slice_summary``).

    Raises:
        ReportError: a job folder without a readable ``.hydra/config.yaml`` naming ``ablation.variant``.
    """
    known = {str(j.folder) for j in jobs}
    by_job: dict[str, list[dict[str, Any]]] = {}
    for s in record.get("slices", []):
        by_job.setdefault(s["job"], []).append(s)
    out = []
    for name, job in record["jobs"].items():
        slices = by_job.get(name)
        if name in known or not slices:
            continue
        path = sweep / job.get("folder", name) / ".hydra" / "config.yaml"
        try:
            cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            ablation = cfg["ablation"]
            variant = ablation["variant"]
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ReportError(
                f"{path} cannot be read or names no ablation.variant ({e}); delete that job "
                f"folder from interleave.json's jobs or run the sweep again"
            ) from e
        summary = slice_summary(slices) | {"config": cfg}
        folder = Path(job.get("folder", name))
        unfinished = Job(
            variant, int(ablation.get("repeat", 0)), folder, ablation.get("kind"), ablation.get("technique"), summary
        )
        unfinished.times = job_times(sweep / folder, None)
        out.append(unfinished)
    return out


def kind_of(variant: str) -> str:
    """The kind of a configuration, from its name: ``baseline``, ``fast``, ``leave-one-in``
    (``baseline+<technique>``) or ``leave-one-out`` (``fast-<technique>``)."""
    if variant in ("baseline", "fast"):
        return variant
    return "leave-one-in" if variant.startswith("baseline+") else "leave-one-out"


def technique_of(variant: str) -> str | None:
    """The technique a configuration switches, from its name (None for ``baseline`` and ``fast``)."""
    for prefix in ("baseline+", "fast-"):
        if variant.startswith(prefix):
            return variant[len(prefix) :]
    return None


def technique_status(
    kind: str | None, own: dict[str, str], baseline: dict[str, str], fast: dict[str, str] | None
) -> tuple[str, bool]:
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
        text = "; ".join(
            p
            for p in (
                "applied: " + ", ".join(applied) if applied else "",
                "skipped: " + ", ".join(skipped) if skipped else "",
            )
            if p
        )
        return text or ("no status recorded" if kind == "fast" else "none"), False
    if not changed:
        return "no status recorded", False
    return "; ".join(f"{k}: {v}" for k, v in changed.items()), all(v.startswith("skipped") for v in changed.values())


def load_record(sweep: Path) -> dict[str, Any]:
    """``ablation.json`` (machine, command, times), or what can be rebuilt without it: the command from
    ``multirun.yaml`` and the machine this report runs on (with a ``machine_note`` saying so).

    A corrupt ``ablation.json`` is treated as missing; nothing is raised.
    """
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
    from runner.measure.hardware import describe_machine  # imports torch: only when the record must be rebuilt

    record["machine"] = describe_machine()
    record["machine_note"] = "the machine this report was made on (the sweep folder has no ablation.json)"
    return record
