"""Numeric precision: autocast context + GradScaler, or do-nothing stand-ins, so the step never branches."""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from omegaconf import DictConfig

from runner.errors import ConfigError


@dataclass
class Precision:
    """``autocast()`` opens the forward pass's context; ``scaler`` scales the loss (disabled = identity)."""

    autocast: Callable[[], ContextManager]
    scaler: torch.amp.GradScaler
    compute_dtype: torch.dtype  # the dtype of the matmuls, for the MFU peak
    techniques: dict[str, str]


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 instructions (AVX-512-BF16 or AMX); emulated bf16 is 14-100x slower."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is not None and any(hasattr(cpu, p) for p in probes):
        return any(getattr(cpu, p)() for p in probes if hasattr(cpu, p))
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def build(cfg: DictConfig, device: torch.device) -> Precision:
    """Pick the precision for ``cfg.name`` on ``device``.

    - ``fp32``: no autocast.
    - ``amp``: automatic mixed precision where the hardware gains from it (PyTorch AMP recipe,
      https://pytorch.org/docs/stable/amp.html; Micikevicius et al. 2018). CUDA: fp16 autocast +
      ``GradScaler(init_scale, growth_interval)``. CPU: bf16 autocast only with native bf16,
      otherwise skipped with the reason.
    - ``bf16``: bf16 autocast on any device (no scaler: bf16 has fp32's range); warns when emulated.
    - ``tf32``: TensorFloat-32 matmuls and convolutions on Ampere+ GPUs
      (https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices).

    Raises:
        ConfigError: an unknown ``precision.name``.
    """
    kind = device.type
    off = Precision(contextlib.nullcontext, torch.amp.GradScaler(kind, enabled=False), torch.float32, {})
    name = cfg.name
    if name == "fp32":
        return off
    if name == "tf32":
        if kind != "cuda":
            off.techniques["tf32"] = "skipped: TF32 is a CUDA (Ampere or newer) feature"
            return off
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        off.techniques["tf32"] = "applied"
        off.compute_dtype = torch.float32  # the MFU table keys TF32 peaks off this plus allow_tf32
        return off
    if name == "amp":
        if kind == "cuda":
            scaler = torch.amp.GradScaler("cuda", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
            ctx = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
            return Precision(ctx, scaler, torch.float16, {"amp": "applied"})
        if not cpu_has_native_bf16():
            off.techniques["amp"] = ("skipped: this CPU has no native bf16 (AVX-512-BF16/AMX); emulated bf16 "
                                     "autocast is 14-100x slower than fp32, use precision=bf16 to force it")
            return off
        ctx = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
        return Precision(ctx, off.scaler, torch.bfloat16, {"amp": "applied"})
    if name == "bf16":
        if kind == "cpu" and not cpu_has_native_bf16():
            warnings.warn("precision=bf16 on a CPU without native bf16: autocast is emulated and much slower "
                          "than fp32", stacklevel=2)
        if kind == "cuda" and not torch.cuda.is_bf16_supported():
            off.techniques["bf16"] = f"skipped: {torch.cuda.get_device_name(device)} has no bf16 support"
            return off
        ctx = functools.partial(torch.autocast, kind, dtype=torch.bfloat16)
        return Precision(ctx, off.scaler, torch.bfloat16, {"bf16": "applied"})
    raise ConfigError(f"precision.name={name!r} is not one of fp32, amp, bf16, tf32")
