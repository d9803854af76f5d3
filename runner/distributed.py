"""The process layer: who am I (rank, world size), which device, the process group, collectives.

``setup`` joins the process group (``nccl`` on CUDA, ``gloo`` on CPU); the collectives are no-ops in a single process.
docs/scaling.md, "What runner does for you".
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from runner import launch
from runner.config import check_choice
from runner.errors import ConfigError
from runner.files import write_own

_GROUPS = itertools.count()  # the process groups this process has joined: each gets keys of its own (attempt_store)


@dataclass
class Env:
    """Where this process runs. ``rank`` is global, ``local_rank`` the index on its node."""

    rank: int
    local_rank: int
    world_size: int
    nodes: int
    device: torch.device
    launcher: str = "single"  # single | torchrun | srun
    model_parallel: int = 1  # ranks one model is split over (distributed=tp|pp): consecutive, fed the same batches

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of each global batch it (and its model-parallel group) gets."""
        return self.rank // self.model_parallel

    @property
    def dp_size(self) -> int:
        """Model copies training side by side: ``world_size / model_parallel``."""
        return self.world_size // self.model_parallel

    def data_view(self) -> "Env":
        """This Env as the data sees it: one rank per model copy (``dp_rank`` of ``dp_size``)."""
        return dataclasses.replace(self, rank=self.dp_rank, world_size=self.dp_size, model_parallel=1)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. A CUDA process uses GPU ``local_rank`` modulo the visible
    GPUs (modulo: under ``srun --gpus-per-task=1`` each task sees one GPU, index 0).

    Raises:
        ConfigError: ``trainer.device`` is not auto/cpu/cuda, or ``cuda`` on a machine without CUDA.
    """
    check_choice("trainer.device", requested)
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False); use trainer.device=auto or trainer.device=cpu"
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _check(cfg: DictConfig, layout: launch.Layout) -> None:
    """Impossible combinations of ``distributed.*`` and the launch, before anything starts."""
    name = cfg.name
    if layout.world_size > 1 and name == "none":
        raise ConfigError(
            f"this job was launched as {layout.world_size} processes ({layout.launcher}) but "
            f"distributed=none, so each would train its own copy; pass distributed=ddp (or fsdp)"
        )
    if layout.world_size > 1 and name == "dp":
        raise ConfigError(
            f"distributed=dp is nn.DataParallel: one process that drives every local GPU; it cannot "
            f"run as {layout.world_size} processes ({layout.launcher}). Use distributed=ddp under "
            f"torchrun, or start dp with plain `python -m runner`"
        )
    if cfg.sync_batchnorm and name in ("fsdp", "tp", "pp", "dp"):
        raise ConfigError(
            f"distributed.sync_batchnorm=true works with distributed=ddp only (here distributed={name}); "
            f"drop it or use ddp"
        )
    if name == "pp" and cfg.pp_schedule not in ("gpipe", "1f1b"):
        check_choice("distributed.pp_schedule", cfg.pp_schedule)
    for key, owner in (("tp_size", "tp"), ("pp_size", "pp")):
        size = cfg[key]
        if size is not None and (name != owner or size < 1 or layout.world_size % size):
            raise ConfigError(
                f"distributed.{key}={size} "
                + (
                    f"is read by distributed={owner} only (here {name}); drop it"
                    if name != owner
                    else f"must divide the world size {layout.world_size} (the rest of the ranks are data "
                    f"parallel); launch a multiple of it or pick a divisor"
                )
            )
    check_choice("distributed.backend", cfg.backend)
    if cfg.timeout_s <= 0:
        raise ConfigError(f"distributed.timeout_s={cfg.timeout_s} must be > 0 seconds")


def setup(cfg: DictConfig, device: str = "auto") -> Env:
    """Discover the process layout (``launch.discover``), pick the device, join the process group.

    ``ddp``/``fsdp`` get a group even with one process; collectives time out after ``distributed.timeout_s`` s.

    Raises:
        ConfigError: an impossible combination (``_check``), ``nccl`` without CUDA, no GPU for this rank.
    """
    layout = launch.discover()
    _check(cfg, layout)
    dev = pick_device(device, layout.local_rank)
    backend = cfg.backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError(
            "distributed.backend=nccl needs CUDA devices but this run is on the CPU; use "
            "distributed.backend=gloo (or null)"
        )
    if cfg.name in ("ddp", "fsdp", "tp", "pp") and not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        if layout.launcher == "srun":
            os.environ.setdefault("MASTER_ADDR", str(layout.master_addr))
            os.environ.setdefault("MASTER_PORT", str(layout.master_port))
        store = attempt_store(layout, timeout) if layout.world_size > 1 else dist.HashStore()
        dist.init_process_group(
            backend,
            store=store,
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    return Env(
        rank=layout.rank,
        local_rank=layout.local_rank,
        world_size=layout.world_size,
        nodes=layout.nodes,
        device=dev,
        launcher=layout.launcher,
        model_parallel={"tp": cfg.tp_size, "pp": cfg.pp_size}.get(cfg.name, 1) or layout.world_size,
    )


def attempt_store(layout: launch.Layout, timeout: timedelta) -> dist.Store:
    """The ``env://`` rendezvous store under a prefix of its own per restart and per process group this process
    joins (``_GROUPS``); why: docs/checkpointing.md, "Elastic restarts".
    """
    store, _, _ = next(dist.rendezvous("env://", rank=layout.rank, world_size=layout.world_size, timeout=timeout))
    return dist.PrefixStore(f"/worker/attempt_{os.getenv('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_GROUPS)}", store)


def teardown() -> None:
    """Leave the process group (all ranks); a no-op without one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ collectives


