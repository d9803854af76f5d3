"""The speed tuner's rounds (runner/tune/speed.py): each an interleaved, paired measurement of candidate
configurations against a reference, and what the search reads from it.

- ``job_config``: a configuration made a measured job (no step limit, no evaluation, no checkpoint, no logger).
- ``measure_round``: the jobs resident side by side (runner/interleave/), racing out the firmly slower ones.
- ``read_round``: the comparisons, Holm's verdicts, failures and median speeds from the round's record.
- ``helps``, ``hopefuls``, ``choose``: the decisions the greedy search and its verification take on them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.tune.switches import Switch, is_language_model

# ------------------------------------------------------------------------------------------- measuring


def job_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` resolved and made a measured job of a round: trains until told to finish (no step limit, no
    evaluation but one batch at the end, no checkpoint, no logger, no samples, no doctor, no early stop)."""
    from runner.config import LOGGERS

    out = copy.deepcopy(cfg)
    OmegaConf.resolve(out)
    quiet = {**{f"logger.{name}": None for name in LOGGERS}, "trainer.progress": "off", "trainer.max_steps": 10**9,
             "trainer.eval_every": 10**9, "trainer.eval_max_batches": 1, "trainer.doctor": False,
             "trainer.target_loss": None, "trainer.target_accuracy": None,
             "trainer.early_stopping.metric": None, "checkpoint.resume": "never", "checkpoint.at_end": False,
             "checkpoint.every_steps": None, "checkpoint.every_minutes": None, "checkpoint.keep_best": False,
             "ablation.isolate": False}
    if is_language_model(cfg):
        quiet["task.sample_tokens"] = 0
    for key, value in quiet.items():
        if OmegaConf.select(out, key, default="<missing>") != "<missing>":
            OmegaConf.update(out, key, value, merge=False)
    return out


@dataclass
class Round:
    """One interleaved measurement: ``jobs`` (name -> config) against ``reference`` (a name of ``jobs``)."""

    title: str
    reference: str
    jobs: dict[str, DictConfig]
    minutes: float
    comparisons: dict[str, Any] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    aa: Any = None
    vs_copy: dict[str, Any] = field(default_factory=dict)  # name -> stats.Paired against the reference's copy A'
    samples_per_sec: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)  # the round's interleave.json (rank 0's)
    measured_s: float = 0.0  # seconds spent measuring (start-ups excluded)


def measure_round(r: Round, folder: Path, settings: DictConfig, ranks: Any = None) -> Round:
    """Measure ``r``'s jobs side by side with the interleaved conductor (runner/interleave/coordinator.py):
    each job resident in its own process, slices in random order per pass, the reference's copy as A', until
    every interval is within ``settings.target_ci`` or ``r.minutes`` of measuring are spent. Fills
    ``r.comparisons`` (name -> ``stats.Paired`` against the reference, or None), ``r.verdicts`` (Holm over the
    round), ``r.aa``, ``r.samples_per_sec`` (each job's median slice) and ``r.failed`` (a job that crashed, e.g.
    out of memory: name -> status) and ``r.record`` (the conductor's ``interleave.json``). Ctrl-C stops the
    round after the current slice. ``ranks``: under torchrun (runner/interleave/ranks.py), every rank's
    conductor mirrors rank 0's, and every rank gets rank 0's record."""
    from runner.interleave import record as record_mod, stats
    from runner.interleave.coordinator import Conductor, Job, conduct

    folder.mkdir(parents=True, exist_ok=True)
    aa = f"{r.reference}-aa"
    configs = [(r.reference, r.jobs[r.reference], None), (aa, r.jobs[r.reference], r.reference)]
    configs += [(name, c, r.reference) for name, c in r.jobs.items() if name != r.reference]
    jobs = [Job(name if p == 0 else f"{name}-p{p}", job_config(c), folder / (name if p == 0 else f"{name}-p{p}"),
                ref, config=name) for name, c, ref in configs for p in range(settings.processes)]
    s = copy.deepcopy(settings)
    s.max_minutes = r.minutes

    def retire(comparisons: dict[str, Any]) -> list[str]:  # racing: firmly slower candidates stop early
        names = [n for n in comparisons if n != aa and comparisons[n] is not None]
        verdicts = stats.verdicts([comparisons[n] for n in names], s.confidence)
        return [n for n, v in zip(names, verdicts) if v == stats.HURTS]

    conductor = Conductor(jobs, s, folder, r.reference, aa, retire=retire, ranks=ranks)
    conduct(conductor)
    r.measured_s = conductor.measuring_s
    record = record_mod.load(folder) if ranks is None or ranks.leader else None
    record = (ranks.share(record) if ranks is not None else record) or {"jobs": {}, "slices": []}
    return read_round(r, record, aa, s.confidence)


