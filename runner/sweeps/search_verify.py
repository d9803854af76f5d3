"""The fresh-seed verification of a recipe search (``hydra/sweeper=search``, runner/sweeps/search.py): the best
``verify_candidates`` trials and the starting recipe run seed by seed, in the search's slots, until every candidate's
time-to-target verdict is firm.

Time to target is the search's own objective: a run's training seconds until an evaluation first met the target,
evaluations excluded, each run with the search's other slots busy as its trials were. Sequential looks: after the
first k seeds of every side have ended (seeds in order, so a look never picks the runs that happened to end first),
each candidate's ratio gets its interval at 1 - α/(L·C), for L possible looks (``MIN_SEEDS`` seeds a side to
``verify_seeds``) and C candidates, α = 1 - ``confidence``: Welch's t on the log times where every run reached the
target (log-normal seed-to-seed spread assumed; firm from 3 seeds a side), the Mann–Whitney interval, censored runs
bounding it, where one did not (firm from 5). By Bonferroni's inequality the chance of any false "faster" or
"slower" over all looks and candidates stays within α, whatever the looks' correlation (Jennison & Turnbull, *Group
Sequential Methods*, 2000). Samples to target, the part that does not depend on the machine, is reported beside it
at the same level (the rank test; not a stopping rule). Why: docs/tuners-and-doctor.md, "Searching the recipe".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from omegaconf import OmegaConf

from runner.compare.convergence import MIN_SEEDS, Seed, TargetRatio, lognormal_ratio, read_seed, samples_to_target


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


def look_confidence(seeds: int, candidates: int, confidence: float) -> float:
    """Each look's confidence: 1 - α / (looks × candidates), a look at each seed count from ``MIN_SEEDS`` to
    ``seeds`` (Bonferroni; the module docstring)."""
    return 1 - (1 - confidence) / (max(1, seeds - MIN_SEEDS + 1) * candidates)


def firm(ratio: TargetRatio | None) -> bool:
    """Whether a verdict is firm: its interval excludes 1."""
    return ratio is not None and (ratio.high < 1 or ratio.low > 1)


@dataclass(frozen=True)
class Run:
    """One verification run read back: its ``samples`` and ``time`` to target (``Seed``s of one run)."""

    samples: Seed
    time: Seed


#: The training seconds of a run that failed (it wrote no summary): unknown, so its time is censored at ~0 -- it
#: says only that the run missed the target
FAILED_S = 1e-9


def run_of(folder: Path) -> Run | None:
    """The ``Run`` of one verification run; a run that wrote no summary (it failed, e.g. diverged) is censored at
    its step limit in samples (its ``.hydra/config.yaml``) and at ``FAILED_S``, or None where that limit is unknown."""
    try:
        return Run(read_seed(folder), read_seed(folder, "time"))
    except FileNotFoundError:
        path = folder / ".hydra" / "config.yaml"
        cfg = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
        steps, batch = OmegaConf.select(cfg, "trainer.max_steps"), OmegaConf.select(cfg, "dataloader.batch_size")
        if not (isinstance(steps, int) and isinstance(batch, int)):
            return None
        seed = OmegaConf.select(cfg, "trainer.seed")
        return Run(
            Seed(float(steps * batch), False, seed, None, str(folder)), Seed(FAILED_S, False, seed, None, str(folder))
        )


def time_ratio(config: Sequence[Seed], reference: Sequence[Seed], level: float) -> TargetRatio | None:
    """Time to target, ``config`` ÷ ``reference``, at ``level``: Welch's t on the logs where every run reached the
    target, else the rank test (the module docstring)."""
    return lognormal_ratio(config, reference, level) or samples_to_target(config, reference, level, "time")


def verdict(ratio: TargetRatio | None) -> str:
    """One line of a samples- or time-to-target ratio (candidate ÷ start): estimate, interval, seeds, verdict."""
    if ratio is None:
        return (
            "no interval: fewer than 3 seeds a side, or no seed reached the target (hydra.sweeper.verify_seeds="
            "8 resolves a 20 % difference)"
        )
    level = f"{100 * ratio.confidence:.4g}%"
    said = f"x{ratio.estimate:.3g} [{ratio.low:.3g}, {ratio.high:.3g}] at {level} ({ratio.counts} seeds reached)"
    fewer, more = ("fewer samples", "MORE samples") if ratio.quantity == "samples" else ("less time", "MORE time")
    if ratio.high < 1:
        sooner = (
            f"{1 / ratio.estimate:.2f}x sooner" if ratio.estimate > 0 else "the start missed the target on most seeds"
        )
        return f"{said}: it needs {fewer}, {sooner} (the interval excludes 1)"
    if ratio.low > 1:
        return f"{said}: it needs {more} than the starting recipe on fresh seeds"
    if ratio.low == 0 and ratio.high == math.inf and ratio.reached + ratio.reference_reached == ratio.n:
        return f"{said}: too few seeds for the rank test at this level (its interval is the whole line below 5 a side)"
    return f"{said}: no difference shown on fresh seeds (the interval includes 1; more seeds narrow it)"


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
    return [
        (("start", s), sweep / "verify" / "start" / f"seed{s}", [*fixed_overrides(plan), f"trainer.seed={s}"])
        for s in seeds[:MIN_SEEDS]
    ]


def runs(sweeper: Any, sides: Sequence[Side], seeds: Sequence[int]) -> Iterator[tuple[int, Run | None]]:
    """Run every side on every seed, seed by seed (job ``i`` = seed ``i // len(sides)``, side ``i % len(sides)``),
    and yield ``(i, its Run)`` as runs end: in the search's slots where its trials ran in them (a freed slot takes
    the next run at once, and the runs the trials' slots started ``ahead`` are taken as they are; closing the
    generator stops the running ones), else one launch per seed through Hydra's launcher (a SLURM array of
    ``len(sides)`` jobs)."""
    jobs = [(side, s) for s in seeds for side in sides]
    sweep = Path(str(sweeper.config.hydra.sweep.dir))
    if not sweeper.in_slots():
        for first in range(0, len(jobs), len(sides)):
            batch = jobs[first : first + len(sides)]
            returns = sweeper.launch(
                [
                    [
                        *side.argv,
                        f"trainer.seed={s}",
                        f"hydra.sweep.subdir=verify/{side.name}/seed{s}",
                        "hydra.sweeper.pruner=null",
                    ]
                    for side, s in batch
                ]
            )
            for i, ret in enumerate(returns, first):
                yield i, run_of(Path(str(OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir"))))
        return
    slots, done_ahead = sweeper.pending or sweeper.slots(), dict(sweeper.ahead_done)
    index = {(side.name, s): i for i, (side, s) in enumerate(jobs)}
    started = done_ahead.keys() | {r.key for r in slots.running}
    queue = [(side, s) for side, s in jobs if (side.name, s) not in started]
    try:
        for key, folder in done_ahead.items():
            if key in index:
                yield index[key], run_of(folder)
        while queue or slots.running:
            while queue and len(slots.running) < slots.n:
                side, s = queue.pop(0)
                folder = sweep / "verify" / side.name / f"seed{s}"
                slots.start((side.name, s), folder, [*side.argv, f"trainer.seed={s}"])
            done, _ = slots.wait_one()
            if done.key in index:
                yield index[done.key], run_of(done.folder)
    finally:
        slots.stop()


def sequential(
    sweeper: Any, sides: Sequence[Side], seeds: Sequence[int], level: float
) -> tuple[dict[str, list[Run]], int, dict[str, TargetRatio | None]]:
    """Run ``sides`` (the candidates, then the start) seed by seed (``runs``) and look after the first ``MIN_SEEDS``
    seeds (every seed, where there are fewer) and each one after: stop at the first look where every candidate's
    time-to-target interval at ``level`` excludes 1. The runs each side had up to the last look, that look's seed
    count, and its time ratios."""
    ended: dict[int, Run | None] = {}

    def upto(side: int, k: int) -> list[Run]:
        return [r for i in range(k) if (r := ended[i * len(sides) + side]) is not None]

    def times(side: int, k: int) -> list[Seed]:
        return [r.time for r in upto(side, k)]

    k, ratios, looked = min(MIN_SEEDS, len(seeds)), {}, 0
    it = runs(sweeper, sides, seeds)
    try:
        for i, run in it:
            ended[i] = run
            while k <= len(seeds) and all(j in ended for j in range(k * len(sides))):
                ratios = {
                    c.name: time_ratio(times(n, k), times(len(sides) - 1, k), level) for n, c in enumerate(sides[:-1])
                }
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
        why = "it compares times to target and the runs have no target: set trainer.target_accuracy"
        return [f"verification skipped: {why}"], {"skipped": why}, trials[0]
    fixed = fixed_overrides(plan)
    candidates = [
        Side(
            "best" if i == 0 else f"best{i + 1}",
            f"{'best trial' if i == 0 else 'candidate'} (trial {t.number + 1})",
            fixed + override_line(t.params),
            dict(t.params),
        )
        for i, t in enumerate(trials)
    ]
    start = Side("start", "starting recipe", fixed)
    sides = [*candidates, start]
    level = look_confidence(len(seeds), len(candidates), sweeper.confidence)
    first = min(MIN_SEEDS, len(seeds))
    print(
        f"\nverifying {len(candidates)} candidate(s) against the starting recipe on fresh seeds {seeds[0]}.."
        f"{seeds[-1]}, seed by seed: a look after seed {first} and each one after stops at the first where every "
        f"time-to-target interval excludes 1 (each at {level:.2%}: over {max(1, len(seeds) - first + 1)} looks "
        f"and {len(candidates)} candidate(s) the chance of any false verdict stays within "
        f"{1 - sweeper.confidence:.0%})",
        flush=True,
    )
    found, looked, timed = sequential(sweeper, sides, seeds, level)
    stop = f"firm at seed {looked} of {len(seeds)}" if looked < len(seeds) else f"all {len(seeds)} seeds run"
    lines = [
        f"\nverification on fresh seeds {seeds[0]}..{seeds[max(looked, 1) - 1]} ({stop}; the search ran on "
        f"trainer.seed={cfg.trainer.seed}):",
        "| | seeds reached | median samples to target | median time to target s |",
        "|---|---:|---:|---:|",
    ]
    for side in sides:
        got = found[side.name]
        samples = [r.samples.value for r in got if r.samples.reached]
        times = [r.time.value for r in got if r.time.reached]
        lines.append(
            f"| {side.label} | {len(samples)}/{looked} | "
            f"{f'{statistics.median(samples):,.0f}' if samples else '-'} | "
            f"{f'{statistics.median(times):.2f}' if times else '-'} |"
        )
    ratios = {
        c.name: samples_to_target([r.samples for r in found[c.name]], [r.samples for r in found["start"]], level)
        for c in candidates
    }
    lines += [f"samples to target, {c.name} / start: {verdict(ratios[c.name])}" for c in candidates]
    lines += [
        f"time to target, {c.name} / start ({_test(timed.get(c.name))}): {verdict(timed.get(c.name))}"
        for c in candidates
    ]
    record: dict[str, Any] = {
        "seeds": seeds[:looked],
        "look_confidence": level,
        "stopped": stop,
        "samples_to_target": _figures(ratios.get("best")),
        "time_to_target": _figures(timed.get("best")),
    }
    if len(candidates) > 1:
        record["candidates"] = {
            c.name: {
                "params": c.params,
                "samples_to_target": _figures(ratios.get(c.name)),
                "time_to_target": _figures(timed.get(c.name)),
            }
            for c in candidates
        }
    chosen = _chosen(candidates, timed, ratios)
    if chosen != 0:
        lines.append(
            f"the recipe found is {candidates[chosen].name} ({candidates[chosen].label}): the shortest "
            f"time to target among the candidates on fresh seeds"
        )
    return lines, record, trials[chosen]


def _test(ratio: TargetRatio | None) -> str:
    """Which test gave a time ratio: Welch's t on the logs (every run reached the target) or the rank test."""
    if ratio is None:
        return "no test"
    return "Welch's t on the logs" if ratio.reached + ratio.reference_reached == ratio.n else "rank test"


def _chosen(
    candidates: Sequence[Side], timed: dict[str, TargetRatio | None], ratios: dict[str, TargetRatio | None]
) -> int:
    """The candidate with the smallest time-to-target estimate (else samples-to-target), the best trial on ties or
    where none was measured."""
    for figures in (timed, ratios):
        known = [(r.estimate, n) for n, c in enumerate(candidates) if (r := figures.get(c.name)) is not None]
        if known:
            return min(known)[1]
    return 0


def _figures(ratio: TargetRatio | None) -> dict[str, Any] | None:
    if ratio is None:
        return None
    return {
        "estimate": ratio.estimate,
        "low": ratio.low,
        "high": ratio.high,
        "p_value": ratio.p_value,
        "confidence": ratio.confidence,
        "counts": ratio.counts,
    }
