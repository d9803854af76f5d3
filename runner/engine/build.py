"""Building a run: every part in a fixed order (``build_parts``, which writes nothing), then opening the run in its
job folder (``open_run``: resume point, tracker, checkpointer, preemption, the slice gate of a comparison).

    parts, state = build(cfg, env, job_dir)   # = open_run(*build_parts(cfg, env, job_dir))
    parts, state = build_parts(cfg, env, job_dir)   # a tuner's trial: the same parts, nothing written

``Parts`` is what the loop (runner/engine/train.py ``fit``) uses, ``Plan`` its fixed numbers. Each part comes from the
module of its config group and sees only its own section; techniques that are off are do-nothing objects
(``nullcontext``, ``GradScaler(enabled=False)``, a clipper that does nothing), so the loop has no feature branches.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import checkpoint, data as data_mod, distributed, measure, models, protocols, task as task_mod
from runner.checkpoint import preempt, resume
from runner.config import global_batch_size
from runner.data import text
from runner.engine import monitor, slice_gate
from runner.engine.state import PerRankState, SharedState, TrainState
from runner.errors import ConfigError
from runner.techniques import compile_cache, ema as ema_mod, model_parallel, optim, precision, prepare, schedule
from runner.track import NullTracker, Tracker, sweep_group


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
    stop_at_target: bool = False  # trainer.stop_at_target: end the run at the first evaluation meeting the targets
    target_suffix: str = ""  # trainer.target_weights=ema: "_ema", the targets are met by the EMA's metrics

    def reached(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` meet every target set (never, when none is), read from the weights' metrics or, with
        ``target_suffix`` ``_ema``, their EMA's (``eval_accuracy_ema``)."""
        if self.target_accuracy is None and self.target_loss is None or None in metrics.values():
            return False
        accuracy, loss = (metrics.get(f"eval_{k}{self.target_suffix}") for k in ("accuracy", "loss"))
        return (self.target_accuracy is None or accuracy >= self.target_accuracy) and (
            self.target_loss is None or loss <= self.target_loss
        )

    def met(self, metrics: dict[str, float]) -> str:
        """How ``metrics`` meet the targets, for ``stopped_early``: ``eval_loss 0.0123 <= trainer.target_loss=0.02``."""
        said, suffix = [], self.target_suffix
        if self.target_accuracy is not None:
            said.append(
                f"eval_accuracy{suffix} {metrics[f'eval_accuracy{suffix}']:.4g} >= trainer.target_accuracy="
                f"{self.target_accuracy:g}"
            )
        if self.target_loss is not None:
            said.append(
                f"eval_loss{suffix} {metrics[f'eval_loss{suffix}']:.4g} <= trainer.target_loss={self.target_loss:g}"
            )
        return " and ".join(said)


@dataclass
class Parts:
    """What ``build`` makes and ``fit``/``summarize`` use; the loop updates the model and optimizer in
    place but never replaces a part (its own changes go to ``TrainState``)."""

    cfg: DictConfig
    env: distributed.Env
    job_dir: Path
    task: protocols.Task  # runner.task.Classification | LanguageModel | Regression | the user's
    data: data_mod.Data
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    amp: precision.Precision
    clip: Callable[[torch.optim.Optimizer], None]
    meter: measure.Meter
    tracker: protocols.Tracker  # rank 0: runner.track.Tracker; other ranks: NullTracker; a tuner: its recorder
    plan: Plan
    flops_per_sample: float | None
    techniques: dict[str, str]
    details: dict[str, object]
    resolved: dict  # the config with every interpolation resolved (summary.json, W&B)
    checkpointer: checkpoint.Checkpointer
    preemption: preempt.Preemption
    at_end: bool  # checkpoint.at_end: a checkpoint and model.safetensors after the last step
    gate: slice_gate.SliceGate | None = None  # the interleaved launcher's pause point (runner/engine/slice_gate.py)
    compile_cache: str = "off"  # compile on: what runner/techniques/compile_cache.py loaded (job folder, shared)
    compiled_before: tuple[float, int, int] = (0.0, 0, 0)  # compile_cache.compiled_so_far() when the run opened
    compile_store: compile_cache.Store | None = None  # compile on: where the job writes its compiled code
    ema: ema_mod.EMA | None = None  # trainer.ema_decay: the moving average of the weights (runner/techniques/ema.py)
    early: monitor.Watch | None = None  # trainer.early_stopping (runner/engine/monitor.py)
    patience: int = 0
    best: monitor.Watch | None = None  # checkpoint.keep_best
    stop: Callable[[TrainState], str | None] | None = None  # after each logged step: why to stop now, or None
    # after each evaluation, on rank 0: (metrics, step, global samples, the samples a run stopped at its target
    # skips, else None) -> why to stop now, or None (a search's pruner)
    on_evaluation: Callable[[dict, int, int, int | None], str | None] | None = None


