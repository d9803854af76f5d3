"""Measurement: step time and data wait without per-step syncs, FLOPs, peak memory, how busy the machine
was while the figures were taken (the device's peak FLOP/s for MFU and the /proc probes are machine
knowledge: runner/measure/hardware.py).

Rules: docs/design.md and docs/outputs-and-loggers.md, "How the figures are taken". Warm-up steps are in no figure.
"""

from __future__ import annotations

import copy
import math
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runner.measure.machine_load import LoadWindow


def flops_per_sample(
    model: nn.Module, example: tuple[torch.Tensor, torch.Tensor], loss: Callable[[nn.Module, tuple], torch.Tensor]
) -> float | None:
    """FLOPs of one forward + backward pass per sample, counted once by ``FlopCounterMode``.

    A copy of the model runs ``loss(copy, example)`` and its backward on ``example``, a real-shaped ``(x, y)``;
    matmuls, convolutions and attention count (PaLM, appendix B, https://arxiv.org/abs/2204.02311). None when
    the model cannot be counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    try:
        clone = copy.deepcopy(model)
        with FlopCounterMode(display=False) as counter:
            loss(clone, example).backward()
        return counter.get_total_flops() / len(example[0])
    except Exception:  # noqa: BLE001 - FLOPs are a figure, never a reason to fail the run
        return None


def wall_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device has finished the work queued so far (a CUDA sync; exact on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak for ``peak_memory_mb`` (CUDA: ``reset_peak_memory_stats``; Linux: 5 written to
    /proc/self/clear_refs sets the peak RSS to the current RSS, proc(5)). False where it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MiB since the start or ``reset_peak_memory``: ``torch.cuda.max_memory_allocated`` on CUDA;
    on a CPU the peak RSS (VmHWM, /proc/self/status; DataLoader workers not counted), else ``ru_maxrss``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        return int(Path("/proc/self/status").read_text().split("VmHWM:", 1)[1].split()[0]) / 1024  # kB
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class _CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(a: float, b: float) -> float:
        return (b - a) * 1e3


class _CudaClock:
    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed_ms(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()  # elapsed_time raises until both events completed; called at log intervals only
        return a.elapsed_time(b)


@dataclass
class Timings:
    """Milliseconds of every measured (post-warm-up) optimizer step: data wait and the rest of the step."""

    data_wait_ms: list[float] = field(default_factory=list)
    step_time_ms: list[float] = field(default_factory=list)


class Meter:
    """Times every optimizer step: each micro-batch fetch (start, ready) and the step's end.

    Usage in the loop::

        for each micro-batch: meter.start_fetch(); x, y = next(it); meter.batch_ready(); ...
        meter.end_step()
        if log step: row = meter.flush()           # the one host-device sync of the interval

    Data wait: the sum of a step's fetches; step time: the rest of the iteration (ms, per rank). ``flush`` drops
    steps < ``warmup_steps``; evaluation runs between ``end_step`` and ``start_fetch``, untimed.

    Args:
        device: the run's device (CUDA events there, perf_counter elsewhere).
        warmup_steps: optimizer steps left out of every figure (compile, cuDNN autotune, allocator growth).
        samples_per_step: global samples per optimizer step (global batch size).
        tokens_per_sample: the task's tokens per sample (language models), or None: then ``flush`` and
            ``totals`` also report ``tokens_per_sec``.
        timings: where measured steps' milliseconds accumulate (the ``TrainState``'s, checkpointed).
        gpu_profile_steps: on CUDA, profile this many of the last warm-up steps (``GpuIdleProbe``); 0 = none.

    Also (this process only): ``load`` (a ``LoadWindow``) and the logging steps' time (``log_started``/``log_done``).
    """

    def __init__(
        self,
        device: torch.device,
        warmup_steps: int,
        samples_per_step: int,
        tokens_per_sample: int | None = None,
        timings: "Timings | None" = None,
        gpu_profile_steps: int = 0,
    ):
        self.clock = _CudaClock() if device.type == "cuda" else _CpuClock()
        self.device = device
        self.warmup_steps = warmup_steps
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.timings = timings if timings is not None else Timings()
        self.step = 0
        self._pending: list[list] = []
        self._marks: list = []
        self.load = LoadWindow(device)
        self._window_pending = True  # the load window opens at the first measured step
        self._first_own = len(self.timings.step_time_ms)  # this process's measured steps start here (resume)
        self.log_s = 0.0  # s spent in logging steps' bookkeeping during measured steps
        # one-time costs (summary.json one_time): perf_counter at this process's first step, the warm-up steps' wall
        # seconds (compilation, autotuning, allocator growth land there), the first evaluation's seconds
        self.first_step_at: float | None = None
        self.warmup_s: float | None = None
        self.first_eval_s: float | None = None
        self._log_mark = 0.0
        first = warmup_steps - gpu_profile_steps
        self.gpu_probe = (
            GpuIdleProbe(first, warmup_steps)
            if device.type == "cuda" and gpu_profile_steps > 0 and first >= 1
            else None
        )

    @property
    def data_wait_ms(self) -> list[float]:
        return self.timings.data_wait_ms

    @property
    def step_time_ms(self) -> list[float]:
        return self.timings.step_time_ms

    def start_fetch(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
        if self._window_pending and self.step >= self.warmup_steps:
            self._window_pending = False
            self.warmup_s = time.perf_counter() - self.first_step_at
            self.load.start()
        self._marks.append(self.clock.mark())

    def batch_ready(self) -> None:
        self._marks.append(self.clock.mark())

    def end_step(self) -> None:
        self._marks.append(self.clock.mark())
        if self.step >= self.warmup_steps:
            self._pending.append(self._marks)
        self._marks = []
        self.step += 1
        if self.gpu_probe is not None and self.step <= self.warmup_steps:
            self.gpu_probe.after_step(self.step)

    def pause(self) -> None:
        """Close the load window for now (evaluation, checkpoint writes, the end of training); no-op if closed."""
        self.load.pause()

    def resume(self) -> None:
        """Reopen the load window after ``pause`` (only once the measured steps have begun)."""
        if not self._window_pending:
            self.load.resume()

    def log_started(self) -> None:
        """Mark the start of a logging step's bookkeeping (the loss read, the metrics row); see ``log_done``."""
        self._log_mark = time.perf_counter()

    def log_done(self) -> None:
        """Add the host time since ``log_started`` to ``log_s`` when the step is measured. On CUDA it includes
        the wait for the GPU's queued work (the loss read is a host-device sync)."""
        if self.step >= self.warmup_steps:
            self.log_s += time.perf_counter() - self._log_mark

    def _resolve(self, marks: list) -> tuple[float, float]:
        ms = self.clock.elapsed_ms
        wait = sum(ms(marks[i], marks[i + 1]) for i in range(0, len(marks) - 1, 2))
        return wait, ms(marks[0], marks[-1]) - wait

    def with_tokens(self, figures: dict) -> dict:
        """``figures`` plus ``tokens_per_sec`` right after ``samples_per_sec`` when the task counts tokens."""
        if self.tokens_per_sample is None:
            return figures
        sps = figures["samples_per_sec"]
        out = {"samples_per_sec": sps, "tokens_per_sec": sps * self.tokens_per_sample if sps else None}
        return out | figures

    def flush(self) -> dict[str, float | None]:
        """Resolve pending marks; return this interval's ``samples_per_sec`` (and ``tokens_per_sec``),
        ``step_time_ms`` (median), ``data_wait_ms`` (mean), all None while the interval is inside the warm-up."""
        resolved = [self._resolve(m) for m in self._pending]
        self._pending = []
        self.load.sample()
        waits, steps = [w for w, _ in resolved], [s for _, s in resolved]
        self.data_wait_ms.extend(waits)
        self.step_time_ms.extend(steps)
        if not steps:
            return self.with_tokens({"samples_per_sec": None, "step_time_ms": None, "data_wait_ms": None})
        total_s = (sum(waits) + sum(steps)) / 1e3
        return self.with_tokens(
            {
                "samples_per_sec": self.samples_per_step * len(steps) / total_s,
                "step_time_ms": statistics.median(steps),
                "data_wait_ms": statistics.fmean(waits),
            }
        )

    def coverage(self) -> str:
        """What the speed figures cover, in words: how many steps were measured, or why none was (a run
        whose steps were all warm-up has null figures, and this says so and what to change)."""

        def steps(k: int) -> str:
            return f"{k} step" + ("" if k == 1 else "s")

        n, warmup = len(self.step_time_ms), min(self.warmup_steps, self.step)
        if n:
            return f"{steps(n)} measured ({steps(warmup)} of warm-up left out)"
        if self.step == 0:
            return "nothing measured: no training step ran"
        return (
            f"too short to measure: all {steps(self.step)} were warm-up (trainer.warmup_steps="
            f"{self.warmup_steps}); raise trainer.max_steps above {self.warmup_steps} or lower "
            f"trainer.warmup_steps"
        )

    def totals(self) -> dict[str, float | int | str | None]:
        """Whole-run figures over all measured (post-warm-up) iterations; call after a final ``flush``.

        ``measurement`` (``coverage()``) says what they cover, or why they are null."""
        n = len(self.step_time_ms)
        if n == 0:
            return {
                "samples_per_sec": None,
                "step_time_ms_median": None,
                "step_time_ms_p90": None,
                "data_wait_fraction": None,
                "measured_steps": 0,
                "measured_time_s": 0.0,
                "measurement": self.coverage(),
                "log_time_fraction": None,
            }
        wait, step = sum(self.data_wait_ms), sum(self.step_time_ms)
        ordered = sorted(self.step_time_ms)
        own_s = (sum(self.data_wait_ms[self._first_own :]) + sum(self.step_time_ms[self._first_own :])) / 1e3
        return {
            "samples_per_sec": self.samples_per_step * n / ((wait + step) / 1e3),
            "step_time_ms_median": statistics.median(ordered),
            "step_time_ms_p90": ordered[min(n - 1, int(round(0.9 * (n - 1))))],
            "data_wait_fraction": wait / (wait + step),
            "measured_steps": n,
            "measured_time_s": (wait + step) / 1e3,
            "measurement": self.coverage(),
            "log_time_fraction": min(1.0, self.log_s / own_s) if own_s > 0 else None,
        }

    def machine_load(self, threads: int, workers: int) -> dict[str, Any] | None:
        """The load window's record (``LoadWindow.record``) with this process's data wait, or None when no
        measured step ran; call after ``pause`` at the end of training."""
        if self._window_pending:
            return None
        own = self.data_wait_ms[self._first_own :]  # one entry per measured step
        return self.load.record(threads, workers, sum(own) / 1e3, len(own))


