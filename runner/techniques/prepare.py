"""Model transforms, one ``apply_<technique>`` each, called by ``prepare`` in torchtitan's order (its model
converters, then its ``parallelize``): memory format -> bias removal -> compression (compress.py) -> fp8 or int8
layers -> activation checkpointing -> compile -> data-parallel wrapper; why, docs/design.md rule 7. Each returns a
``summary.json`` ``techniques`` status, ``"applied"`` or ``"skipped: <why>"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from collections import Counter

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import models
from runner.config import check_choice
from runner.errors import ConfigError, deterministic_refusal
from runner.techniques import TECHNIQUES, Job, compile_cache, compress, parallel, precision
from runner.techniques.parallel import repeated_blocks

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def apply_deterministic(enabled: bool, device: torch.device) -> dict[str, str]:
    """``trainer.deterministic=true``: the same seed gives bit-identical weights (docs/training.md;
    https://pytorch.org/docs/stable/notes/randomness.html). Sets every flag either way (no leak between jobs).

    Returns:
        ``{"deterministic": "applied"}`` when on, else ``{}``.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.are_deterministic_algorithms_enabled() != enabled:
        torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    return {"deterministic": "applied"} if enabled else {}


@contextlib.contextmanager
def deterministic_or_refused(enabled: bool):
    """Around the training loop: with ``trainer.deterministic=true``, PyTorch's refusal of a nondeterministic
    operation becomes one message naming the operation and the key.

    Raises:
        ConfigError: the refused operation, and the fix (``runner.errors.deterministic_refusal``).
    """
    try:
        yield
    except RuntimeError as e:
        refusal = deterministic_refusal(e) if enabled else None
        if refusal is None:
            raise
        raise refusal from e


#: torch's intra-op thread count when this module was imported: what ``trainer.num_threads=null`` restores
DEFAULT_NUM_THREADS = torch.get_num_threads()


def apply_num_threads(num_threads: int | None) -> dict[str, str]:
    """``trainer.num_threads``: the CPU's intra-op threads (``torch.set_num_threads``;
    https://pytorch.org/docs/stable/notes/cpu_threading_torchscript_inference.html); null restores the default.

    Returns:
        ``{"num_threads": "applied"}`` when set, else ``{}``.

    Raises:
        ConfigError: a count below 1.
    """
    if num_threads is None:
        torch.set_num_threads(DEFAULT_NUM_THREADS)
        return {}
    if num_threads < 1:
        raise ConfigError(
            f"trainer.num_threads={num_threads} must be >= 1 (or null for torch's default, {DEFAULT_NUM_THREADS} here)"
        )
    torch.set_num_threads(num_threads)
    return {"num_threads": "applied"}


#: glibc's ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the largest mmap threshold glibc accepts on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_host_allocator_reused = False  # mallopt's settings are process-wide and cannot be undone


def apply_host_allocator(name: str) -> str:
    """``trainer.host_allocator=reuse`` (the default): glibc's malloc serves buffers up to 32 MiB from the heap and
    keeps freed heap memory (``mallopt``); ``system``: glibc's defaults. Why: docs/training.md, "The host allocator";
    https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#switch-memory-allocator.

    Returns:
        ``technique_details.host_allocator``: ``"reuse"``, ``"system"``, or ``"system (reuse skipped: <why>)"``.

    Raises:
        ConfigError: ``system`` in a process where ``reuse`` was applied already (mallopt cannot be undone):
            run it in a fresh process.
    """
    global _host_allocator_reused
    check_choice("trainer.host_allocator", name)
    if name == "system":
        if _host_allocator_reused:
            raise ConfigError(
                "trainer.host_allocator=system: an earlier job in this process set "
                "trainer.host_allocator=reuse, which glibc cannot undo; run it in a fresh process "
                "(python -m runner trainer.host_allocator=system, or hydra/launcher=interleaved)"
            )
        return "system"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        libc = " ".join(filter(None, (platform.system(), platform.libc_ver()[0])))
        return f"system (reuse skipped: mallopt is glibc's; this is {libc})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return "system (reuse skipped: glibc's mallopt returned an error)"
    _host_allocator_reused = True
    return "reuse"


def apply_cudnn_benchmark(enabled: bool, device: torch.device) -> dict[str, str]:
    """Technique 6: cuDNN times its convolution algorithms per input shape and keeps the fastest
    (``torch.backends.cudnn.benchmark``; https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).

    Returns:
        ``{}`` when off; ``{"cudnn_benchmark": "applied" | "skipped: <why>"}`` when on (skipped off CUDA).
    """
    why = TECHNIQUES["cudnn_benchmark"].why_not(Job(None, cuda=device.type == "cuda"))
    torch.backends.cudnn.benchmark = bool(enabled and why is None)
    if not enabled:
        return {}
    return {"cudnn_benchmark": "applied" if why is None else f"skipped: {why}"}


def apply_channels_last(model: nn.Module) -> str:
    """Technique 19: store 4-D weights NHWC (``torch.channels_last``; inputs are converted by the loader): a weight
    ``(C_out, C_in, kH, kW)`` keeps its shape, only its strides change; skipped without a 4-D parameter. PyTorch
    tutorial "Channels Last Memory Format", https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html.
    """
    if not any(p.dim() == 4 for p in model.parameters()):
        return "skipped: the model has no 4-D (convolution) weights to store channels_last"
    model.to(memory_format=torch.channels_last)
    return "applied"


def apply_drop_bias_before_bn(model: nn.Module) -> tuple[str, int]:
    """Technique 15: remove the bias of every Conv/Linear whose every call feeds a BatchNorm directly (found by
    ``torch.fx.symbolic_trace``), which cancels it (Ioffe & Szegedy 2015, https://arxiv.org/abs/1502.03167, §3.2);
    an untraceable model is skipped (docs/configuration.md, "How the model techniques act").

    Returns:
        ``(status, number of biases removed)``.
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as e:  # noqa: BLE001 - any tracing failure means "cannot tell"
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return (
            f"skipped: torch.fx cannot trace {type(model).__name__} ({type(e).__name__}: {reason}); "
            f"its biases were left in place",
            0,
        )
    calls: Counter[str] = Counter()  # layer name -> how many times the graph calls it
    feeds_norm: Counter[str] = Counter()  # layer name -> calls whose only consumer is a norm layer
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        calls[node.target] += 1
        users = list(node.users)
        if (
            len(users) == 1
            and users[0].op == "call_module"
            and users[0].args
            and users[0].args[0] is node
            and isinstance(model.get_submodule(users[0].target), _NORMS)
        ):
            feeds_norm[node.target] += 1
    removed = 0
    for name, n in feeds_norm.items():
        layer = model.get_submodule(name)
        if (
            n == calls[name]
            and isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))
            and layer.bias is not None
        ):
            layer.register_parameter("bias", None)
            removed += 1
    if not removed:
        return "skipped: no conv/linear with a bias feeds a BatchNorm in this model", 0
    return "applied", removed


#: What selective activation checkpointing keeps (torchtitan's ``_save_list``): matmuls and attention
SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
)


def _save_matmuls():
    """``torch.utils.checkpoint``'s contexts for selective checkpointing: ``SAVED_OPS`` saved, the rest recomputed
    (``create_selective_checkpoint_contexts``, https://pytorch.org/docs/stable/checkpoint.html)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name).default for name in SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(
    model: nn.Module, block_names: list[str] | None, policy: str = "full"
) -> tuple[str, list[str], int]:
    """Technique 8: recompute each block's activations in backward (Chen et al. 2016, https://arxiv.org/abs/1604.06174):
    modules of the classes ``block_names`` (default ``repeated_blocks``) go into a non-reentrant ``CheckpointWrapper``
    (https://pytorch.org/docs/stable/checkpoint.html); ``policy="selective"`` keeps ``SAVED_OPS``.

    Returns:
        ``(status, the class names used, number of modules wrapped)``.

    Raises:
        ConfigError: ``memory.checkpoint_modules`` names a class the model does not contain.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing as wrap_blocks,
        checkpoint_wrapper,
    )

    names = list(block_names) if block_names else repeated_blocks(model)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"memory.checkpoint_modules={missing} are not module classes of this model; "
            f"use class names such as its repeated blocks {repeated_blocks(model)}, or null for those"
        )
    if not names:
        return "skipped: the model has no repeated blocks to checkpoint; set memory.checkpoint_modules", names, 0
    if policy not in ("full", "selective"):
        raise ConfigError(f"memory.checkpoint_policy={policy} must be full or selective")
    extra = {"context_fn": _save_matmuls} if policy == "selective" else {}
    wrap_blocks(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra
        ),
        check_fn=lambda m: type(m).__name__ in names,
    )
    return "applied", names, sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def apply_memory_budget(budget: float | None, compile_mode: str | None) -> str | None:
    """``memory.budget``: the fraction of activation memory a compiled model keeps for backward
    (``activation_memory_budget``; https://pytorch.org/blog/activation-checkpointing-techniques/).

    Raises:
        ConfigError: a budget outside [0, 1], or no compile (the budget acts in torch.compile's partitioner).
    """
    import torch._functorch.config as functorch_config

    if budget is None:  # torch's default for this compile (an earlier job in this process may have set one)
        functorch_config.activation_memory_budget = 1.0
        return None
    if not 0 <= budget <= 1:
        raise ConfigError(f"memory.budget={budget} must be in [0, 1] (0: recompute what it can, 1: keep the default)")
    if compile_mode is None:
        raise ConfigError(
            f"memory.budget={budget} acts in torch.compile's partitioner; add compile=default (or use "
            f"memory=selective, which needs no compile)"
        )
    functorch_config.activation_memory_budget = budget
    return "applied"


def apply_compile(model: nn.Module, cfg: DictConfig, device: torch.device) -> tuple[dict[str, str], dict[str, object]]:
    """Technique 18: ``torch.compile`` in place (``nn.Module.compile``;
    https://pytorch.org/docs/stable/generated/torch.compile.html), the whole model or, with ``compile.regional=true``,
    each repeated block (https://pytorch.org/tutorials/recipes/regional_compilation.html); modes: docs/configuration.md.

    Returns:
        ``(techniques, details)``: ``{"compile": "applied"}`` plus ``"cuda_graphs"`` for ``reduce-overhead`` and
        ``"compile_regional"`` with ``compile.regional``; details ``{"compiled_blocks": n, "compiled_block_class":
        [names]}`` when regional.

    Raises:
        ConfigError: ``compile.mode`` is not default, reduce-overhead or max-autotune.
    """
    if cfg.mode is None:  # null is compile=off, which prepare never passes here
        raise ConfigError("compile.mode=None: nothing to compile with (compile=off); give a mode to apply_compile")
    check_choice("compile.mode", cfg.mode)
    compile_cache.isolate()  # this process's own Inductor cache folder, never the global one
    status = {"compile": "applied"}
    mode = cfg.mode
    if mode == "reduce-overhead":
        if device.type == "cuda":
            status["cuda_graphs"] = "applied"
        else:
            status["cuda_graphs"] = "skipped: CUDA graphs need a CUDA device; compiled with mode=default"
            mode = "default"
    options = dict(mode=mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
    if not cfg.get("regional", False):
        model.compile(**options)
        return status, {}
    names, blocks = regional_blocks(model)
    if not blocks:
        status["compile_regional"] = "skipped: the model has no repeated blocks to compile one by one; compiled whole"
        model.compile(**options)
        return status, {}
    for block in blocks:
        block.compile(**options)
    status["compile_regional"] = "applied"
    return status, {"compiled_blocks": len(blocks), "compiled_block_class": names}


def regional_blocks(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """What ``compile.regional`` compiles: the repeated blocks' class names and their modules, outermost first (a
    checkpointed block as its ``CheckpointWrapper``, as torchtitan compiles after AC)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    names = repeated_blocks(model)
    blocks: list[nn.Module] = []
    inner: set[int] = set()
    for m in model.modules():
        if isinstance(m, CheckpointWrapper) and type(m._checkpoint_wrapped_module).__name__ in names:
            blocks.append(m)
            inner.add(id(m._checkpoint_wrapped_module))
        elif type(m).__name__ in names and id(m) not in inner:
            blocks.append(m)
    return names, blocks


def prepare(
    model: nn.Module, cfg: DictConfig, env, amp, skip=()
) -> tuple[nn.Module, dict[str, str], dict[str, object]]:
    """Apply the model-level techniques ``cfg`` switches on, in the module docstring's order, after printing
    ``models.model_report``'s line. ``amp``: the built ``precision.Precision`` (fp8 turns compile on); ``skip``:
    status keys the task rules out. Returns the (possibly wrapped) model, the statuses and their details.

    Raises:
        ConfigError: ``memory.checkpoint_modules`` set while ``memory.checkpointing`` is off, or naming a
            class the model lacks; a bad ``compile.mode``; ``compress.apply``'s refusals.
    """
    techniques: dict[str, str] = {}
    if cfg.memory.checkpoint_modules and not cfg.memory.checkpointing:
        raise ConfigError(
            f"memory.checkpoint_modules={list(cfg.memory.checkpoint_modules)} has no effect while "
            f"memory.checkpointing=false; add memory=checkpointing (or memory.checkpointing=true)"
        )
    details: dict[str, object] = {}
    if env.is_main and cfg.trainer.progress != "off":  # the plain model, before any wrapper
        print(models.model_report(model, cfg.model)[0], flush=True)
    if cfg.channels_last and "channels_last" not in skip:
        techniques["channels_last"] = apply_channels_last(model)
    if cfg.model.drop_bias_before_bn and "drop_bias_before_bn" not in skip:
        techniques["drop_bias_before_bn"], details["biases_removed"] = apply_drop_bias_before_bn(model)
    status, compressed = compress.apply(model, cfg, env.device)  # compress=qat|sparse24
    techniques |= status
    details |= compressed
    compile_cfg = cfg.compile
    if amp.int8:  # precision=int8 (torchao's int8 mixed-precision training)
        techniques["int8"], details["int8"] = precision.convert_int8(model, amp)
    if amp.fp8_recipe is not None:  # precision=fp8 where it can run (a CUDA GPU >= 8.9 with torchao)
        techniques["fp8"], details["fp8"] = precision.convert_fp8(model, amp)
        if techniques["fp8"] == "applied" and compile_cfg.mode is None:
            # torchao's fp8 casts and scales are fast only fused by torch.compile; torchtitan runs fp8 compiled
            compile_cfg = OmegaConf.merge(compile_cfg, {"mode": "default"})
            details["fp8"]["compile"] = (
                "turned on by precision=fp8 (compile=off was given): torchao's fp8 casts are "
                "fused only by torch.compile; mode=default"
            )
            if env.is_main:
                print(
                    "note: precision=fp8 turned torch.compile on (mode=default): torchao's float8 training needs it "
                    "to fuse its casts",
                    flush=True,
                )
    if cfg.memory.checkpointing:
        blocks = list(cfg.memory.checkpoint_modules) if cfg.memory.checkpoint_modules else None
        status, names, wrapped = apply_activation_checkpointing(model, blocks, cfg.memory.checkpoint_policy)
        techniques[
            "activation_checkpointing" if cfg.memory.checkpoint_policy == "full" else "selective_checkpointing"
        ] = status
        details["checkpointed_blocks"] = names
        details["checkpointed_modules"] = wrapped
    if cfg.memory.budget is not None or compile_cfg.mode is not None:  # a process-wide setting: reset when unset
        if (status := apply_memory_budget(cfg.memory.budget, compile_cfg.mode)) is not None:
            techniques["activation_memory_budget"] = status
    if compile_cfg.mode is not None:
        status, compiled = apply_compile(model, compile_cfg, env.device)
        techniques |= status
        details |= compiled
    model, status = parallel.wrap(model, cfg.distributed, env, amp, details)
    techniques |= status
    return model, techniques, details
