"""The speed tuner's rounds (runner/tune/speed.py): each an interleaved, paired measurement of candidate
configurations against a reference, and what the search reads from it.

- ``measure_round``: the jobs compared side by side (runner/compare/), racing out the firmly slower ones.
- ``read_round``: the comparisons, Holm's verdicts, failures and median speeds it measured.
- ``helps``, ``choose``, ``group_best``, ``firmly_hurting``, ``cheap_to_remove``, ``head_to_head``: the decisions
  the search and its verification take, each from a round's figures alone (tests/test_tune_replay.py replays them
  on recorded rounds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# ------------------------------------------------------------------------------------------- measuring


@dataclass
class Round:
    """One interleaved measurement: ``jobs`` (name -> config) against ``reference`` (a name of ``jobs``); the rest
    is what ``measure_round`` read from it (runner/compare/ ``Comparisons``)."""

    title: str
    reference: str
    jobs: dict[str, DictConfig]
    minutes: float
    comparisons: dict[str, Any] = field(default_factory=dict)  # name -> compare.Interval against the reference
    verdicts: dict[str, str] = field(default_factory=dict)
    aa: Any = None
    vs_copy: dict[str, Any] = field(default_factory=dict)  # name -> compare.Interval against the reference's copy A'
    samples_per_sec: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)  # the round's interleave.json (rank 0's)
    measured_s: float = 0.0  # seconds spent measuring (start-ups excluded)
    # name -> its first process's one-time seconds (summary.json one_time: warm-up excess and first evaluation)
    one_time: dict[str, float] = field(default_factory=dict)
    # name -> its first process's compile seconds and what it loaded (one_time.compile_s, .compile_cache)
    compiled: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    # name -> its first process's busy-machine warnings over its measured steps (summary.json warnings)
    warnings: dict[str, list[str]] = field(default_factory=dict)


def measure_round(r: Round, folder: Path, settings: DictConfig, ranks: Any = None) -> Round:
    """Measure ``r``'s jobs side by side (``runner.compare.compare``: each a measured job resident in its own
    process, slices in random order per pass, the reference's copy as A'), until every interval is within
    ``settings.target_ci`` or ``r.minutes`` of measuring are spent, racing out the candidates firmly slower than
    the reference. Fills ``r`` (``read_round``). Ctrl-C stops the round after the current slice. ``ranks``: under
    torchrun (runner/compare/ranks.py), every rank's conductor mirrors rank 0's, and every rank gets rank 0's
    figures."""
    from runner import compare

    aa = f"{r.reference}-aa"

    def retire(comparisons: dict[str, Any]) -> list[str]:  # racing: firmly slower candidates stop early
        names = [n for n in comparisons if n != aa and comparisons[n] is not None]
        verdicts = compare.stats.verdicts([comparisons[n] for n in names], settings.confidence)
        return [n for n, v in zip(names, verdicts) if v == compare.HURTS]

    configs = {name: compare.measured_job(c) for name, c in r.jobs.items()}
    read_round(
        r, compare.compare(configs, r.reference, folder, settings, minutes=r.minutes, retire=retire, ranks=ranks)
    )
    once = _one_time(folder, r.jobs)
    r.one_time, r.compiled, r.warnings = ranks.share(once) if ranks is not None else once
    return r


def _one_time(
    folder: Path, names: Any
) -> tuple[dict[str, float], dict[str, tuple[float | None, str]], dict[str, list[str]]]:
    """Each configuration's one-time seconds, its compile seconds and what it loaded, and its busy-machine warnings,
    from its first process's ``summary.json`` (those that wrote one)."""
    out, compiled, warnings = {}, {}, {}
    for name in names:
        try:
            summary = json.loads((folder / name / "summary.json").read_text())
            once = summary["one_time"]
            out[name] = (once["warmup_excess_s"] or 0.0) + (once["first_eval_s"] or 0.0)
            compiled[name] = (once.get("compile_s"), str(once.get("compile_cache", "off")))
            warnings[name] = [str(w) for w in summary.get("warnings") or []]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out, compiled, warnings


