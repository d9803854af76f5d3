"""The fresh-seed verification of a recipe search (``hydra/sweeper=search``, runner/sweeps/search.py): the best
``verify_candidates`` trials and the starting recipe run seed by seed, in the search's slots, and the verification
stops at the first look at which every candidate's verdict is firm; then their samples/s, interleaved, only until
the time verdicts are firm.

Sequential looks: after the first k seeds of every side have ended (seeds in order, so a look never picks the runs
that happened to end first), each candidate's samples-to-target ratio gets its Mann–Whitney interval
(runner/compare/convergence.py) at 1 - α/(L·C), for L possible looks and C candidates, α = 1 - ``confidence``. By
Bonferroni's inequality the chance of any false "faster" or "slower" over all looks and candidates stays within α,
whatever the looks' correlation: conservative beside Pocock's or O'Brien–Fleming's group-sequential boundaries
(Jennison & Turnbull, *Group Sequential Methods*, 2000), but valid for a rank test's discrete p-values. The first
look is the fewest seeds whose interval can exclude 1 at that level. Where a candidate's samples/s is measured
too, its time verdict splits each look's α between the two intervals: ``SAMPLES_SHARE`` to samples to target, the
rest to samples/s (whose interval narrows with minutes of measuring, not with seeds). Why: docs/tuners-and-doctor.md,
"Searching the recipe".
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from omegaconf import OmegaConf

from runner import techniques
from runner.compare.convergence import MIN_SEEDS, Seed, TargetRatio, read_seed, samples_to_target, time_to_target
from runner.compare.stats import Interval

#: Searched keys (and groups: the technique table's schedules, ``scheduler``) that cannot change what one training
#: step costs: a best trial that differs from the start only in these trains at the start's samples/s, so its time
#: ratio is its samples ratio
SAME_STEP_COST = ("optimizer.lr", "optimizer.adamw_lr", "optimizer.weight_decay", "trainer.warmup_steps",
                  *techniques.same_step_cost())


#: The share of a look's α that the samples-to-target interval gets where the time verdict also needs a samples/s
#: interval (Bonferroni: the two shares sum to α). An even split asked for 6 seeds a side before a first look of 8;
#: 0.8 keeps the first look at 5 and leaves samples/s an interval at 99.75 %, a few passes of measuring
SAMPLES_SHARE = 0.8


@dataclass
class Side:
    """One side of the verification: ``name`` (its folder, ``verify/<name>/seed<N>``), ``label`` (its row),
    ``argv`` (its runs' overrides, less the seed) and ``params`` (the trial's searched values; None: the start)."""

    name: str
    label: str
    argv: list[str]
    params: dict[str, Any] | None = None


def override_line(params: dict[str, Any]) -> list[str]:
    """``key=value`` overrides of a trial's parameters (``repr`` floats: the exact value sampled)."""
    return [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()]


def first_look(seeds: int, candidates: int, confidence: float, share: float = 1.0) -> int:
    """The fewest seeds a side whose Mann–Whitney interval can exclude 1 at each look's level, its α times ``share``
    (all k runs of one side below all of the other's: two-sided p = 2 / C(2k, k)), at most ``seeds``."""
    alpha = 1 - confidence
    for k in range(MIN_SEEDS, seeds):
        if 2 / math.comb(2 * k, k) <= share * alpha / ((seeds - k + 1) * candidates):
            return k
    return seeds


def look_confidence(seeds: int, candidates: int, confidence: float, share: float = 1.0) -> float:
    """Each look's confidence: 1 - α / (looks × candidates) (Bonferroni; the module docstring)."""
    looks = seeds - first_look(seeds, candidates, confidence, share) + 1
    return 1 - (1 - confidence) / (looks * candidates)


def firm(ratio: TargetRatio | None) -> bool:
    """Whether a verdict is firm: its interval excludes 1."""
    return ratio is not None and (ratio.high < 1 or ratio.low > 1)


