"""``python -m runner.tune lr``: the LR range test (Smith 2017, "Cyclical Learning Rates for Training Neural
Networks", section 3.3, https://arxiv.org/abs/1506.01186; as fastai's ``lr_find``,
https://docs.fast.ai/callback.schedule.html) on the run's initial state, with the steepest descent of the
smoothed loss and fastai's valley as suggestions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.errors import ConfigError
from runner.track import NullTracker
from runner.tune.harness import NO_PROFILER, Tuner, for_tuning, pyplot, with_overrides


class RangeRecorder(NullTracker):
    """The range test's tracker: records each optimizer step's LR and (all-reduced) loss as ``fit`` logs them,
    smooths the loss with a bias-corrected EMA (fastai's ``SmoothenValue``: avg = beta avg + (1 - beta) loss,
    smoothed = avg / (1 - beta^n)) and ends the test (``should_stop``, the engine's stop hook) after ``steps``
    steps or once the smoothed loss exceeds ``diverge_factor`` x its best or is not finite (fastai's
    ``LRFinder``); every other call does nothing (``runner.track.NullTracker``)."""

    def __init__(self, steps: int, beta: float, diverge_factor: float):
        self.steps, self.beta, self.diverge_factor = steps, beta, diverge_factor
        self.points: list[dict[str, Any]] = []
        self.avg, self.count, self.best = 0.0, 0, math.inf
        self.stop = "ramp complete"
        self.done = False

    def record(self, step: int, lr: float, loss: float) -> None:
        if math.isfinite(loss):
            self.count += 1
            self.avg = self.beta * self.avg + (1 - self.beta) * loss
            smoothed = self.avg / (1 - self.beta**self.count)
        else:
            smoothed = math.nan
        self.points.append({"step": step, "lr": lr, "loss": loss, "smoothed_loss": smoothed})
        if math.isfinite(smoothed):
            self.best = min(self.best, smoothed)
        if not math.isfinite(smoothed) or smoothed > self.diverge_factor * self.best:
            self.stop = (
                f"stopped at step {step} (lr {lr:.3g}): the smoothed loss {smoothed:.4g} exceeds "
                f"{self.diverge_factor:g} x its best {self.best:.4g}"
                if math.isfinite(smoothed)
                else f"stopped at step {step} (lr {lr:.3g}): the loss is not finite"
            )
            self.done = True
        if step >= self.steps:
            self.done = True

    def log(self, row: dict[str, Any]) -> None:
        if "loss" in row and not self.done:
            self.record(row["step"], row["lr"], row["loss"])

    def should_stop(self, state: Any) -> str | None:
        """The engine's stop hook (``Parts.stop``): why the test ends after this step, or None."""
        return self.stop if self.done else None


def steepest(lrs: list[float], losses: list[float]) -> int:
    """Index of the start of the steepest descent: argmin of (loss[i+1] - loss[i]) / (ln lr[i+1] - ln lr[i])
    (fastai's ``steep``). Needs >= 2 points."""
    grads = [(losses[i + 1] - losses[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i])) for i in range(len(lrs) - 1)]
    return min(range(len(grads)), key=grads.__getitem__)


def valley(losses: list[float]) -> int:
    """fastai's ``valley``: the longest decreasing subsequence of the losses is the valley; the suggestion
    sits 1/3 + 1/6 of the way along it (index into ``losses``)."""
    n = len(losses)
    lds, max_start, max_end = [1] * n, 0, 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return max_start + int(sections) + int(sections / 2)


