"""The ablation: what each technique buys on *your* model and data, every configuration measured interleaved.

``python -m runner -m +experiment=ablation model=... data=...`` is a Hydra multirun over ``ablation/variant`` handed
to the interleaved launcher (runner/sweeps/interleaved.py). The ablation's own: the variants not run here
(``not_run``) and the sweep's record and report (``AblationCallback``); docs/ablation.md, "What it runs".
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner import techniques
from runner.errors import ConfigError
from runner.measure import hardware
from runner.report import ReportError, sweep_command, write_report
from runner.track import write_json_atomic

#: The configuration keys an ablation technique (``ablation.technique``) switches, for the ones a task may skip
#: (``Task.skipped``): on a language model these image techniques leave the job as its reference was
#: (runner/techniques/)
TECHNIQUE_KEYS = techniques.variant_keys()


def not_run(cfg: DictConfig, folder: Path) -> str | None:
    """Why this ablation job is not run here, or None (it runs). A variant whose technique cannot act without CUDA
    (the technique table's ``Technique.why_not``; ``ablation.requires=cuda`` for a variant that is no technique of the
    table) on a job that will not use CUDA, a language model's technique on images, or one that does nothing on
    this job (``no_op_reason``), gets
    ``<folder>/not_run.json`` (variant, repeat, reason) and a console line.

    Raises:
        ConfigError: ``ablation.requires`` is not null or ``cuda``.
    """
    a = cfg.ablation
    if a.variant is None:
        return None
    if a.requires not in (None, "cuda"):
        raise ConfigError(f"ablation.requires={a.requires!r} must be null or 'cuda'")
    cuda = hardware.uses_cuda(str(cfg.trainer.device))
    technique = techniques.by_variant(a.get("technique") or "")
    # the table decides (an image technique on token ids: the task says which, no_op_reason); ablation.requires
    # for the variants that are no technique of the table
    job = techniques.Job(cfg, cuda=cuda)
    why = (
        technique.why_not(job)
        if technique
        else ("ablation.requires=cuda" if a.requires == "cuda" and not job.cuda else None)
    )
    if why and not job.cuda and (technique is None or technique.why_not(techniques.Job(cfg, cuda=True)) is None):
        reason = f"needs CUDA ({why}); this job runs on trainer.device={cfg.trainer.device} without CUDA"
    elif why and technique.variant not in TECHNIQUE_KEYS:  # an image technique on token ids: no_op_reason says
        reason = f"does not act on this job ({why})"
    else:
        reason = no_op_reason(cfg)
    if reason is not None:  # recorded, not run: the report lists it with its reason
        write_json_atomic(folder / "not_run.json", {"variant": a.variant, "repeat": a.repeat, "reason": reason})
        print(f"ablation: {a.variant} r{a.repeat} not run: {reason}", flush=True)
    return reason


def no_op_reason(cfg: DictConfig) -> str | None:
    """Why this leave-one-in or leave-one-out variant is its reference's configuration on this job, or None: switching
    each of its keys (``TECHNIQUE_KEYS``) on adds a technique the task skips (``Task.skipped``)."""
    from runner import task as task_mod

    a = cfg.ablation
    keys = TECHNIQUE_KEYS.get(a.get("technique"))
    if not keys or a.get("kind") not in ("leave-one-in", "leave-one-out") or "task" not in cfg:
        return None
    task = task_mod.build(cfg.task)
    reasons = []
    for key in keys:
        on, off = copy.deepcopy(cfg), copy.deepcopy(cfg)
        OmegaConf.update(on, key, True, force_add=True)
        OmegaConf.update(off, key, False, force_add=True)
        added = [r for status, r in task.skipped(on).items() if status not in task.skipped(off)]
        if not added:
            return None
        reasons += added
    what = "; ".join(r.removeprefix("skipped: ") for r in reasons)
    return f"does nothing on this job ({what}): the same configuration as its reference"


class AblationCallback(Callback):
    """Hydra callback of ``+experiment=ablation`` (``hydra.callbacks.ablation_report``).

    ``on_multirun_start`` writes ``<sweep>/ablation.json`` (machine, command, start) and starts the job server
    (a ``TMPDIR`` too long for its socket: exit status 2); ``on_multirun_end`` writes the report (rank 0; none can
    be made: exit status 1). Each failure is one ``error:`` line.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.compare import server

        try:
            server.check_socket_dir()  # a ConfigError here, not a traceback from the first job
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        sweep = Path(config.hydra.sweep.dir)
        sweep.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {
            "command": sweep_command(config.hydra),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "started_s": time.time(),
            "machine": hardware.describe_machine(),
            "job_process": "forkserver",
            "job_server_start_s": round(server.start(), 2),
        }
        write_json_atomic(sweep / "ablation.json", record)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.launch import discover

        if discover().rank != 0:  # under torchrun, ranks > 0 swept in a scratch folder: rank 0 reports
            return
        sweep = Path(config.hydra.sweep.dir)
        path = sweep / "ablation.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        record["finished_s"] = time.time()
        record["load_average_1min_at_end"] = hardware.load_average()
        write_json_atomic(path, record)
        try:
            written = write_report(sweep)
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        print("ablation report: " + ", ".join(str(p) for p in written), flush=True)
