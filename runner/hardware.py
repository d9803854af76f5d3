"""What machine is this: CUDA, native bf16, device names, peak FLOP/s, how busy it is.

A leaf: it imports torch and the standard library only, never another runner module, so every layer can
ask it (precision and the FSDP policy: native bf16; measure: the peak for MFU; the ablation and its report:
the machine record; the ``${runner_if_cuda:}`` resolver: CUDA or not).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

# Dense (no sparsity) peak TFLOP/s by compute dtype, from the vendors' data sheets. Keys are matched as
# substrings of torch.cuda.get_device_name(), most specific first. "tf32" is used for fp32 matmuls when
# TF32 is allowed. Override with trainer.peak_tflops.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
]
_DTYPE_KEY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def uses_cuda(device: str) -> bool:
    """True when a job with ``trainer.device=<device>`` will run on CUDA (``auto``: CUDA when available)."""
    if device == "cuda":
        return True
    if device != "auto":
        return False
    return torch.cuda.is_available()


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


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA; on a CPU its model name from /proc/cpuinfo (``platform.machine()`` elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_flops(device: torch.device, compute_dtype: torch.dtype, override_tflops: float | None) -> float | None:
    """The device's dense peak in FLOP/s for ``compute_dtype``; None where unknown (CPUs, unlisted GPUs)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = _DTYPE_KEY.get(compute_dtype, "fp32")
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for pattern, peaks in PEAK_TFLOPS:
        if pattern in name and key in peaks:
            return peaks[key] * 1e12
    return None


def load_average() -> float | None:
    """The 1-minute load average, rounded (other users make figures noisy); None where the OS has none."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def describe_machine() -> dict[str, Any]:
    """The machine a sweep runs on, for the report: CPU model, usable cores, memory (GiB), GPUs, native
    bf16, torch/Python/OS versions and the 1-minute load average (other users make figures noisy)."""
    cpu = device_name(torch.device("cpu"))
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "cpu": cpu,
        "cpu_cores": cores,
        "memory_gib": memory_gib,
        "gpus": gpus,
        "cpu_native_bf16": cpu_has_native_bf16(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "load_average_1min": load_average(),
    }