def read_round(r: Round, result: Any) -> Round:
    """Fill ``r``'s figures from what its comparison measured (``runner.compare.Comparisons``): the intervals
    against the reference and against its copy, Holm's verdicts, failures, each configuration's median slice and
    why it stopped. Returns ``r``."""
    r.record = result.record
    r.comparisons = dict(result.intervals)
    r.aa = result.aa
    r.vs_copy = {n: result.versus(n, result.aa_name) for n in r.comparisons} if result.aa_name else {}
    r.verdicts = dict(result.verdicts)
    r.failed = dict(result.failed)
    r.samples_per_sec = dict(result.samples_per_sec)
    r.stopped = list(result.stopped)
    r.measured_s = result.measured_s
    return r


def helps(r: Round, name: str, min_speedup: float) -> bool:
    """True when ``name`` is firmly faster than the round's reference: Holm's verdict is "helps", its interval's
    low end exceeds ``min_speedup``, and it is faster than the reference's copy A' too (interval above 1). The
    last is a guard against the process itself: on a shared VM two processes of one configuration can differ
    by 10-30 % for their whole life (docs/ablation.md), so an unlucky reference process would make every
    candidate look faster; beating both copies makes that unlikely."""
    from runner.compare.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    return (
        c is not None
        and r.verdicts.get(name) == HELPS
        and c.low > min_speedup
        and (r.aa is None or (copy_c is not None and copy_c.low > 1))
    )


def head_to_head(r: Round, name: str, other: str) -> Any:
    """``name`` against ``other`` in round ``r``, both paired with its reference (``compare.record.versus``):
    a ``compare.Interval`` of the samples/s ratio, or None (under 2 passes that measured both, or no record)."""
    from runner.compare import record as record_mod

    return record_mod.versus(r.record or {"slices": [], "jobs": {}}, name, other)


def choose(v: Round, names: list[str], min_speedup: float) -> str | None:
    """Of the verification's configurations ``names`` (fewest switches first), the one to recommend: those
    firmly faster than your configuration (``helps``); of two, the one with more switches only when it is
    firmly faster than the other head to head (fewer switches otherwise: fewer things to keep). None: no change."""
    good = [n for n in names if helps(v, n, min_speedup)]
    if not good:
        return None
    pick = good[0]
    for other in good[1:]:
        head = head_to_head(v, other, pick)
        if head is not None and head.low > 1:
            pick = other
    return pick


def group_best(combination: list, candidates: list, r: Round) -> list:
    """``combination`` with each group's member replaced by the alternative round ``r`` (each alone) read firmly
    faster than it head to head, the fastest of those: a point estimate would let noise pick among equals."""

    def firmly_faster(a: Any, s: Any) -> float:
        c = head_to_head(r, a.name, s.name)
        return c.estimate if c is not None and c.low > 1 else 0.0

    return [
        max(
            [a for a in candidates if s.group and a.group == s.group and firmly_faster(a, s)] or [s],
            key=lambda a: firmly_faster(a, s),
        )
        for s in combination
    ]


def firmly_hurting(r: Round, pick: list, min_speedup: float) -> list:
    """The switches of ``pick`` whose removal from it (the job ``-<name>``) is firmly faster (``helps``)."""
    return [s for s in pick if helps(r, f"-{s.name}", min_speedup)]


def cheap_to_remove(r: Round, pick: list, target_ci: float) -> list:
    """With nothing firm in an elimination round: the switches of ``pick`` whose removal (the job ``-<name>``) was
    measured, is not firmly slower (Holm), and reads faster or is shown to cost under ``target_ci`` (its interval's low
    end at least ``1 - target_ci``): a switch that buys nothing measurable is one thing fewer to keep."""
    from runner.compare.stats import HURTS

    out = []
    for s in pick:
        name = f"-{s.name}"
        c = r.comparisons.get(name)
        if (
            name not in r.failed
            and c is not None
            and r.verdicts.get(name) != HURTS
            and (c.estimate >= 1 or c.low >= 1 - target_ci)
        ):
            out.append(s)
    return out
