"""``TrainState``: everything the training loop changes, and how a checkpoint saves and restores it: the
rank-independent fields once (``SharedState``), each rank's RNG streams, share of the interval's loss and step
timings on their own (``PerRankState``), so a resumed run continues exactly.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from runner import checkpoint, measure


@dataclass
class TrainState:
    """Everything the loop changes: what a checkpoint saves and restores to continue a run exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch consumed
    train_time_s: float = 0.0  # s of training so far, evaluation excluded
    eval_time_s: float = 0.0
    time_to_target_s: float | None = None
    steps_to_target: int | None = None  # the step of the first evaluation meeting the targets
    samples_to_target: int | None = None  # global samples trained by then: steps_to_target x global batch size
    train_loss: float = math.nan  # the last log interval's mean loss
    eval: dict[str, float | None] = field(default_factory=dict)  # the last evaluation's metrics
    timings: measure.Timings = field(default_factory=measure.Timings)  # every measured step's ms
    loss_sum: torch.Tensor | None = None  # this log interval's loss, summed on the device (no sync)
    interval_steps: int = 0
    last_finite: tuple[int, float] | None = None  # (step, loss) of the last log row with a finite loss
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient (trainer.on_nonfinite=skip)
    checkpoint_time_s: float = 0.0  # s the loop was blocked writing checkpoints (not in train_time_s)
    restarts: int = 0  # times this run was resumed from a checkpoint
    restart_lost_time_s: float = 0.0  # s from each resumed checkpoint's write to the resume (redone work, restart)
    interval_skipped: int = 0  # steps of this log interval skipped (trainer.max_skipped_fraction)
    pending_eval: int | None = None  # the step whose evaluation a signal cut short: redone first on resume
    stopped_early: str | None = None  # why the run ended early (early stopping, stop_at_target): resumed, it stays so
    monitors: dict[str, Any] = field(default_factory=dict)  # early stopping's and keep_best's counters (monitor.Watch)
    grad_norm: torch.Tensor | None = None  # this log step's gradient norm, on the device until the row reads it

    #: the fields that are the same on every rank; the rest (loss_sum, timings) is saved per rank
    SHARED = (
        "step",
        "epoch",
        "batch_in_epoch",
        "train_time_s",
        "eval_time_s",
        "time_to_target_s",
        "steps_to_target",
        "samples_to_target",
        "train_loss",
        "eval",
        "interval_steps",
        "last_finite",
        "skipped_steps",
        "checkpoint_time_s",
        "restarts",
        "restart_lost_time_s",
        "interval_skipped",
        "pending_eval",
        "stopped_early",
        "monitors",
    )
    #: what a field missing from an older checkpoint's state means
    ADDED_LATER = {
        "interval_skipped": 0,
        "pending_eval": None,
        "stopped_early": None,
        "monitors": {},
        "steps_to_target": None,
        "samples_to_target": None,
    }


class SharedState:
    """``TrainState``'s rank-independent fields for DCP, as one JSON string (DCP keeps rank 0's).

    JSON, never pickle: loading a checkpoint must not run code from it (``runner.checkpoint``). NaN and
    infinities (a diverged loss) round-trip through Python's JSON; ``last_finite`` comes back as a tuple."""

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"fields": json.dumps({k: getattr(self.state, k) for k in TrainState.SHARED})}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        fields = json.loads(sd["fields"])
        if fields.get("last_finite") is not None:
            fields["last_finite"] = tuple(fields["last_finite"])
        for k in TrainState.SHARED:
            setattr(self.state, k, fields[k] if k in fields else copy.deepcopy(TrainState.ADDED_LATER[k]))


class PerRankState:
    """This rank's part of the state: its RNG streams, its share of the interval's loss and its step timings,
    as tensors and one JSON string under ``rank<r>`` (ranks draw different augmentations and dropout)."""

    def __init__(self, state: TrainState, rank: int):
        self.state, self.rank, self.rng = state, rank, checkpoint.RNGState(rank)

    def state_dict(self) -> dict[str, Any]:
        rng = self.rng.state_dict()[f"rank{self.rank}"]
        payload = {
            "timings": [self.state.timings.data_wait_ms, self.state.timings.step_time_ms],
            "python_rng": rng.pop("python"),
            "numpy_rng": rng.pop("numpy"),
        }
        return {
            f"rank{self.rank}": {"json": json.dumps(payload), "loss_sum": self.state.loss_sum.detach().cpu(), **rng}
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        mine = dict(sd[f"rank{self.rank}"])
        payload = json.loads(mine.pop("json"))
        self.state.loss_sum.copy_(mine.pop("loss_sum"))
        self.rng.load_state_dict(
            {f"rank{self.rank}": {"python": payload["python_rng"], "numpy": payload["numpy_rng"], **mine}}
        )
        self.state.timings.data_wait_ms[:], self.state.timings.step_time_ms[:] = payload["timings"]
