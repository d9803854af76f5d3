"""Where a run starts: the ``checkpoint.*`` settings checked, the checkpoint to resume (or none), and what may
differ between a checkpoint's config and the run resuming from it. Rank 0 decides; the engine broadcasts the
answer (``runner.engine.train``). Which interrupted run of the same job ``python -m runner`` continues instead of
starting a new folder (``interrupted_run``; the folders it looks at and the lock: ``runner.engine.jobdir``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from runner import techniques, trust
from runner.checkpoint import FOLDER, META_FILE, latest, read_meta, verify_digests
from runner.errors import ConfigError
from runner.files import replace_own

#: Config keys (dotted prefixes) that may differ between a checkpoint and the run resuming from it: the run's
#: length and bookkeeping, where things live, how fast batches load. Anything else changes the experiment.
MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_max_batches",
    "trainer.progress",
    "trainer.target_accuracy",
    "trainer.target_loss",
    "trainer.stop_at_target",
    "trainer.peak_tflops",
    "trainer.max_skipped_fraction",
    "trainer.reference_samples_per_sec",
    "trainer.device",
    "trainer.doctor",
    "checkpoint.",
    "logger.",
    "data.root",
    "data.path",
    "data.train_path",
    "data.val_path",
    "data.tokenizer",
    "data.download",
    *techniques.moves_data_only(),
    "dataloader.prefetch_factor",
    "task.sample_",
    "ablation.",
    "tune.",
)  # tune.*: read by runner.tune only


def settings(cfg) -> dict[str, Any]:
    """``checkpoint.*`` as plain values, each checked.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the key and what is allowed.
    """
    c = dict(cfg)
    from runner.config import CHECKPOINT_DEFAULTS

    unknown = sorted(set(c) - set(CHECKPOINT_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"checkpoint.{unknown[0]} is not a checkpoint setting; they are: {', '.join(CHECKPOINT_DEFAULTS)}"
        )

    def bad(key: str, rule: str) -> ConfigError:
        return ConfigError(f"checkpoint.{key}={c[key]!r} {rule}")

    for key in ("every_steps", "keep_last"):
        if c[key] is not None and (not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1):
            raise bad(key, "must be an integer >= 1" + (" or null" if key == "every_steps" else ""))
    if c["keep_last"] is None:
        raise bad("keep_last", "must be an integer >= 1")
    if c["every_minutes"] is not None and (
        not isinstance(c["every_minutes"], (int, float))
        or isinstance(c["every_minutes"], bool)
        or c["every_minutes"] <= 0
    ):
        raise bad("every_minutes", "must be a number of minutes > 0 or null")
    for key in ("at_end", "async", "keep_best"):
        if not isinstance(c[key], bool):
            raise bad(key, "must be true or false")
    if not isinstance(c["resume"], str) or not c["resume"]:
        raise bad("resume", "must be auto, never or the path of a checkpoint folder")
    if not isinstance(c["best_metric"], str) or not c["best_metric"]:
        raise bad("best_metric", "must be the name of a metric the task reports, e.g. eval_loss or eval_accuracy")
    signals = c["signals"]
    if isinstance(signals, str) or not all(isinstance(s, str) for s in (signals or [])):
        raise bad("signals", "must be a list of signal names such as [SIGTERM,SIGUSR1] (or [] for none)")
    c["signals"] = list(signals or [])
    return c


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The dotted keys whose values differ between two resolved configs (``"key: old -> new"``), leaving out
    ``MAY_CHANGE``."""

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out |= flat(v, f"{prefix}{k}.")
            return out
        return {prefix[:-1]: d}

    a, b = flat(trust.moved(copy.deepcopy(saved))), flat(current)  # an older run's moved targets: the same objects
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in keys
        if a.get(k, "<absent>") != b.get(k, "<absent>") and not k.startswith(MAY_CHANGE)
    ]


@dataclass
class ResumePoint:
    """Where a run starts: ``path`` (None: from scratch), the checkpoint's ``meta`` (``runner.json``), and
    ``stale_rows``: whether ``metrics.jsonl`` holds rows of an earlier attempt to drop (those after ``step``)."""

    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    stale_rows: bool = False


