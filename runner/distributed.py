"""Processes and devices: who am I (rank, world size), which device, the process group, the wrapper.

One job, many processes: the same ``python -m runner`` runs alone, under ``torchrun`` (one or many
nodes) and under ``srun``; ``runner.launch.discover`` reads the launcher's environment and ``setup``
joins the process group (``nccl`` on CUDA, ``gloo`` on CPU). ``wrap`` applies the data-parallel
technique of ``distributed.name``:

- ``ddp``: ``DistributedDataParallel`` -- one process per device, gradients all-reduced in buckets
  during backward (https://pytorch.org/docs/stable/notes/ddp.html).
- ``fsdp``: FSDP2 ``fully_shard`` -- parameters, gradients and optimizer state sharded over the ranks
  as DTensors, all-gathered per block for forward/backward
  (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
- ``dp``: ``nn.DataParallel`` -- one process driving all local GPUs; kept only for the ablation, DDP is
  faster (https://pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel).

Every rank builds the model from the same seed; DDP broadcasts rank 0's parameters and buffers when it
wraps, FSDP gets them broadcast explicitly before sharding, so all ranks start identical either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from runner import launch
from runner.errors import ConfigError

_BACKENDS = ("gloo", "nccl", "mpi", "xccl", "ucc")


@dataclass
class Env:
    """Where this process runs. ``rank`` is global, ``local_rank`` the index on its node."""

    rank: int
    local_rank: int
    world_size: int
    nodes: int
    device: torch.device
    launcher: str = "single"  # single | torchrun | srun

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. A CUDA process uses GPU ``local_rank`` modulo the visible
    GPUs (modulo: under ``srun --gpus-per-task=1`` each task sees one GPU, index 0).

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


def _check(cfg: DictConfig, layout: launch.Layout) -> None:
    """Impossible combinations of ``distributed.*`` and the launch, before anything starts."""
    name = cfg.name
    if layout.world_size > 1 and name == "none":
        raise ConfigError(f"this job was launched as {layout.world_size} processes ({layout.launcher}) but "
                          f"distributed=none, so each would train its own copy; pass distributed=ddp (or fsdp)")
    if layout.world_size > 1 and name == "dp":
        raise ConfigError(f"distributed=dp is nn.DataParallel: one process that drives every local GPU; it cannot "
                          f"run as {layout.world_size} processes ({layout.launcher}). Use distributed=ddp under "
                          f"torchrun, or start dp with plain `python -m runner`")
    if cfg.sync_batchnorm and name in ("fsdp", "dp"):
        raise ConfigError(f"distributed.sync_batchnorm=true works with distributed=ddp only (here distributed={name}); "
                          f"drop it or use ddp")
    if cfg.backend is not None and cfg.backend not in _BACKENDS:
        raise ConfigError(f"distributed.backend={cfg.backend!r} is not one of {list(_BACKENDS)} (or null: nccl on "
                          f"CUDA, gloo on CPU)")
    if cfg.timeout_s <= 0:
        raise ConfigError(f"distributed.timeout_s={cfg.timeout_s} must be > 0 seconds")


def setup(cfg: DictConfig, device: str = "auto") -> Env:
    """Discover the process layout (``launch.discover``), pick the device, join the process group.

    The group is created for ``ddp``/``fsdp`` even with one process (a one-rank group on an in-memory
    store), so their wrappers can be measured alone; ``none`` and ``dp`` never create one.
    ``srun`` tasks rendezvous at ``MASTER_ADDR:MASTER_PORT`` from ``launch.discover``.
    Collectives time out after ``distributed.timeout_s`` seconds.

    Raises:
        ConfigError: an impossible combination (``_check``), ``nccl`` without CUDA, no GPU for this rank.
    """
    layout = launch.discover()
    _check(cfg, layout)
    dev = pick_device(device, layout.local_rank)
    backend = cfg.backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA devices but this run is on the CPU; use "
                          "distributed.backend=gloo (or null)")
    if cfg.name in ("ddp", "fsdp") and not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        device_id = dev if dev.type == "cuda" else None
        if layout.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
        else:
            if layout.launcher == "srun":
                os.environ.setdefault("MASTER_ADDR", str(layout.master_addr))
                os.environ.setdefault("MASTER_PORT", str(layout.master_port))
            dist.init_process_group(backend, init_method="env://", rank=layout.rank, world_size=layout.world_size,
                                    timeout=timeout, device_id=device_id)
    return Env(rank=layout.rank, local_rank=layout.local_rank, world_size=layout.world_size, nodes=layout.nodes,
               device=dev, launcher=layout.launcher)


def teardown() -> None:
    """Leave the process group (all ranks); a no-op without one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ wrappers


