"""The one way runner compares configurations: interleaved, paired measurement of resident job processes.

    from runner import compare
    result = compare.compare({"mine": cfg, "bf16": cfg_bf16}, reference="mine", folder=out, settings=cfg.interleave)
    result.intervals["bf16"]      # Interval(estimate=1.31, low=1.27, high=1.35, ...): bf16 ÷ mine, samples/s
    result.verdicts["bf16"]       # "helps" (Holm's step-down over the comparison's family)
    result.aa, result.minimum_detectable   # the reference against its own copy, and what that noise resolves

What each module does: docs/design.md, "The layers". Samples and time to target over seeds:

    seeds = {name: compare.read_seeds(folders) for name, folders in runs.items()}   # one folder per seed
    compare.time_to_target(seeds["bf16"], seeds["mine"], result.intervals["bf16"])   # TargetRatio(estimate=0.78, ...)

Clients: ``hydra/launcher=interleaved`` (runner/sweeps/interleaved.py), the speed tuner's rounds and ``python -m
runner.doctor <job> --verify``; the method: docs/ablation.md ("Interleaved measurement", "Samples to target").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from runner.compare import convergence, record as record_mod, stats
from runner.compare.conductor import Conductor, conduct
from runner.compare.convergence import read_seeds, samples_to_target, time_to_target
from runner.compare.process import Job
from runner.compare.stats import HELPS, HURTS, Interval

__all__ = [
    "HELPS",
    "HURTS",
    "Comparisons",
    "Interval",
    "Job",
    "compare",
    "convergence",
    "measure",
    "measured_job",
    "plan",
    "read",
    "read_seeds",
    "samples_to_target",
    "time_to_target",
]


@dataclass
class Comparisons:
    """What one comparison measured, configuration by configuration (a configuration is named by its first
    process): ``intervals`` (name -> ``Interval`` against its reference, None below 2 pairs), ``verdicts`` (name
    -> ``helps``/``hurts``/``no measurable effect``, Holm's step-down over the family; the A/A is tested on its
    own), ``aa`` (the reference against its copy A'; its name is ``aa_name``), ``samples_per_sec`` (each
    configuration's median slice), ``failed`` (name -> status of a job that did not measure), ``stopped`` (why
    each group stopped), ``measured_s`` (seconds of measuring, start-ups excluded), ``record`` (the whole
    ``interleave.json``) and ``design`` (``interleaved``)."""

    record: dict[str, Any]
    reference: str
    aa_name: str | None
    intervals: dict[str, Interval | None] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    aa: Interval | None = None
    samples_per_sec: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    measured_s: float = 0.0
    design: str = "interleaved"

    @property
    def minimum_detectable(self) -> float | None:
        """The smallest effect (relative) this comparison would call with 80 % power, from its A/A; None without."""
        return stats.minimum_detectable(self.aa) if self.aa is not None else None

    def versus(self, name: str, other: str) -> Interval | None:
        """``name`` against ``other`` when both are compared with the same reference (a candidate against the
        reference's copy, or against another candidate), pass by pass."""
        return record_mod.versus(self.record, name, other)


def read(record: dict[str, Any], confidence: float | None = None) -> Comparisons:
    """The ``Comparisons`` of a record (``interleave.json``, runner/compare/record.py) at ``confidence``
    (default: the record's ``interleave.confidence``)."""
    level = confidence or record.get("settings", {}).get("confidence", 0.95)
    aa = record.get("aa")
    intervals = record_mod.compare(record, level)
    out = Comparisons(
        record,
        record.get("reference"),
        aa,
        aa=intervals.pop(aa, None) if aa else None,
        stopped=list(record.get("stopped", [])),
    )
    out.intervals = intervals
    names = list(intervals)
    out.verdicts = dict(zip(names, stats.verdicts([intervals[n] for n in names], level)))
    for name, job in record.get("jobs", {}).items():
        if job["status"] != "measured":
            out.failed.setdefault(job.get("config") or name, job["status"])
    for config, processes in record_mod.configs(record).items():
        rates = sorted(
            x["samples_per_sec"] for x in record.get("slices", []) if x["job"] in processes and x["samples_per_sec"]
        )
        if rates:
            out.samples_per_sec[config] = rates[len(rates) // 2]
    return out


def plan(configs: Mapping[str, DictConfig], reference: str, folder: Path, processes: int = 1) -> tuple[list[Job], str]:
    """The jobs that compare ``configs`` (name -> resolved config) with ``configs[reference]``: every
    configuration in ``processes`` processes (``<name>``, ``<name>-p1``, ...), each in ``folder/<process>``, and
    the reference's copy ``<reference>-aa`` (A', the comparison's own noise). Returns the jobs and the copy's name.

    Raises:
        KeyError: ``reference`` is not one of ``configs``.
    """
    aa = f"{reference}-aa"
    entries = [(reference, configs[reference], None), (aa, configs[reference], reference)]
    entries += [(name, c, reference) for name, c in configs.items() if name != reference]
    jobs = [
        Job(name if p == 0 else f"{name}-p{p}", c, folder / (name if p == 0 else f"{name}-p{p}"), ref, config=name)
        for name, c, ref in entries
        for p in range(processes)
    ]
    return jobs, aa


def measure(
    jobs: list[Job],
    settings: DictConfig,
    folder: Path,
    reference: str,
    aa: str | None,
    *,
    retire: Callable[[dict[str, Interval | None]], list[str]] | None = None,
    ranks: Any = None,
    enough: Callable[[dict[str, Interval | None]], str | None] | None = None,
) -> Comparisons:
    """Measure ``jobs`` interleaved into ``folder`` with ``settings`` (``interleave.*``) and return what was measured.
    ``retire``: racing, ``enough``: a stop when the caller's verdict is firm, see ``Conductor``; ``ranks``: under
    torchrun (runner/compare/ranks.py), every rank gets rank 0's record. A first Ctrl-C stops after the current
    slice and returns what was measured; a second kills the jobs and raises KeyboardInterrupt (``interleave.json``
    holds what was measured)."""
    folder.mkdir(parents=True, exist_ok=True)
    conductor = Conductor(jobs, settings, folder, reference, aa, retire=retire, ranks=ranks, enough=enough)
    conduct(conductor)
    record = record_mod.load(folder) if ranks is None or ranks.leader else None
    record = (ranks.share(record) if ranks is not None else record) or {"jobs": {}, "slices": []}
    result = read(record, settings.confidence)
    result.measured_s = conductor.measuring_s
    return result


def compare(
    configs: Mapping[str, DictConfig],
    reference: str,
    folder: Path,
    settings: DictConfig,
    *,
    minutes: float | None = None,
    retire: Callable[[dict[str, Interval | None]], list[str]] | None = None,
    ranks: Any = None,
    enough: Callable[[dict[str, Interval | None]], str | None] | None = None,
) -> Comparisons:
    """Compare ``configs`` (name -> resolved config, each made a measured job: ``measured_job``) with
    ``configs[reference]``: ``plan`` with ``settings.processes`` processes each, then ``measure`` with at most
    ``minutes`` of measuring (default ``settings.max_minutes``). Writes each job's folder and ``interleave.json``
    into ``folder``."""
    s = copy.deepcopy(settings)
    if minutes is not None:
        s.max_minutes = minutes
    jobs, aa = plan(configs, reference, folder, s.processes)
    return measure(jobs, s, folder, reference, aa, retire=retire, ranks=ranks, enough=enough)


def measured_job(cfg: DictConfig) -> DictConfig:
    """``cfg`` resolved and made a measured job: it trains until told to finish (no step limit, no evaluation but
    one batch at the end, no checkpoint, no logger, no samples, no doctor, no early stop, no targets, no metric
    for a search to optimize)."""
    from runner.config.logger import LOGGERS

    out = copy.deepcopy(cfg)
    OmegaConf.resolve(out)
    quiet = {
        **{f"logger.{name}": None for name in LOGGERS},
        "trainer.progress": "off",
        "trainer.max_steps": 10**9,
        "trainer.eval_every": 10**9,
        "trainer.eval_max_batches": 1,
        "trainer.doctor": False,
        "trainer.target_loss": None,
        "trainer.target_accuracy": None,
        "trainer.stop_at_target": False,
        "task.sample_tokens": 0,
        "optimized_metric": None,
        "trainer.early_stopping.metric": None,
        "checkpoint.resume": "never",
        "checkpoint.at_end": False,
        "checkpoint.every_steps": None,
        "checkpoint.every_minutes": None,
        "checkpoint.keep_best": False,
    }
    for key, value in quiet.items():
        if OmegaConf.select(out, key, default="<missing>") != "<missing>":
            OmegaConf.update(out, key, value, merge=False)
    return out
