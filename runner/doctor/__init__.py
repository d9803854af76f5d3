"""The speed doctor: what limits a run's speed, the figures that show it, and the overrides to try.

    python -m runner.doctor <job folder>                  # the diagnosis (also printed after every run)
    python -m runner.doctor <job folder> --verify         # and measure what each suggestion really buys

``diagnose`` turns a job folder's ``summary.json`` into ``Finding``s (a category of ``CATEGORIES``, evidence in
figures, ranked suggestions as commands to paste). The categories' thresholds and suggestions, and ``--verify``:
docs/tuners-and-doctor.md, "Speed doctor"; its modules: docs/design.md. Sources: PyTorch Performance Tuning Guide
("disable debugging APIs"), PyTorch DataLoader docs, airbench (the dataset on the device).
"""

from runner.doctor.cli import main
from runner.doctor.diagnosis import (
    CPU_FLOPS_PER_THREAD_MIN,
    DATA_WAIT_FRACTION_MAX,
    GPU_IDLE_FRACTION_MAX,
    LOG_TIME_FRACTION_MAX,
    MEMORY_FRACTION_MAX,
    MFU_HIGH,
    SYNCS_PER_STEP_MAX,
    VERIFY_MEASURED_STEPS,
    diagnose,
)
from runner.doctor.job import Job, command, merge_overrides, render, report
from runner.doctor.verify import verify

__all__ = [
    "CPU_FLOPS_PER_THREAD_MIN",
    "DATA_WAIT_FRACTION_MAX",
    "GPU_IDLE_FRACTION_MAX",
    "LOG_TIME_FRACTION_MAX",
    "MEMORY_FRACTION_MAX",
    "MFU_HIGH",
    "SYNCS_PER_STEP_MAX",
    "VERIFY_MEASURED_STEPS",
    "Job",
    "command",
    "diagnose",
    "main",
    "merge_overrides",
    "render",
    "report",
    "verify",
]