def broadcast_module_state(model: torch.nn.Module, src: int = 0) -> bool:
    """Copy rank ``src``'s parameters and buffers to every rank (one broadcast per tensor, in place).

    Returns whether every rank already held exactly ``src``'s values (so a seed mismatch shows up in the
    summary instead of being silently papered over). Collective: every rank must call it.
    """
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    digest = torch.tensor([float(sum(t.detach().double().sum().item() for t in tensors))], dtype=torch.float64,
                          device=tensors[0].device if tensors else "cpu")
    reference = digest.clone()
    dist.broadcast(reference, src)
    same = torch.tensor([1 if torch.equal(digest, reference) else 0], device=digest.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src)
    return bool(same.item())


def _has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def fsdp_mixed_precision(precision_cfg: DictConfig, device: torch.device):
    """FSDP2's ``MixedPrecisionPolicy`` for the ``precision`` group, or None (fp32 all-gathers).

    Mirrors ``runner.precision.build``: ``bf16`` -> bf16 parameters for compute; ``amp`` -> fp16 on CUDA
    (the GradScaler's found-inf check is reduced over the shards by DTensor), bf16 on a CPU with native
    bf16, nothing where amp itself is skipped; ``fp32``/``tf32`` -> None. Gradients are reduce-scattered
    in fp32 (``reduce_dtype``), as torchtitan does, so the sum over ranks does not lose precision.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from runner.precision import cpu_has_native_bf16

    name = precision_cfg.name
    dtype = None
    if name == "bf16" and (device.type != "cuda" or torch.cuda.is_bf16_supported()):
        dtype = torch.bfloat16
    elif name == "amp":
        if device.type == "cuda":
            dtype = torch.float16
        elif cpu_has_native_bf16():
            dtype = torch.bfloat16
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_ddp(model: torch.nn.Module, cfg: DictConfig, env: Env) -> tuple[torch.nn.Module, dict[str, str]]:
    """``DistributedDataParallel`` (optionally after ``SyncBatchNorm`` conversion).

    DDP broadcasts rank 0's parameters and buffers at construction (``init_sync=True``), registers
    gradient hooks that all-reduce (average) gradients bucket by bucket while backward still runs, and
    broadcasts buffers (BatchNorm statistics) from rank 0 before each forward. ``no_sync`` below skips the
    all-reduce on all micro-batches but the last of an accumulated step.

    ``sync_batchnorm``: BatchNorm statistics over the global batch instead of each rank's share
    (``nn.SyncBatchNorm.convert_sync_batchnorm``); its kernels exist for CUDA only, so on CPU it is
    skipped with the reason. Docs: https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html
    """
    techniques: dict[str, str] = {}
    if cfg.sync_batchnorm:
        if env.device.type != "cuda":
            techniques["sync_batchnorm"] = ("skipped: SyncBatchNorm only runs on CUDA; on CPU each rank normalizes "
                                            "with its own batch statistics")
        elif not _has_batchnorm(model):
            techniques["sync_batchnorm"] = "skipped: the model has no BatchNorm layer"
        elif env.world_size == 1:
            techniques["sync_batchnorm"] = "skipped: one process, its batch statistics are already global"
        else:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            techniques["sync_batchnorm"] = "applied"
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, init_sync=True)
    techniques["ddp"] = "applied"
    return model, techniques


def apply_fsdp(model: torch.nn.Module, env: Env, precision_cfg: DictConfig) -> tuple[torch.nn.Module, dict[str, str]]:
    """FSDP2: ``fully_shard`` each repeated block (``prepare.repeated_blocks``), then the root.

    Sharding per block lets FSDP all-gather one block's parameters at a time and free them after use
    (``reshard_after_forward=True``); the root call covers what is left (stem, head). Parameters become
    DTensors sharded on dim 0 over a 1-D device mesh of all ranks. Rank 0's values are broadcast first:
    ``fully_shard`` keeps each rank's slice of its *own* tensor, so ranks must agree before sharding.
    The mixed-precision policy comes from ``fsdp_mixed_precision``; under it, every BatchNorm layer is
    sharded on its own with fp32 parameters (its running statistics are fp32 buffers, and ``batch_norm``
    wants weight and statistics in one dtype), its input cast to fp32 on the way in.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from runner.prepare import repeated_blocks

    techniques: dict[str, str] = {}
    if not broadcast_module_state(model):
        warnings.warn("distributed=fsdp: ranks built different initial weights; rank 0's were broadcast", stacklevel=2)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = fsdp_mixed_precision(precision_cfg, env.device)
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    if policy is not None:  # BatchNorm keeps fp32 parameters: its running statistics are fp32 buffers
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fp32 = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
        for module in list(model.modules()):
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module is not model:
                fully_shard(module, **fp32)
    blocks = set(repeated_blocks(model))
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    techniques["fsdp"] = "applied"
    if precision_cfg.name in ("bf16", "amp"):
        techniques["fsdp_mixed_precision"] = ("applied" if policy is not None else
                                              f"skipped: precision={precision_cfg.name} is off on this device, so "
                                              f"parameters are all-gathered in fp32")
    return model, techniques