def find_resume_point(mode: str, job_dir: Path, resolved: dict[str, Any], total_steps: int) -> ResumePoint:
    """Decide where this run starts (rank 0; the engine broadcasts the answer).

    - ``auto``: the newest complete checkpoint in ``<job_dir>/checkpoints``; with none, from scratch -- an
      earlier attempt's ``metrics.jsonl`` rows are dropped when it never finished (killed before its first
      checkpoint), and a *finished* run's folder (``summary.json``, no checkpoint) is refused.
    - ``never``: from scratch in a folder that holds no earlier run.
    - a path: that checkpoint (another job's, too).

    Raises:
        ConfigError: each refusal above, naming the folder or keys and the fix; a checkpoint written with another
            config (the differing keys, ``MAY_CHANGE`` aside), one at or past this run's last step while the
            folder holds its summary, one whose files no longer match its ``sha256.json``.
    """
    earlier = (job_dir / "metrics.jsonl").exists() or (job_dir / "summary.json").exists()
    finished = (job_dir / "summary.json").exists()
    if mode == "never":
        if earlier:
            raise ConfigError(
                f"the job folder {job_dir} already holds a run (metrics.jsonl/summary.json) and "
                f"checkpoint.resume=never would mix a new run into it; start in a new folder (drop "
                f"hydra.run.dir) or continue that run with checkpoint.resume=auto"
            )
        return ResumePoint()
    if mode == "auto":
        path = latest(job_dir / FOLDER)
        if path is None:
            if finished:
                raise ConfigError(
                    f"the job folder {job_dir} holds a finished run (summary.json) and no checkpoint "
                    f"to continue from; start in a new folder (drop hydra.run.dir)"
                )
            return ResumePoint(stale_rows=earlier)
    else:
        path = Path(mode).expanduser()
    meta = read_meta(path)
    differences = config_differences(meta.get("config", {}), resolved)
    if differences:
        raise ConfigError(
            f"cannot resume from {path}: the config differs in {'; '.join(differences)}. Resume with the "
            f"checkpoint's config (see {path / META_FILE}), or start fresh in a new folder "
            f"(checkpoint.resume=never)"
        )
    step = int(meta["step"])
    if step >= total_steps and finished and path.parent.parent == job_dir:
        raise ConfigError(
            f"the run in {job_dir} already finished at step {step} (trainer.max_steps allows "
            f"{total_steps}); raise trainer.max_steps to train further, or start in a new folder"
        )
    verify_digests(path)  # its files as written (sha256.json), before any of them is read
    return ResumePoint(path=path, meta=meta, step=step, stale_rows=path.parent.parent == job_dir)


#: rank 0's count of this job folder's restarts, outside the checkpoints (``record_restart``)
RESTARTS_FILE = "restarts.json"


def record_restart(job_dir: Path, saved: int) -> int:
    """Count one more restart of the job in ``job_dir`` and return the count (rank 0): the larger of ``saved`` (the
    checkpoint's count) and ``<job_dir>/restarts.json``'s, plus one, written back atomically. Why both:
    docs/checkpointing.md, "Resume"."""
    import json

    path = job_dir / RESTARTS_FILE
    try:
        counted = int(json.loads(path.read_text())["restarts"])
    except (OSError, ValueError, KeyError, TypeError):
        counted = 0
    restarts = max(saved, counted) + 1
    replace_own(path, json.dumps({"restarts": restarts}) + "\n")
    return restarts


def finished_job(job_dir: Path, resolved: dict[str, Any]) -> dict[str, Any] | None:
    """The ``summary.json`` of a run that already finished in ``job_dir`` with this config (``MAY_CHANGE`` aside)
    and the same length (``trainer.max_steps``, ``trainer.max_epochs``), else None: a multirun rerun into its
    sweep folder skips such a job instead of stopping the sweep at it (rank 0 decides)."""
    import json

    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    saved = summary.get("config") if isinstance(summary, dict) else None
    return summary if isinstance(saved, dict) and same_job(saved, resolved) else None


def same_job(saved: dict[str, Any], resolved: dict[str, Any]) -> bool:
    """Whether a run recorded with the resolved config ``saved`` is this one: ``config_differences`` finds nothing
    (``MAY_CHANGE`` aside) and the length is the same (``trainer.max_steps``, ``trainer.max_epochs``)."""
    if config_differences(saved, resolved):
        return False
    before, now = saved.get("trainer") or {}, resolved.get("trainer") or {}
    return all(before.get(k) == now.get(k) for k in ("max_steps", "max_epochs"))


def interrupted_run(
    folders: Iterable[Path], resolved: dict[str, Any], world_size: int, claim: Callable[[Path], bool]
) -> tuple[Path, int] | None:
    """The first of ``folders`` (newest first) that holds an interrupted run of this job, as ``(folder, step)``; None
    when none does. Such a folder has no ``summary.json`` (the run never finished), a complete checkpoint whose config
    is this run's (``same_job``) and whose world size is ``world_size`` (exact resume needs both), and no live run in
    it: ``claim(folder)`` takes its lock for this process, False when another run holds it. A folder whose checkpoint
    cannot be read is passed over (resuming it would stop on the error instead of starting the run)."""
    for folder in folders:
        if (folder / "summary.json").exists():
            continue
        path = latest(folder / FOLDER)
        if path is None:
            continue
        try:
            meta = read_meta(path)
        except ConfigError:
            continue
        saved = meta.get("config")
        if not isinstance(saved, dict) or not same_job(saved, resolved) or meta.get("world_size", 1) != world_size:
            continue
        if claim(folder):
            return folder, int(meta["step"])
    return None
