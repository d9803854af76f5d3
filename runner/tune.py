"""Tuners: measure the run you are about to start and print the setting to use.

    python -m runner.tune batch_size [overrides]   # the fastest micro-batch that leaves a memory margin
    python -m runner.tune lr [overrides]           # the LR range test (Smith 2017; fastai's lr_find)
    python -m runner.tune dataloader [overrides]   # num_workers x pin_memory x prefetch_factor

The overrides are ``python -m runner``'s: the config is composed by the same ``@hydra.main`` (same search
path, ``--config-dir``, presets), and every configuration is built by the engine's own ``runner.train.build``
(data, model, techniques, optimizer with its LR scaling, precision) and trained by its own ``runner.train.fit``
(so data wait, step time and the loss are measured exactly as in a run). Only the run's length, the
tracker (no W&B, no console rows), the checkpointer (never saves) and, for ``lr``, the LR schedule are
swapped. ``debug`` (anomaly detection, the profiler) is not applied while tuning.

Outputs go to ``outputs/tune/<tuner>/<date>_<time>/`` (or ``--out DIR``): ``<tuner>.csv`` (the measurements),
``<tuner>.md`` (table, recommendation, notes), ``<tuner>.png`` and ``<tuner>.json`` (all of it, with the
recommendation each rank computed), plus Hydra's ``.hydra/``. At the end the table and a ready override
line are printed. ``tune.*`` (runner/config.py ``TuneConfig``) holds the tuners' settings.

Under torchrun every rank builds and trains each configuration, the figures are reduced over the ranks
(slowest rank's time, largest peak memory, the all-reduced mean loss), so each rank takes the same
decisions; the ranks' recommendations are gathered and must agree (``<tuner>.json`` ``ranks``).
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import gc
import math
import os
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from runner import CONF_DIR
from runner.config import register_configs
from runner.errors import ConfigError

register_configs()

TUNERS = ("batch_size", "lr", "dataloader")
USAGE = """usage: python -m runner.tune {batch_size,lr,dataloader} [--out DIR] [overrides of python -m runner]

  batch_size   grow the micro-batch (powers of two, then a binary search); measure samples/s and peak memory;
               recommend the fastest size within tune.max_memory_fraction of the device's memory
  lr           LR range test: exponential LR ramp tune.min_lr -> tune.max_lr over tune.steps from the run's
               initial state; suggest the steepest descent of the smoothed loss and fastai's valley
  dataloader   num_workers x pin_memory x prefetch_factor on the loader alone and in a short training run;
               recommend the fewest workers within tune.tolerance of the best samples/s

