"""The speed tuner's numerics guard (runner/tune/speed.py): the first steps' losses of a configuration, trained
from the same weights and batches as the user's, and how far a loss curve departs from another."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.track import NullTracker
from runner.tune.harness import NO_PROFILER, for_tuning, free_memory, is_oom

#: windows of the samples seen in which the guard compares the mean losses
GUARD_WINDOWS = 5


class LossRecorder(NullTracker):
    """A tracker that keeps each logged training loss (``log_every=1``: one per optimizer step); every other
    call does nothing (``runner.track.NullTracker``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log(self, row: dict[str, Any]) -> None:
        if "loss" in row:
            self.losses.append(float(row["loss"]))


def loss_curve(
    cfg: DictConfig, env, job_dir: Path, steps: int, plan: dict | None = None, built: dict | None = None
) -> tuple[list[float] | None, str]:
    """The training loss of each of the first ``steps`` optimizer steps of ``cfg`` (built by the engine, same
    seed, so the same initial weights and batches as any other configuration of the job), and a note: ``""``,
    ``"loss not finite"``, or (then None) ``"out of memory"`` or ``"cannot train: <the error>"``. ``plan["steps"]``:
    the job's own optimizer steps as configured (epochs counted), when a dict is given; ``built["techniques"]``: what
    the builders recorded (``summary.json``'s ``techniques``: ``applied`` or ``skipped: <why>``), and
    ``built["compile_s"]``: torch.compile's seconds in these steps, when a dict is given."""
    import torch

    from runner.engine import build as builder, train as engine
    from runner.errors import TrainingDiverged
    from runner.techniques.compile_cache import compiled_so_far

    if cfg.compile.mode is not None:
        torch._dynamo.reset()
    compiled_before = compiled_so_far()[0]  # after the reset, which may clear dynamo's timers
    recorder, note = LossRecorder(), ""
    parts = state = None
    try:
        parts, state = builder.build_parts(cfg, env, Path(tempfile.mkdtemp(prefix="guard-", dir=job_dir)))
        if plan is not None:
            plan["steps"] = parts.plan.total_steps
        if built is not None:
            built["techniques"] = dict(parts.techniques)
        parts = for_tuning(parts, steps, 0, log_every=1, tracker=recorder)
        engine.fit(state, parts, NO_PROFILER)
        if built is not None:
            built["compile_s"] = compiled_so_far()[0] - compiled_before
    except TrainingDiverged:
        note = "loss not finite"
    except Exception as e:  # noqa: BLE001 - a configuration that cannot train is rejected, with the reason
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        return None, "out of memory" if is_oom(e) else f"cannot train: {why}"
    finally:
        parts = state = None
        free_memory(env.device)
    return recorder.losses, note


def departure(
    reference: list[float], losses: list[float], ref_batch: int, batch: int, windows: int = GUARD_WINDOWS
) -> float:
    """How far ``losses`` departs from ``reference``: the largest relative difference of their mean losses
    over ``windows`` equal parts of the samples both have seen (so a run with another batch size is
    compared at the same samples). ``inf`` for a loss that is not finite or a curve that is too short.

    Args:
        reference, losses: per-step training losses (nats); ``ref_batch``, ``batch``: their global batch sizes.
    """
    seen = min(len(reference) * ref_batch, len(losses) * batch)
    if seen == 0 or not all(math.isfinite(v) for v in losses):
        return math.inf
    worst = 0.0
    for w in range(windows):
        low, high = seen * w / windows, seen * (w + 1) / windows

        def mean(curve: list[float], b: int) -> float | None:
            inside = [v for i, v in enumerate(curve) if low <= i * b < high]
            return sum(inside) / len(inside) if inside else None

        a, c = mean(reference, ref_batch), mean(losses, batch)
        if a is None or c is None:
            continue
        worst = max(worst, abs(c - a) / abs(a) if a else abs(c))
    return worst
