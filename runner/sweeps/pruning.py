"""Pruning a recipe search's hopeless trials on their evaluation grid (``hydra.sweeper.pruner``).

Each trial reports, after every evaluation, the figure its target is about to the study (``trial.report`` at the
global samples trained, so trials of different batch sizes meet on a samples grid) and stops where the pruner
says so (``trial.should_prune``): Optuna's pruners (median, successive halving, Hyperband; Li et al. 2018,
https://optuna.readthedocs.io/en/stable/reference/pruners.html). A pruned trial ends like one stopped at its
target, with ``stopped_early`` saying why, and the search records it as censored at the samples it reached.

The trial is found from the job: in the search's own process (the basic launcher) through ``STUDY``; in another
process (``submitit_slurm``) by opening ``hydra.sweeper.storage``. Either way by the user attributes the sweeper
set before the launch: the sweep folder and the job number.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from omegaconf import DictConfig

from runner import objective

#: the search's study in this process (``SearchSweeper.sweep`` sets it), for trials the basic launcher runs here
STUDY: Any = None
#: how ``stopped_early`` of a pruned trial begins (the sweeper reads it from the trial's summary)
PRUNED = "pruned by the search"


#: ``hydra.sweeper.pruner=<name>``: Optuna's pruners by name, with Optuna's defaults (a ``{_target_: ...}`` node sets
#: their arguments)
NAMES = {
    "none": "optuna.pruners.NopPruner",
    "median": "optuna.pruners.MedianPruner",
    "successive_halving": "optuna.pruners.SuccessiveHalvingPruner",
    "hyperband": "optuna.pruners.HyperbandPruner",
}


def build(pruner: Any) -> Any:
    """The Optuna pruner of ``hydra.sweeper.pruner``: null or ``none`` (every trial runs to its end), a name of
    ``NAMES``, or a ``{_target_: optuna.pruners.<Class>, ...}`` node.

    Raises:
        ConfigError: an unknown name (listing ``NAMES``), or a node that does not build.
    """
    from hydra.utils import instantiate

    from runner.errors import ConfigError

    if isinstance(pruner, str):
        if pruner not in NAMES:
            raise ConfigError(
                f"hydra.sweeper.pruner={pruner} is not a pruner runner knows: use one of "
                f"{', '.join(NAMES)}, or {{_target_: optuna.pruners.<Class>, ...}} for its arguments"
            )
        pruner = {"_target_": NAMES[pruner]}
    try:
        return instantiate(pruner if pruner is not None else {"_target_": NAMES["none"]})
    except Exception as e:  # noqa: BLE001 - Hydra wraps the pruner's own error: one line
        raise ConfigError(
            f"hydra.sweeper.pruner does not build ({' '.join(str(e).split())}); give a name of "
            f"{', '.join(NAMES)} or an optuna.pruners class"
        ) from e


def active(pruner: Any) -> bool:
    """Whether ``hydra.sweeper.pruner`` prunes (not null or ``none``)."""
    return pruner is not None and pruner != "none"


def name_of(pruner: Any) -> str:
    """The pruner's class name, for the lines that say it stopped a trial."""
    target = NAMES.get(pruner, "") if isinstance(pruner, str) else str(pruner.get("_target_", ""))
    return target.rsplit(".", 1)[-1]


def acts_when(pruner: Any, n_trials: int) -> str:
    """When the built Optuna ``pruner`` starts to stop trials, in one line: the median and percentile pruners wait
    for ``n_startup_trials`` finished trials (with ``n_trials`` no more than that, it stops none) and report steps
    past ``n_warmup_steps`` (samples here); the halving pruners from their first rung."""
    startup, warmup = getattr(pruner, "_n_startup_trials", None), getattr(pruner, "_n_warmup_steps", None)
    name = type(pruner).__name__
    if startup is not None:
        later = f"trial {n_trials}" if n_trials == startup + 1 else f"trials {startup + 1}-{n_trials}"
        can = (
            f"it can stop only {later}"
            if n_trials > startup
            else f"with hydra.sweeper.n_trials={n_trials} it stops none (raise n_trials, or give "
            f"{{_target_: optuna.pruners.{name}, n_startup_trials: <fewer>}})"
        )
        return (
            f"{name} acts once {startup} trials have finished (n_startup_trials), at evaluations past "
            f"{warmup or 0:,} samples (n_warmup_steps): {can}"
        )
    if warmup is not None:
        return f"{name} acts at evaluations past {warmup:,} samples (n_warmup_steps)"
    rung = getattr(pruner, "_min_resource", None)
    return f"{name} acts from its first rung ({rung if rung not in (None, 'auto') else 'set from the first trial'})"


def study_name(name: str | None, storage: str | None) -> str | None:
    """The study's name: ``hydra.sweeper.study_name``, or with a storage and none given, ``runner-search`` (a second
    run adds trials to it); None for a study in memory."""
    return name or ("runner-search" if storage else None)


