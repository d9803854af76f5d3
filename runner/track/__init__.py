"""Where figures go: ``metrics.jsonl`` + ``summary.json`` in the job folder, the console, and the loggers
``logger=`` picks (one or several): W&B, TensorBoard, MLflow, ``metrics.csv``. Only rank 0 tracks (the others get
``NullTracker``); files are replaced atomically (``write_json_atomic``), never left half-written.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner import REPO_ROOT
from runner.config.logger import logger_names
from runner.files import open_own, replace_own
from runner.track import loggers
from runner.track.loggers import wandb_api_key, wandb_offline_reason  # noqa: F401 - runner.track's API
from runner.track.records import reachable, to_json, write_json_atomic  # noqa: F401 - reachable: runner.track's API


def drop_rows_after(path: Path, step: int) -> None:
    """Keep only the ``metrics.jsonl`` rows up to optimizer ``step`` (atomically): a run resumed from the
    checkpoint of ``step`` logs the later steps again, and a row must not appear twice. Unreadable trailing
    lines (a write cut by a kill) are dropped too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    replace_own(path, "".join(f"{line}\n" for line in kept))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def _evaluated(row: dict[str, Any]) -> list[str]:
    """The evaluation figures of a row for the console: accuracy, loss and RMSE first, then a task's own
    (``eval_<name>``, numbers only) in the order the task returned them."""
    first = ["eval_accuracy", "eval_loss", "eval_rmse"]
    return first + [
        k
        for k, v in row.items()
        if k.startswith("eval_") and k not in first and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


class Tracker:
    """Rank 0's outputs for one job: metrics rows, console progress, the loggers `logger=` picks (W&B, TensorBoard,
    MLflow, metrics.csv: ``runner.track.loggers``), the summary."""

    def __init__(
        self,
        job_dir: Path,
        cfg: DictConfig,
        resolved: dict,
        total_steps: int,
        sweep_group: str | None,
        resume_step: int | None = None,
        wandb_run_id: str | None = None,
        mlflow_run_id: str | None = None,
    ):
        self.job_dir = job_dir
        self.sweep_group = sweep_group
        job_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it already; a direct train() call may not
        self.total_steps = total_steps
        self.metrics_path = job_dir / "metrics.jsonl"
        if resume_step is not None:  # rows of the steps after the checkpoint are logged again; a finished
            drop_rows_after(self.metrics_path, resume_step)  # run's summary is replaced by the resumed run's
            (job_dir / "summary.json").unlink(missing_ok=True)
        self._metrics = open_own(self.metrics_path, "a")
        mode = cfg.trainer.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        names = logger_names(cfg.logger)
        # every logger logger= picks, each with log(row), finish(summary), abort(code) (torchtitan's LoggerContainer)
        self.loggers: list[loggers.Logger] = []
        if "wandb" in names:
            self.loggers.append(loggers.WandbLogger(cfg.logger, job_dir, resolved, sweep_group, wandb_run_id))
        if "tensorboard" in names:
            self.loggers.append(loggers.TensorBoardLogger(job_dir / "tensorboard", resolved, resume_step))
        if "mlflow" in names:
            self.loggers.append(loggers.MLflowLogger(cfg.logger, job_dir, resolved, sweep_group, mlflow_run_id))
        if "csv" in names:
            self.loggers.append(loggers.CSVLogger(job_dir / "metrics.csv", resume_step))

    def _run_id(self, kind: type) -> str | None:
        return next((logger.run_id for logger in self.loggers if isinstance(logger, kind)), None)

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (kept in checkpoints, so a resumed run continues the same W&B run)."""
        return self._run_id(loggers.WandbLogger)

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run's id (kept in checkpoints, so a resumed run continues the same MLflow run)."""
        return self._run_id(loggers.MLflowLogger)

    def log(self, row: dict[str, Any]) -> None:
        """Record one log-interval row (step, loss, samples_per_sec, ...); the keys are metrics.jsonl's."""
        self._metrics.write(to_json(row) + "\n")
        self._metrics.flush()
        if self.bar is not None:
            self.bar.n = row["step"]
            shown = {
                k: _fmt(row.get(k))
                for k in ("loss", "samples_per_sec", "tokens_per_sec", *_evaluated(row))
                if row.get(k) is not None
            }
            self.bar.set_postfix({k.replace("_per_sec", "/s"): v for k, v in shown.items()}, refresh=True)
        elif self.mode == "lines":
            parts = [f"step {row['step']}/{self.total_steps}"] + [
                f"{k} {_fmt(row[k])}"
                for k in (
                    "epoch",
                    "loss",
                    "lr",
                    "samples_per_sec",
                    "tokens_per_sec",
                    "step_time_ms",
                    "data_wait_ms",
                    "peak_memory_mb",
                    *_evaluated(row),
                )
                if row.get(k) is not None
            ]
            print(" | ".join(parts), flush=True)
        for logger in self.loggers:
            logger.log(row)

    def note(self, message: str) -> None:
        """A line on the console between the figures (e.g. that a long evaluation is running); not a metric."""
        if self.bar is not None:
            self.bar.write(message)
        elif self.mode == "lines":
            print(message, flush=True)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json``, print the summary table, give every logger the summary and close it."""
        if self.bar is not None:
            self.bar.close()
        self._metrics.close()
        write_json_atomic(self.job_dir / "summary.json", summary)
        if self.mode != "off" and self.sweep_group is not None:
            print_job_line(summary, self.job_dir)  # a multirun ends with the sweep's table (runner/report/end.py)
        elif self.mode != "off":
            print_summary(summary, self.job_dir)
        for logger in self.loggers:
            logger.finish(summary)

    def abort(self, exit_code: int = 1) -> None:
        """Close files and every logger's run after a failure or a preemption (no summary is written);
        ``exit_code`` says which (``runner.errors.EXIT_PREEMPTED`` for a preemption, 130 for Ctrl-C)."""
        if self.bar is not None:
            self.bar.close()
        with contextlib.suppress(OSError):  # the failure may be this file's (a full disk): it is closed all the same
            self._metrics.close()
        for logger in self.loggers:
            logger.abort(exit_code)


class NullTracker:
    """What ranks other than 0 get: every call does nothing."""

    def log(self, row):  # noqa: D102
        pass

    def finish(self, summary):  # noqa: D102
        pass

    def note(self, message):  # noqa: D102
        pass

    def abort(self, exit_code: int = 1):  # noqa: D102
        pass

    wandb_run_id = None
    mlflow_run_id = None


def print_summary(summary: dict[str, Any], job_dir: Path) -> None:
    """Print the run's headline figures and every technique's status as an aligned two-column table, then
    one ``warning:`` line per reason the figures cannot be trusted (summary ``warnings``: a busy machine).

    The first row, ``measurement``, says what the speed figures cover, or why they are blank (all warm-up)."""
    keys = [
        "measurement",
        "samples_per_sec",
        "tokens_per_sec",
        "step_time_ms_median",
        "step_time_ms_p90",
        "data_wait_fraction",
        "peak_memory_mb",
        "flops_per_sample",
        "flops_per_token",
        "mfu",
        "train_loss",
        "eval_accuracy",
        "eval_loss",
        "eval_rmse",
        "eval_bits_per_char",
        "eval_accuracy_ema",
        "eval_loss_ema",
        "eval_rmse_ema",
        "stopped_early",
        "time_to_target_s",
        "train_time_s",
        "eval_time_s",
        "checkpoint_time_s",
        "restarts",
        "skipped_steps",
        "steps",
        "warmup_steps",
        "global_batch_size",
        "world_size",
        "device_name",
    ]
    keys[keys.index("eval_bits_per_char") : keys.index("eval_bits_per_char")] = [  # a task's own (eval_mae), numbers
        k for k in _evaluated(summary)[3:] if k not in keys and not k.endswith("_ema")
    ]
    rows = [
        (k, _fmt(summary[k]))
        for k in keys
        if k in summary and (k not in ("skipped_steps", "stopped_early") or summary[k])
    ] + [(f"technique {k}", v) for k, v in summary["techniques"].items()]
    width = max(len(k) for k, _ in rows)
    print(f"\nsummary ({job_dir / 'summary.json'})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if (missed := missed_target(summary)) is not None:
        print(f"note: {missed}")
    for warning in summary.get("warnings") or []:
        print(f"warning: {warning}; rerun on a quiet machine for figures to trust")


def missed_target(summary: dict[str, Any]) -> str | None:
    """One clause when the run set ``trainer.target_accuracy``/``target_loss`` and never met them (``time_to_target_s``
    null): the targets, the last evaluation's figures and the fix; None otherwise."""
    trainer = (summary.get("config") or {}).get("trainer") or {}
    suffix = "_ema" if trainer.get("target_weights") == "ema" else ""
    wanted = [
        (f"eval_{m}{suffix}", trainer[f"target_{m}"])
        for m in ("accuracy", "loss")
        if trainer.get(f"target_{m}") is not None
    ]
    if not wanted or summary.get("time_to_target_s") is not None:
        return None
    said = ", ".join(
        f"trainer.target_{k.split('_')[1]}={t:g} (the last {k}: {_fmt(summary.get(k))})" for k, t in wanted
    )
    return (
        f"the target was not reached in {summary.get('steps')} steps: {said}; train longer (trainer.max_steps) "
        f"or change the recipe (optimizer.lr, scheduler)"
    )


def print_job_line(summary: dict[str, Any], job_dir: Path) -> None:
    """One line for a job of a multirun, instead of ``print_summary``'s table: its folder and headline figures,
    then its ``warning:`` lines as ``print_summary`` ends; the sweep's table comes at its end
    (``runner.report.end``), the rest is in summary.json."""
    keys = ("samples_per_sec", "tokens_per_sec", "train_loss", "eval_loss", "eval_accuracy", "steps")
    figures = ", ".join(f"{k} {_fmt(summary[k])}" for k in keys if summary.get(k) is not None)
    print(f"job {job_dir}: {figures or summary.get('measurement') or 'no figures'}")
    for warning in summary.get("warnings") or []:
        print(f"warning: {warning}; rerun on a quiet machine for figures to trust")


class _Tee(io.TextIOBase):
    """A console stream that also appends each complete line to a log file; a progress bar's in-place updates
    (text holding a carriage return) stay on the console only."""

    def __init__(self, stream, log):
        self.stream, self.log, self._line = stream, log, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self._line += text
        *lines, self._line = self._line.split("\n")
        kept = [line for line in lines if "\r" not in line]
        if kept:
            self.log.write("".join(f"{line}\n" for line in kept))
            self.log.flush()
        if "\r" in self._line:
            self._line = ""
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):  # noqa: D102
        return getattr(self.stream, "encoding", "utf-8")


@contextlib.contextmanager
def console_to_log(path: Path | None):
    """While open, what runner prints to stdout and stderr (progress lines, the summary table, warnings, the
    doctor's diagnosis, ``error:`` lines) also goes to ``path``: Hydra's job log (``<job>/runner.log``), which
    otherwise holds only Hydra's own log records and stays empty for most runs. ``None``: nothing changes
    (ranks > 0, whose folder is a scratch one). Appends, so a resumed run's lines follow the earlier ones."""
    if path is None:
        yield
        return
    with open_own(path, "a", encoding="utf-8") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def git_sha() -> str | None:
    """The repository's commit, with ``-dirty`` when tracked files changed; None outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def job_folder() -> Path:
    """The Hydra job's output folder (``outputs/<date>/<time>`` or ``outputs/multirun/.../<n>``)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def sweep_group() -> str | None:
    """The W&B group of a multirun job: its sweep folder's last two parts (``<date>_<time>`` by default,
    so sweeps started at the same time on different days stay apart); None for a single run or outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # train() called directly (tests, benchmarks)
        return None
    hc = HydraConfig.get()
    return "_".join(Path(hc.sweep.dir).parts[-2:]) if hc.mode == RunMode.MULTIRUN else None