def read_round(r: Round, record: dict[str, Any], aa: str, confidence: float) -> Round:
    """Fill ``r``'s figures from its conductor's ``record`` (``interleave.json``; ``aa``: the reference's copy):
    the comparisons with the reference and with the copy, Holm's verdicts at ``confidence``, failures, each
    configuration's median slice and why it stopped. Returns ``r``."""
    from runner.interleave import record as record_mod, stats

    r.record = record
    comparisons = record_mod.compare(record)
    r.aa = comparisons.pop(aa, None)
    r.comparisons = comparisons
    r.vs_copy = {n: record_mod.versus(record, n, aa) for n in comparisons}
    names = list(comparisons)
    r.verdicts = dict(zip(names, stats.verdicts([comparisons[n] for n in names], confidence)))
    for name, job in record["jobs"].items():
        if job["status"] not in ("measured",):
            r.failed.setdefault(job.get("config") or name, job["status"])
    for config, processes in record_mod.configs(record).items():
        rates = sorted(x["samples_per_sec"] for x in record["slices"]
                       if x["job"] in processes and x["samples_per_sec"])
        if rates:
            r.samples_per_sec[config] = rates[len(rates) // 2]
    r.stopped = list(record.get("stopped", []))
    return r


def helps(r: Round, name: str, min_speedup: float) -> bool:
    """True when ``name`` is firmly faster than the round's reference: Holm's verdict is "helps", its interval's
    low end exceeds ``min_speedup``, and it is faster than the reference's copy A' too (interval above 1). The
    last is a guard against the process itself: on a shared VM two processes of one configuration can differ
    by 10-30 % for their whole life (docs/ablation.md), so an unlucky reference process would make every
    candidate look faster; beating both copies makes that unlikely."""
    from runner.interleave.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    return (c is not None and r.verdicts.get(name) == HELPS and c.ci_low > min_speedup
            and (r.aa is None or (copy_c is not None and copy_c.ci_low > 1)))


def hopefuls(r: Round, candidates: list[Switch]) -> list[Switch]:
    """The candidates of ``r`` that read faster than its reference without being firmly so: point estimate
    above 1, not firmly slower, not failed; the best of each ``group`` only (one compile mode, one optimizer
    kernel). Greedy selection keeps a switch only when it is firmly faster, but on a noisy machine effects of
    5-15 % are rarely firm in a short round, and several of them add up: on resnet18/CIFAR, compile x1.07 and
    channels_last x1.12 on top of bf16, neither firm, left the pick bf16 alone at x0.83 of +experiment=fast. So
    the pick plus these is measured head to head too (``choose``)."""
    from runner.interleave.stats import HURTS

    best: dict[str, Switch] = {}
    for s in candidates:
        c = r.comparisons.get(s.name)
        if c is None or s.name in r.failed or c.speedup <= 1 or r.verdicts.get(s.name) == HURTS:
            continue
        key = s.group or s.name
        if key not in best or c.speedup > r.comparisons[best[key].name].speedup:
            best[key] = s
    return list(best.values())


def choose(v: Round, names: list[str], min_speedup: float) -> str | None:
    """Of the verification's configurations ``names`` (fewest switches first), the one to recommend: those
    firmly faster than your configuration (``helps``); of two, the one with more switches only when it is
    firmly faster than the other head to head (fewer switches otherwise: fewer things to keep). None: no change."""
    from runner.interleave import record as record_mod

    good = [n for n in names if helps(v, n, min_speedup)]
    if not good:
        return None
    pick = good[0]
    for other in good[1:]:
        head = record_mod.versus(v.record or {"slices": []}, other, pick)
        if head is not None and head.ci_low > 1:
            pick = other
    return pick
