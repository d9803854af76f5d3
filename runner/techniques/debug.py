"""Debug tools, off by default (technique 13: "turn off debugging APIs" once the model works; PyTorch
Performance Tuning Guide, https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#disable-debugging-apis)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from omegaconf import DictConfig

from runner.config import check_choice
from runner.errors import ConfigError


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def build(cfg: DictConfig, job_dir: Path, device: torch.device):
    """Yield ``(profiler, techniques)``; the loop calls ``profiler.step()`` once per optimizer step.

    - ``off``: a profiler whose ``step`` does nothing.
    - ``anomaly``: ``torch.autograd.set_detect_anomaly(True)`` for the whole run: every backward op checks
      for NaN and keeps forward tracebacks (slow; https://pytorch.org/docs/stable/autograd.html#anomaly-detection).
    - ``profile``: ``torch.profiler`` over one window, ``schedule(wait, warmup, active, repeat=1)``
      optimizer steps (skip ``wait``, record but discard ``warmup``, keep ``active``), CPU and CUDA
      activities with input shapes; the trace (``*.pt.trace.json``) is written to ``<job_dir>/profile/``
      for TensorBoard or Perfetto (https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html); a run
      shorter than the window writes what it recorded. It slows the recorded steps: no speed figures from it.

    Raises:
        ConfigError: an unknown ``debug.name`` or a non-positive ``profile_active``.
    """
    check_choice("debug.name", cfg.name)
    if cfg.name == "off":
        yield _NoProfiler(), {}
    elif cfg.name == "anomaly":
        with torch.autograd.set_detect_anomaly(True):
            yield _NoProfiler(), {"anomaly_detection": "applied"}
    else:  # profile, the last of CHOICES["debug.name"]
        if cfg.profile_active < 1 or cfg.profile_wait < 0 or cfg.profile_warmup < 0:
            raise ConfigError("debug.profile_active must be >= 1 and debug.profile_wait/profile_warmup >= 0")
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        trace_dir = job_dir / "profile"
        with profile(
            activities=activities,
            schedule=schedule(wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(trace_dir)),
            record_shapes=True,
        ) as prof:
            yield prof, {"profiler": "applied"}