def apply_dp(model: torch.nn.Module, env: Env) -> tuple[torch.nn.Module, dict[str, str]]:
    """``nn.DataParallel`` over every visible GPU, output gathered on this process's GPU.

    Kept for the ablation only: each step it replicates the module to every GPU, scatters the batch and
    gathers the outputs on one GPU, from Python threads that share the GIL; DDP avoids all three. On a
    machine without CUDA there is nothing to split, so it is skipped and the plain model runs.
    """
    warnings.warn("distributed=dp: nn.DataParallel is slower than DistributedDataParallel (one process, threads "
                  "under the GIL, model replicated every step); use distributed=ddp with scripts/torchrun.sh. "
                  "It is kept for the ablation.", stacklevel=2)
    if env.device.type != "cuda":
        return model, {"dp": "skipped: nn.DataParallel splits batches across CUDA devices and there are none; "
                             "ran the plain model"}
    devices = list(range(torch.cuda.device_count()))
    return torch.nn.DataParallel(model, device_ids=devices, output_device=env.device.index), {"dp": "applied"}


def wrap(model: torch.nn.Module, cfg: DictConfig, env: Env, precision_cfg: DictConfig):
    """Wrap the model for data parallelism (``distributed.name``); ``none`` returns it unchanged.

    Called last by ``prepare`` (after compile): the wrapper registers its hooks on the final parameters.
    Returns ``(model, techniques)`` with ``"applied"`` / ``"skipped: <why>"`` per technique.

    Raises:
        ConfigError: an unknown ``distributed.name``.
    """
    name = cfg.name
    if name == "none":
        return model, ({"sync_batchnorm": "skipped: one process, its batch statistics are already global"}
                       if cfg.sync_batchnorm else {})
    if name == "ddp":
        return apply_ddp(model, cfg, env)
    if name == "fsdp":
        return apply_fsdp(model, env, precision_cfg)
    if name == "dp":
        return apply_dp(model, env)
    raise ConfigError(f"distributed.name={name!r} is not one of none, ddp, fsdp, dp")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP/DataParallel wrapper (FSDP2 shards in place: itself)."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def no_sync(model: torch.nn.Module, last: bool):
    """Skip the gradient reduction on every micro-batch of an accumulated step but the last.

    DDP: its ``no_sync()`` context (the flag is read in forward, so backward may run after the context
    exits, as the engine's loop does). FSDP2: ``set_requires_gradient_sync(last)`` -- a flag read in
    backward, so it is set here and left set until the next micro-batch sets it again (a context that
    restored it on exit would restore it before backward). Others: nothing to skip.
    Docs: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync
    """
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


