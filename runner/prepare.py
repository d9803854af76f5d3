"""Model transforms, one ``apply_<technique>`` each, called in a fixed order by ``prepare``.

Order (torchtitan's ``parallelize``): memory format -> bias removal -> activation checkpointing ->
compile -> data-parallel wrapper.

1. channels_last first: it rewrites the parameters' strides, and every later step should see NHWC weights.
2. bias removal needs the plain module tree (torch.fx traces it) before anything wraps a submodule.
3. activation checkpointing wraps blocks; compile must see those wrappers to trace the recomputation.
4. compile before DDP/FSDP so the wrapper's hooks see the compiled module (as torchtitan does), and
   ``nn.Module.compile`` keeps the module and its ``state_dict`` keys unchanged.
5. the data-parallel wrapper last: it registers gradient hooks on the final parameters.

Each function returns a status for ``summary.json`` ``techniques``: ``"applied"`` or ``"skipped: <why>"``.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from omegaconf import DictConfig
from torch import nn

from runner.errors import ConfigError

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def apply_channels_last(model: nn.Module) -> str:
    """Technique 19: store 4-D weights NHWC (``torch.channels_last``); inputs are converted by the loader.

    Tensor cores read NHWC natively, so convolutions skip layout transposes (PyTorch tutorial "Channels
    Last Memory Format", https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html).
    """
    model.to(memory_format=torch.channels_last)
    return "applied"


def apply_drop_bias_before_bn(model: nn.Module) -> tuple[str, int]:
    """Technique 15: remove the bias of every Conv/Linear whose only consumer is a BatchNorm.

    BatchNorm subtracts the per-channel mean, which cancels any constant bias, so the bias is dead weight
    (Ioffe & Szegedy 2015, section 3.2). The graph comes from ``torch.fx.symbolic_trace``; a model that
    cannot be traced is left alone and the switch is recorded as skipped.

    Returns:
        ``(status, number of biases removed)``.
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as e:  # noqa: BLE001 - any tracing failure means "cannot tell"
        return f"skipped: torch.fx cannot trace {type(model).__name__} ({type(e).__name__})", 0
    removed = 0
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(model.get_submodule(node.target), _NORMS):
            continue
        producer = node.args[0]
        if not isinstance(producer, torch.fx.Node) or producer.op != "call_module" or len(producer.users) != 1:
            continue
        layer = model.get_submodule(producer.target)
        if isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) and layer.bias is not None:
            layer.register_parameter("bias", None)
            removed += 1
    if not removed:
        return "skipped: no conv/linear with a bias feeds a BatchNorm in this model", 0
    return "applied", removed


def repeated_blocks(model: nn.Module) -> list[str]:
    """Class names of the model's repeated blocks: non-container modules with children that occur at least
    twice and are not nested inside another such block (ResNet: ``BasicBlock``/``Bottleneck``)."""
    counts = Counter(type(m).__name__ for m in model.modules()
                     if m is not model and type(m) not in _CONTAINERS and next(m.children(), None) is not None)
    candidates = {name for name, n in counts.items() if n >= 2}
    nested = set()
    for outer in model.modules():
        if type(outer).__name__ in candidates:
            nested |= {type(m).__name__ for m in outer.modules() if m is not outer}
    return sorted(candidates - nested)


def apply_activation_checkpointing(model: nn.Module, block_names: list[str] | None) -> str:
    """Technique 8: recompute the activations of each block in backward instead of storing them.

    Wraps every module whose class name is in ``block_names`` (default: ``repeated_blocks``) with
    ``checkpoint_wrapper`` using the non-reentrant implementation (``use_reentrant=False``, which PyTorch
    recommends: https://pytorch.org/docs/stable/checkpoint.html). Trades ~1 extra forward for memory
    (Chen et al. 2016, https://arxiv.org/abs/1604.06174).

    Raises:
        ConfigError: ``memory.checkpoint_modules`` names a class the model does not contain.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as wrap_blocks,
        checkpoint_wrapper,
    )

    names = list(block_names) if block_names else repeated_blocks(model)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(f"memory.checkpoint_modules={missing} are not module classes of this model; "
                          f"its repeated blocks are {repeated_blocks(model)}")
    if not names:
        return "skipped: the model has no repeated blocks to checkpoint; set memory.checkpoint_modules"
    wrap_blocks(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: type(m).__name__ in names)
    return "applied"


def apply_compile(model: nn.Module, cfg: DictConfig, device: torch.device) -> dict[str, str]:
    """Technique 18: ``torch.compile`` (TorchInductor fuses pointwise ops into generated kernels).

    ``reduce-overhead`` also captures CUDA graphs, which removes per-kernel launch cost; on a CPU it falls
    back to the default mode and records CUDA graphs as skipped. Docs:
    https://pytorch.org/docs/stable/generated/torch.compile.html
    """
    modes = ("default", "reduce-overhead", "max-autotune")
    if cfg.mode not in modes:
        raise ConfigError(f"compile.mode={cfg.mode!r} is not one of {modes} (or compile=off)")
    status = {"compile": "applied"}
    mode = cfg.mode
    if mode == "reduce-overhead" and device.type != "cuda":
        status["cuda_graphs"] = "skipped: CUDA graphs need a CUDA device; compiled with mode=default"
        mode = "default"
    model.compile(mode=mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
    return status


def prepare(model: nn.Module, cfg: DictConfig, env) -> tuple[nn.Module, dict[str, str], dict[str, object]]:
    """Apply the model-level techniques that ``cfg`` switches on, in the order the module docstring gives.

    Returns the (possibly wrapped) model, the techniques' statuses and their details (counts, names).
    """
    from runner import distributed

    techniques: dict[str, str] = {}
    details: dict[str, object] = {}
    if cfg.channels_last:
        techniques["channels_last"] = apply_channels_last(model)
    if cfg.model.drop_bias_before_bn:
        techniques["drop_bias_before_bn"], details["biases_removed"] = apply_drop_bias_before_bn(model)
    if cfg.memory.checkpointing:
        blocks = list(cfg.memory.checkpoint_modules or repeated_blocks(model))
        techniques["activation_checkpointing"] = apply_activation_checkpointing(model, blocks)
        details["checkpointed_blocks"] = blocks
    if cfg.compile.mode is not None:
        techniques |= apply_compile(model, cfg.compile, env.device)
    model, status = distributed.wrap(model, cfg.distributed, env, cfg.precision)
    techniques |= status
    return model, techniques, details
