"""Where figures go: ``metrics.jsonl`` + ``summary.json`` in the job folder, the console, and W&B.

Only rank 0 tracks; other ranks get ``NullTracker``. Files are written atomically (temp file + rename)
so a crash never leaves a half-written ``summary.json``.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# metrics.jsonl key -> W&B key (panel prefix); rows are logged against the step metric "trainer/step".
WANDB_KEYS = {
    "samples_per_sec": "perf/samples_per_sec",
    "step_time_ms": "perf/step_time_ms",
    "data_wait_ms": "perf/data_wait_ms",
    "peak_memory_mb": "perf/peak_memory_mb",
    "loss": "train/loss",
    "lr": "train/lr",
    "epoch": "train/epoch",
    "eval_accuracy": "eval/accuracy",
    "eval_loss": "eval/loss",
}


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file and ``os.replace`` (atomic on POSIX)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "-" if value is None else str(value)


class Tracker:
    """Rank 0's outputs for one job: metrics rows, console progress, optional W&B run, the summary."""

    def __init__(self, job_dir: Path, cfg: DictConfig, resolved: dict, total_steps: int, sweep_group: str | None):
        self.job_dir = job_dir
        job_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it already; a direct train() call may not
        self.total_steps = total_steps
        self.metrics_path = job_dir / "metrics.jsonl"
        self._metrics = self.metrics_path.open("a")
        mode = cfg.trainer.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self.wandb = _start_wandb(cfg.logger, job_dir, resolved, sweep_group) if cfg.logger.name == "wandb" else None

    def log(self, row: dict[str, Any]) -> None:
        """Record one log-interval row (step, loss, samples_per_sec, ...); the keys are metrics.jsonl's."""
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self.bar is not None:
            self.bar.n = row["step"]
            shown = {k: _fmt(row.get(k)) for k in ("loss", "samples_per_sec", "eval_accuracy") if row.get(k) is not None}
            self.bar.set_postfix({k.replace("samples_per_sec", "samples/s"): v for k, v in shown.items()}, refresh=True)
        elif self.mode == "lines":
            parts = [f"step {row['step']}/{self.total_steps}"] + [
                f"{k} {_fmt(row[k])}" for k in ("epoch", "loss", "lr", "samples_per_sec", "step_time_ms",
                                                "data_wait_ms", "peak_memory_mb", "eval_accuracy")
                if row.get(k) is not None]
            print(" | ".join(parts), flush=True)
        if self.wandb is not None:
            self.wandb.log({WANDB_KEYS[k]: v for k, v in row.items() if k in WANDB_KEYS and v is not None}
                           | {"trainer/step": row["step"]})

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json``, print the summary table, close the W&B run."""
        if self.bar is not None:
            self.bar.close()
        self._metrics.close()
        write_json_atomic(self.job_dir / "summary.json", summary)
        if self.mode != "off":
            print_summary(summary, self.job_dir)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if k != "config"})
            self.wandb.finish()

    def abort(self) -> None:
        """Close files and the W&B run after a failure (no summary is written)."""
        if self.bar is not None:
            self.bar.close()
        self._metrics.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1)


class NullTracker:
    """What ranks other than 0 get: every call does nothing."""

    def log(self, row):  # noqa: D102
        pass

    def finish(self, summary):  # noqa: D102
        pass

    def abort(self):  # noqa: D102
        pass


def print_summary(summary: dict[str, Any], job_dir: Path) -> None:
    """Print the run's headline figures and every technique's status as an aligned two-column table.

    The first row, ``measurement``, says what the speed figures cover, or why they are blank (all warm-up)."""
    keys = ["measurement", "samples_per_sec", "step_time_ms_median", "step_time_ms_p90", "data_wait_fraction",
            "peak_memory_mb", "flops_per_sample", "mfu", "train_loss", "eval_accuracy", "time_to_target_s", "steps",
            "warmup_steps", "global_batch_size", "world_size", "device_name"]
    rows = [(k, _fmt(summary.get(k))) for k in keys] + [(f"technique {k}", v) for k, v in summary["techniques"].items()]
    width = max(len(k) for k, _ in rows)
    print(f"\nsummary ({job_dir / 'summary.json'})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("//")[-1]) is not None
    except (OSError, netrc.NetrcParseError):
        return False


_offline_notice_shown = False  # the no-API-key notice is printed once per process (once per sweep)


def _start_wandb(cfg: DictConfig, job_dir: Path, resolved: dict, group: str | None):
    """Start a W&B run in ``<job_dir>/wandb``, grouped by ``group`` (the sweep, in multirun).

    Mode: ``WANDB_MODE`` (online | offline | disabled) when set; with no API key (``WANDB_API_KEY`` or a
    ``~/.netrc`` entry from ``wandb login``) ``offline``, said once per process with the ``wandb sync``
    command that uploads the run(s) later.
    """
    global _offline_notice_shown
    import wandb

    mode = os.environ.get("WANDB_MODE") or None
    if mode is None and not _has_wandb_key():
        mode = "offline"
        if not _offline_notice_shown:
            runs = (job_dir.parent / "*" if group else job_dir) / "wandb" / "offline-run-*"
            print(f"W&B: no API key found, logging offline; upload later with `wandb sync {runs}`", flush=True)
            _offline_notice_shown = True
    run = wandb.init(project=cfg.project, entity=cfg.entity, tags=list(cfg.tags), group=group, dir=str(job_dir),
                     config=resolved, mode=mode, name=f"{group}/{job_dir.name}" if group else None,
                     settings=wandb.Settings(quiet=True, console="off", x_disable_stats=True))
    run.define_metric("trainer/step")
    run.define_metric("*", step_metric="trainer/step")
    return run