# ------------------------------------------------------------------------------------ collectives


def all_reduce_sum(tensor: torch.Tensor, env: Env) -> None:
    """Sum ``tensor`` over all ranks in place (no-op in a single process)."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def all_reduce_mean(tensor: torch.Tensor, env: Env) -> torch.Tensor:
    """Average ``tensor`` over all ranks in place and return it (the global batch's loss, not rank 0's share)."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= env.world_size
    return tensor


def sync_ddp_buffers(model: torch.nn.Module, env: Env) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics), as DDP itself does before each forward.

    Between forwards the ranks' buffers differ (each updated them with its own batch); a checkpoint keeps
    one copy of a replicated tensor, so they are made equal first -- to rank 0's, the ones the next forward
    would have used. A no-op for one process and for models that are not ``DistributedDataParallel``.
    """
    if env.distributed and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with torch.no_grad():
            for buffer in model.module.buffers():
                dist.broadcast(buffer, src=0)


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
            pointer.write_text(str(Path(box[0]).resolve()))
        return Path(box[0])
    return job_dir


def reduce_figures(totals: dict, peak_memory_mb: float, env: Env) -> dict:
    """Global figures from each rank's ``Meter.totals()``: the slowest rank's times, max peak memory.

    samples/s is global: the global batch per step is already in ``totals``; dividing by the slowest
    rank's measured time gives all ranks' samples per second of wall time.
    """
    out = dict(totals, peak_memory_mb=peak_memory_mb)
    if not env.distributed:
        return out
    t = torch.tensor([totals["measured_time_s"], totals["step_time_ms_median"] or 0.0,
                      totals["step_time_ms_p90"] or 0.0, peak_memory_mb], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank takes part, even one without measured steps
    slowest_s, median, p90, mem = t.tolist()
    out["peak_memory_mb"] = mem
    if totals["measured_steps"] == 0 or slowest_s <= 0:
        return out
    out.update(step_time_ms_median=median, step_time_ms_p90=p90, measured_time_s=slowest_s,
               samples_per_sec=totals["samples_per_sec"] * totals["measured_time_s"] / slowest_s)
    return out


def parameter_report(model: torch.nn.Module, env: Env) -> dict:
    """What the trained parameters look like on every rank, to prove the ranks agree.

    - ``sha256_by_rank``: on each rank, a SHA-256 over the bytes of every parameter's *full* value in
      ``named_parameters`` order (an FSDP DTensor is all-gathered one parameter at a time), gathered to
      all ranks. DDP keeps replicas bit-identical, so all entries must be equal; buffers are left out on
      purpose (each rank's last forward updates its own BatchNorm statistics).
    - ``identical_across_ranks``: all entries equal (null for one process).
    - ``l2_norm``: float64 L2 norm over all parameters, comparable between runs of different layouts.
    - ``count``/``numel``: parameters and their elements; ``dtensor_count`` and ``local_numel``: how many
      are DTensors and how many elements this rank (rank 0) stores -- about ``numel / world_size`` under FSDP.

    Collective (all ranks call it); costs one pass over the parameters (and one all-gather each under FSDP).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the root stays unsharded after forward (FSDP2's heuristic); shard it back
    sha = hashlib.sha256()
    sq = 0.0
    count = numel = local = dtensors = 0
    with torch.no_grad():
        for _, p in unwrap(model).named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if isinstance(p, DTensor):
                dtensors += 1
                local += p.to_local().numel()
            else:
                local += p.numel()
            host = full.detach().to("cpu", torch.float32).contiguous()
            sha.update(host.numpy().tobytes())
            sq += float(host.double().pow(2).sum())
            count += 1
            numel += full.numel()
    digests = [sha.hexdigest()]
    if env.distributed:
        digests = [None] * env.world_size
        dist.all_gather_object(digests, sha.hexdigest())
    return {
        "sha256_by_rank": digests,
        "identical_across_ranks": len(set(digests)) == 1 if env.distributed else None,
        "l2_norm": sq ** 0.5,
        "count": count,
        "numel": numel,
        "dtensor_count": dtensors,
        "local_numel": local,
    }
