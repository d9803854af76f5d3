"""A recipe search's trials, ``hydra.sweeper.n_jobs`` at a time, each in a process of its own on this machine, the
next one started as soon as one ends.

Hydra's sweeper API launches a batch and waits for all of it (the request to change that, hydra #3091, was closed
as not planned), so a batch of trials idles a slot for as long as its slowest trial runs on; and Hydra's basic
launcher runs a batch one job after the other. Here the search asks a trial whenever a slot frees (Optuna's
ask-and-tell; the TPE sampler's constant liar keeps running trials apart) and starts ``python -m runner`` with the
trial's overrides in ``<sweep>/<job>``. Each trial finds its own trial in the study through ``TRIAL_ENV``
(``runner.sweeps.pruning.listener``), so a pruner acts on it across processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from runner import objective
from runner.objective import TRIAL_ENV


@dataclass
class Running:
    """One job's process: what it runs for (``key``: a trial, a verification run), its folder, process and start
    (``time.monotonic``)."""

    key: Any
    folder: Path
    proc: subprocess.Popen
    started: float


@dataclass
class Slots:
    """``n`` slots for job processes; ``busy_s`` sums the seconds slots were busy, ``since`` the first start (for
    the share of slot-time used: ``utilization``). ``threads``: the ``trainer.num_threads`` each job gets where
    its config leaves it null (``threads_each``), else None."""

    n: int
    threads: int | None = None
    running: list[Running] = field(default_factory=list)
    busy_s: float = 0.0
    since: float | None = None

    def start(self, key: Any, folder: Path, argv: list[str], trial: dict[str, Any] | None = None) -> None:
        """Start ``python -m runner ARGV hydra.run.dir=<folder>`` for ``key`` (a single run: ``hydra.mode=RUN``; its
        console in ``<folder>/console.log``); ``trial``: the study's trial it runs (``TRIAL_ENV``: ``storage``,
        ``study_name``, ``pruner``, ``trial_id``), for its pruning reports."""
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **({TRIAL_ENV: json.dumps(trial)} if trial is not None else {})}
        threads = [f"trainer.num_threads={self.threads}"] if self.threads else []  # first: ARGV's own wins
        command = [sys.executable, "-m", "runner", *threads, *argv, "hydra.mode=RUN", f"hydra.run.dir={folder}"]
        from runner.files import open_own

        with open_own(folder / "console.log", "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.running.append(Running(key, folder, proc, now))

    def wait_one(self, poll_s: float = 0.1) -> tuple[Running, int]:
        """Wait until a trial's process ends; it (removed from the slots) and its exit status."""
        while True:
            for r in self.running:
                code = r.proc.poll()
                if code is not None:
                    self.running.remove(r)
                    self.busy_s += time.monotonic() - r.started
                    return r, code
            time.sleep(poll_s)

    def utilization(self) -> float | None:
        """The share of the slots' time (``n`` × the time since the first start) that jobs used, those still
        running included."""
        if self.since is None:
            return None
        now = time.monotonic()
        span = self.n * (now - self.since)
        return (self.busy_s + sum(now - r.started for r in self.running)) / span if span > 0 else None

    def stop(self) -> None:
        """Stop every running trial (the search was interrupted)."""
        for r in self.running:
            r.proc.terminate()
        for r in self.running:
            r.proc.wait()


def threads_each(config: Any, n: int) -> int | None:
    """The intra-op threads each of ``n`` jobs at once gets, this process's CPUs shared out (at least 1), where
    ``config.trainer.num_threads`` is null; None where the config sets it. torch's default is every core for each
    process: two trials on two cores then ran each step ~30x slower than one alone."""
    if OmegaConf.select(config, "trainer.num_threads") is not None:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // n)


def job_return(folder: Path, code: int, metric: str) -> JobReturn:
    """What Hydra's launcher returns for a job, for a trial that ran in a process of its own: its figure ``metric``
    from its ``summary.json`` (None where the run has none), or a failure with the exit status."""
    ret = JobReturn()
    ret.hydra_cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(folder)}}})
    path = folder / "summary.json"
    summary = json.loads(path.read_text()) if code == 0 and path.is_file() else None
    if summary is None:
        ret.status = JobStatus.FAILED
        ret._return_value = RuntimeError(
            f"python -m runner exited with status {code} (its console: {folder / 'console.log'})"
        )
        return ret
    ret.status = JobStatus.COMPLETED
    ret._return_value = objective.value(summary, metric)
    return ret