def checkpoint_state(state: TrainState, parts: Parts) -> dict[str, Any]:
    """What a checkpoint holds, as DCP Stateful objects: model + optimizer (sharded under FSDP), LR schedule,
    GradScaler, the shared ``TrainState`` (step, epoch, position in the epoch, measured time, ...) and each
    rank's RNG, loss share and timings."""
    held = {
        "model_optimizer": checkpoint.ModelAndOptimizer(parts.model, parts.optimizer),
        "scheduler": parts.scheduler,
        "scaler": parts.amp.scaler,
        "train": SharedState(state),
        "rank": PerRankState(state, parts.env.rank),
    }
    return held | ({"ema": parts.ema} if parts.ema is not None else {})


def build(
    cfg: DictConfig, env: distributed.Env, job_dir: Path, gate: slice_gate.SliceGate | None = None
) -> tuple[Parts, TrainState]:
    """Build every part (``build_parts``) and open the run in ``job_dir`` (``open_run``, with ``gate``).

    Raises:
        ConfigError: bad input found by any builder, before any result file is written.
    """
    parts, state = build_parts(cfg, env, job_dir)
    return open_run(parts, state, gate), state


def build_parts(cfg: DictConfig, env: distributed.Env, job_dir: Path) -> tuple[Parts, TrainState]:
    """Build every part in order: task -> data -> model -> model techniques -> optimizer, schedule, precision
    -> meter; and the initial ``TrainState``. Writes nothing: the tracker records nothing, the checkpointer never
    saves and no signal is handled until ``open_run`` (the tuners train such parts for a few steps).

    Raises:
        ConfigError: bad input found by any builder.
    """
    job_dir = distributed.shared_job_dir(job_dir, env)
    t = cfg.trainer
    seed_everything(t.seed)
    task = task_mod.build(cfg.task)
    for key, metric in (("target_accuracy", "eval_accuracy"), ("target_loss", "eval_loss")):
        if t[key] is not None and metric not in task.metrics:
            raise ConfigError(
                f"trainer.{key}={t[key]} but {type(task).__name__} reports no {metric} "
                f"(it reports {', '.join(task.metrics)}); use a target of those"
            )
    skipped = task.skipped(cfg)  # switches that do not apply to this task: recorded, never applied
    techniques, host_allocator, memory_format = _process_techniques(cfg, env, skipped)
    # a model split over ranks (distributed=tp) is one data-parallel rank: its ranks draw the same batches
    data = data_mod.build(
        cfg.data, cfg.dataloader, env.data_view(), seed=t.seed, memory_format=memory_format, task=task
    )
    model = models.build(cfg.model, task.model_kwargs(data), data.in_channels, example=data.item).to(env.device)
    task.check(model, data)
    # counted on the plain model, before any wrapper: the arithmetic is the same, and FSDP2 cannot be copied
    flops = measure.flops_per_sample(model, data.example, task.loss)
    amp = precision.build(cfg.precision, env.device)  # before the wrapper: FSDP all-gathers in its compute dtype
    model, applied, details = prepare.prepare(model, cfg, env, amp, skip=skipped)
    details["host_allocator"] = host_allocator
    if amp.note:  # precision=auto or amp: the dtype it trains with on this device
        details["precision"] = amp.note
        if env.is_main and cfg.trainer.progress != "off":
            print(f"note: {amp.note}", flush=True)
    seed_everything(t.seed + env.dp_rank)  # weights are identical on all ranks; augmentation/dropout differ
    techniques |= data.techniques | applied
    plan = _plan(cfg, env, len(data.train))
    if plan.accumulate > 1:
        techniques["gradient_accumulation"] = "applied"
    optimizer, status = optim.build(cfg.optimizer, model, plan.global_batch, env.device)
    techniques |= status
    if cfg.compile.optimizer:  # the LRs tensors before the scheduler reads them (its state holds them too)
        optim.tensor_lr(optimizer)
    scheduler, status = schedule.build(cfg.scheduler, optimizer, plan.total_steps)
    techniques |= status | amp.techniques
    if cfg.compile.optimizer:  # after the scheduler, which wraps the step it then calls compiled
        techniques["compiled_optimizer_step"] = optim.compile_step(optimizer)
    clip = optim.gradient_clipping(cfg.optimizer.clip_grad_norm, model, amp.scaler)  # recorded by optim.build
    if cfg.distributed.name == "pp":  # the schedule runs forward and backward; the loop asks it through the task
        task = model_parallel.pipeline(model, task, env, cfg, plan)
        clip = task.clip
    ema = _ema(t, model, env, techniques, details)
    reported = tuple(task.metrics) + (tuple(f"{m}_ema" for m in task.metrics) if ema is not None else ())
    early, patience = monitor.early_stopping(t.early_stopping, reported)
    best = monitor.best_checkpoint(resume.settings(cfg.checkpoint), reported)
    state = TrainState(eval=dict.fromkeys(reported), loss_sum=torch.zeros((), device=env.device))
    # the speed doctor's GPU window: the last warm-up steps on CUDA (no figure includes them), never beside
    # debug=profile's own profiler
    profile_steps = GPU_PROFILE_STEPS if t.doctor and cfg.debug.name == "off" else 0
    meter = measure.Meter(
        env.device,
        t.warmup_steps,
        plan.global_batch,
        task.tokens_per_sample(data),
        state.timings,
        gpu_profile_steps=profile_steps,
    )
    parts = Parts(
        cfg=cfg,
        env=env,
        job_dir=job_dir,
        task=task,
        data=data,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        amp=amp,
        clip=clip,
        meter=meter,
        tracker=NullTracker(),
        plan=plan,
        flops_per_sample=flops,
        techniques=techniques,
        details=details,
        resolved=OmegaConf.to_container(cfg, resolve=True),
        checkpointer=checkpoint.Checkpointer(job_dir / checkpoint.FOLDER, is_main=env.is_main),
        at_end=False,
        preemption=preempt.Preemption([]),
        ema=ema,
        early=early,
        patience=patience,
        best=best,
    )
    return parts, state