Outputs: outputs/tune/<tuner>/<date>_<time>/ (or --out DIR): <tuner>.csv, .md, .png, .json.
Example: python -m runner.tune batch_size model=resnet18 data=cifar10 data.root=/path logger=none"""

_NO_PROFILER = types.SimpleNamespace(step=lambda: None)  # fit() steps a profiler; tuning runs none


# ------------------------------------------------------------------------------------------- settings


def check_settings(t: DictConfig) -> None:
    """Value checks of ``tune.*`` (types are the schema's, checked by Hydra at compose time).

    Raises:
        ConfigError: naming the key, its value and the allowed range.
    """
    def positive_list(values, minimum: int) -> bool:
        return values is None or (len(values) > 0 and all(v >= minimum for v in values))

    checks = [
        (t.warmup_steps >= 0, "tune.warmup_steps", t.warmup_steps, "must be >= 0"),
        (t.measure_steps >= 1, "tune.measure_steps", t.measure_steps, "must be >= 1"),
        (t.start_batch_size >= 1, "tune.start_batch_size", t.start_batch_size, "must be >= 1"),
        (t.max_batch_size >= t.start_batch_size, "tune.max_batch_size", t.max_batch_size,
         f"must be >= tune.start_batch_size={t.start_batch_size}"),
        (0 < t.max_memory_fraction <= 1, "tune.max_memory_fraction", t.max_memory_fraction, "must be in (0, 1]"),
        (t.search_steps >= 0, "tune.search_steps", t.search_steps, "must be >= 0"),
        (t.min_lr > 0, "tune.min_lr", t.min_lr, "must be > 0 (the ramp is exponential)"),
        (t.max_lr > t.min_lr, "tune.max_lr", t.max_lr, f"must be > tune.min_lr={t.min_lr}"),
        (t.steps >= 10, "tune.steps", t.steps, "must be >= 10 (the suggestions leave out the first 10 % and the "
                                               "last 5 steps)"),
        (0 <= t.smoothing < 1, "tune.smoothing", t.smoothing, "must be in [0, 1)"),
        (t.diverge_factor > 1, "tune.diverge_factor", t.diverge_factor, "must be > 1"),
        (positive_list(t.workers, 0), "tune.workers", t.workers, "must be a non-empty list of counts >= 0, or null"),
        (t.pin_memory is None or len(t.pin_memory) > 0, "tune.pin_memory", t.pin_memory,
         "must be a non-empty list of booleans, or null"),
        (positive_list(t.prefetch_factors, 1), "tune.prefetch_factors", t.prefetch_factors,
         "must be a non-empty list of numbers >= 1, or null"),
        (t.loader_batches >= 1, "tune.loader_batches", t.loader_batches, "must be >= 1"),
        (0 <= t.tolerance < 1, "tune.tolerance", t.tolerance, "must be in [0, 1)"),
    ]
    for ok, key, value, rule in checks:
        if not ok:
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ConfigError(f"{key}={shown} {rule}")


def _with(cfg: DictConfig, **changes: Any) -> DictConfig:
    """A copy of ``cfg`` quiet for tuning (no W&B, no console rows, never resumes) with ``changes`` applied
    (dotted keys written with ``__``: ``dataloader__batch_size=64``)."""
    out = copy.deepcopy(cfg)
    settings = {"logger.name": "none", "trainer.progress": "off", "checkpoint.resume": "never"}
    settings |= {k.replace("__", "."): v for k, v in changes.items()}
    for key, value in settings.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


# ------------------------------------------------------------------------------------------- memory


def host_memory_mb() -> float:
    """This machine's RAM in MiB (``sysconf``), or the cgroup's memory limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total / 2**20


def memory_limit_mb(env, fraction: float) -> tuple[float, str]:
    """``(limit in MiB, what it is)``: ``fraction`` of the GPU's memory on CUDA; on a CPU, ``fraction`` of
    host RAM shared by this node's processes (world size / nodes under torchrun)."""
    import torch

    if env.device.type == "cuda":
        total = torch.cuda.get_device_properties(env.device).total_memory / 2**20
        return fraction * total, f"{fraction:g} x {total:,.0f} MiB of GPU memory"
    per_node = max(1, env.world_size // max(1, env.nodes))
    total = host_memory_mb()
    share = f" / {per_node} processes" if per_node > 1 else ""
    return fraction * total / per_node, f"{fraction:g} x {total:,.0f} MiB of host RAM{share}"


def _reset_peak_memory(device) -> bool:
    """Start a new peak: ``torch.cuda.reset_peak_memory_stats`` on CUDA; on Linux, writing 5 to
    ``/proc/self/clear_refs`` resets the process's peak RSS (VmHWM) to its current RSS (proc(5)). Returns
    False where the peak cannot be reset (then the CPU figure is the peak since the process started)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_memory_mb(device) -> float:
    """MiB: ``torch.cuda.max_memory_allocated`` on CUDA (runner's figure); on a CPU the process's peak RSS
    (VmHWM of /proc/self/status, since the last ``_reset_peak_memory``), else ``ru_maxrss``."""
    from runner import measure

    if device.type != "cuda":
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
        except OSError:
            pass
    return measure.peak_memory_mb(device)


def _free_memory(device) -> None:
    """Return the previous configuration's memory: collect garbage, empty CUDA's cache, and on glibc hand
    free heap pages back to the OS (``malloc_trim``), so the next CPU peak starts from what is really held."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _is_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error (``torch.cuda.OutOfMemoryError``) or the CPU allocator's failure."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# ------------------------------------------------------------------------------------------- one trial


def _for_tuning(parts, steps: int, warmup: int, log_every: int, **replace: Any):
    """The engine's ``parts`` set up to train ``steps`` optimizer steps (``warmup`` of them left out of the
    figures) with the run's own loop: a copy with the plan shortened (evaluation: one batch, after the last
    step; no targets), a fresh meter, a checkpointer that never saves and ``replace['tracker']`` (default:
    ``NullTracker``) as the tracker; ``parts`` itself is left as it was."""
    from runner import checkpoint, measure
    from runner.track import NullTracker

    plan = dataclasses.replace(parts.plan, total_steps=steps, log_every=log_every, eval_every=steps,
                               eval_max_batches=1, target_accuracy=None, target_loss=None)
    meter = measure.Meter(parts.env.device, warmup, plan.global_batch, parts.task.tokens_per_sample(parts.data))
    fields = dict(plan=plan, meter=meter, tracker=NullTracker(), at_end=False,
                  checkpointer=checkpoint.Checkpointer(parts.job_dir / checkpoint.FOLDER, is_main=parts.env.is_main))
    return dataclasses.replace(parts, **(fields | replace))


def _reduce_max(values: list[float], env) -> list[float]:
    """Element-wise maximum over the ranks (the values themselves with one process)."""
    if not env.distributed:
        return values
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _loader_seconds(parts, warmup: int, batches: int) -> float:
    """Seconds to draw ``batches`` batches from the run's training loader alone (host->device copy included,
    epochs cycled as in training), after ``warmup`` batches (workers starting) left out."""
    from runner import measure, train as engine

    it = engine._batches(parts.data.train, engine.TrainState())
    for _ in range(warmup):
        next(it)
    start = measure.wall_clock(parts.env.device)
    for _ in range(batches):
        next(it)
    elapsed = measure.wall_clock(parts.env.device) - start
    it.close()  # drops the loader's iterator: its workers stop (unless persistent)
    return elapsed


def measure_config(cfg: DictConfig, env, job_dir: Path, t: DictConfig, loader_batches: int = 0) -> dict[str, Any]:
    """Build ``cfg``'s job with the engine and train ``t.warmup_steps + t.measure_steps`` steps of it.

    Returns a row: ``status`` (``ok``, ``oom``: CUDA's ``OutOfMemoryError`` or the CPU allocator's failure,
    caught and the memory returned; ``unmeasured``), ``samples_per_sec`` (global: global batch x measured
    steps / the slowest rank's measured time), ``tokens_per_sec`` (token tasks), ``step_time_ms_median``
    and ``data_wait_fraction`` (the engine's meter, slowest rank), ``peak_memory_mb`` (largest over ranks:
    CUDA ``max_memory_allocated``, or the process's peak RSS on a CPU, both from after the build to the end
    of the steps, so they cover model, optimizer state, activations and the loader's batches; DataLoader
    worker processes are not counted), ``train_samples`` (per rank). With ``loader_batches``, also
    ``loader_batches_per_sec``: the training loader alone (``_loader_seconds``), slowest rank.

    Under several processes an out-of-memory error on one rank only, inside a collective, cannot be
    recovered: the others wait until ``distributed.timeout_s``.
    """
    import torch

    from runner import train as engine
    from runner.errors import TrainingDiverged

    if cfg.compile.mode is not None:
        torch._dynamo.reset()  # each configuration compiles afresh (and no recompile limit is reached)
    row: dict[str, Any] = {"note": ""}
    parts = state = None
    oom, figures, peak, loader_s, train_samples, tokens = False, None, 0.0, 0.0, 0, None
    steps = t.warmup_steps + t.measure_steps
    try:
        parts, state = engine.build(cfg, env, Path(tempfile.mkdtemp(prefix="trial-", dir=job_dir)))
        parts.tracker.abort()  # closes the metrics file build() opened (logger=none: no W&B run)
        parts = _for_tuning(parts, steps, t.warmup_steps, log_every=steps)
        train_samples = parts.data.train_samples // env.world_size
        tokens = parts.task.tokens_per_sample(parts.data)
        if loader_batches:
            loader_s = _loader_seconds(parts, t.warmup_steps, loader_batches)
        if not _reset_peak_memory(env.device):
            row["note"] = "peak RSS since the process started (could not reset it)"
        try:
            engine.fit(state, parts, _NO_PROFILER)
        except TrainingDiverged:
            row["note"] = "loss not finite (speed still measured)"
        parts.meter.flush()
        figures = parts.meter.totals()
        peak = _peak_memory_mb(env.device)
    except Exception as e:  # noqa: BLE001 - out of memory is a measurement here; anything else is re-raised
        if not _is_oom(e):
            raise
        oom = True
    finally:
        parts = state = None
        _free_memory(env.device)
    ok = not oom and figures is not None and figures["measured_steps"] > 0
    # one all-reduce: the worst status (2 out of memory, 1 unmeasured), the slowest time, the largest peak;
    # measured steps negated (max -> the fewest)
    keys = ("measured_time_s", "step_time_ms_median", "data_wait_fraction")
    vals = [2.0 if oom else float(not ok), *(figures[k] if ok else 0.0 for k in keys), peak, loader_s,
            -(figures["measured_steps"] if ok else 0)]
    failed, time_s, step_ms, wait, peak, loader_s, neg_steps = _reduce_max(vals, env)
    global_batch = cfg.dataloader.batch_size * cfg.memory.accumulate_steps * env.world_size
    row.update(status={0: "ok", 1: "unmeasured", 2: "oom"}[int(failed)],
               samples_per_sec=None, tokens_per_sec=None, step_time_ms_median=None, data_wait_fraction=None,
               peak_memory_mb=peak or None, train_samples=train_samples)
    if failed == 2:
        row["note"] = "out of memory" + ("" if oom else " on another rank")
    if not failed and time_s > 0:
        sps = global_batch * -neg_steps / time_s
        row.update(samples_per_sec=sps, tokens_per_sec=sps * tokens if tokens else None,
                   step_time_ms_median=step_ms, data_wait_fraction=wait)
    if loader_batches:
        row["loader_batches_per_sec"] = loader_batches / loader_s if not failed and loader_s > 0 else None
    return row


def _trial_steps(t: DictConfig) -> str:
    return f"{t.warmup_steps} warm-up + {t.measure_steps} measured step" + ("s" if t.measure_steps != 1 else "")


def _say(env, message: str) -> None:
    if env.is_main:
        print(message, flush=True)


def _fmt(value: Any, spec: str = ",.1f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


# ------------------------------------------------------------------------------------------- batch_size


def _lr_note(cfg: DictConfig, micro_batch: int, world_size: int) -> tuple[str, float]:
    """How ``optimizer.lr_scaling`` sets the LR at ``micro_batch`` (runner.optim.scaled_lr, technique 3)."""
    from runner import optim

    o = cfg.optimizer
    global_batch = micro_batch * cfg.memory.accumulate_steps * world_size
    lr = optim.scaled_lr(o, global_batch)
    if o.lr_scaling != "none":
        return (f"the LR follows: {lr:.4g} at global batch {global_batch} (optimizer.lr={o.lr:g} x "
                f"optimizer.lr_scaling={o.lr_scaling} from optimizer.base_batch_size={o.base_batch_size})"), lr
    linear = optim.scaled_lr(OmegaConf.merge(o, {"lr_scaling": "linear"}), global_batch)
    return (f"the LR stays {o.lr:g} (optimizer.lr_scaling=none); add optimizer.lr_scaling=linear to scale it "
            f"with the batch ({linear:.4g} at global batch {global_batch}; Goyal et al. 2017)"), lr


def tune_batch_size(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """The micro-batch size (per rank) with the highest samples/s that stays within the memory margin.

    Sizes: ``tune.start_batch_size``, then doubling while each size fits (no out-of-memory error, peak
    memory <= ``memory_limit_mb``) and is faster than the last, up to ``tune.max_batch_size`` (and the
    per-rank training set); then up to ``tune.search_steps`` bisections between the last good size and the
    first bad or slower one (midpoints rounded down to a multiple of 8 from 64 up), a midpoint being good
    when it fits and beats the current lower end. Each size is a fresh ``measure_config`` (its own model,
    optimizer with the LR ``optimizer.lr_scaling`` gives it, loader). The recommendation is the fastest
    measured size that fits.

    Raises:
        ConfigError: the smallest size already runs out of memory or over the limit.
    """
    t = cfg.tune
    limit, limit_text = memory_limit_mb(env, t.max_memory_fraction)
    rows: list[dict[str, Any]] = []

    def measure(size: int, phase: str) -> dict[str, Any]:
        row = {"batch_size": size, "global_batch_size": size * cfg.memory.accumulate_steps * env.world_size,
               "phase": phase}
        row |= measure_config(_with(cfg, dataloader__batch_size=size), env, job_dir, t)
        if row["status"] == "ok" and row["peak_memory_mb"] is not None and row["peak_memory_mb"] > limit:
            row["status"], row["note"] = "over_memory_limit", f"peak > {limit:,.0f} MiB"
        rows.append(row)
        _say(env, f"batch_size {size}: {row['status']}, {_fmt(row['samples_per_sec'])} samples/s, peak "
                  f"{_fmt(row['peak_memory_mb'], ',.0f')} MiB")
        return row

    def fits(row) -> bool:
        return row["status"] == "ok"

    first = measure(t.start_batch_size, "grow")
    if not fits(first):
        why = ("ran out of memory" if first["status"] == "oom" else
               f"peaked at {first['peak_memory_mb']:,.0f} MiB, over the limit of {limit:,.0f} MiB ({limit_text})"
               if first["status"] == "over_memory_limit" else "measured no step")
        raise ConfigError(f"the job does not fit at the smallest batch size tried, dataloader.batch_size="
                          f"{t.start_batch_size}: it {why}. Lower tune.start_batch_size, raise "
                          f"tune.max_memory_fraction, or save memory (precision=bf16, memory=checkpointing)")
    cap = min(t.max_batch_size, max(first["train_samples"], t.start_batch_size))
    good, bad, stop = first, None, f"reached tune.max_batch_size={t.max_batch_size}"
    if cap < t.max_batch_size:
        stop = f"reached the per-rank training set ({first['train_samples']} samples)"
    size = t.start_batch_size
    while size * 2 <= cap:
        size *= 2
        row = measure(size, "grow")
        if not fits(row) or row["samples_per_sec"] <= good["samples_per_sec"]:
            bad = size
            stop = (f"stopped growing at {size}: " + ("slower than " + str(good["batch_size"]) if fits(row)
                                                      else row["status"].replace("_", " ")))
            break
        good = row
    if bad is not None:
        for _ in range(t.search_steps):
            lo, hi = good["batch_size"], bad
            mid = (lo + hi) // 2
            if lo >= 64:
                mid -= mid % 8
            if not lo < mid < hi:
                break
            row = measure(mid, "search")
            if fits(row) and row["samples_per_sec"] > good["samples_per_sec"]:
                good = row
            else:
                bad = mid
    best = max((r for r in rows if fits(r)), key=lambda r: r["samples_per_sec"])
    note, lr = _lr_note(cfg, best["batch_size"], env.world_size)
    return {"recommended": {"batch_size": best["batch_size"], "samples_per_sec": best["samples_per_sec"],
                            "peak_memory_mb": best["peak_memory_mb"], "lr": lr},
            "override": f"dataloader.batch_size={best['batch_size']}",
            "rows": rows, "memory_limit_mb": limit,
            "notes": [f"memory limit: {limit:,.0f} MiB ({limit_text}); peak memory is "
                      + ("torch.cuda.max_memory_allocated" if env.device.type == "cuda" else
                         "the process's peak RSS during the steps (DataLoader workers not counted)"),
                      stop, note,
                      f"each size: {_trial_steps(t)} of the run's own loop"]}


# ------------------------------------------------------------------------------------------- lr


class _RampDone(Exception):
    """Raised by the recorder to end the range test (ramp complete or loss diverged) on every rank alike."""


class RangeRecorder:
    """The range test's tracker: records each optimizer step's LR and (all-reduced) loss as ``fit`` logs them,
    smooths the loss with a bias-corrected EMA (fastai's ``SmoothenValue``: avg = beta avg + (1 - beta) loss,
    smoothed = avg / (1 - beta^n)) and ends the test (``_RampDone``) after ``steps`` steps or once the smoothed
    loss exceeds ``diverge_factor`` x its best or is not finite (fastai's ``LRFinder``)."""

    wandb_run_id = None

    def __init__(self, steps: int, beta: float, diverge_factor: float):
        self.steps, self.beta, self.diverge_factor = steps, beta, diverge_factor
        self.points: list[dict[str, Any]] = []
        self.avg, self.count, self.best = 0.0, 0, math.inf
        self.stop = "ramp complete"

    def record(self, step: int, lr: float, loss: float) -> None:
        if math.isfinite(loss):
            self.count += 1
            self.avg = self.beta * self.avg + (1 - self.beta) * loss
            smoothed = self.avg / (1 - self.beta ** self.count)
        else:
            smoothed = math.nan
        self.points.append({"step": step, "lr": lr, "loss": loss, "smoothed_loss": smoothed})
        if math.isfinite(smoothed):
            self.best = min(self.best, smoothed)
        if not math.isfinite(smoothed) or smoothed > self.diverge_factor * self.best:
            self.stop = (f"stopped at step {step} (lr {lr:.3g}): the smoothed loss {smoothed:.4g} exceeds "
                         f"{self.diverge_factor:g} x its best {self.best:.4g}" if math.isfinite(smoothed)
                         else f"stopped at step {step} (lr {lr:.3g}): the loss is not finite")
            raise _RampDone
        if step >= self.steps:
            raise _RampDone

    def log(self, row: dict[str, Any]) -> None:
        if "loss" in row:
            self.record(row["step"], row["lr"], row["loss"])

    def note(self, message: str) -> None:
        pass

    def abort(self, exit_code: int = 1) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


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
    used = points[steps // 10: max(len(points) - 5, 0)]
    bad = next((i for i, p in enumerate(used) if not math.isfinite(p["smoothed_loss"])), None)
    used = used[:bad]
    if used:  # past the lowest smoothed loss the LR is too high already
        lowest = min(range(len(used)), key=lambda i: used[i]["smoothed_loss"])
        used = used[:lowest + 1]
    return used


@dataclass
class RangeTest:
    """What ``lr_range_test`` found: every step's ``lr``, raw ``loss`` (mean over the global batch),
    ``smoothed_loss`` and ``used`` (inside the range the suggestions are taken from: fastai leaves out the
    first 10 % of the requested steps, the last 5 recorded and everything from the first non-finite
    smoothed loss on) and, unlike fastai, everything after the lowest smoothed loss: past it the loss rises
    (the LR is too high already), and a network with BatchNorm can recover from a spike there, whose
    descent would otherwise be taken for the steepest one (seen on resnet18/CIFAR-10, docs/tuning.md);
    ``steepest_lr`` (steepest descent of the smoothed loss), ``valley_lr`` (fastai's valley); why it stopped."""

    points: list[dict[str, Any]]
    steepest_lr: float
    valley_lr: float
    stop: str
    best_smoothed_loss: float
    extras: dict[str, Any] = field(default_factory=dict)


def lr_range_test(parts, min_lr: float, max_lr: float, steps: int, smoothing: float = 0.98,
                  diverge_factor: float = 4.0) -> RangeTest:
    """The LR range test (Smith 2017, "Cyclical Learning Rates for Training Neural Networks", section 3.3,
    https://arxiv.org/abs/1506.01186; as fastai's ``lr_find``, https://docs.fast.ai/callback.schedule.html):
    from the state ``parts`` holds, train with the LR rising exponentially from ``min_lr`` (first step) to
    ``max_lr`` (step ``steps``), every parameter group alike, recording the loss of each step.

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

    from runner import checkpoint, train as engine
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
        run = _for_tuning(parts, steps, 0, log_every=1, tracker=recorder, scheduler=ramp)
        state = engine.TrainState(eval=dict.fromkeys(parts.task.metrics),
                                  loss_sum=torch.zeros((), device=parts.env.device))
        try:
            engine.fit(state, run, _NO_PROFILER)
        except _RampDone:
            pass
        except TrainingDiverged:  # the loss became NaN/inf (trainer.on_nonfinite=stop): the same on every rank
            i = state.step - 1
            try:
                recorder.record(state.step, min_lr * ratio ** (i / (steps - 1)), math.nan)
            except _RampDone:
                pass
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
        raise ConfigError(f"the LR range test has too few points to suggest an LR: {recorder.stop} after "
                          f"{len(points)} of tune.steps={steps} steps (suggestions leave out the first 10 % and the "
                          f"last 5). Start lower (tune.min_lr={min_lr:g}), end lower (tune.max_lr={max_lr:g}, the loss "
                          f"diverged by lr {last['lr']:.3g}) or raise tune.steps")
    for p in points:
        p["used"] = any(p is u for u in used)
    lrs, smoothed = [p["lr"] for p in used], [p["smoothed_loss"] for p in used]
    return RangeTest(points=points, steepest_lr=lrs[steepest(lrs, smoothed)], valley_lr=lrs[valley(smoothed)],
                     stop=recorder.stop, best_smoothed_loss=recorder.best)


def tune_lr(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """Build the run (its initial weights, optimizer, data, precision) and run ``lr_range_test`` on it with
    ``tune.min_lr``, ``tune.max_lr``, ``tune.steps``, ``tune.smoothing``, ``tune.diverge_factor``.

    The suggested LR is the one the optimizer should use; the override gives ``optimizer.lr``, which is the
    LR at ``optimizer.base_batch_size`` when ``optimizer.lr_scaling`` is on, so it is divided by the run's
    scaling factor.
    """
    from runner import optim, train as engine

    t = cfg.tune
    parts, _ = engine.build(_with(cfg), env, job_dir)
    try:
        result = lr_range_test(parts, t.min_lr, t.max_lr, t.steps, t.smoothing, t.diverge_factor)
    finally:
        parts.tracker.abort()
    factor = optim.scaled_lr(cfg.optimizer, parts.plan.global_batch) / cfg.optimizer.lr if cfg.optimizer.lr else 1.0
    setting = result.steepest_lr / factor
    notes = [result.stop,
             f"ramp: {t.min_lr:g} -> {t.max_lr:g} over {t.steps} steps, every parameter group; loss smoothed "
             f"(EMA {t.smoothing:g}, bias-corrected); weights and optimizer restored afterwards",
             "transformers (AdamW) often train best below these suggestions (nanoGPT's small GPT: 1e-3); treat "
             "them as an upper end and keep a warm-up"]
    if factor != 1.0:
        notes.append(f"optimizer.lr is the LR at optimizer.base_batch_size={cfg.optimizer.base_batch_size}: "
                     f"the suggested {result.steepest_lr:.3g} at global batch {parts.plan.global_batch} / "
                     f"{factor:.4g} (optimizer.lr_scaling={cfg.optimizer.lr_scaling})")
    if cfg.scheduler.name in ("onecycle", "cyclic"):
        notes.append(f"scheduler={cfg.scheduler.name} peaks at optimizer.lr x scheduler.max_lr_factor="
                     f"{cfg.scheduler.max_lr_factor:g}")
    rows = [{k: p[k] for k in ("step", "lr", "loss", "smoothed_loss", "used")} for p in result.points]
    return {"recommended": {"lr": result.steepest_lr, "steepest_lr": result.steepest_lr,
                            "valley_lr": result.valley_lr, "optimizer.lr": setting},
            "override": f"optimizer.lr={setting:.3g}", "rows": rows, "notes": notes}


# ------------------------------------------------------------------------------------------- dataloader


def default_grid(env, t: DictConfig) -> tuple[list[int], list[bool], list[int]]:
    """``(workers, pin_memory, prefetch_factors)``: ``tune.*`` where set; else workers 0, 1, 2, 4, ... up to
    the CPU count, pinning and prefetch factors 2 and 4 compared on CUDA only (pinning acts only there)."""
    cpus = os.cpu_count() or 1
    workers = list(t.workers) if t.workers is not None else \
        sorted({0, 1, *(2 ** k for k in range(1, 8) if 2 ** k <= cpus)})
    cuda = env.device.type == "cuda"
    pins = list(t.pin_memory) if t.pin_memory is not None else ([False, True] if cuda else [False])
    prefetch = list(t.prefetch_factors) if t.prefetch_factors is not None else ([2, 4] if cuda else [2])
    return workers, pins, prefetch


def tune_dataloader(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """Each ``(num_workers, pin_memory, prefetch_factor)`` of the grid (``default_grid``; the prefetch factor
    only with workers), measured twice with the run's own loader: alone (batches/s drawing
    ``tune.loader_batches`` batches) and in ``tune.measure_steps`` training steps (samples/s and the
    engine's data-wait fraction). Recommends the fewest workers whose samples/s is within ``tune.tolerance``
    of the best (the fastest such configuration): extra workers cost CPU cores and memory.

    Raises:
        ConfigError: ``dataloader.on_device=true`` (no DataLoader to tune).
    """
    if cfg.dataloader.on_device:
        raise ConfigError("dataloader.on_device=true keeps the data on the device: there is no DataLoader to tune; "
                          "drop dataloader=device (or dataloader.on_device=true) to tune the host loader")
    t = cfg.tune
    workers, pins, prefetch = default_grid(env, t)
    grid = [(w, pin, pf if w > 0 else None) for w in workers for pin in pins for pf in (prefetch if w > 0 else [0])]
    rows = []
    for w, pin, pf in dict.fromkeys(grid):
        row = {"num_workers": w, "pin_memory": pin, "prefetch_factor": pf}
        row |= measure_config(_with(cfg, dataloader__num_workers=w, dataloader__pin_memory=pin,
                                    dataloader__prefetch_factor=pf), env, job_dir, t, t.loader_batches)
        rows.append(row)
        _say(env, f"num_workers={w} pin_memory={pin} prefetch_factor={pf}: loader "
                  f"{_fmt(row['loader_batches_per_sec'])} batches/s, training {_fmt(row['samples_per_sec'])} "
                  f"samples/s, data wait {_fmt(row['data_wait_fraction'], '.1%')}")
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        raise ConfigError("no DataLoader configuration could be measured (out of memory); lower "
                          "dataloader.batch_size")
    best = max(r["samples_per_sec"] for r in measured)
    close = [r for r in measured if r["samples_per_sec"] >= (1 - t.tolerance) * best]
    fewest = min(r["num_workers"] for r in close)
    pick = max((r for r in close if r["num_workers"] == fewest), key=lambda r: r["samples_per_sec"])
    override = f"dataloader.num_workers={pick['num_workers']} dataloader.pin_memory={str(pick['pin_memory']).lower()}"
    if pick["num_workers"] > 0:
        override += f" dataloader.prefetch_factor={pick['prefetch_factor']}"
    notes = [f"the fewest workers within {t.tolerance:.0%} of the best samples/s ({best:,.1f})",
             f"loader alone: {t.loader_batches} batches after {t.warmup_steps} left out; training: {_trial_steps(t)} "
             f"of the run's own loop (batch {cfg.dataloader.batch_size})"]
    if env.device.type != "cuda":
        notes.append("on a CPU pin_memory does nothing (page-locked memory speeds up copies to a GPU)")
    return {"recommended": {k: pick[k] for k in ("num_workers", "pin_memory", "prefetch_factor", "samples_per_sec")},
            "override": override, "rows": rows, "notes": notes}


# ------------------------------------------------------------------------------------------- outputs


COLUMNS: dict[str, list[tuple[str, str, str]]] = {  # (key, header, format) of the printed and markdown tables
    "batch_size": [("batch_size", "batch size", ""), ("global_batch_size", "global batch", ""),
                   ("phase", "phase", ""), ("status", "status", ""), ("samples_per_sec", "samples/s", ",.1f"),
                   ("tokens_per_sec", "tokens/s", ",.0f"), ("step_time_ms_median", "step ms", ",.1f"),
                   ("data_wait_fraction", "data wait", ".1%"), ("peak_memory_mb", "peak MiB", ",.0f"),
                   ("note", "note", "")],
    "lr": [("step", "step", ""), ("lr", "lr", ".3g"), ("loss", "loss", ".4f"),
           ("smoothed_loss", "smoothed loss", ".4f"), ("used", "used", "")],
    "dataloader": [("num_workers", "num_workers", ""), ("pin_memory", "pin_memory", ""),
                   ("prefetch_factor", "prefetch_factor", ""), ("status", "status", ""),
                   ("loader_batches_per_sec", "loader batches/s", ",.1f"), ("samples_per_sec", "samples/s", ",.1f"),
                   ("data_wait_fraction", "data wait", ".1%"), ("step_time_ms_median", "step ms", ",.1f")],
}


def _is_pick(kind: str, row: dict, rec: dict) -> bool:
    if kind == "batch_size":
        return row["batch_size"] == rec["batch_size"] and row["status"] == "ok"
    if kind == "lr":
        return row["lr"] == rec["lr"]
    return all(row[k] == rec[k] for k in ("num_workers", "pin_memory", "prefetch_factor"))


def markdown_table(kind: str, rows: list[dict], rec: dict, max_rows: int | None = None) -> str:
    """The rows as a markdown table (columns present in some row only), the recommended one marked;
    ``max_rows``: every k-th row (and the recommended one) so at most about that many are shown."""
    cols = [c for c in COLUMNS[kind] if any(r.get(c[0]) not in (None, "") for r in rows)]
    shown = rows
    if max_rows and len(rows) > max_rows:
        k = math.ceil(len(rows) / max_rows)
        shown = [r for i, r in enumerate(rows) if i % k == 0 or i == len(rows) - 1 or _is_pick(kind, r, rec)]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " | |", "|" + "---|" * (len(cols) + 1)]
    for r in shown:
        cells = [_fmt(r.get(k), spec) if spec else _fmt(r.get(k)) for k, _, spec in cols]
        lines.append("| " + " | ".join(cells) + (" | **<- recommended** |" if _is_pick(kind, r, rec) else " | |"))
    return "\n".join(lines)


def plot(kind: str, result: dict, path: Path) -> None:
    """``<kind>.png`` (matplotlib, Agg): batch_size: samples/s and peak memory against the batch size (log 2),
    the limit dashed; lr: raw and smoothed loss against the LR (log x), the suggestions marked; dataloader:
    training samples/s and loader-alone batches/s per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, rec = result["rows"], result["recommended"]
    if kind == "batch_size":
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["batch_size"])
        top.plot([r["batch_size"] for r in ok], [r["samples_per_sec"] for r in ok], marker="o")
        top.plot([rec["batch_size"]], [rec["samples_per_sec"]], marker="*", markersize=16, color="tab:green",
                 linestyle="none", label=f"recommended: {rec['batch_size']}")
        top.set_ylabel("samples/s")
        top.legend(fontsize=8)
        measured = sorted((r for r in rows if r["peak_memory_mb"]), key=lambda r: r["batch_size"])
        bottom.plot([r["batch_size"] for r in measured], [r["peak_memory_mb"] for r in measured], marker="o")
        for r in rows:
            if r["status"] != "ok":
                bottom.axvline(r["batch_size"], color="tab:red", alpha=0.4, linestyle=":")
        limit, highest = result["memory_limit_mb"], max((r["peak_memory_mb"] for r in measured), default=0.0)
        if limit <= 3 * highest:  # drawn where it is near the figures; otherwise said in the title
            bottom.axhline(limit, color="tab:red", linestyle="--", label="memory limit")
            bottom.legend(fontsize=8)
        else:
            bottom.set_title(f"memory limit {limit:,.0f} MiB (off the scale)", fontsize=9)
        bottom.set_ylabel("peak memory (MiB)")
        bottom.set_xlabel("micro-batch size per rank (red dotted: out of memory or over the limit)")
        bottom.set_xscale("log", base=2)
        sizes = sorted({r["batch_size"] for r in rows})
        bottom.set_xticks(sizes, [str(v) for v in sizes], fontsize=7)
        bottom.minorticks_off()
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    elif kind == "lr":
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
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.35 * len(rows) + 2), sharey=True)
        labels = [f"w={r['num_workers']} pin={'y' if r['pin_memory'] else 'n'}"
                  + (f" pf={r['prefetch_factor']}" if r["num_workers"] else "") for r in rows]
        y = range(len(rows))
        colors = ["tab:green" if _is_pick(kind, r, rec) else "tab:blue" for r in rows]
        left.barh(y, [r["samples_per_sec"] or 0 for r in rows], color=colors)
        left.set_xlabel("training samples/s (green: recommended)")
        left.set_yticks(list(y), labels, fontsize=8)
        right.barh(y, [r["loader_batches_per_sec"] or 0 for r in rows], color="0.6")
        right.set_xlabel("loader alone: batches/s")
        for ax in (left, right):
            ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(kind: str, result: dict, cfg: DictConfig, out: Path) -> list[Path]:
    """Write ``<kind>.csv``, ``.md``, ``.png`` and ``.json`` into ``out``; returns their paths."""
    from runner.track import write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    rows, rec = result["rows"], result["recommended"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    csv_path = out / f"{kind}.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows([{k: ("" if r.get(k) is None else r.get(k)) for k in keys} for r in rows])
    md = [f"# runner.tune {kind}", "", f"model `{cfg.model._target_}`, data `{cfg.data.name}`, device "
          f"{result['device']}, {result['world_size']} process(es)", "", markdown_table(kind, rows, rec, max_rows=30), "",
          f"**override:** `{result['override']}`", "", *[f"- {n}" for n in result["notes"]], ""]
    md_path = out / f"{kind}.md"
    md_path.write_text("\n".join(md))
    png_path = out / f"{kind}.png"
    plot(kind, result, png_path)
    json_path = out / f"{kind}.json"
    write_json_atomic(json_path, {"tuner": kind, **result, "tune": OmegaConf.to_container(cfg.tune)})
    return [csv_path, md_path, png_path, json_path]


# ------------------------------------------------------------------------------------------- entry


_TUNE: dict[str, Callable[[DictConfig, Any, Path], dict[str, Any]]] = {
    "batch_size": tune_batch_size, "lr": tune_lr, "dataloader": tune_dataloader}


def _gather(value: Any, env) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` with one process)."""
    if not env.distributed:
        return [value]
    import torch.distributed as dist

    box: list[Any] = [None] * env.world_size
    dist.all_gather_object(box, value)
    return box


def run(kind: str, cfg: DictConfig, out: Path) -> dict[str, Any]:
    """Run tuner ``kind`` on the composed run config ``cfg``; rank 0 writes the outputs into ``out`` and prints
    the table and the override line. Returns the result (``recommended``, ``override``, ``rows``, ``notes``,
    ``ranks``: each rank's recommendation).

    Raises:
        ConfigError: an unknown tuner, bad ``tune.*`` values, bad run config (``runner.train.validate`` and
            the builders), or nothing to recommend (the job does not fit at the smallest batch size, ...).
        RuntimeError: the ranks' recommendations differ (a bug: they decide on the same reduced figures).
    """
    from runner import distributed, hardware
    from runner.train import validate

    if kind not in _TUNE:
        raise ConfigError(f"unknown tuner {kind!r}: use one of {', '.join(TUNERS)} "
                          f"(python -m runner.tune batch_size [overrides])")
    validate(cfg)
    check_settings(cfg.tune)
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    try:
        out = distributed.shared_job_dir(Path(out), env)
        with tempfile.TemporaryDirectory(prefix="runner-tune-") as scratch:  # the trials' job folders
            started = time.perf_counter()
            result = _TUNE[kind](cfg, env, Path(scratch))
        result |= {"device": hardware.device_name(env.device), "world_size": env.world_size,
                   "tune_time_s": time.perf_counter() - started}
        result["ranks"] = _gather(result["recommended"], env)
        if any(r != result["ranks"][0] for r in result["ranks"]):
            raise RuntimeError(f"the ranks recommend different settings: {result['ranks']}")
        if env.is_main:
            paths = write_outputs(kind, result, cfg, out)
            print(f"\n{markdown_table(kind, result['rows'], result['recommended'], max_rows=15)}\n")
            for note in result["notes"]:
                print(f"note: {note}")
            print(f"\nwrote {', '.join(p.name for p in paths)} in {out}")
            print(f"override: {result['override']}", flush=True)
        return result
    finally:
        distributed.teardown()


_KIND: list[str] = []  # the tuner named on the command line, for the Hydra task below


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from runner.train import job_folder

    try:
        run(_KIND[0], cfg, job_folder())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def parse_args(args: list[str]) -> tuple[str, str | None, list[str]]:
    """``(tuner, --out DIR or None, the rest for Hydra)`` from the command line after ``python -m runner.tune``.

    Raises:
        ConfigError: no or an unknown tuner, ``--out`` without a folder, a multirun (``-m``).
    """
    if not args or args[0] not in TUNERS:
        given = f"unknown tuner {args[0]!r}" if args else "no tuner named"
        raise ConfigError(f"{given}: use one of {', '.join(TUNERS)}, e.g. python -m runner.tune batch_size "
                          f"[overrides] (python -m runner.tune --help)")
    kind, rest, out = args[0], [], None
    i = 1
    while i < len(args):
        a = args[i]
        if a == "--out" or a.startswith("--out="):
            out = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in a else 2
            if not out:
                raise ConfigError("--out needs a folder: python -m runner.tune <tuner> --out DIR [overrides]")
            continue
        if a in ("-m", "--multirun"):
            raise ConfigError("a tuner measures one configuration: drop -m/--multirun (sweep the result instead)")
        rest.append(a)
        i += 1
    return kind, out, rest


def main() -> None:
    """``python -m runner.tune <tuner> [--out DIR] [overrides]``: exit status 2 with one ``error:`` line for bad
    input. Under torchrun, ranks > 0 are kept out of the output folder as in ``python -m runner``."""
    from runner.launch import prepare_process, record_if_elastic

    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        return
    try:
        kind, out, rest = parse_args(sys.argv[1:])
        sys.argv[1:] = rest + ([f"hydra.run.dir={out}"] if out else [])
        layout = prepare_process(sys.argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if layout.rank == 0 and not any(a.startswith("hydra.run.dir=") for a in sys.argv):
        sys.argv.append(f"hydra.run.dir=outputs/tune/{kind}/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    _KIND[:] = [kind]
    record_if_elastic(_hydra_main)()


if __name__ == "__main__":
    main()
