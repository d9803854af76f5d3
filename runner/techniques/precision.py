"""Numeric precision (technique 4): autocast context + GradScaler, or do-nothing stand-ins, so the step
never branches; and fp8 training's model conversion (``convert_fp8``, applied by ``runner.techniques.prepare``).

The loop always runs ``with amp.autocast(): loss = ...``, ``amp.scaler.scale(loss).backward()``,
``amp.scaler.step(opt)``, ``amp.scaler.update()``; with ``fp32`` those are a ``nullcontext`` and a
``GradScaler(enabled=False)`` whose methods are identities.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from omegaconf import DictConfig
from torch import nn
from torch.amp import GradScaler

from runner.config import check_choice
from runner.errors import ConfigError
from runner.measure import hardware
from runner.techniques import TECHNIQUES, Job


@dataclass
class Precision:
    """``autocast()`` opens the forward pass's context; ``scaler`` scales the loss (disabled = identity)."""

    autocast: Callable[[], ContextManager]
    scaler: GradScaler
    compute_dtype: torch.dtype  # the dtype of autocast's matmuls (FSDP all-gathers in it), for the MFU peak
    techniques: dict[str, str]
    #: precision=fp8 where it can apply: the torchao recipe (``tensorwise``/``rowwise``) that ``convert_fp8``
    #: converts the model's Linear layers with; None otherwise
    fp8_recipe: str | None = None
    #: the dtype whose dense peak MFU is measured against when it is not ``compute_dtype`` (fp8: float8_e4m3fn,
    #: set by ``convert_fp8`` once some layer was converted)
    peak_dtype: torch.dtype | None = None
    #: ``auto``: the precision it picked on this device and why (``summary.json`` ``technique_details.precision``)
    note: str | None = None
    #: precision=int8 where it can apply: ``convert_int8`` swaps the Linear layers for torchao's int8 ones
    int8: bool = False

    @property
    def mfu_dtype(self) -> torch.dtype:
        """The dtype of the device's peak that MFU divides by: ``peak_dtype`` when set, else ``compute_dtype``."""
        return self.peak_dtype or self.compute_dtype


def _set_tf32(allowed: bool) -> None:
    """TF32 for matmuls and cuDNN convolutions, set explicitly (torch's defaults differ between the two:
    matmul off, cuDNN on), so ``fp32`` is true fp32 and a previous job in the process cannot leak it."""
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


#: The CUDA compute capability fp8 matmuls need (``torch._scaled_mm``): Ada Lovelace (8.9), Hopper (9.0), Blackwell
FP8_CAPABILITY = (8, 9)


