"""Processes and devices: who am I (rank, world size), which device, and the process group.

Process discovery follows torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``) and
falls back to SLURM's ``srun`` variables. A single process needs no process group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from runner.errors import ConfigError


@dataclass
class Env:
    """Where this process runs. ``rank`` is global, ``local_rank`` the index on its node."""

    rank: int
    local_rank: int
    world_size: int
    nodes: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU.

    Raises:
        ConfigError: ``trainer.device`` is not auto/cpu/cuda, or ``cuda`` on a machine without CUDA.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device={requested!r} is not one of auto, cpu, cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but this machine has no usable CUDA device "
                          "(torch.cuda.is_available() is False); use trainer.device=auto or trainer.device=cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def setup(cfg: DictConfig, device: str = "auto") -> Env:
    """Discover the process layout and join the process group when there is more than one process."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    nodes = int(env.get("SLURM_NNODES", env.get("GROUP_WORLD_SIZE", 1))) if world_size > 1 else 1
    dev = pick_device(device, local_rank)
    if cfg.name != "none" and world_size == 1:
        pass  # a single process: DDP/FSDP wrappers still apply (useful for overhead checks)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.backend or ("nccl" if dev.type == "cuda" else "gloo")
        from datetime import timedelta

        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=cfg.timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return Env(rank=rank, local_rank=local_rank, world_size=world_size, nodes=nodes, device=dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, cfg: DictConfig, env: Env, precision_cfg: DictConfig):
    """Wrap the model for data parallelism (``distributed.name``); ``none`` returns it unchanged.

    Returns ``(model, techniques)``.
    """
    if cfg.name == "none":
        return model, {}
    raise ConfigError(f"distributed.name={cfg.name!r} is not supported yet; use distributed=none")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP/DataParallel wrapper (FSDP2 shards in place: itself)."""
    return getattr(model, "module", model)


def no_sync(model: torch.nn.Module, last: bool):
    """DDP's ``no_sync()`` on every micro-batch but the last: gradients are all-reduced once per step."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def all_reduce_sum(tensor: torch.Tensor, env: Env) -> None:
    """Sum ``tensor`` over all ranks in place (no-op in a single process)."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def shared_job_dir(job_dir: Path, env: Env) -> Path:
    """The job folder every rank writes into: rank 0's (single process: ``job_dir`` itself)."""
    if env.distributed:
        box = [str(job_dir)]
        dist.broadcast_object_list(box, src=0)
        return Path(box[0])
    return job_dir


def reduce_figures(totals: dict, peak_memory_mb: float, env: Env) -> dict:
    """Global figures from each rank's ``Meter.totals()``: the slowest rank's times, max peak memory.

    samples/s is global: the global batch per step is already in ``totals``; dividing by the slowest
    rank's measured time gives all ranks' samples per second of wall time.
    """
    out = dict(totals, peak_memory_mb=peak_memory_mb)
    if not env.distributed or totals["measured_steps"] == 0:
        return out
    t = torch.tensor([totals["measured_time_s"], totals["step_time_ms_median"], totals["step_time_ms_p90"],
                      peak_memory_mb], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    slowest_s, median, p90, mem = t.tolist()
    out.update(step_time_ms_median=median, step_time_ms_p90=p90, peak_memory_mb=mem, measured_time_s=slowest_s,
               samples_per_sec=totals["samples_per_sec"] * totals["measured_time_s"] / slowest_s)
    return out
