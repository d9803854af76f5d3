"""The interleaved sweep's conductor: resident job processes taking turns, pass after pass.

``run`` receives the sweep's prepared jobs (resolved configs and folders; runner/interleave/launcher.py) and:

1. **Admits** jobs, one at a time, each forked from the job server (runner/ablation.py: torch and runner
   imported once) into a new session (a terminal's Ctrl-C reaches the conductor only), built, and warmed up
   for its ``trainer.warmup_steps`` (at least one step) while every other job waits. References start
   whatever the memory, in the start order (``start_order``), and stay resident to the end. Another job is
   admitted while the free memory the last job reported exceeds the largest footprint so far x
   (``interleave.memory_margin`` + the references still to start), and fewer than ``interleave.max_resident``
   are resident or still to start: the jobs that fit form a *group*.
2. **Calibrates** the slice once, on the sweep's reference: ``interleave.slice_steps``, or the steps that
   take about ``interleave.slice_seconds``. Every job of the sweep trains the same steps per slice, each slice
   after ``interleave.resume_steps`` unmeasured steps (a job that waited a whole pass runs slower at first,
   while the reference runs every third slice: without them, the reference against its own copy read x0.67).
3. **Settles** the group: every resident job trains one slice, not measured. The references wait through each
   group's start-up (minutes, while other processes import, build and compile), and their first slices after
   it read x0.43-0.88 of their later ones, against x0.94-0.96 for the jobs just started (the resnet18/CIFAR
   ablation, docs/ablation.md): without it, every comparison of the group leans towards "faster".
4. **Measures** the group pass after pass (runner/interleave/schedule.py gives the order and the pairs),
   printing one line per pass, until every comparison in the group is within ``±interleave.target_ci``
   (after ``interleave.min_passes``), the group's share of ``interleave.max_minutes`` is spent,
   ``interleave.max_passes`` is reached, or Ctrl-C. Then the group's jobs finish (final evaluation,
   ``summary.json``) and the next group is admitted beside the references.
5. Writes ``interleave.json`` (runner/interleave/record.py) after every pass.
6. **Falls back to rounds** for jobs that had no room beside the references (not even alone: free memory under
   one footprint, or ``interleave.max_resident`` reached) or died for memory there (exit status
   ``EXIT_OUT_OF_MEMORY`` or SIGKILL): once the references have finished, each such configuration runs in
   ``interleave.fallback_pairs`` pairs of fresh processes, reference and job, ABBA (runner/interleave/fallback.py).

Under torchrun every rank runs a conductor that forks its own rank of each job; rank 0's runs the steps above and
tells the others each start, slice and finish before it acts (runner/interleave/ranks.py).

A job that crashes is reported (``failed.json`` in its folder) and the others go on; when a reference
crashes, its group stops. A first Ctrl-C stops after the current slice and finishes every job (the report is
written from what was measured); a second one kills the jobs.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.interleave import record as record_mod
from runner.interleave.schedule import pass_order
from runner.track import write_json_atomic

#: A job process's exit status after a CUDA out-of-memory error (the kernel's out-of-memory killer: -9, SIGKILL).
EXIT_OUT_OF_MEMORY = 4


@dataclass
class Job:
    """One process of the sweep: its name (folder relative to the sweep), resolved config, folder, reference
    (the configuration it is compared with; None for the sweep's reference) and ``config``, the configuration
    it runs (the name of that configuration's first process; None: its own name; ``interleave.processes`` > 1
    runs each configuration in several processes); the conductor fills the rest."""

    name: str
    cfg: DictConfig
    folder: Path
    reference: str | None
    config: str | None = None
    process: Any = None
    connection: Any = None
    status: str = "pending"  # pending | resident | measured | failed (exit N) | ended early
    report: dict[str, Any] = field(default_factory=dict)  # the job's last message (runner/slice_gate.py)
    group: int | str | None = None  # the group it was resident in; "rounds": measured by the fallback
    design: str = "interleaved"  # interleaved | rounds (it could not be resident beside its reference)
    out_of_memory: bool = False  # it failed for want of memory (the fallback measures it again, in rounds)

    def __post_init__(self) -> None:
        self.config = self.config or self.name


class Stop:
    """Ctrl-C: the first sets ``requested`` (stop after the current slice), the second raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> "Stop":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterleave: Ctrl-C: stopping after this slice; every job finishes and the report holds what was "
              "measured (Ctrl-C again to kill the jobs at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _job_body(cfg: DictConfig, job_dir: str, connection: Any, start_method: str | None,
              env: dict[str, str]) -> None:
    """The body of a job process: leave the terminal's process group, install the slice gate, train (with
    ``env`` added to the environment: under torchrun, the job's own rendezvous port, runner/interleave/ranks.py)."""
    os.setsid()
    import torch

    from runner import ablation, slice_gate

    slice_gate.install(connection)
    try:
        ablation._train_forked(cfg, job_dir, env, start_method)
    except torch.OutOfMemoryError:
        import traceback

        traceback.print_exc()
        sys.exit(EXIT_OUT_OF_MEMORY)


