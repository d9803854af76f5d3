"""What machine is this: CUDA, native bf16, device names, peak FLOP/s, memory, how busy it is. A leaf (torch and
the standard library only: tests/test_layers.py), so every layer can ask it.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

# Dense (no sparsity: half a "with sparsity" figure) peak TFLOP/s per GPU model and compute dtype, from the vendors'
# data sheets. Patterns are searched in torch.cuda.get_device_name() ignoring case, the first match decides (a variant
# before its family). Override with trainer.peak_tflops.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 NVL column
    (r"H100.*NVL", {"fp8": 1670.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    # the same datasheet (its 2022 edition), H100 PCIe column
    (r"H100.*PCIe", {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    # the same datasheet, H100 SXM column ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ...")
    (r"H100", {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 NVL column
    (r"H200.*NVL", {"fp8": 1670.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    # the same datasheet, H200 SXM column ("NVIDIA H200"); the GH200's GPU has the same figures
    (r"H200", {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72): the rack's figures / 72 GPUs
    (r"GB200", {"fp8": 5000.0, "bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    # NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx): the 8-GPU board's figures / 8
    (r"B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): SXM and PCIe alike; no fp8
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)
    (r"L40S", {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    # NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4)
    (r"\bL4\b", {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # NVIDIA A10 Tensor Core GPU datasheet (not the A10G, whose figures differ: unlisted)
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # NVIDIA Ada GPU architecture whitepaper, appendix A (GeForce RTX 4090; tensor figures with fp32 accumulation)
    (r"RTX 4090", {"fp8": 330.3, "bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (GeForce RTX 3090; fp32 accumulation)
    (r"RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2): no bf16 or TF32 tensor cores
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    # NVIDIA T4 Tensor Core GPU datasheet
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    # AMD Instinct MI300X data sheet (amd.com; ROCm's torch names it "AMD Instinct MI300X"), matrix figures
    (r"MI300X", {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]
_DTYPE_KEY = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def peak_tflops(name: str, key: str) -> float | None:
    """The dense peak TFLOP/s of the GPU ``name`` for ``key`` (``fp8``, ``bf16``, ``fp16``, ``tf32``, ``fp32``) from
    ``PEAK_TFLOPS``; None where no row matches or it has no figure for ``key``."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            return peaks.get(key)
    return None


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
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_flops(device: torch.device, compute_dtype: torch.dtype, override_tflops: float | None) -> float | None:
    """The device's dense peak in FLOP/s for ``compute_dtype`` (fp8 dtypes: its fp8 peak; fp32 with TF32 allowed:
    its TF32 peak) from ``PEAK_TFLOPS``, or ``override_tflops`` x 1e12; None where unknown (CPUs, unlisted GPUs)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    key = _DTYPE_KEY.get(compute_dtype, "fp32")
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    tflops = peak_tflops(torch.cuda.get_device_name(device), key)
    return tflops * 1e12 if tflops is not None else None


def load_average() -> float | None:
    """The 1-minute load average, rounded (other users make figures noisy); None where the OS has none."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where the OS has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ------------------------------------------------------------------------ how busy the machine is (Linux /proc)
def cpu_ticks() -> tuple[int, int] | None:
    """``(steal, total)`` clock ticks of all CPUs since boot, from ``/proc/stat`` (proc(5)); None where absent."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(v) for v in fields[1:9]]  # guest time is already inside user time: not added again
    return ticks[7], sum(ticks)


def thread_schedule_ns() -> tuple[int, int] | None:
    """``(on_cpu, waiting)`` ns summed over this process's threads: ran, and runnable but waiting for a CPU, from
    ``/proc/self/task/*/schedstat`` (kernel docs ``scheduler/sched-stats``); None where absent."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    on_cpu = waiting = 0
    found = False
    for task in tasks.iterdir():
        try:
            ran, waited = (int(v) for v in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue  # a thread that ended while we read
        on_cpu, waiting, found = on_cpu + ran, waiting + waited, True
    return (on_cpu, waiting) if found else None


def children_cpu_s() -> float | None:
    """CPU seconds (user + system) used so far by this process's live child processes (DataLoader
    workers), from ``/proc/<pid>/stat`` of the pids in ``/proc/self/task/*/children``; None where absent."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    hz = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for task in tasks.iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            return None  # kernel without CONFIG_PROC_CHILDREN
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
            total += (int(fields[11]) + int(fields[12])) / hz  # utime, stime (fields 14, 15 of proc(5))
    return total


