"""The ablation's job plumbing: one fresh process per job, CUDA-only variants, the machine and command.

``python -m runner -m +experiment=ablation model=... data=...`` is an ordinary Hydra multirun over
``ablation.repeat`` x ``ablation/variant`` (conf/experiment/ablation.yaml, conf/ablation/variant/).
Three things make its figures comparable, and they live here:

- ``run_job``: Hydra's basic launcher runs every job in one Python process. Peak RSS (the CPU's peak
  memory figure) only ever grows in a process, ``torch.compile`` caches and recompile limits carry over,
  and global flags (``cudnn.benchmark``, TF32) stay set. So, inside a multirun, each job re-runs itself
  as ``python -m runner <the job's overrides> hydra.run.dir=<its folder> ablation.isolate=false``,
  exactly the process a user would start, and returns that child's summary.
- ``ablation.requires=cuda``: a variant that can only differ from its reference on CUDA (the cuDNN
  autotuner; the leave-one-out of the CUDA-only bigger batch) is not run elsewhere; ``not_run.json`` in
  its folder says why, and the report lists it.
- ``AblationCallback``: at the start of the sweep, ``ablation.json`` records the machine (CPU model,
  cores, memory, GPUs, native bf16, load average) and the exact command; at the end it writes the
  report (runner/report.py).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner import uses_cuda
from runner.errors import ConfigError
from runner.track import write_json_atomic

#: What a job that did not train returns to Hydra (``__main__`` reads ``samples_per_sec``).
_NO_FIGURES = {"samples_per_sec": None}


def run_job(cfg: DictConfig, job_dir: Path | None = None) -> dict[str, Any] | None:
    """Handle an ablation job before anything is built; None means "train it here, in this process".

    - A variant with ``ablation.requires=cuda`` on a job that will not use CUDA: writes
      ``<job_dir>/not_run.json`` (variant, repeat, reason) and returns ``{"samples_per_sec": None}``.
    - Inside a Hydra multirun with ``ablation.isolate=true``: runs the job in a child process (see the
      module docstring) and returns the child's ``summary.json``; when the child fails, writes
      ``<job_dir>/failed.json`` (exit status) and returns ``{"samples_per_sec": None}``, so one broken
      configuration does not stop a 30-minute sweep (the report lists it).
    - Otherwise (a single run, tests, the child itself): None.

    Raises:
        ConfigError: ``ablation.requires`` is not null or ``cuda``.
    """
    a = cfg.ablation
    if a.variant is None:
        return None
    if a.requires not in (None, "cuda"):
        raise ConfigError(f"ablation.requires={a.requires!r} must be null or 'cuda'")
    hydra_cfg = _hydra_config()
    folder = job_dir or (Path(hydra_cfg.runtime.output_dir) if hydra_cfg is not None else None)
    if a.requires == "cuda" and not uses_cuda(str(cfg.trainer.device)):
        if folder is None:
            raise ConfigError(f"ablation variant {a.variant} needs CUDA and no job folder is known to record that")
        reason = f"needs CUDA; this job runs on trainer.device={cfg.trainer.device} without CUDA"
        write_json_atomic(folder / "not_run.json", {"variant": a.variant, "repeat": a.repeat, "reason": reason})
        print(f"ablation: {a.variant} r{a.repeat} not run: {reason}", flush=True)
        return dict(_NO_FIGURES)
    if not a.isolate or hydra_cfg is None or job_dir is not None or not _is_multirun(hydra_cfg):
        return None
    return _run_in_child(folder, list(hydra_cfg.overrides.task), Path(hydra_cfg.sweep.dir).name,
                         f"{a.variant}/r{a.repeat}", a)


def _hydra_config():
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _is_multirun(hydra_cfg) -> bool:
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN


def _quote(value: str) -> str:
    """``value`` as a single-quoted Hydra override value (paths may hold ``+``, ``=``, ``,``)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _run_in_child(job_dir: Path, overrides: list[str], group: str, name: str, a) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={_quote(str(job_dir))}",
           "ablation.isolate=false"]
    # The child is a single run, so train.sweep_group() is None there: W&B reads the group from the env.
    env = {**os.environ, "WANDB_RUN_GROUP": group, "WANDB_NAME": f"{group}/{name}"}
    started = time.perf_counter()
    returncode = subprocess.run(cmd, env=env).returncode
    summary_path = job_dir / "summary.json"
    if returncode == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        print(f"ablation: {name} done in {time.perf_counter() - started:.0f} s", flush=True)
        return summary
    write_json_atomic(job_dir / "failed.json", {"variant": a.variant, "repeat": a.repeat, "returncode": returncode,
                                                 "command": shlex.join(cmd)})
    print(f"ablation: {name} FAILED (exit status {returncode}); its output is above and in {job_dir}; "
          f"the sweep goes on", file=sys.stderr, flush=True)
    return dict(_NO_FIGURES)


def describe_machine() -> dict[str, Any]:
    """The machine a sweep runs on, for the report: CPU model, usable cores, memory (GiB), GPUs, native
    bf16, torch/Python/OS versions and the 1-minute load average (other users make figures noisy)."""
    import torch

    from runner.precision import cpu_has_native_bf16

    from runner.measure import device_name

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
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def sweep_command(hydra_cfg: DictConfig) -> str:
    """The command line that started this multirun, rebuilt from Hydra's record of its overrides."""
    overrides = [o for o in (*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task) if o != "hydra.mode=MULTIRUN"]
    return shlex.join(["python", "-m", "runner", "-m", *[str(o) for o in overrides]])


class AblationCallback(Callback):
    """Hydra callback of ``+experiment=ablation`` (``hydra.callbacks.ablation_report``).

    ``on_multirun_start`` writes ``<sweep>/ablation.json`` (machine, command, start time);
    ``on_multirun_end`` adds the end time and load average and writes the report. A report that cannot
    be made (no summaries, no baseline) prints one ``error:`` line and exits with status 1.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        sweep.mkdir(parents=True, exist_ok=True)
        write_json_atomic(sweep / "ablation.json", {"command": sweep_command(config.hydra),
                                                     "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                     "machine": describe_machine()})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.report import ReportError, write_report

        sweep = Path(config.hydra.sweep.dir)
        record_path = sweep / "ablation.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        record["load_average_1min_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        write_json_atomic(record_path, record)
        try:
            written = write_report(sweep)
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        print("ablation report: " + ", ".join(str(p) for p in written), flush=True)