def suggestion_range(points: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """The points of an LR range test the suggestions are taken from (see ``RangeTest``): without the first
    10 % of ``steps`` and the last 5 recorded (fastai), cut at the first non-finite smoothed loss and after
    the lowest smoothed loss (on the falling side only)."""
    used = points[steps // 10 : max(len(points) - 5, 0)]
    bad = next((i for i, p in enumerate(used) if not math.isfinite(p["smoothed_loss"])), None)
    used = used[:bad]
    if used:  # past the lowest smoothed loss the LR is too high already
        lowest = min(range(len(used)), key=lambda i: used[i]["smoothed_loss"])
        used = used[: lowest + 1]
    return used


@dataclass
class RangeTest:
    """What ``lr_range_test`` found: every step's ``lr``, raw ``loss`` (mean over the global batch),
    ``smoothed_loss`` and ``used`` (inside the range the suggestions are taken from: fastai leaves out the
    first 10 % of the requested steps, the last 5 recorded and everything from the first non-finite
    smoothed loss on) and, unlike fastai, everything after the lowest smoothed loss: past it the loss rises
    (the LR is too high already), and a network with BatchNorm can recover from a spike there, whose
    descent would otherwise be taken for the steepest one (seen on resnet18/CIFAR-10, docs/benchmarks/tuning.md);
    ``steepest_lr`` (steepest descent of the smoothed loss), ``valley_lr`` (fastai's valley); why it stopped."""

    points: list[dict[str, Any]]
    steepest_lr: float
    valley_lr: float
    stop: str
    best_smoothed_loss: float
    extras: dict[str, Any] = field(default_factory=dict)


def lr_range_test(
    parts, min_lr: float, max_lr: float, steps: int, smoothing: float = 0.98, diverge_factor: float = 4.0
) -> RangeTest:
    """The LR range test (the module docstring's sources): from the state ``parts`` holds, train with the LR rising
    exponentially from ``min_lr`` (first step) to ``max_lr`` (step ``steps``), every parameter group alike, recording
    the loss of each step.

    The engine's ``fit`` runs the steps (accumulation, autocast and loss scaling, clipping, DDP/FSDP
    gradient reduction), with a ``LambdaLR`` ramp as the schedule and ``RangeRecorder`` as the tracker; the
    loss is logged every step, averaged over the ranks, so every rank sees the same curve and stops at the
    same step. Afterwards the model (parameters and buffers), the optimizer (state, LRs), the loss scaler
    and the random generators are restored exactly as they were: training can start from ``parts`` next.

    Raises:
        ConfigError: fewer than 3 usable points (the loss diverged too early): names the step and the fix.
    """
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from runner import checkpoint
    from runner.engine import train as engine
    from runner.engine.state import TrainState
    from runner.errors import TrainingDiverged

    model, optimizer, scaler = parts.model, parts.optimizer, parts.amp.scaler
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_scaler = copy.deepcopy(scaler.state_dict())
    rng = checkpoint.RNGState(parts.env.rank)
    saved_rng = rng.state_dict()
    recorder = RangeRecorder(steps, smoothing, diverge_factor)
    ratio = max_lr / min_lr
    try:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = min_lr
        ramp = LambdaLR(optimizer, lambda i: ratio ** (min(i, steps - 1) / (steps - 1)))
        run = for_tuning(parts, steps, 0, log_every=1, tracker=recorder, scheduler=ramp, stop=recorder.should_stop)
        state = TrainState(eval=dict.fromkeys(parts.task.metrics), loss_sum=torch.zeros((), device=parts.env.device))
        try:
            engine.fit(state, run, NO_PROFILER)
        except TrainingDiverged:  # the loss became NaN/inf (trainer.on_nonfinite=stop): the same on every rank
            i = state.step - 1
            recorder.record(state.step, min_lr * ratio ** (i / (steps - 1)), math.nan)
    finally:
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_optimizer)
        if saved_scaler:
            scaler.load_state_dict(saved_scaler)
        rng.load_state_dict(saved_rng)
        optimizer.zero_grad(set_to_none=True)
    points = recorder.points
    used = suggestion_range(points, steps)
    if len(used) < 3:
        last = points[-1] if points else {"step": 0, "lr": min_lr}
        raise ConfigError(
            f"the LR range test has too few points to suggest an LR: {recorder.stop} after "
            f"{len(points)} of tune.steps={steps} steps (suggestions leave out the first 10 % and the "
            f"last 5). Start lower (tune.min_lr={min_lr:g}), end lower (tune.max_lr={max_lr:g}, the loss "
            f"diverged by lr {last['lr']:.3g}) or raise tune.steps"
        )
    for p in points:
        p["used"] = any(p is u for u in used)
    lrs, smoothed = [p["lr"] for p in used], [p["smoothed_loss"] for p in used]
    return RangeTest(
        points=points,
        steepest_lr=lrs[steepest(lrs, smoothed)],
        valley_lr=lrs[valley(smoothed)],
        stop=recorder.stop,
        best_smoothed_loss=recorder.best,
    )


def tune_lr(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """Build the run (its initial weights, optimizer, data, precision) and run ``lr_range_test`` on it with
    ``tune.min_lr``, ``tune.max_lr``, ``tune.steps``, ``tune.smoothing``, ``tune.diverge_factor``.

    The suggested LR is the one the optimizer should use; the override gives ``optimizer.lr``, which is the
    LR at ``optimizer.base_batch_size`` when ``optimizer.lr_scaling`` is on, so it is divided by the run's
    scaling factor.

    Raises:
        ConfigError: the range test has too few usable points (``lr_range_test``), or the run's config is bad.
    """
    from runner.engine import build as builder
    from runner.techniques import optim

    t = cfg.tune
    parts, _ = builder.build_parts(with_overrides(cfg), env, job_dir)
    result = lr_range_test(parts, t.min_lr, t.max_lr, t.steps, t.smoothing, t.diverge_factor)
    factor = optim.scaled_lr(cfg.optimizer, parts.plan.global_batch) / cfg.optimizer.lr if cfg.optimizer.lr else 1.0
    setting = result.steepest_lr / factor
    notes = [
        result.stop,
        f"ramp: {t.min_lr:g} -> {t.max_lr:g} over {t.steps} steps, every parameter group; loss smoothed "
        f"(EMA {t.smoothing:g}, bias-corrected); weights and optimizer restored afterwards",
        "transformers (AdamW) often train best below these suggestions (nanoGPT's small GPT: 1e-3); treat "
        "them as an upper end and keep a warm-up",
    ]
    if factor != 1.0:
        notes.append(
            f"optimizer.lr is the LR at optimizer.base_batch_size={cfg.optimizer.base_batch_size}: "
            f"the suggested {result.steepest_lr:.3g} at global batch {parts.plan.global_batch} / "
            f"{factor:.4g} (optimizer.lr_scaling={cfg.optimizer.lr_scaling})"
        )
    if cfg.scheduler.name in ("onecycle", "cyclic"):
        notes.append(
            f"scheduler={cfg.scheduler.name} peaks at optimizer.lr x scheduler.max_lr_factor="
            f"{cfg.scheduler.max_lr_factor:g}"
        )
    rows = [{k: p[k] for k in ("step", "lr", "loss", "smoothed_loss", "used")} for p in result.points]
    return {
        "recommended": {
            "lr": result.steepest_lr,
            "steepest_lr": result.steepest_lr,
            "valley_lr": result.valley_lr,
            "optimizer.lr": setting,
        },
        "override": f"optimizer.lr={setting:.3g}",
        "rows": rows,
        "notes": notes,
    }


def is_pick(row: dict, rec: dict) -> bool:
    """The step whose LR is the suggestion (the steepest descent)."""
    return row["lr"] == rec["lr"]


def plot(result: dict[str, Any]):
    """Raw and smoothed loss against the LR (log x), both suggestions marked; the diverged tail cut off."""
    plt = pyplot()
    rows, rec = result["rows"], result["recommended"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lrs = [r["lr"] for r in rows]
    ax.plot(lrs, [r["loss"] for r in rows], color="0.7", linewidth=0.8, label="loss")
    ax.plot(lrs, [r["smoothed_loss"] for r in rows], color="tab:blue", label="smoothed loss")
    ax.axvline(rec["steepest_lr"], color="tab:green", linestyle="--", label=f"steepest {rec['steepest_lr']:.2g}")
    ax.axvline(rec["valley_lr"], color="tab:orange", linestyle=":", label=f"valley {rec['valley_lr']:.2g}")
    finite = [r["smoothed_loss"] for r in rows if math.isfinite(r["smoothed_loss"])]
    if finite:  # from the lowest loss to a little above the start: the diverged tail is cut off
        low = min(finite + [r["loss"] for r in rows if math.isfinite(r["loss"])])
        first = finite[0]
        ax.set_ylim(low - 0.1 * abs(low), max(first, low) + 0.6 * (max(first, low) - low) + 1e-3)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


TUNER = Tuner(
    name="lr",
    help="LR range test: exponential LR ramp tune.min_lr -> tune.max_lr over tune.steps from the run's\n"
    "initial state; suggest the steepest descent of the smoothed loss and fastai's valley",
    tune=tune_lr,
    columns=[
        ("step", "step", ""),
        ("lr", "lr", ".3g"),
        ("loss", "loss", ".4f"),
        ("smoothed_loss", "smoothed loss", ".4f"),
        ("used", "used", ""),
    ],
    is_pick=is_pick,
    plot=plot,
)
