"""The end of ``hydra/sweeper=search`` (runner/tune/search.py): the trials' table, the best trial, its verification
against the starting recipe on fresh seeds (samples to target; samples/s interleaved where a searched key is not in
``SAME_STEP_COST``; their ratio, time to target), the line to paste, and ``<sweep>/optimization_results.yaml``.
Why, and the statistic: docs/tuners-and-doctor.md, "Searching the recipe" (Verification on fresh seeds).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn
from omegaconf import OmegaConf

from runner import techniques
from runner.compare.convergence import Seed, TargetRatio, read_seed, samples_to_target, time_to_target
from runner.compare.stats import Interval
from runner.objective import TO_TARGET

#: Searched keys (and groups: the technique table's schedules, ``scheduler``) that cannot change what one training
#: step costs: a best trial that differs from the start only in these trains at the start's samples/s, so its time
#: ratio is its samples ratio
SAME_STEP_COST = ("optimizer.lr", "optimizer.adamw_lr", "optimizer.weight_decay", "trainer.warmup_steps",
                  *techniques.same_step_cost())


def override_line(params: dict[str, Any]) -> list[str]:
    """``key=value`` overrides of a trial's parameters (``repr`` floats: the exact value sampled)."""
    return [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()]


def job_folder(ret: JobReturn) -> Path:
    """The folder a job ran in (its summary.json, .hydra/)."""
    return Path(str(OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir")))


def in_space(trial: Any, space: dict[str, Any]) -> bool:
    """Whether a stored trial's parameters are exactly the search's keys, each with a value its distribution holds:
    a shared study's rows are data, and a planted one (``model._target_=numpy.load``) is never launched."""
    if set(trial.params) != set(space):
        return False
    try:
        return all(space[k]._contains(space[k].to_internal_repr(v)) for k, v in trial.params.items())
    except (ValueError, TypeError, KeyError):
        return False


def best_trial(study: Any, metric: str, direction: str, space: dict[str, Any]) -> Any:
    """The best complete trial of the search ``space`` (``in_space``); for a to-target metric only among those that
    reached the target (a censored trial's value is a penalty, not a measurement). None when there is none."""
    from optuna.trial import TrialState

    done = [t for t in study.trials if t.state == TrialState.COMPLETE and in_space(t, space)]
    if metric in TO_TARGET:
        done = [t for t in done if t.user_attrs.get("reached")]
    if not done:
        return None
    pick = min if direction == "minimize" else max
    return pick(done, key=lambda t: t.value)


def trials_table(study: Any, metric: str) -> list[str]:
    keys = sorted({k for t in study.trials for k in t.params})
    lines = [f"| trial | {' | '.join(f'`{k}`' for k in keys)} | {metric} | note | job |",
             "|---:|" + "---|" * len(keys) + "---:|---|---|"]
    for t in study.trials:
        cells = [_short(t.params.get(k, "")) for k in keys]
        value = f"{t.value:.4g}" if t.value is not None else "-"
        lines.append(f"| {t.number + 1} | {' | '.join(cells)} | {value} | {t.user_attrs.get('note', '')} | "
                     f"`{t.user_attrs.get('job', '')}` |")
    return lines


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def paste_line(fixed: Sequence[str], params: dict[str, Any], recipe: Sequence[str] = (),
               config_dir: str | None = None) -> str:
    """``python -m runner`` with the search's ``--config-dir`` (where its presets came from), the command line's
    own overrides (less the search file) and the best trial's. ``recipe`` (``hydra.sweeper.recipe``) comes first:
    the overrides that give the preset a search file composes itself (``+experiment=shakespeare_char`` for
    conf/hparams_search/gpt_optuna.yaml), which leaving the search file out would otherwise lose."""
    kept = [o for o in fixed if not o.startswith(("hparams_search=", "hydra/sweeper=", "optimized_metric="))]
    where = ["--config-dir", str(Path(config_dir).resolve())] if config_dir else []
    return "python -m runner " + " ".join(shlex.quote(o) for o in [*where, *recipe, *kept, *override_line(params)])


def config_dir(config: Any) -> str | None:
    """The ``--config-dir`` of the running Hydra command (its ``hydra.runtime.config_sources``), or None."""
    sources = OmegaConf.select(config, "hydra.runtime.config_sources") or []
    given = [s.path for s in sources if s.provider == "command-line"]
    return given[0] if given else None


def seed_of(ret: JobReturn) -> Seed | None:
    """The ``Seed`` of one verification run; a run that wrote no summary (it failed, e.g. diverged) is censored at
    its step limit in samples, or None where that limit is unknown (``trainer.max_steps`` null)."""
    try:
        return read_seed(job_folder(ret))
    except FileNotFoundError:
        steps = OmegaConf.select(ret.cfg, "trainer.max_steps")
        batch = OmegaConf.select(ret.cfg, "dataloader.batch_size")
        seed = OmegaConf.select(ret.cfg, "trainer.seed")
        return Seed(float(steps * batch), False, seed, None, str(job_folder(ret))) if steps and batch else None


def _median_figure(returns: Sequence[JobReturn], key: str) -> float | None:
    values = []
    for ret in returns:
        path = job_folder(ret) / "summary.json"
        if path.is_file() and (v := json.loads(path.read_text()).get(key)) is not None:
            values.append(float(v))
    return statistics.median(values) if values else None


def verdict(ratio: TargetRatio | None) -> str:
    """One line of a samples- or time-to-target ratio (best ÷ start): estimate, interval, seeds, verdict."""
    if ratio is None:
        return ("no interval: fewer than 3 seeds a side, or no seed reached the target (hydra.sweeper.verify_seeds="
                "8 resolves a 20 % difference), or no samples/s interval")
    level = f"{ratio.confidence:.0%}"
    said = f"x{ratio.estimate:.3g} [{ratio.low:.3g}, {ratio.high:.3g}] at {level} ({ratio.counts} seeds reached)"
    fewer, more = ("fewer samples", "MORE samples") if ratio.quantity == "samples" else ("less time", "MORE time")
    if ratio.high < 1:
        sooner = (f"{1 / ratio.estimate:.2f}x sooner" if ratio.estimate > 0
                  else "the start missed the target on most seeds")
        return f"{said}: the best trial needs {fewer}, {sooner} (the interval excludes 1)"
    if ratio.low > 1:
        return f"{said}: the best trial needs {more} than the starting recipe on fresh seeds"
    return f"{said}: no difference shown on fresh seeds (the interval includes 1; more seeds narrow it)"


def changes_step_cost(params: dict[str, Any]) -> bool:
    """Whether a searched key outside ``SAME_STEP_COST`` is among ``params`` (the batch size, the optimizer, the
    EMA, the model: anything that may change a step's work is measured, never assumed)."""
    return any(not any(k == same or k.startswith(same + ".") for same in SAME_STEP_COST) for k in params)


def throughput(sweeper: Any, fixed: Sequence[str], params: dict[str, Any]) -> tuple[Interval | float | None, str]:
    """Best ÷ start samples/s (a dimensionless ratio, > 1: the best trial trains faster): 1 where no searched key
    changes a step's cost; else measured interleaved for ``sweeper.verify_minutes`` minutes into
    ``<sweep>/verify/throughput`` (runner/compare/ ``compare``: randomized multiple interleaved trials, Abedi &
    Brecht, ICPE 2017): an ``Interval``, None below 2 pairs; None too with ``verify_minutes`` 0. Returns
    it and the line that says how it was had. A job that fails to start is recorded as failed by the comparison
    (no interval), not raised."""
    if not changes_step_cost(params):
        return 1.0, "samples/s, best / start: 1 (the searched keys do not change a step's cost)"
    if sweeper.verify_minutes <= 0:
        return None, "samples/s, best / start: not measured (hydra.sweeper.verify_minutes=0): no time verdict"
    from runner import compare
    from runner.compare.record import describe

    folder = Path(str(sweeper.config.hydra.sweep.dir)) / "verify" / "throughput"
    configs = {"start": compare.measured_job(sweeper.compose(fixed)),
               "best": compare.measured_job(sweeper.compose([*fixed, *override_line(params)]))}
    print(f"\nmeasuring best against start's samples/s interleaved ({sweeper.verify_minutes:g} min) in {folder}",
          flush=True)
    result = compare.compare(configs, "start", folder, sweeper.config.interleave, minutes=sweeper.verify_minutes)
    ratio = result.intervals.get("best")
    return ratio, (f"samples/s, best / start, interleaved ({result.measured_s / 60:.1f} min, {folder}): "
                   f"{describe(ratio)}, the start against its copy (A/A) {describe(result.aa)}")


def verify(sweeper: Any, plan: dict[str, Any], params: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Run the best trial and the starting recipe on ``plan['seeds']``; the printed lines and the record."""
    seeds, cfg = plan["seeds"], sweeper.config
    if not seeds:
        return ["verification skipped (hydra.sweeper.verify_seeds=0)"], {"skipped": "verify_seeds=0"}
    if cfg.trainer.target_accuracy is None and cfg.trainer.target_loss is None:
        why = "it compares samples to target and the runs have no target: set trainer.target_accuracy"
        return [f"verification skipped: {why}"], {"skipped": why}
    fixed = [o for o in plan["fixed"] if not o.startswith(("trainer.seed=", "hydra."))]
    jobs = []
    for s in seeds:  # best and start alternate: a machine growing busier slows both alike
        jobs.append(fixed + override_line(params) + [f"trainer.seed={s}", f"hydra.sweep.subdir=verify/best/seed{s}",
                                                     "hydra.sweeper.pruner=null"])  # no trial: runs to its end
        jobs.append(fixed + [f"trainer.seed={s}", f"hydra.sweep.subdir=verify/start/seed{s}",
                             "hydra.sweeper.pruner=null"])
    print(f"\nverifying the best trial against the starting recipe on fresh seeds {seeds[0]}..{seeds[-1]} "
          f"({len(jobs)} runs)", flush=True)
    returns = sweeper.launch(jobs)
    sides = {"best trial": returns[0::2], "starting recipe": returns[1::2]}
    found = {name: [s for s in map(seed_of, rets) if s is not None] for name, rets in sides.items()}
    ratio = samples_to_target(found["best trial"], found["starting recipe"], sweeper.confidence)
    lines = [f"\nverification on fresh seeds {seeds[0]}..{seeds[-1]} (the search ran on trainer.seed="
             f"{cfg.trainer.seed}):", "| | seeds reached | median samples to target | median time to target s |",
             "|---|---:|---:|---:|"]
    for name, rets in sides.items():
        got = found[name]
        reached = [s.samples for s in got if s.reached]
        median = f"{statistics.median(reached):,.0f}" if reached else "-"
        t = _median_figure(rets, "time_to_target_s")
        lines.append(f"| {name} | {sum(s.reached for s in got)}/{len(rets)} | {median} | "
                     f"{f'{t:.2f}' if t is not None else '-'} |")
    lines.append(f"samples to target, best / start: {verdict(ratio)}")
    record: dict[str, Any] = {"seeds": seeds, "samples_to_target": _figures(ratio)}
    if ratio is not None:
        speed, said = throughput(sweeper, fixed, params)
        timed = time_to_target(found["best trial"], found["starting recipe"], speed, sweeper.confidence)
        lines += [said, f"time to target, best / start (samples ratio / samples/s ratio): {verdict(timed)}"]
        record |= {"samples_per_sec": _figures(speed) if isinstance(speed, Interval) else speed,
                   "time_to_target": _figures(timed)}
    return lines, record


def _figures(ratio: TargetRatio | Interval | None) -> dict[str, Any] | None:
    if ratio is None:
        return None
    out = {"estimate": ratio.estimate, "low": ratio.low, "high": ratio.high}
    if isinstance(ratio, TargetRatio):
        out |= {"p_value": ratio.p_value, "confidence": ratio.confidence, "counts": ratio.counts}
    return out


def finish(sweeper: Any, study: Any, plan: dict[str, Any]) -> None:
    """Print the trials' table, verify the best trial, print the line to paste; write optimization_results.yaml."""
    metric, direction = plan["metric"], plan["direction"]
    sweep_dir = Path(str(sweeper.config.hydra.sweep.dir))
    print(f"\nsearch {sweep_dir}: {len(study.trials)} trials, {metric} ({direction}):", *trials_table(study, metric),
          sep="\n", flush=True)
    best = best_trial(study, metric, direction, plan["space"])
    results: dict[str, Any] = {"name": study.study_name, "optimized_metric": metric, "direction": direction}
    if best is None:
        _write(sweep_dir, results | {"best_params": None})
        if study.trials and all(t.value is None for t in study.trials):  # not one figure: the search failed
            notes = "; ".join(sorted({str(t.user_attrs.get("note", "")) for t in study.trials}))
            print(f"error: no trial gave {metric} ({notes}): check that optimized_metric is a figure this task "
                  f"reports, and narrow the space where every trial diverged", file=sys.stderr)
            sys.exit(1)
        why = "reached the target" if metric in TO_TARGET else "completed"
        print(f"no trial {why}: nothing to verify; widen the search space or raise trainer.max_steps", flush=True)
        return
    print(f"best trial: {best.number + 1}, {metric} = {best.value:.4g}", flush=True)
    lines, record = verify(sweeper, plan, best.params)
    line = paste_line(plan["fixed"], best.params, sweeper.recipe, config_dir(sweeper.config))
    print("\n".join(lines), "", "the recipe found (paste it):", line, sep="\n", flush=True)
    _write(sweep_dir, results | {"best_params": dict(best.params), "best_value": best.value,
                                 "verification": record, "command": line})


def _write(sweep_dir: Path, results: dict[str, Any]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