def build(cfg: DictConfig, device: torch.device) -> Precision:
    """Pick the precision for ``cfg.name`` on ``device``.

    - ``fp32``: no autocast; on CUDA TF32 is switched off for matmuls *and* convolutions (true fp32).
    - ``amp``: automatic mixed precision where the hardware gains from it (PyTorch AMP recipe,
      https://pytorch.org/docs/stable/amp.html; Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740).
      CUDA: fp16 autocast + ``GradScaler(init_scale, growth_interval)``. CPU: bf16 autocast (no scaler: bf16 has
      fp32's exponent range) only with native bf16, otherwise skipped with the reason.
    - ``auto`` (``+experiment=fast``): ``amp``, except bf16 autocast without a scaler on a GPU with bf16 (Ampere and
      newer; why: docs/configuration.md, "Presets"). Recorded as ``amp``; on CUDA the dtype it picked is ``note``.
    - ``bf16``: bf16 autocast on any device (no scaler); warns when the CPU emulates bf16.
    - ``tf32``: TensorFloat-32 matmuls and convolutions on Ampere+ GPUs (fp32 storage, 10-bit mantissa
      products; https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices).
      Skipped on a CPU.
    - ``fp8``: bf16 autocast, and the model's large Linear layers converted to torchao's float8 training
      (``convert_fp8``, applied by ``runner.techniques.prepare`` before compile; torchao float8,
      https://github.com/pytorch/ao/tree/main/torchao/float8), recipe ``precision.fp8_recipe``; where it cannot run
      (``fp8_unavailable``) skipped, bf16 autocast where the device has native bf16, else fp32.
    - ``int8``: torchao's INT8 mixed-precision training of the Linear layers (``convert_int8``, applied by
      ``runner.techniques.prepare``), the rest under bf16 autocast where the device has native bf16, else fp32; on
      CUDA and CPUs alike; without torchao skipped with the reason.

    Returns:
        a ``Precision``; ``techniques`` is ``{}`` for ``fp32`` and for an ``fp8`` or ``int8`` that will be applied (its
        status comes from ``convert_fp8`` or ``convert_int8``), else ``{name: "applied" | "skipped: ..."}`` (``amp``
        for ``auto``).

    Raises:
        ConfigError: an unknown ``precision.name`` or ``precision.fp8_recipe``, ``init_scale`` <= 0 or
            ``growth_interval`` < 1.
    """
    check_choice("precision.name", cfg.name)
    check_choice("precision.fp8_recipe", cfg.fp8_recipe)
    kind = device.type
    if cfg.init_scale <= 0:
        raise ConfigError(f"precision.init_scale={cfg.init_scale} must be > 0 (a loss scale, e.g. 65536)")
    if cfg.growth_interval < 1:
        raise ConfigError(f"precision.growth_interval={cfg.growth_interval} must be >= 1 (optimizer steps)")
    off = Precision(contextlib.nullcontext, GradScaler(kind, enabled=False), torch.float32, {})
    name = cfg.name
    if name == "fp32":
        if kind == "cuda":
            _set_tf32(False)
        return off
    if name == "tf32":
        if why := TECHNIQUES["tf32"].why_not(Job.of(None, device)):
            off.techniques["tf32"] = f"skipped: {why}"
            return off
        _set_tf32(True)
        off.techniques["tf32"] = "applied"
        off.compute_dtype = torch.float32  # the MFU table keys TF32 peaks off this plus allow_tf32
        return off
    if kind == "cuda":
        _set_tf32(False)  # autocast covers the matmuls; keep the rest true fp32
    bf16 = functools.partial(torch.autocast, kind, dtype=torch.bfloat16)
    if name in ("fp8", "int8"):
        return _low_bit(name, cfg, device, bf16, off)
    if name in ("auto", "amp"):
        return _mixed(name, cfg, device, bf16, off)
    # bf16, the one name left
    if kind == "cpu" and not hardware.cpu_has_native_bf16():
        warnings.warn(
            "precision=bf16 on a CPU without native bf16: autocast is emulated and much slower than fp32", stacklevel=2
        )
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        off.techniques["bf16"] = f"skipped: {torch.cuda.get_device_name(device)} has no bf16 support"
        return off
    return Precision(bf16, off.scaler, torch.bfloat16, {"bf16": "applied"})


def _low_bit(name: str, cfg: DictConfig, device: torch.device, bf16, off: Precision) -> Precision:
    """``precision=fp8`` and ``int8`` (see ``build``): bf16 autocast (int8: where the device has native bf16, else
    fp32) with what ``convert_fp8``/``convert_int8`` convert, or the reason it is skipped and the bf16 (or fp32) it
    trains with instead."""
    why = fp8_unavailable(device) if name == "fp8" else _torchao_missing()
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else hardware.cpu_has_native_bf16()
    if why is None and name == "fp8":
        return Precision(bf16, off.scaler, torch.bfloat16, {}, fp8_recipe=cfg.fp8_recipe)
    if why is None:
        if not native:
            off.int8 = True
            return off
        return Precision(bf16, off.scaler, torch.bfloat16, {}, int8=True)
    if not native:
        off.techniques[name] = f"skipped: {why}; trained in fp32 (this device has no native bf16)"
        return off
    return Precision(bf16, off.scaler, torch.bfloat16, {name: f"skipped: {why}; trained with bf16 autocast"})