# ------------------------------------------------------------------------------ the GPU between its kernels
class GpuIdleProbe:
    """How long the GPU idles between kernels, from a short ``torch.profiler`` window (CUDA activity only).

    Steps ``first`` to ``last`` of the warm-up; ``idle_fraction`` = 1 - (union of kernels' and copies' device time) /
    (the window's wall time), or None with the reason in ``note``
    (https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html).
    """

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.idle_fraction: float | None = None
        self.note = f"not reached (the window is steps {first}..{last})"
        self._prof = None

    def after_step(self, steps_done: int) -> None:
        """Called with the number of optimizer steps done; opens or closes the window at its edges."""
        try:
            if steps_done == self.first:
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                self._prof = profile(activities=[ProfilerActivity.CUDA])
                self._prof.start()
                self._t0 = time.perf_counter()
            elif steps_done == self.last and self._prof is not None:
                torch.cuda.synchronize()
                wall_us = (time.perf_counter() - self._t0) * 1e6
                self._prof.stop()
                spans = sorted(
                    (e.time_range.start, e.time_range.end)
                    for e in self._prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                )
                self._prof = None
                self.idle_fraction = max(0.0, 1 - union_length(spans) / wall_us) if wall_us > 0 else None
                self.note = f"steps {self.first + 1}..{self.last} profiled ({len(spans)} kernels and copies)"
        except Exception as e:  # noqa: BLE001 - a figure for the doctor, never a reason to fail the run
            self._prof, self.idle_fraction = None, None
            self.note = f"profiler failed: {type(e).__name__}: {e}"[:200]


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals sorted by start (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