def seed_of(folder: Path) -> Seed | None:
    """The ``Seed`` of one verification run; a run that wrote no summary (it failed, e.g. diverged) is censored at
    its step limit in samples (its ``.hydra/config.yaml``), or None where that limit is unknown."""
    try:
        return read_seed(folder)
    except FileNotFoundError:
        path = folder / ".hydra" / "config.yaml"
        cfg = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
        steps, batch = OmegaConf.select(cfg, "trainer.max_steps"), OmegaConf.select(cfg, "dataloader.batch_size")
        ok = isinstance(steps, int) and isinstance(batch, int)
        return Seed(float(steps * batch), False, OmegaConf.select(cfg, "trainer.seed"), None, str(folder)) if ok \
            else None


def verdict(ratio: TargetRatio | None) -> str:
    """One line of a samples- or time-to-target ratio (candidate ÷ start): estimate, interval, seeds, verdict."""
    if ratio is None:
        return ("no interval: fewer than 3 seeds a side, or no seed reached the target (hydra.sweeper.verify_seeds="
                "8 resolves a 20 % difference), or no samples/s interval")
    level = f"{100 * ratio.confidence:.4g}%"
    said = f"x{ratio.estimate:.3g} [{ratio.low:.3g}, {ratio.high:.3g}] at {level} ({ratio.counts} seeds reached)"
    fewer, more = ("fewer samples", "MORE samples") if ratio.quantity == "samples" else ("less time", "MORE time")
    if ratio.high < 1:
        sooner = (f"{1 / ratio.estimate:.2f}x sooner" if ratio.estimate > 0
                  else "the start missed the target on most seeds")
        return f"{said}: it needs {fewer}, {sooner} (the interval excludes 1)"
    if ratio.low > 1:
        return f"{said}: it needs {more} than the starting recipe on fresh seeds"
    return f"{said}: no difference shown on fresh seeds (the interval includes 1; more seeds narrow it)"


def changes_step_cost(params: dict[str, Any]) -> bool:
    """Whether a searched key outside ``SAME_STEP_COST`` is among ``params`` (the batch size, the optimizer, the
    EMA, the model: anything that may change a step's work is measured, never assumed)."""
    return any(not any(k == same or k.startswith(same + ".") for same in SAME_STEP_COST) for k in params)


def fixed_overrides(plan: dict[str, Any]) -> list[str]:
    """The search's fixed overrides as the verification's runs take them (no seed, no ``hydra.*``)."""
    return [o for o in plan["fixed"] if not o.startswith(("trainer.seed=", "hydra."))]


def ahead(sweeper: Any, plan: dict[str, Any]) -> list[tuple[tuple[str, int], Path, list[str]]]:
    """The starting recipe's verification runs that are sure to be needed -- its seeds up to the first look --
    as ``Slots.start`` arguments ``((side, seed), folder, argv)``, for slots that the search's last trials leave
    free (none where the verification will not run)."""
    seeds, cfg = plan["seeds"], sweeper.config
    if not seeds or (cfg.trainer.target_accuracy is None and cfg.trainer.target_loss is None):
        return []
    sweep = Path(str(cfg.hydra.sweep.dir))
    first = first_look(len(seeds), max(1, sweeper.verify_candidates), sweeper.confidence)
    return [(("start", s), sweep / "verify" / "start" / f"seed{s}", [*fixed_overrides(plan), f"trainer.seed={s}"])
            for s in seeds[:first]]


