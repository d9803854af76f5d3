"""Learning-rate schedules (technique 1) from ``torch.optim.lr_scheduler``, stepped once per optimizer
step (not per micro-batch), so gradient accumulation does not speed the schedule up.

Every schedule is relative to the optimizer's LR after batch scaling (``optim.scaled_lr``): factors in
the config multiply it. ``constant`` is the baseline and records nothing.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch.optim.lr_scheduler import CyclicLR, LambdaLR, LRScheduler, OneCycleLR

from runner.config import check_choice
from runner.errors import ConfigError


def build(cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> tuple[LRScheduler, dict]:
    """Return ``(scheduler, techniques)`` for ``total_steps`` optimizer steps.

    - ``constant``: the optimizer's LR throughout.
    - ``onecycle``: 1Cycle (Smith & Topin 2018, https://arxiv.org/abs/1708.07120), ``OneCycleLR``: from
      peak / 25 up to the peak ``max_lr_factor`` x LR over the first ``pct_start`` of the steps (cosine),
      then annealed down to peak / 25e4 at the last step.
    - ``cosine``: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_factor`` x LR
      (Loshchilov & Hutter 2017, https://arxiv.org/abs/1608.03983; warm-up: Goyal et al. 2017).
    - ``cyclic``: triangular cyclical LR (Smith 2017, https://arxiv.org/abs/1506.01186) between
      ``base_lr_factor`` and ``max_lr_factor`` x LR, ``cycle_steps`` per cycle.

    Raises:
        ConfigError: an unknown ``scheduler.name``, a warm-up as long as the run, ``pct_start`` outside
            (0, 1), ``cycle_steps`` < 2 or factors that are not positive / not base < max.
    """
    lr = optimizer.param_groups[0]["lr"]
    total_steps = max(total_steps, 1)
    name = cfg.name
    check_choice("scheduler.name", name)
    if name == "constant":
        return LambdaLR(optimizer, lambda step: 1.0), {}
    if name == "onecycle":
        if cfg.max_lr_factor <= 0:
            raise ConfigError(f"scheduler.max_lr_factor={cfg.max_lr_factor} must be > 0")
        if not 0 < cfg.pct_start < 1:
            raise ConfigError(f"scheduler.pct_start={cfg.pct_start} must be in (0, 1)")
        # Step i (0-based) uses the schedule's value i, so the last step uses the annealed minimum; the
        # scheduler.step() after it reaches last_epoch == total_steps, which OneCycleLR still allows.
        # OneCycleLR divides by each phase's length: keep both phases >= 2 steps on very short runs.
        phases_min = math.ceil(2 / min(cfg.pct_start, 1 - cfg.pct_start)) + 1
        sched = OneCycleLR(
            optimizer,
            max_lr=lr * cfg.max_lr_factor,
            total_steps=max(total_steps, phases_min),
            pct_start=cfg.pct_start,
            cycle_momentum=False,
        )
    elif name == "cosine":
        warm = cfg.warmup_steps
        if warm < 0 or warm >= total_steps:
            raise ConfigError(
                f"scheduler.warmup_steps={warm} must be in [0, {total_steps}) for this run's "
                f"{total_steps} optimizer steps; lower it"
            )
        floor = cfg.min_lr_factor
        if not 0 <= floor <= 1:
            raise ConfigError(f"scheduler.min_lr_factor={floor} must be in [0, 1] (final LR = optimizer LR x this)")

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min((step - warm) / max(total_steps - warm, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = LambdaLR(optimizer, factor)
    else:  # cyclic, the last of CHOICES["scheduler.name"]
        if cfg.cycle_steps < 2:
            raise ConfigError(f"scheduler.cycle_steps={cfg.cycle_steps} must be >= 2 (one step up, one down)")
        if not 0 < cfg.base_lr_factor < cfg.max_lr_factor:
            raise ConfigError(
                f"scheduler.base_lr_factor={cfg.base_lr_factor} must be > 0 and below "
                f"scheduler.max_lr_factor={cfg.max_lr_factor}"
            )
        sched = CyclicLR(
            optimizer,
            base_lr=lr * cfg.base_lr_factor,
            max_lr=lr * cfg.max_lr_factor,
            step_size_up=max(cfg.cycle_steps // 2, 1),
            cycle_momentum=False,
        )
    return sched, {f"scheduler_{name}": "applied"}
