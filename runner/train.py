"""The engine: build every component in a fixed order, then run the one training loop.

Each component comes from the module of its config group and sees only its own section; techniques
that are off are do-nothing objects (``nullcontext``, ``GradScaler(enabled=False)``), so the loop
below has no feature branches.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from runner import REPO_ROOT, data as data_mod, debug, distributed, measure, models, optim, precision, prepare, schedule
from runner.errors import ConfigError
from runner.track import NullTracker, Tracker


def validate(cfg: DictConfig) -> None:
    """Cross-key checks that types alone cannot express; run before anything is built or written.

    Raises:
        ConfigError: naming the key, its value and the allowed range.
    """
    t = cfg.trainer
    checks = [
        (cfg.dataloader.batch_size >= 1, "dataloader.batch_size", cfg.dataloader.batch_size, "must be >= 1"),
        (cfg.memory.accumulate_steps >= 1, "memory.accumulate_steps", cfg.memory.accumulate_steps, "must be >= 1"),
        (t.max_epochs >= 1, "trainer.max_epochs", t.max_epochs, "must be >= 1"),
        (t.max_steps is None or t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1 or null"),
        (t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "must be >= 0"),
        (t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1"),
        (t.eval_every is None or t.eval_every >= 1, "trainer.eval_every", t.eval_every, "must be >= 1 or null"),
        (t.target_accuracy is None or 0 < t.target_accuracy <= 1, "trainer.target_accuracy", t.target_accuracy,
         "must be a fraction in (0, 1] or null"),
        (t.progress in ("auto", "bar", "lines", "off"), "trainer.progress", t.progress,
         "must be one of auto, bar, lines, off"),
        (cfg.optimizer.clip_grad_norm is None or cfg.optimizer.clip_grad_norm > 0, "optimizer.clip_grad_norm",
         cfg.optimizer.clip_grad_norm, "must be > 0 or null"),
    ]
    choices = {
        "data.name": (cfg.data.name, ("mnist", "cifar10", "imagefolder", "synthetic")),
        "scheduler.name": (cfg.scheduler.name, ("constant", "onecycle", "cosine", "cyclic")),
        "precision.name": (cfg.precision.name, ("fp32", "amp", "bf16", "tf32")),
        "distributed.name": (cfg.distributed.name, ("none", "ddp", "fsdp", "dp")),
        "debug.name": (cfg.debug.name, ("off", "anomaly", "profile")),
        "logger.name": (cfg.logger.name, ("wandb", "none")),
        "compile.mode": (cfg.compile.mode, (None, "default", "reduce-overhead", "max-autotune")),
        "optimizer.impl": (cfg.optimizer.impl, (None, "fused", "foreach", "loop")),
        "optimizer.lr_scaling": (cfg.optimizer.lr_scaling, ("none", "linear", "sqrt")),
    }
    checks += [(value in allowed, key, value, f"must be one of {[a for a in allowed]}")
               for key, (value, allowed) in choices.items()]
    for ok, key, value, rule in checks:
        if not ok:
            raise ConfigError(f"{key}={value} {rule}")


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def git_sha() -> str | None:
    """The repository's commit, with ``-dirty`` when tracked files changed; None outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def job_folder() -> Path:
    """The Hydra job's output folder (``outputs/<date>/<time>`` or ``outputs/multirun/.../<n>``)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def sweep_group() -> str | None:
    """The W&B group of a multirun job: its sweep folder's last two parts (``<date>_<time>`` by default,
    so sweeps started at the same time on different days stay apart); None for a single run or outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # train() called directly (tests, benchmarks)
        return None
    hc = HydraConfig.get()
    return "_".join(Path(hc.sweep.dir).parts[-2:]) if hc.mode == RunMode.MULTIRUN else None