#: The cgroup memory limits a container or a SLURM job puts on its processes, in bytes: v2, then v1 (whose
#: "no limit" is a huge number, v2's is the word ``max``; both simply lose against the machine's memory).
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def physical_memory_mb() -> float | None:
    """The machine's RAM in MiB: ``sysconf`` (physical pages x page size), else ``MemTotal`` of /proc/meminfo
    (proc(5)); None where neither is available."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (AttributeError, ValueError, OSError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_mb() -> float | None:
    """The host memory this process may use, in MiB: ``physical_memory_mb`` or the lower cgroup limit
    (``CGROUP_MEMORY_LIMITS``); None where neither is known."""
    limits = [physical_memory_mb()]
    for path in CGROUP_MEMORY_LIMITS:
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            limits.append(int(value) / 2**20)
    known = [v for v in limits if v is not None]
    return min(known) if known else None


def memory_limit_mb(device: torch.device) -> float | None:
    """What the run's peak memory is measured against, in MiB: the GPU's total memory on CUDA; on a CPU
    ``host_memory_mb`` (the machine's memory, or the cgroup's limit when lower); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    return host_memory_mb()


#: NVML clock-throttle reasons that mean the GPU ran slower than it could (power, heat, another limit);
#: idle and the user's application-clock setting are left out. nvml.h ``nvmlClocksThrottleReason*``.
_THROTTLE_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}


#: Set by an interleaved comparison (runner/compare/process.py) in each job it forks: the conductor's pid. The
#: comparison's other jobs are resident on the GPU while this one trains, paused at their slice gates: they are
#: the design, not contention, and ``gpu_contention`` leaves them out.
SWEEP_ROOT_ENV = "RUNNER_SWEEP_ROOT"


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants, by the parent links in
    ``/proc/<pid>/stat``; False where ``/proc`` cannot tell (another PID namespace, a process gone)."""
    for _ in range(64):  # deeper trees than this are not a sweep's
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state": the parent's pid
    return False


def gpu_contention(device: torch.device) -> dict[str, Any] | None:
    """Other processes on the run's GPU and clock throttling, through NVML (``nvidia-ml-py``, the ``gpu`` extra);
    None on a CPU, without it, or when NVML fails (never an error).

    Returns ``{"other_processes": n, "sweep_processes": m, "throttle_reasons": [names], "utilization_percent": p}``
    (``sweep_processes``: an interleaved comparison's own, ``SWEEP_ROOT_ENV``).
    """
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        reasons_of = (
            getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)  # its newer name
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = reasons_of(handle)
        root = int(os.environ.get(SWEEP_ROOT_ENV) or 0)
        others = [p.pid for p in procs if p.pid != os.getpid()]
        sweep = sum(bool(root) and descends_from(pid, root) for pid in others)
        return {
            "other_processes": len(others) - sweep,
            "sweep_processes": sweep,
            "throttle_reasons": [name for bit, name in _THROTTLE_REASONS.items() if reasons & bit],
            "utilization_percent": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        }
    except Exception:  # noqa: BLE001 - no bindings, no driver, a container without NVML: no record, no failure
        return None


def describe_machine() -> dict[str, Any]:
    """The machine a sweep runs on, for the report: CPU model, usable cores, memory (GiB), GPUs, native
    bf16, torch/Python/OS versions and the 1-minute load average (other users make figures noisy)."""
    cpu = device_name(torch.device("cpu"))
    physical = physical_memory_mb()
    memory_gib = round(physical / 1024, 1) if physical is not None else None
    cores = cpu_cores()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
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
