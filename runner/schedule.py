"""Learning-rate schedules from ``torch.optim.lr_scheduler``, stepped once per optimizer step."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch.optim.lr_scheduler import CyclicLR, LambdaLR, LRScheduler, OneCycleLR

from runner.errors import ConfigError


def build(cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> tuple[LRScheduler, dict]:
    """Return ``(scheduler, techniques)`` for ``total_steps`` optimizer steps.

    - ``constant``: the optimizer's LR throughout.
    - ``onecycle``: 1Cycle (Smith & Topin 2018, https://arxiv.org/abs/1708.07120), ``OneCycleLR`` up to
      ``max_lr_factor`` x LR over ``pct_start`` of the steps, then annealed down.
    - ``cosine``: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_factor`` x LR
      (Loshchilov & Hutter 2017, https://arxiv.org/abs/1608.03983; warm-up: Goyal et al. 2017).
    - ``cyclic``: triangular cyclical LR (Smith 2017, https://arxiv.org/abs/1506.01186) between
      ``base_lr_factor`` and ``max_lr_factor`` x LR, ``cycle_steps`` per cycle.

    Raises:
        ConfigError: an unknown ``scheduler.name`` or a warm-up longer than the run.
    """
    lr = optimizer.param_groups[0]["lr"]
    total_steps = max(total_steps, 1)
    name = cfg.name
    if name == "constant":
        return LambdaLR(optimizer, lambda step: 1.0), {}
    if name == "onecycle":
        if not 0 < cfg.pct_start < 1:
            raise ConfigError(f"scheduler.pct_start={cfg.pct_start} must be in (0, 1)")
        # OneCycleLR divides by each phase's length: keep both phases >= 2 steps on very short runs
        phases_min = math.ceil(2 / min(cfg.pct_start, 1 - cfg.pct_start)) + 1
        sched = OneCycleLR(optimizer, max_lr=lr * cfg.max_lr_factor, total_steps=max(total_steps + 1, phases_min),
                           pct_start=cfg.pct_start, cycle_momentum=False)
    elif name == "cosine":
        warm = cfg.warmup_steps
        if warm < 0 or warm >= total_steps:
            raise ConfigError(f"scheduler.warmup_steps={warm} must be in [0, {total_steps}) for this run's "
                              f"{total_steps} optimizer steps; lower it")
        floor = cfg.min_lr_factor

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min((step - warm) / max(total_steps - warm, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = LambdaLR(optimizer, factor)
    elif name == "cyclic":
        sched = CyclicLR(optimizer, base_lr=lr * cfg.base_lr_factor, max_lr=lr * cfg.max_lr_factor,
                         step_size_up=max(cfg.cycle_steps // 2, 1), cycle_momentum=False)
    else:
        raise ConfigError(f"scheduler.name={name!r} is not one of constant, onecycle, cosine, cyclic")
    return sched, {f"scheduler_{name}": "applied"}
