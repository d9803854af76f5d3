"""``optimized_metric``: the one figure of a run's summary that ``python -m runner`` returns to a Hydra sweeper:
``samples_per_sec`` unless it names another of ``METRICS``; a run that never reached its target returns
``CENSORED_FACTOR`` × what it spent. Why: docs/tuners-and-doctor.md, "The metric".
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from omegaconf import DictConfig

from runner.errors import ConfigError

#: The figures a sweeper may optimize: summary.json key -> the direction in which it is better
METRICS = {
    "time_to_target_s": "minimize",  # training seconds until an evaluation first met the targets
    "samples_to_target": "minimize",  # global samples trained by then
    "steps_to_target": "minimize",  # optimizer steps by then
    "eval_accuracy": "maximize",
    "eval_loss": "minimize",
    "train_loss": "minimize",
    "samples_per_sec": "maximize",
    "tokens_per_sec": "maximize",
}
#: The figures dated by the targets: a run that did not reach them is censored
TO_TARGET = ("time_to_target_s", "samples_to_target", "steps_to_target")
#: A censored run returns this many times what it spent (``train_time_s``, samples, ``steps``)
CENSORED_FACTOR = 2.0


def check(cfg: DictConfig) -> None:
    """Refuse an ``optimized_metric`` that is not one of ``METRICS``, or a to-target one without a target.

    Raises:
        ConfigError: naming the key, the allowed values and the fix.
    """
    name = cfg.get("optimized_metric")
    if name is None:
        return
    if name not in METRICS:
        close = difflib.get_close_matches(str(name), METRICS, n=1)
        hint = f"did you mean optimized_metric={close[0]}? " if close else ""
        raise ConfigError(
            f"optimized_metric={name} is not a figure python -m runner can return: {hint}use one of "
            f"{', '.join(METRICS)} (or null: samples_per_sec)"
        )
    t = cfg.trainer
    if name in TO_TARGET and t.target_accuracy is None and t.target_loss is None:
        raise ConfigError(
            f"optimized_metric={name} needs a target: set trainer.target_accuracy (e.g. 0.98) or "
            f"trainer.target_loss, with trainer.stop_at_target=true to end each run there"
        )


def reached(summary: dict[str, Any]) -> bool:
    """Whether the run met its targets (an evaluation dated ``time_to_target_s``)."""
    return summary.get("time_to_target_s") is not None


def value(summary: dict[str, Any], name: str | None) -> float | None:
    """The figure ``name`` of ``summary`` (``samples_per_sec`` for None) as a float; for a to-target figure of a
    run that did not reach the target, ``CENSORED_FACTOR`` × what the run spent; None where the run has no such
    figure (no evaluation, no tokens, a speed figure not measured)."""
    name = name or "samples_per_sec"
    if name in TO_TARGET and not reached(summary):
        spent = {
            "time_to_target_s": summary.get("train_time_s"),
            "steps_to_target": summary.get("steps"),
            "samples_to_target": (summary.get("steps") or 0) * (summary.get("global_batch_size") or 0),
        }[name]
        return CENSORED_FACTOR * float(spent) if spent else None
    figure = summary.get(name)
    if figure is None or not math.isfinite(float(figure)):
        return None
    return float(figure)


#: The ``_target_`` of ``hydra/sweeper=search`` (conf/hydra/sweeper/search.yaml), registered by ``python -m runner``
SEARCH_SWEEPER = "hydra_plugins.runner_search.SearchSweeper"
#: The environment variable that names a search trial's study, pruner and trial to its job process
#: (runner/sweeps/slots.py): ``{"storage", "study_name", "pruner", "trial_id"}`` as JSON
TRIAL_ENV = "RUNNER_SEARCH_TRIAL"
#: Hydra's own launcher: one job after the other in this process
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