def runs(sweeper: Any, sides: Sequence[Side], seeds: Sequence[int]) -> Iterator[tuple[int, Seed | None]]:
    """Run every side on every seed, seed by seed (job ``i`` = seed ``i // len(sides)``, side ``i % len(sides)``),
    and yield ``(i, its Seed)`` as runs end: in the search's slots where its trials ran in them (a freed slot takes
    the next run at once, and the runs the trials' slots started ``ahead`` are taken as they are; closing the
    generator stops the running ones), else one launch per seed through Hydra's launcher (a SLURM array of
    ``len(sides)`` jobs)."""
    jobs = [(side, s) for s in seeds for side in sides]
    sweep = Path(str(sweeper.config.hydra.sweep.dir))
    if not sweeper.in_slots():
        for first in range(0, len(jobs), len(sides)):
            batch = jobs[first:first + len(sides)]
            returns = sweeper.launch([[*side.argv, f"trainer.seed={s}", f"hydra.sweep.subdir=verify/{side.name}/"
                                       f"seed{s}", "hydra.sweeper.pruner=null"] for side, s in batch])
            for i, ret in enumerate(returns, first):
                yield i, seed_of(Path(str(OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir"))))
        return
    slots, done_ahead = sweeper.pending or sweeper.slots(), dict(sweeper.ahead_done)
    index = {(side.name, s): i for i, (side, s) in enumerate(jobs)}
    started = done_ahead.keys() | {r.key for r in slots.running}
    queue = [(side, s) for side, s in jobs if (side.name, s) not in started]
    try:
        for key, folder in done_ahead.items():
            if key in index:
                yield index[key], seed_of(folder)
        while queue or slots.running:
            while queue and len(slots.running) < slots.n:
                side, s = queue.pop(0)
                folder = sweep / "verify" / side.name / f"seed{s}"
                slots.start((side.name, s), folder, [*side.argv, f"trainer.seed={s}"])
            done, _ = slots.wait_one()
            if done.key in index:
                yield index[done.key], seed_of(done.folder)
    finally:
        slots.stop()


def _median_figure(folders: Sequence[Path], key: str) -> float | None:
    values = []
    for folder in folders:
        path = folder / "summary.json"
        if path.is_file() and (v := json.loads(path.read_text()).get(key)) is not None:
            values.append(float(v))
    return statistics.median(values) if values else None


def throughput(sweeper: Any, start: Side, candidates: Sequence[Side], found: dict[str, list[Seed]],
               level: float, share: float) -> tuple[dict[str, Interval | float | None], str]:
    """Each candidate's samples/s ÷ the start's (> 1: it trains faster): 1 where no searched key changes a step's
    cost; else measured interleaved into ``<sweep>/verify/throughput`` (runner/compare/ ``compare``: randomized
    multiple interleaved trials, Abedi & Brecht, ICPE 2017), ``hydra.sweeper.verify_processes`` processes each,
    for at most ``verify_minutes`` and only until every candidate's time-to-target verdict (``found``'s seeds, at
    ``level``, the samples interval's ``share`` of α) is firm: an ``Interval``, None below 2 pairs or with
    ``verify_minutes`` 0. Returns them and the line that says how they were had. A job that fails to start is
    recorded as failed (no interval), not raised."""
    measured = [c for c in candidates if changes_step_cost(c.params or {})]
    ratios: dict[str, Interval | float | None] = {c.name: 1.0 for c in candidates if c not in measured}
    if not measured:
        return ratios, "samples/s, candidate / start: 1 (the searched keys do not change a step's cost)"
    if sweeper.verify_minutes <= 0:
        return ratios | {c.name: None for c in measured}, ("samples/s, candidate / start: not measured "
                                                           "(hydra.sweeper.verify_minutes=0): no time verdict")
    from runner import compare
    from runner.compare.record import describe

    folder = Path(str(sweeper.config.hydra.sweep.dir)) / "verify" / "throughput"
    configs = {side.name: compare.measured_job(sweeper.compose(side.argv)) for side in (start, *measured)}
    settings = sweeper.config.interleave.copy()
    settings.processes = sweeper.verify_processes

    def enough(comparisons: dict[str, Interval | None]) -> str | None:
        timed = [time_to_target(found[c.name], found[start.name], comparisons.get(c.name), level, share)
                 for c in measured]
        return "every time-to-target verdict firm" if all(map(firm, timed)) else None

    print(f"\nmeasuring {', '.join(c.name for c in measured)} against start's samples/s interleaved (at most "
          f"{sweeper.verify_minutes:g} min, until the time verdicts are firm) in {folder}", flush=True)
    result = compare.compare(configs, start.name, folder, settings, minutes=sweeper.verify_minutes, enough=enough)
    ratios |= {c.name: result.intervals.get(c.name) for c in measured}
    how = f"interleaved ({result.measured_s / 60:.1f} min, {folder})"
    return ratios, "\n".join(f"samples/s, {c.name} / start, {how}: {describe(ratios[c.name])}, the start against its "
                             f"copy (A/A) {describe(result.aa)}" for c in measured)


def sequential(sweeper: Any, sides: Sequence[Side], seeds: Sequence[int], first: int, level: float
               ) -> tuple[dict[str, list[Seed]], int, dict[str, TargetRatio | None]]:
    """Run ``sides`` (the candidates, then the start) seed by seed (``runs``) and look after the first ``first``
    seeds and each one after: stop at the first look where every candidate's samples-to-target interval at ``level``
    excludes 1. The seeds each side ran up to the last look, that look's seed count, and its ratios."""
    ended: dict[int, Seed | None] = {}

    def upto(side: int, k: int) -> list[Seed]:
        return [s for i in range(k) if (s := ended[i * len(sides) + side]) is not None]

    k, ratios, looked = first, {}, 0
    it = runs(sweeper, sides, seeds)
    try:
        for i, seed in it:
            ended[i] = seed
            while k <= len(seeds) and all(j in ended for j in range(k * len(sides))):
                ratios = {c.name: samples_to_target(upto(n, k), upto(len(sides) - 1, k), level)
                          for n, c in enumerate(sides[:-1])}
                looked, k = k, k + 1
                if all(map(firm, ratios.values())):
                    k = len(seeds) + 1
            if k > len(seeds):
                break
    finally:
        it.close()
    return {side.name: upto(n, looked) for n, side in enumerate(sides)}, looked, ratios


def verify(sweeper: Any, plan: dict[str, Any], trials: Sequence[Any]) -> tuple[list[str], dict[str, Any], Any]:
    """Run the candidate ``trials`` (best first) and the starting recipe seed by seed on ``plan['seeds']``, stopping
    at the first firm look; the printed lines, the record, and the trial whose recipe is found (the candidate with
    the shortest time to target, else the fewest samples; the best trial where nothing was measured)."""
    seeds, cfg = plan["seeds"], sweeper.config
    if not seeds:
        return ["verification skipped (hydra.sweeper.verify_seeds=0)"], {"skipped": "verify_seeds=0"}, trials[0]
    if cfg.trainer.target_accuracy is None and cfg.trainer.target_loss is None:
        why = "it compares samples to target and the runs have no target: set trainer.target_accuracy"
        return [f"verification skipped: {why}"], {"skipped": why}, trials[0]
    fixed = fixed_overrides(plan)
    candidates = [Side("best" if i == 0 else f"best{i + 1}", f"{'best trial' if i == 0 else 'candidate'} ("
                       f"trial {t.number + 1})", fixed + override_line(t.params), dict(t.params))
                  for i, t in enumerate(trials)]
    start = Side("start", "starting recipe", fixed)
    sides = [*candidates, start]
    timed_too = sweeper.verify_minutes > 0 and any(changes_step_cost(c.params or {}) for c in candidates)
    share = SAMPLES_SHARE if timed_too else 1.0
    first = first_look(len(seeds), len(candidates), sweeper.confidence, share)
    level = look_confidence(len(seeds), len(candidates), sweeper.confidence, share)
    samples_level = 1 - share * (1 - level)
    print(f"\nverifying {len(candidates)} candidate(s) against the starting recipe on fresh seeds {seeds[0]}.."
          f"{seeds[-1]}, seed by seed: a look after seed {first} and each one after stops at the first where every "
          f"samples-to-target interval excludes 1 (each at {samples_level:.2%}: over {len(seeds) - first + 1} looks "
          f"and {len(candidates)} candidate(s) the chance of any false verdict stays within "
          f"{1 - sweeper.confidence:.0%})", flush=True)
    found, looked, ratios = sequential(sweeper, sides, seeds, first, samples_level)
    sweep = Path(str(cfg.hydra.sweep.dir))
    stop = (f"firm at seed {looked} of {len(seeds)}" if looked < len(seeds) else
            f"all {len(seeds)} seeds run")
    lines = [f"\nverification on fresh seeds {seeds[0]}..{seeds[looked - 1]} ({stop}; the search ran on "
             f"trainer.seed={cfg.trainer.seed}):",
             "| | seeds reached | median samples to target | median time to target s |", "|---|---:|---:|---:|"]
    for side in sides:
        got = found[side.name]
        reached = [s.samples for s in got if s.reached]
        median = f"{statistics.median(reached):,.0f}" if reached else "-"
        t = _median_figure([sweep / "verify" / side.name / f"seed{s}" for s in seeds[:looked]], "time_to_target_s")
        lines.append(f"| {side.label} | {sum(s.reached for s in got)}/{looked} | {median} | "
                     f"{f'{t:.2f}' if t is not None else '-'} |")
    lines += [f"samples to target, {c.name} / start: {verdict(ratios.get(c.name))}" for c in candidates]
    record: dict[str, Any] = {"seeds": seeds[:looked], "look_confidence": level, "samples_confidence": samples_level,
                              "stopped": stop,
                              "samples_to_target": _figures(ratios.get("best"))}
    timed: dict[str, TargetRatio | None] = {}
    if any(r is not None for r in ratios.values()):
        speed, said = throughput(sweeper, start, candidates, found, level, share)
        timed = {c.name: time_to_target(found[c.name], found["start"], speed.get(c.name), level, share)
                 for c in candidates}
        lines += [said, *(f"time to target, {c.name} / start (samples ratio / samples/s ratio): "
                          f"{verdict(timed[c.name])}" for c in candidates)]
        best_speed = speed.get("best")
        record |= {"samples_per_sec": _figures(best_speed) if isinstance(best_speed, Interval) else best_speed,
                   "time_to_target": _figures(timed.get("best"))}
    if len(candidates) > 1:
        record["candidates"] = {c.name: {"params": c.params, "samples_to_target": _figures(ratios.get(c.name)),
                                         "time_to_target": _figures(timed.get(c.name))} for c in candidates}
    chosen = _chosen(candidates, timed, ratios)
    if chosen != 0:
        lines.append(f"the recipe found is {candidates[chosen].name} ({candidates[chosen].label}): the shortest "
                     f"time to target among the candidates on fresh seeds")
    return lines, record, trials[chosen]


def _chosen(candidates: Sequence[Side], timed: dict[str, TargetRatio | None],
            ratios: dict[str, TargetRatio | None]) -> int:
    """The candidate with the smallest time-to-target estimate (else samples-to-target), the best trial on ties or
    where none was measured."""
    for figures in (timed, ratios):
        known = [(r.estimate, n) for n, c in enumerate(candidates) if (r := figures.get(c.name)) is not None]
        if known:
            return min(known)[1]
    return 0


def _figures(ratio: TargetRatio | Interval | None) -> dict[str, Any] | None:
    if ratio is None:
        return None
    out = {"estimate": ratio.estimate, "low": ratio.low, "high": ratio.high}
    if isinstance(ratio, TargetRatio):
        out |= {"p_value": ratio.p_value, "confidence": ratio.confidence, "counts": ratio.counts}
    return out
