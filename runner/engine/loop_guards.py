"""What the training loop checks besides training: a scheduled checkpoint or a signal after a step, a
non-finite gradient or loss, too many skipped steps, an evaluation a signal cuts short, and the stop for a
signal with the command that resumes. Kept out of ``runner.engine.train`` so the loop itself stays readable.

Nothing here costs a host-device sync on the happy path beyond what ``docs/design.md`` lists: the signal
flag is a Python attribute, the gradient check runs only with ``trainer.on_nonfinite=skip``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from runner import checkpoint
from runner.checkpoint import preempt
from runner.engine.state import TrainState
from runner.errors import EXIT_PREEMPTED, ConfigError, Preempted, TrainingDiverged

Parts = Any  # runner.engine.build.Parts (the engine imports this module, so not the other way round)


def finite_gradients(model: torch.nn.Module) -> bool:
    """Whether every gradient is finite: one norm over all of them and one host-device sync. Under FSDP the
    norm of the shards is a DTensor reduced over the ranks, so every rank gets the same answer."""
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    if not grads:
        return True
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return bool(torch.isfinite(norm).item())


def checkpoint_due(state: TrainState, parts: Parts, logged: bool) -> tuple[bool, bool]:
    """``(save, stop)`` after this step: a scheduled checkpoint (by steps, or by minutes on rank 0's clock),
    and a signal received (SIGTERM/SIGUSR1/SIGINT). One process decides every step at no cost; several agree at
    log steps only, with one all-reduce, since a collective per step would be a host-device sync per step
    (so a signal is acted on within ``trainer.log_every`` steps)."""
    p = parts
    by_steps = bool(p.checkpointer.every_steps) and state.step % p.checkpointer.every_steps == 0
    if not p.env.distributed:
        return by_steps or p.checkpointer.due(state.step), p.preemption.received is not None
    if not logged:
        return by_steps, False
    flags = torch.tensor(
        [p.checkpointer.due(state.step) and p.env.is_main, p.preemption.received is not None],
        dtype=torch.int32,
        device=p.env.device,
    )
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    by_time, signalled = (bool(v) for v in flags.tolist())
    if signalled and p.preemption.received is None:
        p.preemption.received = "another rank's signal"
    return by_steps or by_time, signalled


_END = object()


class InterruptibleBatches:
    """The evaluation batches, at most ``limit`` (None: all), ending early at a batch boundary once ``stop()`` is
    true (a signal arrived mid-evaluation); ``interrupted`` then says the figures are partial. ``len`` and other
    attributes are the loader's.

    With several processes (``env.distributed``) the ranks agree before every batch, with one all-reduce of
    (a signal here, a batch here): all stop at the same batch when any rank has a signal, and a rank whose
    share ran out keeps taking part until no rank has a batch left, so the collectives always match (the cost:
    one small all-reduce per evaluation batch, outside the timed steps). A rank stopped by another's signal
    records it in ``preemption`` (``received = "another rank's signal"``) so it checkpoints and stops too.
    """

    def __init__(self, loader, stop: Callable[[], bool], limit: int | None = None, env=None, preemption=None):
        self.loader, self.stop, self.limit, self.env, self.preemption = loader, stop, limit, env, preemption
        self.interrupted = False

    def _agree(self, signalled: bool, has_batch: bool) -> tuple[bool, bool]:
        flags = torch.tensor([signalled, has_batch], dtype=torch.int32, device=self.env.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        any_signal, any_batch = (bool(v) for v in flags.tolist())
        return any_signal, any_batch

    def __iter__(self):
        batches, i = iter(self.loader), 0
        several = self.env is not None and self.env.distributed
        while self.limit is None or i < self.limit:
            i += 1
            batch = next(batches, _END)
            if not several:
                if batch is _END:
                    return
                if self.stop():
                    self.interrupted = True
                    return
                yield batch
                continue
            any_signal, any_batch = self._agree(self.stop(), batch is not _END)
            if any_signal:
                self.interrupted = True
                if self.preemption is not None and self.preemption.received is None:
                    self.preemption.received = "another rank's signal"
                return
            if not any_batch:
                return
            if batch is not _END:
                yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def _sweep_dir() -> Path | None:
    """The multirun's sweep folder, or None (a single run, or outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir).resolve()


def stop_for_signal(state: TrainState, parts: Parts, launcher: str) -> None:
    """After the checkpoint of a signalled step: print where it is and the exact command that resumes (two
    lines), under submitit hand the signal back to submitit (it requeues the job its own way), under SLURM
    requeue the job; then stop with ``Preempted`` (exit status ``EXIT_PREEMPTED``)."""
    p = parts
    p.checkpointer.finish()
    message = (
        f"stopped at step {state.step} for {p.preemption.received}: checkpoint "
        f"{p.checkpointer.root / checkpoint.step_name(state.step)} written"
    )
    if p.env.is_main:
        done = preempt.requeue_slurm_job()  # None under submitit: it requeues its own jobs
        hint = preempt.resume_command(sys.argv[1:], p.job_dir.resolve(), _sweep_dir(), launcher)
        print(message + (f"; {done}" if done else "") + f"\nresume with: {hint}", flush=True)
    if p.preemption.handoff:  # a submitit job: its handler requeues once it gets its signal back
        p.tracker.abort(exit_code=EXIT_PREEMPTED)
        p.preemption.resend()
    raise Preempted(message)


def diverged_message(state: TrainState, parts: Parts, what: str | None = None) -> str:
    """The ``TrainingDiverged`` message: what became non-finite (the training loss by default), the last finite
    loss, and the usual fixes."""
    last = (
        f"the last finite loss was {state.last_finite[1]:.4g} at step {state.last_finite[0]}"
        if state.last_finite
        else "no logged loss was finite"
    )
    opt = parts.cfg.optimizer
    what = what or f"the training loss became {state.train_loss} by step {state.step}"
    return (
        f"{what} (trainer.log_every={parts.plan.log_every}); {last}. Usual fixes: a lower optimizer.lr (now "
        f"{opt.lr}{', scaled by ' + opt.lr_scaling if opt.lr_scaling != 'none' else ''}), "
        f"optimizer.clip_grad_norm=1.0, precision=bf16 instead of fp16 amp, a warm-up "
        f"(scheduler=cosine scheduler.warmup_steps=100), or checking the data for NaN/inf. "
        f"trainer.on_nonfinite=skip skips such steps instead. No summary was written; the last checkpoint "
        f"(if any) is intact"
    )


def check_skipped(state: TrainState, parts: Parts, interval_skipped: int, interval_steps: int) -> None:
    """With ``trainer.on_nonfinite=skip``: stop when more than ``trainer.max_skipped_fraction`` of a log
    interval's steps were skipped (the run is diverging, not hitting a rare bad batch).

    Raises:
        TrainingDiverged: naming the count, the interval and the setting.
    """
    limit = parts.cfg.trainer.max_skipped_fraction
    if interval_steps and interval_skipped > limit * interval_steps:
        raise TrainingDiverged(
            diverged_message(
                state,
                parts,
                f"{interval_skipped} of the {interval_steps} steps up to step {state.step} had a "
                f"non-finite gradient and were skipped (more than trainer.max_skipped_fraction={limit}; "
                f"{state.skipped_steps} skipped in all)",
            )
        )


def check_evaluation(state: TrainState, parts: Parts) -> None:
    """A non-finite evaluation metric: bad evaluation data when the training loss is finite, else divergence.

    Raises:
        ConfigError: the training loss is finite (the evaluation set holds NaN/inf, or fp16 overflows there).
        TrainingDiverged: naming the step and the metric.
    """
    bad = {k: v for k, v in state.eval.items() if isinstance(v, float) and not math.isfinite(v)}
    recent = state.loss_sum.item() / state.interval_steps if bad and state.interval_steps else None  # a sync, here only
    train_loss = recent if recent is not None else state.last_finite[1] if state.last_finite else None
    if bad and train_loss is not None and math.isfinite(train_loss):  # the model is fine: the evaluation data is not
        raise ConfigError(
            f"the evaluation at step {state.step} gave {', '.join(f'{k}={v}' for k, v in bad.items())} "
            f"while the training loss is finite ({train_loss:.4g}): the evaluation set holds NaN or inf "
            f"(its targets or inputs; data.*), or evaluation overflows in fp16 (precision=bf16). No "
            f"summary was written; the last checkpoint (if any) is intact"
        )
    if bad:
        raise TrainingDiverged(
            diverged_message(
                state,
                parts,
                f"the evaluation at step {state.step} gave {', '.join(f'{k}={v}' for k, v in bad.items())}"
                f" ({state.skipped_steps} steps skipped for a non-finite gradient)",
            )
        )
