"""The loop's evaluations: the task's metrics of the weights (and of their EMA), the targets' time (and, with
``trainer.stop_at_target``, the end of the run there), and what watches the metrics afterwards (the best weights,
early stopping: runner/engine/monitor.py).

Called by ``runner.engine.train.fit`` with its ``TrainState`` and ``Parts`` (outside the timed steps).
"""

from __future__ import annotations

import time

from runner import checkpoint
from runner.engine import loop_guards as guards, monitor
from runner.files import own_folder
from runner.track import write_json_atomic


def evaluate(state, parts) -> bool:
    """Run the task's evaluation (outside the timed steps), log it, and date the first one meeting the
    targets: ``time_to_target_s`` = training time until then, evaluations excluded, and ``steps_to_target`` /
    ``samples_to_target`` = the step and the global samples trained by then (step x global batch: the factor of
    that time that does not depend on the machine, runner/compare/convergence.py); with ``trainer.stop_at_target``
    one meeting them ends the run (``state.stopped_early`` says how they were met). It stops at a batch
    boundary when a signal arrives (every rank at the same batch: ``loop_guards.InterruptibleBatches``): nothing is
    logged, ``state.pending_eval`` marks the step (its checkpoint redoes the evaluation on resume) and False is
    returned; True otherwise.

    Raises:
        TrainingDiverged: a non-finite evaluation loss (``loop_guards.check_evaluation``).
    """
    started = time.perf_counter()
    p = parts
    batches = len(p.data.eval) if p.plan.eval_max_batches is None else min(len(p.data.eval), p.plan.eval_max_batches)
    p.tracker.note(
        f"step {state.step}: evaluating ({batches} batches per rank"
        + (", the weights and their EMA)" if p.ema is not None else ")")
    )
    figures = _evaluate_once(parts)
    if figures is not None and p.ema is not None:
        with p.ema.swapped():
            averaged = _evaluate_once(parts)
        figures = None if averaged is None else figures | {f"{k}_ema": v for k, v in averaged.items()}
    elapsed = time.perf_counter() - started
    state.eval_time_s += elapsed
    if p.meter.first_eval_s is None:
        p.meter.first_eval_s = elapsed
    if figures is None:
        state.pending_eval = state.step
        return False
    state.eval, state.pending_eval = figures, None
    reached = p.plan.reached(state.eval)
    if state.time_to_target_s is None and reached:
        state.time_to_target_s = state.train_time_s
        state.steps_to_target, state.samples_to_target = state.step, state.step * p.plan.global_batch
    p.tracker.log({"step": state.step, "epoch": state.epoch, **state.eval})
    guards.check_evaluation(state, parts)
    _watch(state, parts)
    at_target = reached and p.plan.stop_at_target and state.stopped_early is None
    if at_target:  # trainer.stop_at_target
        state.stopped_early = f"reached the targets: {p.plan.met(state.eval)}"
        p.tracker.note(f"step {state.step}: stopping (trainer.stop_at_target): {state.stopped_early}")
    if p.on_evaluation is not None and (state.stopped_early is None or at_target):  # a search's pruner (rank 0)
        from runner.engine.build import agree

        samples = state.step * p.plan.global_batch
        ends = p.plan.total_steps * p.plan.global_batch if at_target else None  # the samples it stops short of
        answer = agree(lambda: p.on_evaluation(state.eval, state.step, samples, ends), p.env)
        if state.stopped_early is None and answer is not None:
            state.stopped_early = answer
            p.tracker.note(f"step {state.step}: stopping: {state.stopped_early}")
    return True


def _evaluate_once(parts) -> dict[str, float] | None:
    """The task's metrics of the model's current weights; None when a signal cut the evaluation short."""
    p = parts
    loader = guards.InterruptibleBatches(
        p.data.eval, lambda: p.preemption.received is not None, p.plan.eval_max_batches, p.env, p.preemption
    )
    figures = p.task.evaluate(p.model, loader, p.amp.autocast, p.plan.eval_max_batches, p.env)
    return None if getattr(loader, "interrupted", False) else figures


def _watch(state, parts) -> None:
    """After an evaluation: keep the best weights (``checkpoint.keep_best``) and decide early stopping
    (runner/engine/monitor.py); their counters go into ``state.monitors`` (the checkpoint's)."""
    p = parts
    if p.best is not None and p.best.observe(state.eval, state.step):
        best_dir = p.job_dir / "best"
        if p.env.is_main:
            own_folder(best_dir)
        checkpoint.save_weights(p.model, best_dir / "model.safetensors", p.env.is_main)
        if p.env.is_main:
            write_json_atomic(
                best_dir / "best.json",
                {"metric": p.best.metric, "value": p.best.best, "step": state.step, "epoch": state.epoch},
            )
        state.monitors["best"] = p.best.as_dict()
    elif p.best is not None:
        state.monitors["best"] = p.best.as_dict()
    if p.early is not None:
        p.early.observe(state.eval, state.step)
        state.monitors["early_stopping"] = p.early.as_dict()
        if p.early.since_best >= p.patience:
            state.stopped_early = monitor.stop_reason(p.early, p.patience)
            p.tracker.note(f"step {state.step}: early stopping: {state.stopped_early}")