def figure(cfg: DictConfig) -> str | None:
    """The evaluation figure a trial reports: the one its ``optimized_metric`` is about (``eval_accuracy`` or
    ``eval_loss``; for a time to target, the target's, of the EMA with ``trainer.target_weights=ema``); None where
    the metric is no evaluation figure (samples/s, ``train_loss``): nothing to prune on."""
    metric = cfg.get("optimized_metric")
    if metric in ("eval_accuracy", "eval_loss"):
        return metric
    if metric in objective.TO_TARGET:
        suffix = "_ema" if cfg.trainer.get("target_weights") == "ema" else ""
        return ("eval_accuracy" if cfg.trainer.target_accuracy is not None else "eval_loss") + suffix
    return None


def intermediate(name: str, value: float, direction: str) -> float:
    """``value`` of figure ``name`` as the study compares it: Optuna's pruners read intermediate values in the
    study's ``direction``, so an accuracy in a minimized study (time to target) is reported as its error rate."""
    if objective.METRICS[name.removesuffix("_ema")] == direction:
        return value
    return 1.0 - value if name.startswith("eval_accuracy") else -value


def listener(cfg: DictConfig) -> Callable[[dict, int, int, int | None], str | None] | None:
    """``runner.engine.train.train``'s ``on_evaluation`` for a job that is a trial of a search with a pruner, else
    None (any other run, or a search whose trial cannot be found: said in one line)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    given = json.loads(os.environ[objective.TRIAL_ENV]) if os.environ.get(objective.TRIAL_ENV) else None  # slots.py
    sweeper = given or hc.get("sweeper") or {}
    if (given is None and sweeper.get("_target_") != objective.SEARCH_SWEEPER) or not active(sweeper.get("pruner")):
        return None
    name = figure(cfg)
    from optuna.trial import TrialState

    if given is not None:  # named to it: its study and trial
        study = _open(given)
        trial = next(
            (
                t
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t._trial_id == given["trial_id"]
            ),
            None,
        )
    else:
        study = STUDY if STUDY is not None else _open(sweeper)
        trial = (
            None
            if study is None
            else max(  # the running one: a dead search's trial of that job is not it
                (
                    t
                    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if t.user_attrs.get("sweep") == str(hc.sweep.dir) and t.user_attrs.get("job") == hc.job.num
                ),
                key=lambda t: t.number,
                default=None,
            )
        )
    if name is None or trial is None:
        print(
            f"note: hydra.sweeper.pruner: trial {hc.job.num} of this search cannot report to its study (a study "
            f"in memory is not seen from another process: give hydra.sweeper.storage, e.g. sqlite:///search.db); "
            f"it runs to its end",
            flush=True,
        )
        return None
    import optuna

    live = optuna.trial.Trial(study, trial._trial_id)
    direction = study.direction.name.lower()

    every = int(cfg.trainer.get("eval_every") or 0)  # steps between evaluations: the grid the trials share

    def on_evaluation(metrics: dict, step: int, samples: int, ends: int | None = None) -> str | None:
        value = metrics.get(name)
        if value is None:
            return None
        reported = intermediate(name, float(value), direction)
        live.report(reported, samples)
        if ends is not None:  # it met its target and stops: its figure stands for the grid it skips
            for later in carried_forward(samples, step, every, ends):
                live.report(reported, later)
            return None
        if not live.should_prune():
            return None
        return (
            f"{PRUNED} ({type(study.pruner).__name__}) at {samples:,} samples (step {step}): {name} {value:.4g}, "
            f"worse than the trials before it there"
        )

    return on_evaluation


def carried_forward(samples: int, step: int, every: int, ends: int) -> range:
    """The evaluation grid (global samples) a trial that met its target at ``samples`` (``step``) skips, up to
    ``ends``: it reports its last figure at each, as if it had run on. Optuna's median and percentile pruners compare
    a trial only with trials that reported at the same step; without these, a trial slower to the target than all
    trials before it is compared with none of them once it passes their targets, and is never pruned. The figure
    carried is one that already met the target (last observation carried forward: a conservative stand-in, since a
    run that went on would likely do better)."""
    if every <= 0 or step <= 0:
        return range(0)
    spacing = samples // step * every
    return range(samples + spacing, ends + 1, spacing)


def _open(sweeper: Any) -> Any:
    """The study in ``hydra.sweeper.storage`` (a job in a process of its own), or None without a storage."""
    if not sweeper.get("storage"):
        return None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(
        study_name=study_name(sweeper.get("study_name"), sweeper["storage"]),
        storage=sweeper["storage"],
        pruner=build(sweeper.get("pruner")),
    )  # not kept there


def saved(summaries: list[dict[str, Any]]) -> tuple[int, float]:
    """``(trials pruned, seconds saved)`` over the trials' summaries: each pruned trial's remaining steps
    (``total_steps - steps``) at its own pace, its evaluations included (``(train_time_s + eval_time_s) / steps``:
    the evaluations come every ``eval_every`` steps) -- what it would have spent had it run to its limit without
    reaching the target."""
    pruned = [s for s in summaries if str(s.get("stopped_early") or "").startswith(PRUNED)]
    seconds = sum(
        (s["total_steps"] - s["steps"]) * (s["train_time_s"] + (s.get("eval_time_s") or 0)) / s["steps"]
        for s in pruned
        if s.get("total_steps") and s.get("steps") and s.get("train_time_s")
    )
    return len(pruned), seconds