def broadcast_module_state(model: torch.nn.Module, src: int = 0) -> bool:
    """Copy rank ``src``'s parameters and buffers to every rank (one broadcast per tensor, in place).

    Returns whether every rank already held exactly ``src``'s values (so a seed mismatch shows up in the
    summary instead of being silently papered over). Collective: every rank must call it.
    """
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    digest = torch.tensor(
        [float(sum(t.detach().double().sum().item() for t in tensors))],
        dtype=torch.float64,
        device=tensors[0].device if tensors else "cpu",
    )
    reference = digest.clone()
    dist.broadcast(reference, src)
    same = torch.tensor([1 if torch.equal(digest, reference) else 0], device=digest.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src)
    return bool(same.item())


def all_reduce_sum(tensor: torch.Tensor, env: Env) -> None:
    """Sum ``tensor`` over the model copies in place (no-op in a single process): over all ranks, each model-parallel
    group's identical copies counted once."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if env.model_parallel > 1:
            tensor /= env.model_parallel


def all_reduce_mean(tensor: torch.Tensor, env: Env) -> torch.Tensor:
    """Average ``tensor`` over all ranks in place and return it (the global batch's loss, not rank 0's share)."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= env.world_size
    return tensor


def broadcast_object(obj, env: Env):
    """Rank 0's ``obj`` on every rank (pickled over the process group); ``obj`` itself with one process."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shared_job_dir(job_dir: Path, env: Env) -> Path:
    """The job folder every rank writes into: rank 0's (single process: ``job_dir`` itself).

    Ranks > 0 were pointed at a scratch folder by ``launch.hydra_overrides``; here they learn rank 0's.
    """
    if env.distributed:
        box = [str(job_dir)]
        dist.broadcast_object_list(box, src=0)
        if env.rank != 0:
            launch.drop_scratch(job_dir)
        pointer = launch.elastic_pointer()
        if env.rank == 0 and pointer is not None:  # restarted workers (torchrun --max-restarts) come back here
            write_own(pointer, str(Path(box[0]).resolve()))
        return Path(box[0])
    return job_dir


def reduce_figures(totals: dict, peak_memory_mb: float, env: Env) -> dict:
    """Global figures from each rank's ``Meter.totals()``: the slowest rank's times, max peak memory.

    samples/s is global: all ranks' samples per second of the slowest rank's time.
    """
    out = dict(totals, peak_memory_mb=peak_memory_mb)
    if not env.distributed:
        return out
    t = torch.tensor(
        [
            totals["measured_time_s"],
            totals["step_time_ms_median"] or 0.0,
            totals["step_time_ms_p90"] or 0.0,
            peak_memory_mb,
        ],
        dtype=torch.float64,
        device=env.device,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank takes part, even one without measured steps
    slowest_s, median, p90, mem = t.tolist()
    out["peak_memory_mb"] = mem
    if totals["measured_steps"] == 0 or slowest_s <= 0:
        return out
    out.update(
        step_time_ms_median=median,
        step_time_ms_p90=p90,
        measured_time_s=slowest_s,
        samples_per_sec=totals["samples_per_sec"] * totals["measured_time_s"] / slowest_s,
    )
    return out
