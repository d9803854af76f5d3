"""The speed doctor: what limits a run's speed, the figures that show it, and the overrides to try.

    python -m runner.doctor <job folder>                  # the diagnosis (also printed after every run)
    python -m runner.doctor <job folder> --verify         # and measure what each suggestion really buys

It reads what the run recorded in its folder: ``summary.json`` (the figures, ``machine_load`` and its
``warnings``, the resolved config), ``metrics.jsonl`` (per-interval figures), ``.hydra/overrides.yaml``
(the command) and ``.hydra/hydra.yaml`` (the folder it ran from, a ``--config-dir``). ``diagnose`` turns a
summary into ``Finding``s, each a category with its evidence in figures and ranked suggestions; every
suggestion is printed as a command to paste: ``python -m runner <the job's overrides> <the suggestion>``.
The categories, in the order they are checked:

- **untrustworthy**: the run's machine-load warnings (``runner.measure.machine_load.load_warnings``): on a CPU whose
  free cores were fewer than runner's threads, ``trainer.num_threads`` at the free cores; rerun on a quiet
  machine before trusting any figure below;
- **not measured**: every step was warm-up;
- **debug tools on**: ``debug=anomaly|profile`` slows every step (PyTorch Performance Tuning Guide,
  "disable debugging APIs");
- **input-bound**: the data-wait fraction is high: DataLoader workers, pinned memory, the dataset on the
  device (PyTorch DataLoader docs; airbench);
- **host/launch-bound** (CUDA): the GPU idles between kernels in a short profiler window of the warm-up
  (``runner.measure.GpuIdleProbe``): CUDA graphs (``compile=reduce-overhead``), a larger batch;
- **sync/overhead-bound**: a host-device sync (the loss read at a log step) every step or two, logging a
  large share of the time, or a step doing little arithmetic for its time (fixed per-step costs: Python,
  op dispatch, per-parameter optimizer work): raise ``trainer.log_every``, a larger batch, compile;
- **memory-bound**: peak memory near the device's: bf16, activation checkpointing, gradient accumulation;
- **near the hardware ceiling**: MFU high: nothing big left.

Thresholds are the module constants below, each with why. ``--verify`` measures the job's own rerun and each
suggestion interleaved, as the ablation and the speed tuner do (runner/compare/: resident processes taking
turns in slices, a copy of the rerun as the A/A), and reports the speed-up of each over the rerun with its
interval and Holm's verdict.

Where each part lives: ``diagnosis`` (the thresholds, ``Finding``, ``diagnose``), ``job`` (reading a job folder,
the command to paste, ``render``), ``verify`` (``--verify``), ``cli`` (``python -m runner.doctor``).
"""


from runner.doctor.cli import main
from runner.doctor.diagnosis import (
    CATEGORIES,
    CPU_FLOPS_PER_THREAD_MIN,
    DATA_WAIT_FRACTION_MAX,
    GPU_IDLE_FRACTION_MAX,
    LOG_TIME_FRACTION_MAX,
    MEMORY_FRACTION_MAX,
    MFU_HIGH,
    SYNCS_PER_STEP_MAX,
    VERIFY_MEASURED_STEPS,
    Finding,
    Suggestion,
    diagnose,
)
from runner.doctor.job import Job, command, load_job, merge_overrides, render, report
from runner.doctor.verify import VERIFY_FIXED, VERIFY_MINUTES, Trial, compose_job, verify, verify_plan, verify_table

__all__ = ["CATEGORIES", "CPU_FLOPS_PER_THREAD_MIN", "DATA_WAIT_FRACTION_MAX", "GPU_IDLE_FRACTION_MAX",
           "LOG_TIME_FRACTION_MAX", "MEMORY_FRACTION_MAX", "MFU_HIGH", "SYNCS_PER_STEP_MAX", "VERIFY_FIXED",
           "VERIFY_MEASURED_STEPS", "VERIFY_MINUTES", "Finding", "Job", "Suggestion", "Trial", "command", "compose_job",
           "diagnose", "load_job", "main", "merge_overrides", "render", "report", "verify", "verify_plan",
           "verify_table"]
