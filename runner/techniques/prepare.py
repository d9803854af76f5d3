"""Model transforms, one ``apply_<technique>`` each, called in a fixed order by ``prepare``.

Order (torchtitan's model converters, then its ``parallelize``): memory format -> bias removal -> fp8 layers ->
activation checkpointing -> compile -> data-parallel wrapper.

1. channels_last first: it rewrites the parameters' strides, and every later step should see NHWC weights.
2. bias removal needs the plain module tree (torch.fx traces it) before anything wraps a submodule.
3. precision=fp8 swaps Linear layers for torchao's Float8Linear (``precision.convert_fp8``) on the plain
   tree, as torchtitan's float8 converter runs before it parallelizes; it turns compile on.
4. activation checkpointing wraps blocks; compile must see those wrappers to trace the recomputation.
5. compile before DDP/FSDP so the wrapper's hooks see the compiled module (as torchtitan does), and
   ``nn.Module.compile`` keeps the module and its ``state_dict`` keys unchanged -- the whole model, or each
   repeated block (``compile.regional``).
6. the data-parallel wrapper last: it registers gradient hooks on the final parameters.

``apply_cudnn_benchmark`` is a process-wide backend flag rather than a model transform; the engine calls
it before building anything, so cuDNN autotunes from the first step (which the warm-up excludes).

Each function returns a status for ``summary.json`` ``techniques``: ``"applied"`` or ``"skipped: <why>"``.
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
from runner.techniques import parallel, precision
from runner.techniques.parallel import repeated_blocks

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def apply_deterministic(enabled: bool, device: torch.device) -> dict[str, str]:
    """``trainer.deterministic=true``: the same seed gives bit-identical weights, run after run.

    ``torch.use_deterministic_algorithms(True)`` (an operation without a deterministic implementation raises
    instead of running), cuDNN's deterministic algorithms without autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    (set before CUDA's first cuBLAS call when the environment has none). DataLoader workers are seeded from the
    run's seeded generator either way (runner/data/loading.py). PyTorch "Reproducibility",
    https://pytorch.org/docs/stable/notes/randomness.html. Sets every flag either way, so an earlier job in the
    same process cannot leak it; torch's switch only when it changes (turning it off when it is off imports ~280
    modules, ~0.8 s of every run).

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
    """Around the training loop: with ``trainer.deterministic=true``, PyTorch's refusal of an operation that has
    no deterministic kernel on this device becomes one message naming the operation and the key (PyTorch
    "Reproducibility", https://pytorch.org/docs/stable/notes/randomness.html). Costs nothing per step: it wraps the
    whole loop once.

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
    """``trainer.num_threads``: the CPU's intra-op threads (``torch.set_num_threads``; PyTorch "CPU threading
    and TorchScript inference", https://pytorch.org/docs/stable/notes/cpu_threading_torchscript_inference.html).

    torch's default is one thread per physical core; fewer can be faster when other work (DataLoader workers,
    another process) shares the cores, and ``python -m runner.tune speed`` measures it. null restores the
    default this process started with, so an earlier job in the same process cannot leak its setting.

    Returns:
        ``{"num_threads": "applied"}`` when set, else ``{}``.

    Raises:
        ConfigError: a count below 1.
    """
    if num_threads is None:
        torch.set_num_threads(DEFAULT_NUM_THREADS)
        return {}
    if num_threads < 1:
        raise ConfigError(f"trainer.num_threads={num_threads} must be >= 1 (or null for torch's default, "
                          f"{DEFAULT_NUM_THREADS} here)")
    torch.set_num_threads(num_threads)
    return {"num_threads": "applied"}


#: glibc's ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the largest mmap threshold glibc accepts on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_host_allocator_reused = False  # mallopt's settings are process-wide and cannot be undone


def apply_host_allocator(name: str) -> str:
    """``trainer.host_allocator=reuse`` (the default): glibc's malloc keeps freed memory for the next step.

    By default glibc maps every buffer above a threshold afresh (``mmap``), raises the threshold as such buffers
    are freed, and returns freed heap memory to the OS above a second threshold; a training step frees and
    allocates the same activations and workspaces every step, so depending on the process's allocation history
    they come back as fresh pages, each page-faulted and zeroed by the kernel (thousands of minor page faults
    per step). On this project's CPU, identical resnet18/CIFAR processes then differ by 5 % and MNIST CNN
    processes by up to 25 %, whole processes at a time (docs/ablation.md, "Where the process levels come
    from"). ``reuse`` serves buffers up to 32 MiB from the heap (``M_MMAP_THRESHOLD``) and keeps freed heap
    memory (``M_TRIM_THRESHOLD``): no page faults in the steady state, processes within 2 %, and faster
    (MNIST CNN, interleaved: ``system`` ran at x0.90 [0.88-0.93] of ``reuse``, docs/training.md). The same idea as
    PyTorch's tuning guide's advice to preload jemalloc or TCMalloc ("Performance Tuning Guide",
    https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#switch-memory-allocator), without a library to
    install; the cost is that the process keeps its peak heap resident. ``system``: glibc's defaults. Tensors on a
    GPU are unaffected (PyTorch's CUDA caching allocator already reuses).

    Returns:
        ``summary.json`` ``technique_details.host_allocator``: ``"reuse"``, ``"system"``, or ``"system (reuse
        skipped: <why>)"`` off glibc (macOS, musl). A setting of the machine rather than a technique the ablation
        compares: every configuration of a sweep runs with the same one.

    Raises:
        ConfigError: ``system`` in a process where ``reuse`` was applied already (mallopt cannot be undone):
            run it in a fresh process.
    """
    global _host_allocator_reused
    check_choice("trainer.host_allocator", name)
    if name == "system":
        if _host_allocator_reused:
            raise ConfigError("trainer.host_allocator=system: an earlier job in this process set "
                              "trainer.host_allocator=reuse, which glibc cannot undo; run it in a fresh process "
                              "(python -m runner trainer.host_allocator=system, or hydra/launcher=interleaved)")
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
    """Technique 6: let cuDNN time its convolution algorithms on the first batch of each input shape and
    keep the fastest (``torch.backends.cudnn.benchmark``; PyTorch "Performance Tuning Guide",
    https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#enable-cudnn-auto-tuner).

    Sets the flag explicitly either way, so a previous job in the same process cannot leak it. Helps
    convolutional nets with fixed input shapes; the autotuning cost lands in the warm-up steps.

    Returns:
        ``{}`` when off; ``{"cudnn_benchmark": "applied" | "skipped: <why>"}`` when on (skipped off CUDA).
    """
    on_cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = bool(enabled and on_cuda)
    if not enabled:
        return {}
    return {"cudnn_benchmark": "applied" if on_cuda else "skipped: cuDNN autotuning only exists on CUDA"}


def apply_channels_last(model: nn.Module) -> str:
    """Technique 19: store 4-D weights NHWC (``torch.channels_last``); inputs are converted by the loader.

    Tensor cores read NHWC natively, so convolutions skip layout transposes (PyTorch tutorial "Channels
    Last Memory Format", https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html; timm and
    Composer switch it on for convnets). A weight ``(C_out, C_in, kH, kW)`` keeps its shape, only its
    strides change. Skipped for a model with no 4-D parameter (nothing to convert).
    """
    if not any(p.dim() == 4 for p in model.parameters()):
        return "skipped: the model has no 4-D (convolution) weights to store channels_last"
    model.to(memory_format=torch.channels_last)
    return "applied"


def apply_drop_bias_before_bn(model: nn.Module) -> tuple[str, int]:
    """Technique 15: remove the bias of every Conv/Linear whose only consumer is a BatchNorm.

    BatchNorm subtracts the per-channel batch mean, which cancels any constant per-channel bias, so the
    bias is dead weight that still costs memory traffic and an optimizer update (Ioffe & Szegedy 2015,
    https://arxiv.org/abs/1502.03167, section 3.2). In train mode the outputs are unchanged (up to
    rounding); eval-mode running statistics computed with the bias would be off, so apply this before
    training, as ``prepare`` does.

    The graph comes from ``torch.fx.symbolic_trace`` (https://pytorch.org/docs/stable/fx.html). A layer is
    changed only if *every* call of it feeds a BatchNorm directly (a layer reused elsewhere keeps its
    bias). A model that cannot be traced (data-dependent control flow, ...) is left alone and the switch
    is recorded as skipped with the tracer's error.

    Returns:
        ``(status, number of biases removed)``.
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as e:  # noqa: BLE001 - any tracing failure means "cannot tell"
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return (f"skipped: torch.fx cannot trace {type(model).__name__} ({type(e).__name__}: {reason}); "
                f"its biases were left in place", 0)
    calls: Counter[str] = Counter()  # layer name -> how many times the graph calls it
    feeds_norm: Counter[str] = Counter()  # layer name -> calls whose only consumer is a norm layer
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        calls[node.target] += 1
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_module" and users[0].args and users[0].args[0] is node \
                and isinstance(model.get_submodule(users[0].target), _NORMS):
            feeds_norm[node.target] += 1
    removed = 0
    for name, n in feeds_norm.items():
        layer = model.get_submodule(name)
        if n == calls[name] and isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) \
                and layer.bias is not None:
            layer.register_parameter("bias", None)
            removed += 1
    if not removed:
        return "skipped: no conv/linear with a bias feeds a BatchNorm in this model", 0
    return "applied", removed


def apply_activation_checkpointing(model: nn.Module, block_names: list[str] | None) -> tuple[str, list[str], int]:
    """Technique 8: recompute the activations of each block in backward instead of storing them.

    Wraps every module whose class name is in ``block_names`` (default: ``repeated_blocks``) in a
    ``CheckpointWrapper`` running ``torch.utils.checkpoint`` with ``use_reentrant=False``, the
    implementation PyTorch recommends (https://pytorch.org/docs/stable/checkpoint.html): it works when the
    block's input does not require grad, with ``torch.compile`` and with keyword arguments. Only the
    blocks' inputs are saved in forward; everything inside is recomputed in backward. Gradients are the
    same; memory drops, at the cost of about one extra forward pass (Chen et al. 2016,
    https://arxiv.org/abs/1604.06174). Helps when activations, not weights, limit the batch size.

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
        raise ConfigError(f"memory.checkpoint_modules={missing} are not module classes of this model; "
                          f"use class names such as its repeated blocks {repeated_blocks(model)}, or null for those")
    if not names:
        return "skipped: the model has no repeated blocks to checkpoint; set memory.checkpoint_modules", names, 0
    wrap_blocks(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: type(m).__name__ in names)
    return "applied", names, sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def apply_compile(model: nn.Module, cfg: DictConfig, device: torch.device) -> tuple[dict[str, str], dict[str, object]]:
    """Technique 18: ``torch.compile`` (TorchInductor fuses pointwise ops into generated kernels).

    Uses ``nn.Module.compile`` (in place: the module object and its ``state_dict`` keys stay the same);
    compilation happens on the first forward, so its cost lands in the warm-up steps and a recompile
    happens when evaluation switches the model to eval mode. ``reduce-overhead`` also captures CUDA
    graphs, which removes per-kernel launch cost (helps small models whose steps are launch-bound); on a
    CPU it falls back to the default mode and records CUDA graphs as skipped. ``max-autotune`` also
    benchmarks matmul/conv kernels (long compile). Docs: https://pytorch.org/docs/stable/generated/torch.compile.html

    ``compile.regional=true`` compiles each repeated block (``repeated_blocks``: runner's GPT ``Block``, a ResNet's
    ``BasicBlock``/``Bottleneck``; a block wrapped for activation checkpointing is compiled with its wrapper)
    instead of the whole model, as torchtitan does by default (``apply_compile`` in its ``parallelize``, one
    ``torch.compile`` per TransformerBlock; PyTorch recipe "Reducing torch.compile cold start compilation time with
    regional compilation", https://pytorch.org/tutorials/recipes/regional_compilation.html): the blocks share one
    class and their code, so dynamo traces it once and reuses the graph for the others (their parameters are
    inputs, not constants), and the first compile is shorter, the more so the more blocks; what lies between the
    blocks (embeddings, the head, the stem) runs eager, so the steady step may be a little slower (the 4-layer
    Shakespeare GPT on a quiet CPU: compile x0.67, steady step x1.13; docs/benchmarks/compile-regional-cpu.md). A
    model with no repeated blocks is compiled whole, and ``compile_regional`` records why.

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
    """What ``compile.regional`` compiles: the class names of the model's repeated blocks (``repeated_blocks``) and
    every module of those classes, outermost first -- a block inside activation checkpointing's ``CheckpointWrapper``
    is given as the wrapper, so the compiled region holds the recomputation too (torchtitan compiles after AC)."""
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


def prepare(model: nn.Module, cfg: DictConfig, env, amp,
            skip=()) -> tuple[nn.Module, dict[str, str], dict[str, object]]:
    """Apply the model-level techniques that ``cfg`` switches on, in the order the module docstring gives.

    ``amp``: the built ``precision.Precision``; the FSDP wrapper all-gathers parameters in its ``compute_dtype``; with
    ``amp.fp8_recipe`` set (precision=fp8 on a GPU that has it) the model's large Linear layers become fp8
    (``precision.convert_fp8``) and compile is turned on if it was off (``technique_details.fp8.compile`` says so).
    ``skip``: status keys of techniques the task rules out (``Task.skipped``: channels_last and drop_bias_before_bn on a
    language model); the engine records them, they are not applied here.

    Prints the built model's line (``models.model_report``: weights loaded, backbone frozen, trainable
    parameters) on rank 0 first, unless ``trainer.progress=off``.

    Returns the (possibly wrapped) model, the techniques' statuses and their details (counts, names).

    Raises:
        ConfigError: ``memory.checkpoint_modules`` set while ``memory.checkpointing`` is off, or naming a
            class the model lacks; a bad ``compile.mode``.
    """
    techniques: dict[str, str] = {}
    if cfg.memory.checkpoint_modules and not cfg.memory.checkpointing:
        raise ConfigError(f"memory.checkpoint_modules={list(cfg.memory.checkpoint_modules)} has no effect while "
                          f"memory.checkpointing=false; add memory=checkpointing (or memory.checkpointing=true)")
    details: dict[str, object] = {}
    if env.is_main and cfg.trainer.progress != "off":  # the plain model, before any wrapper
        print(models.model_report(model, cfg.model)[0], flush=True)
    if cfg.channels_last and "channels_last" not in skip:
        techniques["channels_last"] = apply_channels_last(model)
    if cfg.model.drop_bias_before_bn and "drop_bias_before_bn" not in skip:
        techniques["drop_bias_before_bn"], details["biases_removed"] = apply_drop_bias_before_bn(model)
    compile_cfg = cfg.compile
    if amp.fp8_recipe is not None:  # precision=fp8 where it can run (a CUDA GPU >= 8.9 with torchao)
        techniques["fp8"], details["fp8"] = precision.convert_fp8(model, amp)
        if techniques["fp8"] == "applied" and compile_cfg.mode is None:
            # torchao's fp8 casts and scales are fast only fused by torch.compile; torchtitan runs fp8 compiled
            compile_cfg = OmegaConf.merge(compile_cfg, {"mode": "default"})
            details["fp8"]["compile"] = ("turned on by precision=fp8 (compile=off was given): torchao's fp8 casts are "
                                         "fused only by torch.compile; mode=default")
            if env.is_main:
                print("note: precision=fp8 turned torch.compile on (mode=default): torchao's float8 training needs it "
                      "to fuse its casts", flush=True)
    if cfg.memory.checkpointing:
        blocks = list(cfg.memory.checkpoint_modules) if cfg.memory.checkpoint_modules else None
        status, names, wrapped = apply_activation_checkpointing(model, blocks)
        techniques["activation_checkpointing"] = status
        details["checkpointed_blocks"] = names
        details["checkpointed_modules"] = wrapped
    if compile_cfg.mode is not None:
        status, compiled = apply_compile(model, compile_cfg, env.device)
        techniques |= status
        details |= compiled
    model, status = parallel.wrap(model, cfg.distributed, env, amp)
    techniques |= status
    return model, techniques, details