def _torchao_missing() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao, or runner's extra: pip install -e '.[fp8]')"
    return None


def _mixed(name: str, cfg: DictConfig, device: torch.device, bf16, off: Precision) -> Precision:
    """``precision=amp`` and ``precision=auto`` (see ``build``)."""
    kind, note = device.type, None
    if name == "auto":
        if kind == "cuda" and torch.cuda.is_bf16_supported():
            note = (
                f"auto: bf16 autocast, no loss scaling ({torch.cuda.get_device_name(device)} supports bf16, "
                f"whose range is fp32's: no fp16 overflow)"
            )
            return Precision(bf16, off.scaler, torch.bfloat16, {"amp": "applied"}, note=note)
        # on a CPU exactly precision=amp, record included
        note = "auto: fp16 autocast + GradScaler (this GPU has no bf16)" if kind == "cuda" else None
    if kind == "cuda":
        scaler = GradScaler("cuda", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
        ctx = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
        return Precision(ctx, scaler, torch.float16, {"amp": "applied"}, note=note)
    if not hardware.cpu_has_native_bf16():
        off.techniques["amp"] = (
            "skipped: this CPU has no native bf16 (AVX-512-BF16/AMX); emulated bf16 "
            "autocast is 14-100x slower than fp32, use precision=bf16 to force it"
        )
        off.note = note
        return off
    note = note or (
        f"precision={name} on a CPU: bf16 autocast, no loss scaling (CPU autocast's dtype; fp16 with a "
        f"GradScaler is what amp means on CUDA)"
    )
    return Precision(bf16, off.scaler, torch.bfloat16, {"amp": "applied"}, note=note)


def fp8_unavailable(device: torch.device) -> str | None:
    """Why fp8 training cannot run on ``device``, or None where it can: fp8 GEMMs (``torch._scaled_mm``) need a
    CUDA GPU of compute capability >= 8.9 (``FP8_CAPABILITY``: Ada Lovelace, Hopper, Blackwell), and the
    conversion needs torchao (``pip install torchao``, or runner's ``fp8`` extra). Both are named when both miss."""
    why = []
    if device.type != "cuda":
        why.append(
            f"fp8 matmuls need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); this "
            f"job runs on the {device.type.upper()}"
        )
    else:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_CAPABILITY:
            why.append(
                f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; fp8 matmuls "
                f"need 8.9 or newer (Ada, Hopper, Blackwell)"
            )
    if (missing := _torchao_missing()) is not None:
        why.append(missing)
    return "; ".join(why) or None


def edge_layers(model: nn.Module) -> list[str]:
    """The names of the model's first and last layers with weights -- ``nn.Linear``, ``nn.Embedding`` and
    convolutions, in registration order (``named_modules``): runner's GPT ``transformer.wte`` (the token
    embedding) and ``lm_head``; a torchvision ResNet ``conv1`` (the stem) and ``fc`` (the classifier). fp8 keeps
    them in bf16 (torchtitan's ``filter_fqns=["output"]``; Micikevicius et al. 2022, "FP8 Formats for Deep
    Learning", https://arxiv.org/abs/2209.05433; why: docs/configuration.md, "fp8 training")."""
    layers = [
        name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))
    ]
    return sorted({layers[0], layers[-1]}) if layers else []


