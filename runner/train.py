"""The engine: ``build`` every part in a fixed order, ``fit`` (the one training loop), ``summarize``.

    parts, state = build(cfg, env, job_dir)   # task, data, model + its techniques, optimizer, ... ; TrainState
    fit(state, parts, profiler)               # the loop: changes nothing but ``state`` (and the model/optimizer)
    summary = summarize(state, parts)         # summary.json

Each part comes from the module of its config group and sees only its own section; techniques that are
off are do-nothing objects (``nullcontext``, ``GradScaler(enabled=False)``, a clipper that does nothing),
so the loop has no feature branches. The loop never names a loss or a metric: it asks the task.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import (
    bad_data,
    checkpoint,
    data as data_mod,
    debug,
    distributed,
    ema as ema_mod,
    evaluation,
    hardware,
    launch,
    loop_guards as guards,
    machine_load,
    measure,
    models,
    monitor,
    optim,
    parallel,
    precision,
    preempt,
    prepare,
    resume,
    schedule,
    slice_gate,
    task as task_mod,
)
from runner.config import global_batch_size
from runner.data import text
from runner.errors import ConfigError, Preempted, TrainingDiverged
from runner.state import PerRankState, SharedState, TrainState
from runner.track import NullTracker, Tracker, git_sha, job_folder, sweep_group
from runner.validate import validate


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


#: Warm-up steps profiled on CUDA for the speed doctor (``measure.GpuIdleProbe``; trainer.doctor=false: none):
#: two steps give a steady step's kernels without the first steps' compilation and autotuning (the window
#: needs trainer.warmup_steps >= 3).
GPU_PROFILE_STEPS = 2


@dataclass
class Plan:
    """The run's fixed numbers, read from the config once (plain ints: no config lookups per step)."""

    total_steps: int  # optimizer steps
    accumulate: int  # micro-batches per optimizer step
    micro_batch: int  # samples per micro-batch and rank
    global_batch: int  # samples per optimizer step, all ranks
    log_every: int
    eval_every: int
    eval_max_batches: int | None
    set_to_none: bool
    target_accuracy: float | None
    target_loss: float | None
    skip_nonfinite: bool  # trainer.on_nonfinite=skip: check every step's gradients (one sync per step)

    def reached(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` meet every target set (never, when none is)."""
        if self.target_accuracy is None and self.target_loss is None or None in metrics.values():
            return False
        return ((self.target_accuracy is None or metrics["eval_accuracy"] >= self.target_accuracy)
                and (self.target_loss is None or metrics["eval_loss"] <= self.target_loss))


@dataclass
class Parts:
    """What ``build`` makes and ``fit``/``summarize`` use; the loop updates the model and optimizer in
    place but never replaces a part (its own changes go to ``TrainState``)."""

    cfg: DictConfig
    env: distributed.Env
    job_dir: Path
    task: Any  # runner.task.Classification | LanguageModel | the user's
    data: data_mod.Data
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    amp: precision.Precision
    clip: Callable[[torch.optim.Optimizer], None]
    meter: measure.Meter
    tracker: Tracker | NullTracker
    plan: Plan
    flops_per_sample: float | None
    techniques: dict[str, str]
    details: dict[str, object]
    resolved: dict  # the config with every interpolation resolved (summary.json, W&B)
    checkpointer: checkpoint.Checkpointer
    preemption: preempt.Preemption
    at_end: bool  # checkpoint.at_end: a checkpoint and model.safetensors after the last step
    gate: slice_gate.SliceGate | None = None  # the interleaved launcher's pause point (runner/slice_gate.py)
    ema: ema_mod.EMA | None = None  # trainer.ema_decay: the moving average of the weights (runner/ema.py)
    early: monitor.Watch | None = None  # trainer.early_stopping (runner/monitor.py)
    patience: int = 0
    best: monitor.Watch | None = None  # checkpoint.keep_best


def checkpoint_state(state: TrainState, parts: Parts) -> dict[str, Any]:
    """What a checkpoint holds, as DCP Stateful objects: model + optimizer (sharded under FSDP), LR schedule,
    GradScaler, the shared ``TrainState`` (step, epoch, position in the epoch, measured time, ...) and each
    rank's RNG, loss share and timings."""
    held = {"model_optimizer": checkpoint.ModelAndOptimizer(parts.model, parts.optimizer),
            "scheduler": parts.scheduler, "scaler": parts.amp.scaler, "train": SharedState(state),
            "rank": PerRankState(state, parts.env.rank)}
    return held | ({"ema": parts.ema} if parts.ema is not None else {})


def train(cfg: DictConfig, job_dir: Path | None = None) -> dict[str, Any]:
    """Train ``cfg`` and return the summary written to ``<job_dir>/summary.json``.

    ``job_dir`` defaults to the Hydra job's folder. Raises ``ConfigError`` for bad input, before any
    result file is written.
    """
    validate(cfg)
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    try:
        job_dir = job_dir or job_folder()
        if sweep_group() is not None:  # a sweep rerun into its folder: a job that finished there is skipped
            resolved = OmegaConf.to_container(cfg, resolve=True)
            done = _agree(lambda: resume.finished_job(job_dir, resolved), env)
            if done is not None:
                if env.is_main:
                    print(f"{job_dir}: finished already (summary.json, step {done.get('steps')}); skipped", flush=True)
                return done
        parts, state = build(cfg, env, job_dir)
        try:
            with debug.build(cfg.debug, parts.job_dir, env.device) as (profiler, status), parts.preemption:
                parts.techniques |= status
                with prepare.deterministic_or_refused(cfg.trainer.deterministic):
                    fit(state, parts, profiler)
            if parts.at_end:  # the weights first: a final checkpoint that fails (a full disk) does not lose them
                checkpoint.save_weights(parts.model, parts.job_dir / "model.safetensors", env.is_main)
                if parts.ema is not None:
                    with parts.ema.swapped():
                        checkpoint.save_weights(parts.model, parts.job_dir / "model_ema.safetensors", env.is_main)
            try:
                if parts.at_end:
                    save_checkpoint(state, parts)
                parts.checkpointer.finish()
            except ConfigError as e:
                raise ConfigError(f"{e}" + (f". The trained weights are in {parts.job_dir / 'model.safetensors'}"
                                            if parts.at_end else "")) from e
            parts.task.finish(parts.model, parts.data, parts.job_dir, env, cfg.trainer.seed)
        except Preempted:
            parts.checkpointer.finish()
            parts.tracker.abort(exit_code=preempt.EXIT_PREEMPTED)
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stopped by the user, not failed (MLflow: KILLED)
            parts.tracker.abort(exit_code=130)
            raise
        except BaseException:
            parts.tracker.abort()
            raise
        summary = summarize(state, parts)
        if env.is_main:
            launch.forget_elastic_pointer()  # finished: no restart will look for this job folder again
        return summary
    finally:
        distributed.teardown()


def build(cfg: DictConfig, env: distributed.Env, job_dir: Path) -> tuple[Parts, TrainState]:
    """Build every part in order: task -> data -> model -> model techniques -> optimizer, schedule, precision
    -> meter, tracker; and the initial ``TrainState``.

    Raises:
        ConfigError: bad input found by any builder, before any result file is written.
    """
    job_dir = distributed.shared_job_dir(job_dir, env)
    t = cfg.trainer
    seed_everything(t.seed)
    task = task_mod.build(cfg.task)
    for key, metric in (("target_accuracy", "eval_accuracy"), ("target_loss", "eval_loss")):
        if t[key] is not None and metric not in task.metrics:
            raise ConfigError(f"trainer.{key}={t[key]} but {type(task).__name__} reports no {metric} "
                              f"(it reports {', '.join(task.metrics)}); use a target of those")
    skipped = task.skipped(cfg)  # switches that do not apply to this task: recorded, never applied
    techniques = dict(skipped)
    techniques |= prepare.apply_deterministic(t.deterministic, env.device)
    techniques |= prepare.apply_num_threads(t.num_threads)
    host_allocator = prepare.apply_host_allocator(t.host_allocator)  # before the first tensor is built
    benchmark = cfg.cudnn_benchmark and "cudnn_benchmark" not in skipped
    techniques |= prepare.apply_cudnn_benchmark(benchmark and not t.deterministic, env.device)
    if benchmark and t.deterministic:
        techniques["cudnn_benchmark"] = "skipped: trainer.deterministic=true (autotuning picks algorithms by timing)"
    channels_last = cfg.channels_last and "channels_last" not in skipped
    memory_format = torch.channels_last if channels_last else torch.contiguous_format

    data = data_mod.build(cfg.data, cfg.dataloader, env, seed=t.seed, memory_format=memory_format)
    model = models.build(cfg.model, task.model_kwargs(data), data.in_channels, example=data.item).to(env.device)
    task.check(model, data)
    # counted on the plain model, before any wrapper: the arithmetic is the same, and FSDP2 cannot be copied
    flops = measure.flops_per_sample(model, data.example, task.loss)
    amp = precision.build(cfg.precision, env.device)  # before the wrapper: FSDP all-gathers in its compute dtype
    model, applied, details = prepare.prepare(model, cfg, env, amp, skip=skipped)
    details["host_allocator"] = host_allocator
    if amp.note:
        details["precision"] = amp.note  # precision=auto: the dtype it picked on this device
    seed_everything(t.seed + env.rank)  # weights are identical on all ranks; augmentation/dropout differ
    techniques |= data.techniques | applied

    accumulate = cfg.memory.accumulate_steps
    if accumulate > 1:
        techniques["gradient_accumulation"] = "applied"
    steps_per_epoch = len(data.train) // accumulate
    if steps_per_epoch == 0:
        raise ConfigError(f"memory.accumulate_steps={accumulate} exceeds the {len(data.train)} micro-batches of an "
                          f"epoch; lower it or dataloader.batch_size")
    plan = Plan(total_steps=t.max_steps or t.max_epochs * steps_per_epoch, accumulate=accumulate,
                micro_batch=cfg.dataloader.batch_size,
                global_batch=global_batch_size(cfg.dataloader.batch_size, accumulate, env.world_size), log_every=t.log_every,
                eval_every=t.eval_every or steps_per_epoch, eval_max_batches=t.eval_max_batches,
                set_to_none=cfg.optimizer.set_to_none, target_accuracy=t.target_accuracy, target_loss=t.target_loss,
                skip_nonfinite=t.on_nonfinite == "skip")
    optimizer, status = optim.build(cfg.optimizer, model, plan.global_batch, env.device)
    techniques |= status
    scheduler, status = schedule.build(cfg.scheduler, optimizer, plan.total_steps)
    techniques |= status
    techniques |= amp.techniques
    clip = optim.gradient_clipping(cfg.optimizer.clip_grad_norm, model, amp.scaler)  # recorded by optim.build

    ema = ema_mod.EMA(model, t.ema_decay, t.ema_warmup, t.ema_every) if t.ema_decay is not None else None
    reported = tuple(task.metrics) + (tuple(f"{m}_ema" for m in task.metrics) if ema is not None else ())
    early, patience = monitor.early_stopping(t.early_stopping, reported)
    ck = resume.settings(cfg.checkpoint)
    best = monitor.best_checkpoint(ck, reported)
    if ema is not None:
        techniques["ema"] = "applied"
        details["ema"] = {"decay": t.ema_decay, "warmup": t.ema_warmup, "every": t.ema_every,
                          "update_ms": round(ema.measure_update_ms(env.device), 4)}
    state = TrainState(eval=dict.fromkeys(reported), loss_sum=torch.zeros((), device=env.device))
    # the speed doctor's GPU window: the last warm-up steps on CUDA (no figure includes them), never beside
    # debug=profile's own profiler
    profile_steps = GPU_PROFILE_STEPS if t.doctor and cfg.debug.name == "off" else 0
    meter = measure.Meter(env.device, t.warmup_steps, plan.global_batch, task.tokens_per_sample(data), state.timings,
                          gpu_profile_steps=profile_steps)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    point = _agree(lambda: resume.find_resume_point(ck["resume"], job_dir, resolved, plan.total_steps), env)
    if point.path is not None and point.meta.get("world_size", env.world_size) != env.world_size:
        raise ConfigError(f"cannot resume from {point.path}: it was written by {point.meta['world_size']} processes and "
                          f"this run has {env.world_size}; exact resume needs the same world size (same launch), or "
                          f"start fresh with checkpoint.resume=never in a new folder")
    tracker = (Tracker(job_dir, cfg, resolved, plan.total_steps, sweep_group(),
                       resume_step=point.step if point.stale_rows else None,
                       wandb_run_id=point.meta.get("wandb_run_id"), mlflow_run_id=point.meta.get("mlflow_run_id"))
               if env.is_main else NullTracker())
    if data.vocab is not None and point.path is not None:  # data.path may move, but must hold the same text
        _agree(lambda: text.check_vocab(data.vocab, cfg.data.path, point.meta, point.path), env)
    if env.is_main and data.vocab is not None:
        text.save_vocab(data.vocab, job_dir)
    if env.is_main and data.codec is not None and data.codec.note:
        print(f"note: {data.codec.note}", flush=True)  # data=tokens: why samples.txt holds token ids
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    checkpointer = checkpoint.Checkpointer(job_dir / checkpoint.FOLDER, every_steps=ck["every_steps"],
                                           every_minutes=ck["every_minutes"], keep_last=ck["keep_last"],
                                           async_save=ck["async"], is_main=env.is_main)
    parts = Parts(cfg=cfg, env=env, job_dir=job_dir, task=task, data=data, model=model, optimizer=optimizer,
                  scheduler=scheduler, amp=amp, clip=clip, meter=meter, tracker=tracker, plan=plan,
                  flops_per_sample=flops, techniques=techniques, details=details, resolved=resolved,
                  checkpointer=checkpointer, at_end=ck["at_end"],
                  preemption=preempt.Preemption(ck["signals"], handoff=preempt.submitit_signal()),
                  gate=slice_gate.current(), ema=ema, early=early, patience=patience, best=best)
    if point.path is not None:
        checkpointer.load(checkpoint_state(state, parts), point.path)
        for watch, key in ((early, "early_stopping"), (best, "best")):
            if watch is not None:
                watch.restore(state.monitors.get(key))
        state.restart_lost_time_s += max(0.0, time.time() - float(point.meta.get("time", time.time())))
    if point.path is not None or point.stale_rows:  # an earlier attempt stopped early: counted outside checkpoints
        state.restarts = _agree(lambda: resume.record_restart(job_dir, state.restarts), env)
        if env.is_main:
            print(f"resumed from {point.path} (step {state.step}, epoch {state.epoch}, restart {state.restarts})"
                  if point.path is not None else f"started over: the earlier attempt in {job_dir} stopped before its "
                  f"first checkpoint (restart {state.restarts})", flush=True)
    return parts, state


def _agree(decide: Callable[[], Any], env: distributed.Env) -> Any:
    """Rank 0 runs ``decide`` (file-system decisions: one answer for all); every rank gets its result, or
    raises the ConfigError it raised (instead of waiting for an answer that never comes)."""
    try:
        result = decide() if env.is_main else None
    except ConfigError as e:
        result = e
    result = distributed.broadcast_object(result, env)
    if isinstance(result, ConfigError):
        raise ConfigError(str(result))
    return result


def save_checkpoint(state: TrainState, parts: Parts) -> None:
    """Write the checkpoint of ``state.step`` (every rank; outside the timed steps and ``train_time_s``)."""
    p = parts
    p.meter.flush()  # pending timing marks become figures of the state being saved
    parallel.sync_ddp_buffers(p.model, p.env)  # one copy of a replicated buffer is kept: make it rank 0's
    meta = {"config": p.resolved, "world_size": p.env.world_size, "wandb_run_id": p.tracker.wandb_run_id,
            "mlflow_run_id": p.tracker.mlflow_run_id,
            "time": time.time(), "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
            **({"vocab": p.data.vocab} if p.data.vocab is not None else {})}
    before = p.checkpointer.time_s
    p.checkpointer.save(checkpoint_state(state, parts), state.step, meta)
    state.checkpoint_time_s += p.checkpointer.time_s - before


def fit(state: TrainState, parts: Parts, profiler) -> None:
    """The training loop: from ``state.step`` to ``plan.total_steps`` optimizer steps.

    One optimizer step = ``plan.accumulate`` micro-batches (forward under autocast, scaled backward;
    DDP/FSDP reduce gradients on the last one only), clipping, the optimizer and LR-schedule steps. Every
    ``log_every`` steps the loss is read (the interval's only host-device sync) and the meter flushed;
    every ``eval_every`` steps (and at the last) the task evaluates, outside the timed steps.
    """
    p, plan = parts, parts.plan
    if state.pending_eval == state.step and state.step:  # a signal cut this step's evaluation short: redo it
        evaluation.evaluate(state, parts)
    batches = _batches(p.data.train, state)
    segment_start = time.perf_counter()
    while state.step < plan.total_steps and state.stopped_early is None:
        if p.gate is not None and p.gate.due(state.step):  # interleaved: a slice ended; wait, untimed, for the next
            state.train_time_s += measure.wall_clock(p.env.device) - segment_start
            p.meter.pause()
            if not p.gate.wait(state.step, state.train_time_s, plan.global_batch, p.env):
                plan.total_steps = state.step + 1  # finish: one last step, then the final log and evaluation
            p.meter.resume()
            segment_start = time.perf_counter()
        try:  # free on the happy path; bad data or a bad model output is diagnosed only once it failed
            for micro in range(plan.accumulate):
                p.meter.start_fetch()
                batch = next(batches)
                p.meter.batch_ready()
                with parallel.no_sync(p.model, last=micro == plan.accumulate - 1), p.amp.autocast():
                    loss = p.task.loss(p.model, batch) / plan.accumulate
                p.amp.scaler.scale(loss).backward()
                state.loss_sum += loss.detach()  # stays on the device: no sync
        except (IndexError, TypeError, ValueError, RuntimeError, OSError, AttributeError) as e:
            found = None if isinstance(e, ConfigError) else bad_data.diagnose(
                e, state.step + 1, state.batch_in_epoch, state.epoch, p.data.train, p.data.item, p.data.num_classes)
            if found is None:
                raise
            raise found from e
        logging = (state.step + 1) % plan.log_every == 0 or state.step + 1 == plan.total_steps
        norm = p.clip(p.optimizer, logging)  # the norm before clipping: on the device, read at the log step
        if logging:
            state.grad_norm = norm
        if plan.skip_nonfinite and not guards.finite_gradients(p.model):  # one sync per step, only when asked for
            state.skipped_steps += 1
            state.interval_skipped += 1
        else:
            p.amp.scaler.step(p.optimizer)
            p.amp.scaler.update()
        p.optimizer.zero_grad(set_to_none=plan.set_to_none)
        lr = p.scheduler.get_last_lr()[0]  # the LR this step used (a Python float: no sync)
        p.scheduler.step()
        profiler.step()
        state.step += 1
        state.interval_steps += 1
        if p.ema is not None:
            p.ema.update(state.step)
        last = state.step == plan.total_steps
        if state.step % plan.log_every == 0 or last:
            p.meter.log_started()
            log(state, parts, lr)
            p.meter.log_done()
        p.meter.end_step()  # after logging, so the cost of the sync above is part of the step
        evaluating = state.step % plan.eval_every == 0 or last
        save, stop = guards.checkpoint_due(state, parts, logged=state.step % plan.log_every == 0 or last)
        if evaluating or save or stop:
            state.train_time_s += measure.wall_clock(p.env.device) - segment_start  # queued kernels count as training
            p.meter.pause()  # the machine-load window covers training only
            if evaluating:
                stop = not evaluation.evaluate(state, parts) or stop  # False: a signal cut it short (one process)
                last = last or state.stopped_early is not None
            if stop or (save and not (last and p.at_end)):  # the end-of-run checkpoint follows the loop
                save_checkpoint(state, parts)
            if stop:
                guards.stop_for_signal(state, parts, launch.discover().launcher)
            p.meter.resume()
            segment_start = time.perf_counter()
    state.train_time_s += time.perf_counter() - segment_start
    p.meter.pause()


def _batches(loader, state: TrainState):
    """Yield micro-batches forever, epoch after epoch (reshuffled by ``set_epoch``), keeping
    ``state.epoch`` and ``state.batch_in_epoch`` current. A resumed state starts ``batch_in_epoch`` batches
    into its epoch, so it sees exactly the batches the interrupted run had left."""
    while True:
        loader.set_epoch(state.epoch, skip=state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def log(state: TrainState, parts: Parts, lr: float) -> None:
    """One ``metrics.jsonl`` row: the global batch's mean loss over the interval (one ``.item()``), the LR,
    the meter's interval figures and peak memory."""
    distributed.all_reduce_mean(state.loss_sum, parts.env)  # the global batch's loss, not rank 0's share
    read = [state.loss_sum] + ([state.grad_norm.detach().float()] if state.grad_norm is not None else [])
    values = torch.stack(read).tolist()  # host-device sync, only at log steps: loss and gradient norm at once
    state.train_loss = values[0] / state.interval_steps
    grad_norm = values[1] if len(values) > 1 else None
    state.loss_sum.zero_()
    state.grad_norm = None
    if parts.plan.skip_nonfinite:
        guards.check_skipped(state, parts, state.interval_skipped, state.interval_steps)
    state.interval_steps = state.interval_skipped = 0
    if not math.isfinite(state.train_loss):
        if not parts.plan.skip_nonfinite:
            raise TrainingDiverged(guards.diverged_message(state, parts))
    else:
        state.last_finite = (state.step, state.train_loss)
    parts.tracker.log({"step": state.step, "epoch": state.epoch, "loss": state.train_loss, "lr": lr,
                       **({"grad_norm": grad_norm} if grad_norm is not None else {}), **parts.meter.flush(), "peak_memory_mb": measure.peak_memory_mb(parts.env.device)})


def summarize(state: TrainState, parts: Parts) -> dict[str, Any]:
    """The run's figures (``summary.json``), global over the ranks; written by rank 0's tracker."""
    p, plan, env, t = parts, parts.plan, parts.env, parts.cfg.trainer
    p.meter.flush()
    figures = distributed.reduce_figures(p.meter.totals(), measure.peak_memory_mb(env.device), env)
    peak = hardware.peak_flops(env.device, p.amp.mfu_dtype, t.peak_tflops)  # fp8: its fp8 peak
    flops, sps = p.flops_per_sample, figures["samples_per_sec"]
    workers = p.cfg.dataloader.num_workers if p.data.techniques.get("num_workers") == "applied" else 0
    load = p.meter.machine_load(torch.get_num_threads(), workers)  # rank 0's machine: summary.json is rank 0's
    probe = p.meter.gpu_probe
    achieved = flops * sps if flops and sps else None
    throughput: dict[str, Any] = {"samples_per_sec": sps}
    tokens = p.task.tokens_per_sample(p.data)
    if tokens is not None:  # the task counts tokens: throughput and FLOPs in its unit too
        throughput |= {"tokens_per_sec": sps * tokens if sps else None, "tokens_per_sample": tokens,
                       "flops_per_token": flops / tokens if flops else None}
    summary = {
        **throughput,
        "step_time_ms_median": figures["step_time_ms_median"],
        "step_time_ms_p90": figures["step_time_ms_p90"],
        "data_wait_fraction": figures["data_wait_fraction"],
        "peak_memory_mb": figures["peak_memory_mb"],
        "memory_limit_mb": hardware.memory_limit_mb(env.device),
        "flops_per_sample": flops,
        "achieved_tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / peak if achieved and peak else None,
        # what the speed doctor (runner/doctor/) reads besides the figures above
        "log_time_fraction": figures["log_time_fraction"],  # measured time spent logging (loss read, metrics row)
        "host_syncs_per_step": 1 / plan.log_every + (1 if plan.skip_nonfinite else 0),  # the loop's own
        "gpu_idle_fraction": probe.idle_fraction if probe else None,  # GPU idle between kernels (warm-up window)
        "gpu_profile": probe.note if probe else ("CPU run: no GPU" if env.device.type != "cuda" else "off"),
        "train_loss": state.train_loss,
        **state.eval,
        "time_to_target_s": state.time_to_target_s,
        "train_time_s": state.train_time_s,
        "eval_time_s": state.eval_time_s,
        "checkpoint_time_s": state.checkpoint_time_s,
        "restarts": state.restarts,
        "restart_lost_time_s": state.restart_lost_time_s,
        "skipped_steps": state.skipped_steps,
        "steps": state.step,
        "stopped_early": state.stopped_early,  # why trainer.early_stopping ended the run, or null
        "best": {**p.best.as_dict(), "metric": p.best.metric, "weights": "best/model.safetensors"} if p.best else None,
        "ema_update_ms": p.details["ema"]["update_ms"] if p.ema is not None else None,
        "deterministic": t.deterministic,
        "warmup_steps": min(t.warmup_steps, state.step),
        "measured_steps": figures["measured_steps"],
        "measured_time_s": figures["measured_time_s"],  # samples_per_sec = global batch x measured_steps / this
        "measurement": figures["measurement"],  # what the speed figures cover, or why they are null
        "machine_load": load,  # how busy the machine was during the measured steps (machine_load.LoadWindow.record)
        "warnings": machine_load.load_warnings(load, env.device.type),  # why the figures cannot be trusted, if so
        "global_batch_size": plan.global_batch,
        "micro_batch_size": plan.micro_batch,
        "accumulate_steps": plan.accumulate,
        "world_size": env.world_size,
        "nodes": env.nodes,
        "parameters": parallel.parameter_report(p.model, env),  # per-rank checksums: replicas must agree
        "scaling_efficiency": (sps / (t.reference_samples_per_sec * env.world_size)
                               if t.reference_samples_per_sec and sps else None),
        "device": env.device.type,
        "device_name": hardware.device_name(env.device),
        "torch_version": torch.__version__,
        "git_sha": git_sha(),
        "techniques": p.techniques,
        "technique_details": p.details,
        "model_details": models.model_report(parallel.unwrap(p.model), p.cfg.model)[1],  # weights, frozen, trainable
        "config": p.resolved,
    }
    p.tracker.finish(summary)
    return summary
