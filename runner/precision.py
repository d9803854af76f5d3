"""Numeric precision (technique 4): autocast context + GradScaler, or do-nothing stand-ins, so the step
never branches.

The loop always runs ``with amp.autocast(): loss = ...``, ``amp.scaler.scale(loss).backward()``,
``amp.scaler.step(opt)``, ``amp.scaler.update()``; with ``fp32`` those are a ``nullcontext`` and a
``GradScaler(enabled=False)`` whose methods are identities.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from omegaconf import DictConfig
from torch.amp import GradScaler

from runner import hardware
from runner.config import check_choice
from runner.errors import ConfigError


@dataclass
class Precision:
    """``autocast()`` opens the forward pass's context; ``scaler`` scales the loss (disabled = identity)."""

    autocast: Callable[[], ContextManager]
    scaler: GradScaler
    compute_dtype: torch.dtype  # the dtype of the matmuls, for the MFU peak
    techniques: dict[str, str]


def _set_tf32(allowed: bool) -> None:
    """TF32 for matmuls and cuDNN convolutions, set explicitly (torch's defaults differ between the two:
    matmul off, cuDNN on), so ``fp32`` is true fp32 and a previous job in the process cannot leak it."""
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


def build(cfg: DictConfig, device: torch.device) -> Precision:
    """Pick the precision for ``cfg.name`` on ``device``.

    - ``fp32``: no autocast; on CUDA TF32 is switched off for matmuls *and* convolutions (true fp32).
    - ``amp``: automatic mixed precision where the hardware gains from it (PyTorch AMP recipe,
      https://pytorch.org/docs/stable/amp.html; Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740).
      CUDA: fp16 autocast + ``GradScaler(init_scale, growth_interval)``, which multiplies the loss by the
      scale, skips the optimizer step when a gradient is inf/NaN and halves the scale, and doubles it
      after ``growth_interval`` clean steps. CPU: bf16 autocast (no scaler needed: bf16 has fp32's
      exponent range) only with native bf16, otherwise skipped with the reason.
    - ``bf16``: bf16 autocast on any device (no scaler); warns when the CPU emulates bf16.
    - ``tf32``: TensorFloat-32 matmuls and convolutions on Ampere+ GPUs (fp32 storage, 10-bit mantissa
      products; https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices).
      Skipped on a CPU.

    Returns:
        a ``Precision``; ``techniques`` is ``{}`` for ``fp32``, else ``{name: "applied" | "skipped: ..."}``.

    Raises:
        ConfigError: an unknown ``precision.name``, ``init_scale`` <= 0 or ``growth_interval`` < 1.
    """
    check_choice("precision.name", cfg.name)
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
        if kind != "cuda":
            off.techniques["tf32"] = "skipped: TF32 is a CUDA (Ampere or newer) feature"
            return off
        _set_tf32(True)
        off.techniques["tf32"] = "applied"
        off.compute_dtype = torch.float32  # the MFU table keys TF32 peaks off this plus allow_tf32
        return off
    if kind == "cuda":
        _set_tf32(False)  # autocast covers the matmuls; keep the rest true fp32
    if name == "amp":
        if kind == "cuda":
            scaler = GradScaler("cuda", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
            ctx = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
            return Precision(ctx, scaler, torch.float16, {"amp": "applied"})
        if not hardware.cpu_has_native_bf16():
            off.techniques["amp"] = ("skipped: this CPU has no native bf16 (AVX-512-BF16/AMX); emulated bf16 "
                                     "autocast is 14-100x slower than fp32, use precision=bf16 to force it")
            return off
        ctx = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        return Precision(ctx, off.scaler, torch.bfloat16, {"amp": "applied"})
    # bf16, the last of CHOICES["precision.name"]
    if kind == "cpu" and not hardware.cpu_has_native_bf16():
        warnings.warn("precision=bf16 on a CPU without native bf16: autocast is emulated and much slower "
                      "than fp32", stacklevel=2)
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        off.techniques["bf16"] = f"skipped: {torch.cuda.get_device_name(device)} has no bf16 support"
        return off
    ctx = functools.partial(torch.autocast, kind, dtype=torch.bfloat16)
    return Precision(ctx, off.scaler, torch.bfloat16, {"bf16": "applied"})