def fp8_module_filter(
    model: nn.Module, recipe: str, base: Callable[[nn.Module, str], bool] | None = None
) -> Callable[[nn.Module, str], bool]:
    """The ``module_filter_fn`` of ``convert_to_float8_training`` for ``model``: ``(module, fully qualified name)``
    -> True to convert that Linear to fp8.

    True when ``base`` keeps it and it is not one of ``edge_layers(model)`` (those stay bf16). ``base`` defaults
    to torchao's ``_auto_filter_for_recipe(recipe)`` (torchao/float8/float8_linear_utils.py, the filter torchtitan
    uses with ``auto_filter_small_kn``); its thresholds, and which layers of a GPT they convert:
    docs/configuration.md, "fp8 training".

    Raises:
        ImportError: ``base`` is None and torchao is not installed.
    """
    if base is None:
        from torchao.float8 import _auto_filter_for_recipe

        base = _auto_filter_for_recipe(recipe, filter_fqns=[])
    edges = set(edge_layers(model))
    return lambda module, fqn: fqn not in edges and bool(base(module, fqn))


def convert_fp8(model: nn.Module, amp: Precision) -> tuple[str, dict[str, Any]]:
    """precision=fp8: swap the Linear layers ``fp8_module_filter`` picks for torchao's ``Float8Linear``
    (``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(amp.fp8_recipe)``),
    in place (https://github.com/pytorch/ao/tree/main/torchao/float8); everything else runs under the bf16
    autocast of ``amp``, and ``runner.techniques.prepare`` turns on ``torch.compile``, which alone fuses the casts.
    With the rowwise recipe inductor emulates fp8 precision casts, as torchtitan does (pytorch/pytorch#150859). Sets
    ``amp.peak_dtype`` to fp8 (MFU against the device's fp8 dense peak) once a layer is converted.

    Returns:
        ``(status, details)``: ``"applied"`` or ``"skipped: <why>"`` (no Linear layer large enough to gain: the
        model trains in bf16); details ``{"recipe", "converted", "kept_bf16", "converted_layers"}``.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = amp.fp8_recipe
    keep = fp8_module_filter(model, recipe)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, name)]
    details = {
        "recipe": recipe,
        "converted": len(chosen),
        "kept_bf16": len(linears) - len(chosen),
        "converted_layers": chosen,
    }
    if not chosen:
        return (
            f"skipped: none of the model's {len(linears)} Linear layers is large enough for fp8 to gain (torchao's "
            f"auto filter for {recipe}; first and last layers stay bf16); trained with bf16 autocast"
        ), details
    if recipe == "rowwise":
        from torch._inductor import config as inductor_config

        inductor_config.emulate_precision_casts = True
    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe))
    amp.peak_dtype = torch.float8_e4m3fn
    return "applied", details


def convert_int8(model: nn.Module, amp: Precision) -> tuple[str, dict[str, Any]]:
    """precision=int8: torchao's INT8 mixed-precision training (``Int8MixedPrecisionTrainingConfig``, module swap;
    https://github.com/pytorch/ao/tree/main/torchao/prototype/quantized_training) on every Linear layer but the first
    and last (``edge_layers``: torchao's Llama runs keep the head), in place: the forward's ``input @ weight.T`` and
    backward's two matmuls quantize both operands to int8 row-wise (scales computed each step) and multiply in int8
    (Triton on CUDA, ``torch._int_mm`` elsewhere); the weights stay fp32 under their own names.

    Returns:
        ``(status, {"converted", "kept", "converted_layers"})``: ``"applied"``, or ``"skipped: <why>"`` when no Linear
        layer lies between the first and last.
    """
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    edges = set(edge_layers(model))
    chosen = [name for name in linears if name not in edges]
    details = {"converted": len(chosen), "kept": len(linears) - len(chosen), "converted_layers": chosen}
    if not chosen:
        dtype = "with bf16 autocast" if amp.compute_dtype == torch.bfloat16 else "in fp32"
        return (
            f"skipped: none of the model's {len(linears)} Linear layers lies between its first and last layers "
            f"(those stay as they are); trained {dtype}"
        ), details
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
    from torchao.quantization import quantize_

    keep = set(chosen)
    quantize_(model, Int8MixedPrecisionTrainingConfig(module_swap=True), filter_fn=lambda m, fqn: fqn in keep)
    return "applied", details
