"""A metric watched across evaluations: early stopping (``trainer.early_stopping.*``; Lightning's ``EarlyStopping``,
Hugging Face's ``EarlyStoppingCallback``; Prechelt, "Early stopping — but when?", 1998) and the best weights
(``checkpoint.keep_best``; Lightning's ``ModelCheckpoint(monitor=...)``). What each does, and ``mode=auto``:
docs/training.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runner.errors import ConfigError

MODES = ("auto", "min", "max")


def direction(metric: str, mode: str) -> str:
    """``min`` or ``max`` for ``metric`` under ``mode`` (``auto``: max for accuracy-like names)."""
    if mode != "auto":
        return mode
    return "max" if "accuracy" in metric else "min"


def check_metric(key: str, metric: str, reported: tuple[str, ...]) -> None:
    """Raise ConfigError when ``metric`` (the value of config ``key``) is not among the task's ``reported``."""
    if metric not in reported:
        raise ConfigError(f"{key}={metric}: the task does not report it; it reports {', '.join(reported)}")


@dataclass
class Watch:
    """The best value so far of one metric and the evaluations since it improved (a checkpoint carries it
    as plain numbers: ``as_dict``/``from_dict``)."""

    metric: str
    mode: str  # min | max
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0  # evaluations since the last improvement

    def observe(self, metrics: dict[str, Any], step: int) -> bool:
        """Record the evaluation of ``step``; True when it improved on the best by more than ``min_delta``
        (the first finite value always does). A non-finite value never improves."""
        value = metrics.get(self.metric)
        better = (
            value is not None
            and math.isfinite(value)
            and (
                self.best is None
                or (value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta)
            )
        )
        if better:
            self.best, self.best_step, self.since_best = float(value), step, 0
        else:
            self.since_best += 1
        return better

    def as_dict(self) -> dict[str, Any]:
        """The state as JSON-able numbers."""
        return {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue from ``as_dict``'s numbers (a resumed run)."""
        if saved:
            self.best, self.best_step, self.since_best = saved["best"], saved["best_step"], saved["since_best"]


def early_stopping(cfg, reported: tuple[str, ...]) -> tuple[Watch | None, int]:
    """``trainer.early_stopping`` as a ``Watch`` and its patience, or (None, 0) when ``metric`` is null.

    Raises:
        ConfigError: a metric the task does not report, ``patience`` < 1, ``min_delta`` < 0, an unknown mode.
    """
    if cfg.metric is None:
        return None, 0
    check_metric("trainer.early_stopping.metric", cfg.metric, reported)
    if cfg.patience < 1:
        raise ConfigError(
            f"trainer.early_stopping.patience={cfg.patience} must be >= 1 (evaluations without an "
            f"improvement before the run stops)"
        )
    if cfg.min_delta < 0:
        raise ConfigError(f"trainer.early_stopping.min_delta={cfg.min_delta} must be >= 0")
    if cfg.mode not in MODES:
        raise ConfigError(f"trainer.early_stopping.mode={cfg.mode}: choose one of {', '.join(MODES)}")
    return Watch(cfg.metric, direction(cfg.metric, cfg.mode), cfg.min_delta), cfg.patience


def best_checkpoint(ck: dict[str, Any], reported: tuple[str, ...]) -> Watch | None:
    """``checkpoint.keep_best`` as a ``Watch`` of ``checkpoint.best_metric``, or None when off.

    Raises:
        ConfigError: a metric the task does not report.
    """
    if not ck["keep_best"]:
        return None
    check_metric("checkpoint.best_metric", ck["best_metric"], reported)
    return Watch(ck["best_metric"], direction(ck["best_metric"], "auto"))


def stop_reason(watch: Watch, patience: int) -> str:
    """The summary's ``stopped_early``: the metric, how long it did not improve, and its best."""
    return (
        f"{watch.metric} did not improve by more than {watch.min_delta:g} for {patience} evaluation(s) "
        f"(trainer.early_stopping.patience={patience}); best {watch.best:.6g} at step {watch.best_step}"
    )
