"""``TrainState``: everything the training loop changes, and how a checkpoint saves and restores it.

A checkpoint (``runner.checkpoint``, torch.distributed.checkpoint) holds the model and optimizer, the LR schedule,
the GradScaler and this state: the rank-independent fields once (``_Shared``), and each rank's RNG streams, share
of the interval's loss and step timings (``_PerRank``), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runner import checkpoint, measure

if TYPE_CHECKING:
    from runner.train import Parts


@dataclass
class TrainState:
    """Everything the loop changes: what a checkpoint saves and restores to continue a run exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch consumed
    train_time_s: float = 0.0  # s of training so far, evaluation excluded
    eval_time_s: float = 0.0
    time_to_target_s: float | None = None
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

    #: the fields that are the same on every rank; the rest (loss_sum, timings) is saved per rank
    SHARED = ("step", "epoch", "batch_in_epoch", "train_time_s", "eval_time_s", "time_to_target_s", "train_loss",
              "eval", "interval_steps", "last_finite", "skipped_steps", "checkpoint_time_s", "restarts",
              "restart_lost_time_s")


class _Shared:
    """``TrainState``'s rank-independent fields for DCP, pickled into one item (DCP keeps rank 0's)."""

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"fields": pickle.dumps({k: getattr(self.state, k) for k in TrainState.SHARED})}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in pickle.loads(sd["fields"]).items():
            setattr(self.state, k, v)


class _PerRank:
    """This rank's part of the state: its RNG streams, its share of the interval's loss and its step timings."""

    def __init__(self, state: TrainState, rank: int):
        self.state, self.rank, self.rng = state, rank, checkpoint.RNGState(rank)

    def state_dict(self) -> dict[str, Any]:
        payload = {"rng": self.rng.state_dict()[f"rank{self.rank}"], "loss_sum": self.state.loss_sum.detach().cpu(),
                   "timings": (self.state.timings.data_wait_ms, self.state.timings.step_time_ms)}
        return {f"rank{self.rank}": pickle.dumps(payload)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        payload = pickle.loads(sd[f"rank{self.rank}"])
        self.rng.load_state_dict({f"rank{self.rank}": payload["rng"]})
        self.state.loss_sum.copy_(payload["loss_sum"])
        self.state.timings.data_wait_ms[:], self.state.timings.step_time_ms[:] = payload["timings"]


def checkpoint_state(state: TrainState, parts: "Parts") -> dict[str, Any]:
    """What a checkpoint holds, as DCP Stateful objects: model + optimizer (sharded under FSDP), LR schedule,
    GradScaler, the shared ``TrainState`` (step, epoch, position in the epoch, measured time, ...) and each
    rank's RNG, loss share and timings."""
    return {"model_optimizer": checkpoint.ModelAndOptimizer(parts.model, parts.optimizer),
            "scheduler": parts.scheduler, "scaler": parts.amp.scaler, "train": _Shared(state),
            "rank": _PerRank(state, parts.env.rank)}