class Conductor:
    """Runs the jobs of one interleaved sweep (see the module docstring); ``run`` returns when all finished."""

    def __init__(self, jobs: list[Job], settings: DictConfig, sweep: Path, reference: str, aa: str | None,
                 retire: Any = None, ranks: Any = None):
        """``retire``: optional ``retire(comparisons) -> names``, asked after every pass from the
        ``interleave.min_passes``-th on with ``record.compare`` of the slices so far; the jobs it names finish at
        once and leave the passes (racing: the speed tuner retires candidates firmly slower than their
        reference, so the others get the time). ``ranks``: under torchrun, this conductor's place among the
        ranks' conductors (``runner.interleave.ranks.Ranks``): rank 0's runs the sweep and tells the others
        what to do to their processes of each job (``ranks.follow``); None with one process."""
        self.retire = retire
        self.ranks = ranks
        self.jobs = {j.name: j for j in jobs}
        self.s = settings
        self.sweep = sweep
        self.reference = reference
        self.rng = random.Random(settings.seed)
        self.slices: list[dict[str, Any]] = []
        self.slice_steps: int | None = settings.slice_steps
        self.stopped: list[str] = []
        self.fallback: list[Job] = []  # jobs to measure in rounds after the groups (``_defer``)
        self.record: dict[str, Any] = {"design": "interleaved", "reference": reference, "aa": aa,
                                       "settings": dict(settings), "started": time.time(), "finished": None}
        self.measuring_s = 0.0

    # ------------------------------------------------------------------------------------------- processes
    def _start(self, job: Job) -> bool:
        """Fork ``job``, wait for its first message and warm it up; False when it failed on the way."""
        port = None
        if self.ranks is not None:  # under torchrun: the job's own rendezvous, the same port on every rank
            from runner.interleave.ranks import free_port

            port = free_port()
            self.ranks.tell(("spawn", job.name, port))
        warmup = max(int(job.cfg.trainer.warmup_steps), 1)
        return self._spawn(job, port) and self._slice(job, warmup) is not None

    def _spawn(self, job: Job, port: int | None) -> bool:
        """Fork ``job`` from the job server (rendezvous at ``port`` under torchrun) and wait for its first
        message; False when it ended on the way."""
        from runner import ablation
        from runner.interleave.ranks import job_env

        ctx = ablation._job_server()
        mine, theirs = ctx.Pipe()
        job.process = ctx.Process(target=_job_body, name=f"interleave {job.name}",
                                  args=(job.cfg, str(job.folder), theirs, ctx.get_start_method(),
                                        job_env(port) if port is not None else {}))
        started = time.time()
        job.process.start()
        theirs.close()
        job.connection, job.status = mine, "resident"
        if self._receive(job) is None:
            return False
        # its setup (fork, data, model, FLOP count: up to the first step's gate), for the report: the job's wall
        # time is its resident time, most of it waiting for its turn (runner/report/sweep.py job_times)
        if self.ranks is None or self.ranks.leader:
            write_json_atomic(job.folder / "job.json", {"started": started, "setup_s": time.time() - started,
                                                        "design": "interleaved"})
        return True

    def _receive(self, job: Job) -> dict[str, Any] | None:
        try:
            job.report = job.connection.recv()
            return job.report
        except (EOFError, OSError):
            self._ended(job)
            return None

    def _slice(self, job: Job, steps: int) -> dict[str, Any] | None:
        """Let ``job`` train ``steps`` steps; returns its figures (steps, seconds, samples/s), None if it ended."""
        if self.ranks is not None:
            self.ranks.tell(("slice", job.name, steps))
        before = job.report
        try:
            job.connection.send({"steps": steps})
        except (BrokenPipeError, OSError):
            self._ended(job)
            return None
        after = self._receive(job)
        if after is None:
            return None
        seconds = after["train_time_s"] - before["train_time_s"]
        done = after["step"] - before["step"]
        return {"steps": done, "seconds": seconds,
                "samples_per_sec": done * after["global_batch"] / seconds if seconds > 0 else None}

    def _resumed_slice(self, job: Job) -> dict[str, Any] | None:
        """A measured slice: ``interleave.resume_steps`` unmeasured steps first (a job that waited a whole pass
        runs slower for its first steps; the reference, which runs every third slice, would not), then the slice."""
        warm = self.s.resume_steps if self.s.resume_steps is not None else -(-self.slice_steps // 4)
        if warm and self._slice(job, warm) is None:
            return None
        figures = self._slice(job, self.slice_steps)
        return figures and {**figures, "resume_steps": warm}

    def _ended(self, job: Job) -> None:
        """``job``'s pipe closed: it crashed, or reached ``trainer.max_steps`` before being told to finish."""
        job.process.join()
        code = job.process.exitcode
        if code == 0:
            job.status = "ended early (trainer.max_steps reached: raise it for longer interleaving)"
        else:
            self._failed(job, code)
            print(f"interleave: {job.name} FAILED (exit status {code}); its output is above; the sweep goes on",
                  file=sys.stderr, flush=True)

    def _finish(self, job: Job) -> None:
        """Tell a resident ``job`` to finish (one last step, final evaluation, summary.json) and wait for it."""
        if job.status != "resident":
            return
        if self.ranks is not None:
            self.ranks.tell(("finish", job.name))
        try:
            job.connection.send({"steps": 0})
        except (BrokenPipeError, OSError):
            pass
        job.process.join()
        if job.process.exitcode == 0:
            job.status = "measured"
        else:
            self._failed(job, job.process.exitcode)

    @staticmethod
    def _failed(job: Job, code: int | None) -> None:
        """Record a failed job: its status and ``failed.json`` (what the reports list), as ``ablation.run_job`` does."""
        job.status = f"failed (exit {code})"
        job.out_of_memory = code in (EXIT_OUT_OF_MEMORY, -signal.SIGKILL)
        write_json_atomic(job.folder / "failed.json", {**_variant(job.cfg), "returncode": code, "design": "interleaved"})

    def kill(self) -> None:
        """Kill every resident job (a second Ctrl-C)."""
        for job in self.jobs.values():
            if job.status == "resident" and job.process.is_alive():
                job.process.kill()
                job.process.join()
                job.status = "killed (Ctrl-C)"

    # ---------------------------------------------------------------------------------------------- passes
    def _fits(self, resident: list[Job], refs_to_come: int = 0, margin: float | None = None) -> bool:
        """Whether one more job may start beside ``resident`` while ``refs_to_come`` references (which start
        whatever the memory) are still to start: the least free memory a resident job reported (the latest, as
        memory only fills while jobs start) must exceed the largest footprint so far x (``interleave.memory_margin``
        + ``refs_to_come``); ``margin`` replaces ``interleave.memory_margin`` (1: room for the job itself)."""
        if self.s.max_resident is not None and len(resident) + refs_to_come >= self.s.max_resident:
            return False
        footprint = max((j.report.get("footprint_mb") or 0.0 for j in resident), default=0.0)
        footprint *= self.ranks.per_node if self.ranks is not None else 1  # a job's ranks on this node
        reports = [j.report["available_mb"] for j in resident if j.report.get("available_mb")]
        free = min(reports, default=None)  # the latest report (a reference started after the group's last job)
        margin = self.s.memory_margin if margin is None else margin
        return free is None or free > footprint * (margin + refs_to_come)

    def _calibrate(self, reference: Job) -> None:
        if self.slice_steps is None:
            figures = self._slice(reference, 2)
            step_s = figures["seconds"] / max(figures["steps"], 1) if figures else 1.0
            self.slice_steps = max(1, round(self.s.slice_seconds / max(step_s, 1e-6)))
        print(f"interleave: {self.slice_steps} step(s) per slice"
              + ("" if self.s.slice_steps else f" (about {self.s.slice_seconds:g} s of {self.reference})"), flush=True)

    def run(self, stop: Stop) -> None:
        """Admit, calibrate, measure group after group and finish every job (the module docstring); returns
        early, with the record written, when the sweep's reference fails to start. Ctrl-C: ``stop``."""
        refs = [j for j in self.jobs.values() if j.reference is None or self._is_reference(j.config)]
        order = self.start_order()
        pending = [j for j in order if j not in refs]
        budget_s = 60 * self.s.max_minutes
        admitted = self._start_first_group(refs, order, pending, stop)
        if admitted is None:
            self.write()
            return
        self._calibrate(self.jobs[self.reference])
        group = 1
        while (admitted or pending) and not stop.requested:
            if not admitted:  # the next group (the first was admitted between the references)
                while pending and not stop.requested:
                    here = [j for j in refs if j.status == "resident"] + admitted
                    if admitted and not self._fits(here):
                        break
                    if not admitted and not self._fits(here, margin=1.0):  # not even alone beside the references
                        self._defer(pending.pop(0), "no room beside the references")
                        continue
                    self._admit(pending.pop(0), group, admitted)
                if not admitted:
                    break
            share = budget_s - self.measuring_s
            group_budget = share * len(admitted) / (len(admitted) + len(pending)) if admitted else 0.0
            self._measure(group, [j for j in refs if j.status == "resident"] + admitted, group_budget, stop)
            for job in admitted:
                self._finish(job)
                if job.out_of_memory:
                    self._defer(job, "out of memory beside the others")
            admitted, group = [], group + 1
        for job in refs:
            self._finish(job)
        if self.fallback and not stop.requested:
            from runner.interleave.fallback import measure_in_rounds

            measure_in_rounds(self, self.fallback, stop)
        self.write()

    def _start_first_group(self, refs: list[Job], order: list[Job], pending: list[Job], stop: Stop) -> list[Job] | None:
        """Start the references in ``order`` and admit between them, while they fit (``_fits``, with room kept
        for the references still to start), the first group, taken from the front of ``pending``. Returns the
        group, or None when the sweep's reference failed to start (the reason is in ``self.stopped``)."""
        admitted: list[Job] = []
        for position, job in enumerate(order):
            if job in refs:
                if not self._start(job) and job.name == self.reference:
                    self.stopped.append(f"the reference {job.name} {job.status}")
                    return None
            elif pending and pending[0] is job and not stop.requested and self._fits(
                    [j for j in refs if j.status == "resident"] + admitted,
                    refs_to_come=sum(j in refs for j in order[position + 1:]), margin=None if admitted else 1.0):
                self._admit(pending.pop(0), 1, admitted)
        return admitted

    def start_order(self) -> list[Job]:
        """The order in which processes start: the first process of every configuration (the reference's first),
        then the second of every configuration, and so on. Processes started back to back can share a speed for
        their whole life (measured: a configuration's three processes started one after another sat within 4 %
        of each other while the configurations started before and after them read 10-15 % apart), so the
        processes of one configuration are spread over the start-up instead of started together."""
        by_config: dict[str, list[Job]] = {}
        for job in sorted(self.jobs.values(), key=lambda j: j.config != self.reference):
            by_config.setdefault(job.config, []).append(job)
        rounds = max((len(js) for js in by_config.values()), default=0)
        return [js[r] for r in range(rounds) for js in by_config.values() if r < len(js)]

    def _admit(self, job: Job, group: int, admitted: list[Job]) -> None:
        job.group = group
        print(f"interleave: group {group}: starting {job.name}", flush=True)
        if self._start(job):
            admitted.append(job)
        elif job.out_of_memory:
            self._defer(job, "out of memory when it started beside the others")

    def _is_reference(self, name: str) -> bool:
        return any(j.reference == name for j in self.jobs.values())

    def _measure(self, group: int, resident: list[Job], budget_s: float, stop: Stop) -> None:
        started = time.perf_counter()
        why = None
        for job in resident:  # a settling pass, not measured: each job waited while the group started
            if job.status == "resident" and not stop.requested:
                self._slice(job, self.slice_steps)
        for p in range(self.s.max_passes):
            by_ref: dict[str, list[str]] = {}
            for j in resident:
                if j.status == "resident" and j.reference is not None:
                    by_ref.setdefault(j.reference, []).append(j.name)
            for j in resident:  # further processes of a reference: scheduled beside its first
                if j.status == "resident" and j.reference is None and j.config != j.name and j.config in by_ref:
                    by_ref[j.config].append(j.name)
            if j_ref_missing := [r for r in by_ref if self.jobs[r].status != "resident"]:
                why = f"the reference {j_ref_missing[0]} {self.jobs[j_ref_missing[0]].status}"
                break
            if not by_ref:
                why = "no job left to compare"
                break
            for position, slot in enumerate(pass_order(by_ref, p, self.s.order, self.rng)):
                job = self.jobs[slot.job]
                figures = self._resumed_slice(job) if job.status == "resident" else None
                if figures is not None:
                    self.slices.append({"group": group, "pass": p, "position": position, "job": slot.job,
                                        "pairs_with": slot.pairs_with, **figures, "time": time.time()})
                if stop.requested:
                    break
            elapsed = time.perf_counter() - started
            if self.retire is not None and p + 1 >= self.s.min_passes:
                for name in self.retire(record_mod.compare(self._snapshot())):
                    processes = [j for j in self.jobs.values() if j.config == name and j.status == "resident"
                                 and j.reference is not None]
                    if processes:
                        print(f"interleave: {name} retired after {p + 1} passes (firmly slower than "
                              f"{processes[0].reference})", flush=True)
                    for job in processes:
                        self._finish(job)
            self.write()
            widest = self._progress(group, p, resident, elapsed)
            if stop.requested:
                why = "Ctrl-C"
                break
            if p + 1 >= self.s.min_passes and widest is not None and widest <= self.s.target_ci:
                why = f"every interval within ±{self.s.target_ci:.1%} after {p + 1} passes"
                break
            if elapsed >= budget_s:
                why = f"its share of interleave.max_minutes={self.s.max_minutes:g} spent ({elapsed / 60:.1f} min)"
                break
        else:
            why = f"interleave.max_passes={self.s.max_passes} reached"
        self.measuring_s += time.perf_counter() - started
        self.stopped.append(f"group {group}: {why}")
        print(f"interleave: group {group} stopped: {why}", flush=True)

    # ------------------------------------------------------------------------------------------- the fallback
    def _defer(self, job: Job, why: str) -> None:
        """``job`` cannot be resident beside its reference: it is measured in rounds after the groups."""
        job.group, job.design, job.status = "rounds", "rounds", "pending"
        self.fallback.append(job)
        print(f"interleave: {job.name}: {why}; measured in rounds after the groups", flush=True)

    def _progress(self, group: int, p: int, resident: list[Job], elapsed: float) -> float | None:
        """Print the pass's line; return the widest relative half-width among the group's comparisons (None if
        one has no interval yet)."""
        comparisons = record_mod.compare(self._snapshot())
        names = list(dict.fromkeys(j.config for j in resident if j.reference is not None and j.status == "resident"))
        widths = {n: comparisons.get(n).half_width if comparisons.get(n) else None for n in names}
        aa = comparisons.get(self.record["aa"]) if self.record["aa"] else None
        known = {n: w for n, w in widths.items() if w is not None}
        widest = max(known, key=known.get) if known else None
        print(f"interleave: group {group} pass {p + 1}: {len(names)} job(s), {elapsed / 60:.1f} min; widest interval "
              + (f"±{known[widest]:.1%} ({widest})" if widest else "none yet")
              + (f"; A/A {record_mod.describe(aa)}" if aa else ""), flush=True)
        if None in widths.values() or not known:
            return None
        return known[widest]

    def _snapshot(self) -> dict[str, Any]:
        jobs = {j.name: {"folder": str(j.folder.relative_to(self.sweep)) if j.folder.is_relative_to(self.sweep)
                         else str(j.folder), "config": j.config, "reference": j.reference, "group": j.group, "status": j.status,
                         "footprint_mb": j.report.get("footprint_mb"), "steps": j.report.get("step"),
                         "design": j.design}
                for j in self.jobs.values()}
        return {**self.record, "slice_steps": self.slice_steps, "jobs": jobs, "slices": self.slices,
                "stopped": self.stopped}

    def write(self) -> None:
        """Write ``interleave.json`` (atomically) with every slice so far; ``finished`` once no job is resident."""
        snapshot = self._snapshot()
        if all(j.status not in ("pending", "resident") for j in self.jobs.values()):
            snapshot["finished"] = time.time()
        write_json_atomic(self.sweep / record_mod.FILE, snapshot)


def conduct(conductor: Conductor) -> None:
    """Run ``conductor`` with Ctrl-C handled (``Stop``): the first stops after the current slice and every job
    finishes; a second kills the jobs, writes ``interleave.json`` with what was measured and re-raises
    KeyboardInterrupt for the caller to report."""
    from runner.interleave.ranks import END, follow

    ranks = conductor.ranks
    with Stop() as stop:
        try:
            if ranks is not None and not ranks.leader:
                follow(conductor)  # rank 0's conductor decides; a first Ctrl-C reaches it too
                return
            conductor.run(stop)
            if ranks is not None:
                ranks.tell(END)
        except KeyboardInterrupt:
            conductor.kill()
            if ranks is None or ranks.leader:
                conductor.write()
            raise


def _variant(cfg: DictConfig) -> dict[str, Any]:
    a = cfg.get("ablation") or {}
    return {"variant": a.get("variant"), "repeat": a.get("repeat", 0)} if a.get("variant") else {}