def _ema(t: DictConfig, model: torch.nn.Module, env: distributed.Env, techniques: dict, details: dict):
    """The EMA of the weights (``trainer.ema_decay``; None without one), recorded in ``techniques`` and ``details``
    with the time of one update."""
    if t.ema_decay is None:
        return None
    ema = ema_mod.EMA(model, t.ema_decay, t.ema_warmup, t.ema_every)
    techniques["ema"] = "applied"
    update_ms = round(ema.measure_update_ms(env.device), 4)
    details["ema"] = {"decay": t.ema_decay, "warmup": t.ema_warmup, "every": t.ema_every, "update_ms": update_ms}
    return ema


def _process_techniques(cfg: DictConfig, env: distributed.Env, skipped: dict[str, str]) -> tuple[dict, str, Any]:
    """The process-wide switches, set before anything is built: determinism, threads, the host allocator (before
    the first tensor), cuDNN autotuning; returns their statuses, the allocator's and the memory format."""
    t = cfg.trainer
    techniques = dict(skipped)
    techniques |= prepare.apply_deterministic(t.deterministic, env.device)
    techniques |= prepare.apply_num_threads(t.num_threads)
    host_allocator = prepare.apply_host_allocator(t.host_allocator)
    benchmark = cfg.cudnn_benchmark and "cudnn_benchmark" not in skipped
    techniques |= prepare.apply_cudnn_benchmark(benchmark and not t.deterministic, env.device)
    if benchmark and t.deterministic:
        techniques["cudnn_benchmark"] = "skipped: trainer.deterministic=true (autotuning picks algorithms by timing)"
    channels_last = cfg.channels_last and "channels_last" not in skipped
    return techniques, host_allocator, torch.channels_last if channels_last else torch.contiguous_format


def _plan(cfg: DictConfig, env: distributed.Env, micro_batches: int) -> Plan:
    """The run's plan from ``trainer.*`` and the ``micro_batches`` of an epoch.

    Raises:
        ConfigError: ``memory.accumulate_steps`` exceeds the micro-batches of an epoch.
    """
    t, accumulate = cfg.trainer, cfg.memory.accumulate_steps
    steps_per_epoch = micro_batches // accumulate
    if steps_per_epoch == 0:
        raise ConfigError(
            f"memory.accumulate_steps={accumulate} exceeds the {micro_batches} micro-batches of an "
            f"epoch; lower it or dataloader.batch_size"
        )
    return Plan(
        total_steps=t.max_steps or t.max_epochs * steps_per_epoch,
        accumulate=accumulate,
        micro_batch=cfg.dataloader.batch_size,
        global_batch=global_batch_size(cfg.dataloader.batch_size, accumulate, env.dp_size),
        log_every=t.log_every,
        eval_every=t.eval_every or steps_per_epoch,
        eval_max_batches=t.eval_max_batches,
        set_to_none=cfg.optimizer.set_to_none,
        target_accuracy=t.target_accuracy,
        target_loss=t.target_loss,
        skip_nonfinite=t.on_nonfinite == "skip",
        stop_at_target=t.stop_at_target,
        target_suffix="_ema" if t.target_weights == "ema" else "",
    )