@torch.inference_mode()
def evaluate(model: torch.nn.Module, batches, autocast, max_batches: int | None, env) -> tuple[float, float]:
    """Top-1 accuracy (fraction) and mean cross-entropy over the evaluation set, all ranks together.

    Runs under ``torch.inference_mode()`` (technique 16: no autograd graph, no version counters;
    https://pytorch.org/docs/stable/generated/torch.autograd.grad_mode.inference_mode.html); one
    host-device sync at the end.
    """
    model.eval()
    totals = torch.zeros(3, device=env.device, dtype=torch.float64)  # correct, loss sum, count
    for i, (x, y) in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        with autocast():
            logits = model(x)
        totals[0] += (logits.argmax(1) == y).sum()
        totals[1] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[2] += y.numel()
    distributed.all_reduce_sum(totals, env)
    correct, loss_sum, count = totals.tolist()  # host-device sync
    model.train()
    return correct / max(count, 1), loss_sum / max(count, 1)


def _batches(loader):
    """Yield ``(epoch, (x, y))`` forever, reshuffling at each epoch (``set_epoch``)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def train(cfg: DictConfig, job_dir: Path | None = None) -> dict[str, Any]:
    """Train ``cfg`` and return the summary written to ``<job_dir>/summary.json``.

    ``job_dir`` defaults to the Hydra job's folder. Raises ``ConfigError`` for bad input, before any
    result file is written.
    """
    validate(cfg)
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    try:
        return _train(cfg, env, job_dir)
    finally:
        distributed.teardown()


def _train(cfg: DictConfig, env, job_dir: Path | None) -> dict[str, Any]:
    job_dir = distributed.shared_job_dir(job_dir or job_folder(), env)
    seed_everything(cfg.trainer.seed)
    techniques: dict[str, str] = {}
    techniques |= prepare.apply_cudnn_benchmark(cfg.cudnn_benchmark, env.device)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format

    data = data_mod.build(cfg.data, cfg.dataloader, env, seed=cfg.trainer.seed, memory_format=memory_format)
    model = models.build(cfg.model, data.num_classes, data.in_channels).to(env.device)
    # counted on the plain model, before any wrapper: the arithmetic is the same, and FSDP2 cannot be copied
    flops = measure.flops_per_sample(model, data.sample_shape, env.device, num_classes=data.num_classes)
    model, applied, details = prepare.prepare(model, cfg, env)
    seed_everything(cfg.trainer.seed + env.rank)  # weights are identical on all ranks; augmentation/dropout differ
    techniques |= data.techniques | applied

    accumulate = cfg.memory.accumulate_steps
    if accumulate > 1:
        techniques["gradient_accumulation"] = "applied"
    micro_batch = cfg.dataloader.batch_size
    global_batch = micro_batch * accumulate * env.world_size
    steps_per_epoch = len(data.train) // accumulate
    if steps_per_epoch == 0:
        raise ConfigError(f"memory.accumulate_steps={accumulate} exceeds the {len(data.train)} micro-batches of an "
                          f"epoch; lower it or dataloader.batch_size")
    total_steps = cfg.trainer.max_steps or cfg.trainer.max_epochs * steps_per_epoch
    optimizer, status = optim.build(cfg.optimizer, model, global_batch, env.device)
    techniques |= status
    scheduler, status = schedule.build(cfg.scheduler, optimizer, total_steps)
    techniques |= status
    amp = precision.build(cfg.precision, env.device)
    techniques |= amp.techniques
    clip = cfg.optimizer.clip_grad_norm  # recorded in techniques by optim.build, like set_to_none
    set_to_none = cfg.optimizer.set_to_none
    meter = measure.Meter(env.device, cfg.trainer.warmup_steps, global_batch)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    tracker = Tracker(job_dir, cfg, resolved, total_steps, sweep_group()) if env.is_main else NullTracker()
    t = cfg.trainer
    log_every, eval_every = t.log_every, t.eval_every or steps_per_epoch  # plain ints: no config lookups per step
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)

    # ---------------------------------------------------------------- the loop
    step, loss_sum, interval_steps, row_loss = 0, torch.zeros((), device=env.device), 0, float("nan")
    eval_acc = eval_loss = time_to_target = None
    eval_time = 0.0
    batches = _batches(data.train)
    epoch = 0
    try:
        with debug.build(cfg.debug, job_dir, env.device) as (profiler, status):
            techniques |= status
            train_start = time.perf_counter()
            while step < total_steps:
                for micro in range(accumulate):
                    meter.start_fetch()
                    epoch, (x, y) = next(batches)
                    meter.batch_ready()
                    with distributed.no_sync(model, last=micro == accumulate - 1), amp.autocast():
                        loss = F.cross_entropy(model(x), y) / accumulate
                    amp.scaler.scale(loss).backward()
                    loss_sum += loss.detach()  # stays on the device: no sync
                if clip is not None:
                    amp.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                amp.scaler.step(optimizer)
                amp.scaler.update()
                optimizer.zero_grad(set_to_none=set_to_none)
                lr = scheduler.get_last_lr()[0]  # the LR this step used (a Python float: no sync)
                scheduler.step()
                profiler.step()
                step += 1
                interval_steps += 1
                if step % log_every == 0 or step == total_steps:
                    distributed.all_reduce_mean(loss_sum, env)  # the global batch's loss, not rank 0's share
                    row_loss = loss_sum.item() / interval_steps  # host-device sync, only at log steps
                    loss_sum.zero_()
                    interval_steps = 0
                    row = {"step": step, "epoch": epoch, "loss": row_loss, "lr": lr,
                           **meter.flush(), "peak_memory_mb": measure.peak_memory_mb(env.device)}
                    tracker.log(row)
                meter.end_step()  # after logging, so the cost of the sync above is part of the step
                if step % eval_every == 0 or step == total_steps:
                    if env.device.type == "cuda":
                        torch.cuda.synchronize(env.device)  # training's queued kernels count as training
                    eval_started = time.perf_counter()
                    eval_acc, eval_loss = evaluate(model, data.eval, amp.autocast, t.eval_max_batches, env)
                    if time_to_target is None and t.target_accuracy is not None and eval_acc >= t.target_accuracy:
                        time_to_target = eval_started - train_start - eval_time
                    eval_time += time.perf_counter() - eval_started
                    tracker.log({"step": step, "epoch": epoch, "eval_accuracy": eval_acc, "eval_loss": eval_loss})
            train_time = time.perf_counter() - train_start - eval_time
    except BaseException:
        tracker.abort()
        raise

    meter.flush()
    figures = distributed.reduce_figures(meter.totals(), measure.peak_memory_mb(env.device), env)
    peak = measure.peak_flops(env.device, amp.compute_dtype, t.peak_tflops)
    achieved = flops * figures["samples_per_sec"] if flops and figures["samples_per_sec"] else None
    summary = {
        "samples_per_sec": figures["samples_per_sec"],
        "step_time_ms_median": figures["step_time_ms_median"],
        "step_time_ms_p90": figures["step_time_ms_p90"],
        "data_wait_fraction": figures["data_wait_fraction"],
        "peak_memory_mb": figures["peak_memory_mb"],
        "flops_per_sample": flops,
        "achieved_tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / peak if achieved and peak else None,
        "train_loss": row_loss,
        "eval_accuracy": eval_acc,
        "eval_loss": eval_loss,
        "time_to_target_s": time_to_target,
        "train_time_s": train_time,
        "eval_time_s": eval_time,
        "steps": step,
        "warmup_steps": min(t.warmup_steps, step),
        "measured_steps": figures["measured_steps"],
        "measured_time_s": figures["measured_time_s"],  # samples_per_sec = global batch x measured_steps / this
        "measurement": figures["measurement"],  # what the speed figures cover, or why they are null
        "global_batch_size": global_batch,
        "micro_batch_size": micro_batch,
        "accumulate_steps": accumulate,
        "world_size": env.world_size,
        "nodes": env.nodes,
        "parameters": distributed.parameter_report(model, env),  # per-rank checksums: replicas must agree
        "scaling_efficiency": (figures["samples_per_sec"] / (t.reference_samples_per_sec * env.world_size)
                               if t.reference_samples_per_sec and figures["samples_per_sec"] else None),
        "device": env.device.type,
        "device_name": measure.device_name(env.device),
        "torch_version": torch.__version__,
        "git_sha": git_sha(),
        "techniques": techniques,
        "technique_details": details,
        "config": resolved,
    }
    tracker.finish(summary)
    return summary

