"""Tuners: measure the run you are about to start and print the setting to use.

    python -m runner.tune batch_size [overrides]   # the fastest micro-batch that leaves a memory margin
    python -m runner.tune lr [overrides]           # the LR range test (Smith 2017; fastai's lr_find)
    python -m runner.tune dataloader [overrides]   # num_workers x pin_memory x prefetch_factor
    python -m runner.tune speed [overrides]        # the fastest combination of speed switches, verified

The overrides are ``python -m runner``'s: the config is composed by the same ``@hydra.main`` (same search
path, ``--config-dir``, presets), and every configuration is built by the engine's own ``runner.engine.train.build``
(data, model, techniques, optimizer with its LR scaling, precision) and trained by its own ``runner.engine.train.fit``
(so data wait, step time and the loss are measured exactly as in a run). Only the run's length, the
tracker (no W&B, no console rows), the checkpointer (never saves) and, for ``lr``, the LR schedule are
swapped. ``debug`` (anomaly detection, the profiler) is not applied while tuning.

Outputs go to ``outputs/tune/<tuner>/<date>_<time>/`` (or ``--out DIR``): ``<tuner>.csv`` (the measurements),
``<tuner>.md`` (table, recommendation, notes), ``<tuner>.png`` and ``<tuner>.json`` (all of it, with the
recommendation each rank computed), plus Hydra's ``.hydra/``. At the end the table and a ready override
line are printed. ``tune.*`` (runner/config/ ``TuneConfig``) holds the tuners' settings.

Under torchrun every rank builds and trains each configuration, the figures are reduced over the ranks
(slowest rank's time, largest peak memory, the all-reduced mean loss), so each rank takes the same
decisions; the ranks' recommendations are gathered and must agree (``<tuner>.json`` ``ranks``).

Layout: ``harness`` (the trial, the ranks, the outputs, ``Tuner``), one module per tuner defining its
``TUNER`` (search, table columns, pick rule, plot), this registry, and ``__main__`` (the CLI). A new tuner
is one module plus one line in ``TUNERS`` below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.errors import ConfigError
from runner.techniques import variants
from runner.tune import batch_size, dataloader, lr, speed
from runner.tune.harness import Tuner, check_settings
from runner.tune.lr import lr_range_test, steepest, suggestion_range

__all__ = ["TUNERS", "Tuner", "run", "check_settings", "lr_range_test", "steepest", "suggestion_range"]

variants.register()  # the run config's schema, for Hydra composing it (the CLI) as ``python -m runner`` does

#: every tuner, by its CLI name, in the order ``--help`` lists them
TUNERS: dict[str, Tuner] = {t.name: t for t in (batch_size.TUNER, lr.TUNER, dataloader.TUNER, speed.TUNER)}


def run(kind: str, cfg: DictConfig, out: Path, started_s: float | None = None) -> dict[str, Any]:
    """Run the tuner named ``kind`` (a key of ``TUNERS``) on the composed run config ``cfg``; rank 0 writes the
    outputs into ``out`` and prints the table and the override line (``harness.run``, which returns the
    result: ``recommended``, ``override``, ``rows``, ``notes``, ``ranks``: each rank's recommendation).
    ``started_s``: when the command started (``time.perf_counter()``; default now), whence ``tune.budget_minutes``
    counts.

    Raises:
        ConfigError: an unknown tuner, bad ``tune.*`` values, bad run config (``runner.engine.validate.validate`` and
            the builders), or nothing to recommend (the job does not fit at the smallest batch size, ...).
        RuntimeError: the ranks' recommendations differ (a bug: they decide on the same reduced figures).
    """
    from runner.tune import harness

    if kind not in TUNERS:
        raise ConfigError(
            f"unknown tuner {kind!r}: use one of {', '.join(TUNERS)} (python -m runner.tune batch_size [overrides])"
        )
    return harness.run(TUNERS[kind], cfg, out, started_s)