def open_run(parts: Parts, state: TrainState, gate: slice_gate.SliceGate | None = None) -> Parts:
    """Open the run of ``parts`` in its job folder: find the resume point (refusing one of another world size),
    the tracker (metrics, console, loggers), the vocabulary, the checkpointer and the preemption handler; put
    ``gate`` (an interleaved comparison's pause point) in place; load the checkpoint into ``state`` when
    resuming. Returns the parts with these in place.

    Raises:
        ConfigError: a checkpoint written by another world size, a vocabulary that differs from the checkpoint's, a
            checkpoint that does not load; each before the tracker opens, so a refused run changes nothing there.
    """
    cfg, env, job_dir, data = parts.cfg, parts.env, parts.job_dir, parts.data
    ck = resume.settings(cfg.checkpoint)
    total = parts.plan.total_steps
    point = agree(lambda: resume.find_resume_point(ck["resume"], job_dir, parts.resolved, total), env)
    if point.path is not None and point.meta.get("world_size", env.world_size) != env.world_size:
        raise ConfigError(
            f"cannot resume from {point.path}: it was written by {point.meta['world_size']} processes "
            f"and this run has {env.world_size}; exact resume needs the same world size (same launch), "
            f"or start fresh with checkpoint.resume=never in a new folder"
        )
    if data.vocab is not None and point.path is not None:  # data.path may move, but must hold the same text
        agree(lambda: text.check_vocab(data.vocab, cfg.data.path, point.meta, point.path), env)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    checkpointer = checkpoint.Checkpointer(
        job_dir / checkpoint.FOLDER,
        every_steps=ck["every_steps"],
        every_minutes=ck["every_minutes"],
        keep_last=ck["keep_last"],
        async_save=ck["async"],
        is_main=env.is_main,
    )
    parts = dataclasses.replace(
        parts,
        checkpointer=checkpointer,
        at_end=ck["at_end"],
        preemption=preempt.Preemption(ck["signals"], handoff=preempt.submitit_signal()),
        gate=gate,
    )
    if cfg.compile.mode or cfg.compile.optimizer:  # before the first compile: the resumed job's cache, the shared one
        shared = compile_cache.shared_folder(cfg)
        resumed = point.path.parent.parent if point.path is not None else job_dir
        parts.compile_cache = compile_cache.load([resumed / compile_cache.FOLDER, *([shared] if shared else [])])
        parts.compile_store = compile_cache.Store(job_dir, shared, env.is_main)
        parts.compiled_before = compile_cache.compiled_so_far()
    if point.path is not None:
        checkpointer.load(checkpoint_state(state, parts), point.path)
        for watch, key in ((parts.early, "early_stopping"), (parts.best, "best")):
            if watch is not None:
                watch.restore(state.monitors.get(key))
        state.restart_lost_time_s += max(0.0, time.time() - float(point.meta.get("time", time.time())))
    # every refusal (world size, vocabulary, a checkpoint that does not load) is behind: only now does the run change
    # its folder (a finished run's summary.json and metrics stay as they were when a continuation is refused)
    parts.tracker = (
        Tracker(
            job_dir,
            cfg,
            parts.resolved,
            total,
            sweep_group(),
            resume_step=point.step if point.stale_rows else None,
            wandb_run_id=point.meta.get("wandb_run_id"),
            mlflow_run_id=point.meta.get("mlflow_run_id"),
        )
        if env.is_main
        else NullTracker()
    )
    if env.is_main and data.vocab is not None:
        text.save_vocab(data.vocab, job_dir)
    if env.is_main and data.codec is not None and data.codec.note:
        print(f"note: {data.codec.note}", flush=True)  # data=tokens: why samples.txt holds token ids
    if point.path is not None or point.stale_rows:  # an earlier attempt stopped early: counted outside checkpoints
        state.restarts = agree(lambda: resume.record_restart(job_dir, state.restarts), env)
        if env.is_main:
            print(
                f"resumed from {point.path} (step {state.step}, epoch {state.epoch}, restart {state.restarts})"
                if point.path is not None
                else f"started over: the earlier attempt in {job_dir} stopped before its "
                f"first checkpoint (restart {state.restarts})",
                flush=True,
            )
    return parts


def agree(decide: Callable[[], Any], env: distributed.Env) -> Any:
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
