"""Parallel wrappers: ``wrap`` applies the technique of ``distributed.name``; the loop's helpers
(``no_sync``, ``unwrap``, ``sync_ddp_buffers``) and the parameters' cross-rank report go with them.

- ``ddp``: ``DistributedDataParallel`` -- one process per device, gradients all-reduced in buckets
  during backward (https://pytorch.org/docs/stable/notes/ddp.html).
- ``fsdp``: FSDP2 ``fully_shard`` -- parameters, gradients and optimizer state sharded over the ranks
  as DTensors, all-gathered per block for forward/backward
  (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
- ``tp``: tensor parallelism, the model split over ranks (runner/techniques/model_parallel.py), FSDP2 over the
  rest of the ranks; ``pp``: pipeline parallelism, one stage of the model per rank (the same module).
- ``dp``: ``nn.DataParallel`` -- one process driving all local GPUs; kept only for the ablation, DDP is
  faster (https://pytorch.org/docs/stable/notes/cuda.html#use-nn-parallel-distributeddataparallel-instead-of-multiprocessing-or-nn-dataparallel).

What runner does for a job of several processes: docs/scaling.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from runner.config import check_choice
from runner.distributed import Env, broadcast_module_state
from runner.techniques.precision import Precision

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def repeated_blocks(model: nn.Module) -> list[str]:
    """Class names of the model's repeated blocks: modules with children occurring at least twice, not nested in
    another (ResNet ``BasicBlock``, GPT ``Block``), or a Hugging Face model's ``_no_split_modules``
    (https://huggingface.co/docs/accelerate/usage_guides/big_modeling)."""
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        present = {type(m).__name__ for m in model.modules()}
        found = sorted(present & set(declared))
        if found:
            return found
    counts = Counter(
        type(m).__name__
        for m in model.modules()
        if m is not model and type(m) not in _CONTAINERS and next(m.children(), None) is not None
    )
    candidates = {name for name, n in counts.items() if n >= 2}
    nested = set()
    for outer in model.modules():
        if type(outer).__name__ in candidates:
            nested |= {type(m).__name__ for m in outer.modules() if m is not outer}
    return sorted(candidates - nested)


def _has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def fsdp_mixed_precision(compute_dtype: torch.dtype):
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision.Precision.compute_dtype``, or None (fp32, tf32 or a skipped
    amp/bf16: fp32 all-gathers; under amp on CUDA DTensor reduces the GradScaler's found-inf check over the shards).
    Gradients are reduce-scattered in fp32 (docs/scaling.md, "How the wrappers act")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def apply_ddp(model: torch.nn.Module, cfg: DictConfig, env: Env) -> tuple[torch.nn.Module, dict[str, str]]:
    """``DistributedDataParallel``, after ``nn.SyncBatchNorm.convert_sync_batchnorm`` with ``sync_batchnorm`` (CUDA
    only: skipped on a CPU with the reason; https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html).
    """
    techniques: dict[str, str] = {}
    if cfg.sync_batchnorm:
        if env.device.type != "cuda":
            techniques["sync_batchnorm"] = (
                "skipped: SyncBatchNorm only runs on CUDA; on CPU each rank normalizes with its own batch statistics"
            )
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


def apply_fsdp(model: torch.nn.Module, env: Env, amp: Precision, mesh=None) -> tuple[torch.nn.Module, dict[str, str]]:
    """FSDP2: ``fully_shard`` each repeated block (``repeated_blocks``), then the root, after broadcasting rank 0's
    values (unless ``mesh``, the data-parallel dimension of a 2-D mesh, is given: tp broadcast them already); under
    ``fsdp_mixed_precision``'s policy each BatchNorm layer is sharded on its own in fp32. Why: docs/scaling.md,
    "How the wrappers act".
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    techniques: dict[str, str] = {}
    if mesh is None and not broadcast_module_state(model):
        warnings.warn("distributed=fsdp: ranks built different initial weights; rank 0's were broadcast", stacklevel=2)
    mesh = mesh if mesh is not None else init_device_mesh(env.device.type, (env.world_size,))
    policy = fsdp_mixed_precision(amp.compute_dtype)
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
    wanted = {"amp", "bf16"} & set(amp.techniques)
    if wanted:
        techniques["fsdp_mixed_precision"] = (
            "applied"
            if policy is not None
            else f"skipped: precision={wanted.pop()} is off on this device, so parameters are all-gathered in fp32"
        )
    return model, techniques


def apply_tp(model: torch.nn.Module, env: Env, amp: Precision) -> tuple[torch.nn.Module, dict[str, str], dict]:
    """Tensor parallelism over ``env.model_parallel`` consecutive ranks (``model_parallel.apply_tp``), after
    broadcasting rank 0's values; with more ranks than that, FSDP2 over the data-parallel dimension of a
    ``(dp, tp)`` mesh. Returns the model, the statuses and the plan's details."""
    from torch.distributed.device_mesh import init_device_mesh

    from runner.techniques import model_parallel

    if not broadcast_module_state(model):
        warnings.warn("distributed=tp: ranks built different initial weights; rank 0's were broadcast", stacklevel=2)
    mesh = init_device_mesh(env.device.type, (env.dp_size, env.model_parallel), mesh_dim_names=("dp", "tp"))
    details = model_parallel.apply_tp(model, mesh["tp"], env.model_parallel)
    techniques = {"tp": "applied"}
    if env.dp_size > 1:
        model, sharded = apply_fsdp(model, env, amp, mesh["dp"])
        techniques |= sharded
    return model, techniques, details


def apply_pp(model: torch.nn.Module, cfg: DictConfig, env: Env, details: dict) -> tuple[torch.nn.Module, dict]:
    """Pipeline parallelism: this rank keeps its stage of the model (``model_parallel.split_stage``; the schedule
    that runs the stages is built with the task: runner/engine/build.py), one stage per rank, consecutive ranks one
    pipeline; with more ranks than stages, the copies of each stage are data parallel (DDP over a ``(dp, pp)``
    mesh's ``dp`` dimension; the schedule skips its all-reduce on all micro-batches but the last)."""
    from torch.distributed.device_mesh import init_device_mesh

    from runner.techniques import model_parallel

    stage = env.rank % env.model_parallel
    model = model_parallel.split_stage(model, stage, env.model_parallel)
    model.pipeline_stages = env.model_parallel  # read by runner.checkpoint.full_model_state_dict and parameter_report
    details["pipeline_parallel"] = {
        "stages": env.model_parallel,
        "schedule": cfg.pp_schedule,
        "stage_parameters": sum(p.numel() for p in model.parameters()),
    }
    if env.dp_size == 1:
        return model, {"pp": "applied"}
    mesh = init_device_mesh(env.device.type, (env.dp_size, env.model_parallel), mesh_dim_names=("dp", "pp"))
    wrapped = torch.nn.parallel.DistributedDataParallel(
        model,
        process_group=mesh["dp"].get_group(),
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        init_sync=True,
    )
    wrapped.pipeline_stages = env.model_parallel
    return wrapped, {"pp": "applied", "ddp": "applied"}


def apply_dp(model: torch.nn.Module, env: Env) -> tuple[torch.nn.Module, dict[str, str]]:
    """``nn.DataParallel`` over every visible GPU, output gathered on this process's GPU; kept for the ablation only.
    Without CUDA it is skipped and the plain model runs."""
    warnings.warn(
        "distributed=dp: nn.DataParallel is slower than DistributedDataParallel (one process, threads "
        "under the GIL, model replicated every step); use distributed=ddp with scripts/torchrun.sh. "
        "It is kept for the ablation.",
        stacklevel=2,
    )
    if env.device.type != "cuda":
        return model, {
            "dp": "skipped: nn.DataParallel splits batches across CUDA devices and there are none; ran the plain model"
        }
    devices = list(range(torch.cuda.device_count()))
    return torch.nn.DataParallel(model, device_ids=devices, output_device=env.device.index), {"dp": "applied"}


def wrap(model: torch.nn.Module, cfg: DictConfig, env: Env, amp: Precision, details: dict):
    """Wrap the model for data parallelism, or split it (``distributed.name``); ``none`` returns it unchanged.

    Returns ``(model, techniques)`` with ``"applied"`` / ``"skipped: <why>"`` per technique; tp adds its plan to
    ``details`` (``tensor_parallel``).

    Raises:
        ConfigError: an unknown ``distributed.name``.
    """
    name = cfg.name
    check_choice("distributed.name", name)
    if name == "none":
        return model, (
            {"sync_batchnorm": "skipped: one process, its batch statistics are already global"}
            if cfg.sync_batchnorm
            else {}
        )
    if name == "ddp":
        return apply_ddp(model, cfg, env)
    if name == "fsdp":
        return apply_fsdp(model, env, amp)
    if name == "tp":
        model, techniques, details["tensor_parallel"] = apply_tp(model, env, amp)
        return model, techniques
    if name == "pp":
        return apply_pp(model, cfg, env, details)
    return apply_dp(model, env)  # dp, the last of CHOICES["distributed.name"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP/DataParallel wrapper (FSDP2 shards in place: itself)."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def no_sync(model: torch.nn.Module, last: bool):
    """Skip the gradient reduction on every micro-batch of an accumulated step but the last.

    DDP: ``no_sync()`` (read in forward); FSDP2: ``set_requires_gradient_sync(last)``, read in backward, left set.
    Docs: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync
    """
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def sync_ddp_buffers(model: torch.nn.Module, env: Env) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics), as DDP does before each forward, so that a checkpoint's
    one copy of a replicated tensor is every rank's. A no-op for one process and models that are not DDP."""
    if env.distributed and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with torch.no_grad():
            for buffer in model.module.buffers():
                dist.broadcast(buffer, src=0)


def parameter_report(model: torch.nn.Module, env: Env) -> dict:
    """What the trained parameters look like on every rank, to prove the ranks agree.

    ``sha256_by_rank`` (each rank's SHA-256 of the full parameters, buffers left out), ``identical_across_ranks``
    (null for one process), ``l2_norm`` (float64), ``count``/``numel``, ``dtensor_count``, ``local_numel``.
    Collective: all ranks call it.
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
        # null for one process, and for a pipeline, whose ranks hold different stages
        "identical_across_ranks": (
            len(set(digests)) == 1 if env.distributed and getattr(unwrap(model), "pipeline_stages", 1) == 1 else None
        ),
        "l2_norm": sq**0.5,
        "count": count,
        "numel": numel,
        "dtensor_count": dtensors,
        "local_numel": local,
    }
