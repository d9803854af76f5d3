"""The conductor of an interleaved comparison: resident job processes taking turns, pass after pass.

``run`` admits the prepared jobs (``Job``s) while they fit (runner/compare/admission.py), calibrates the slice on
the reference (``calibrated_steps``), lets each group settle for one unmeasured slice, measures it pass after pass
(runner/compare/schedule.py) until ``interleave.target_ci``, ``max_minutes``, ``max_passes`` or Ctrl-C, rewrites
``interleave.json`` after every pass, and hands the jobs with no room beside the references to
runner/compare/fallback.py. Each step, its stopping rules, faults and Ctrl-C, with the measurements behind them:
docs/ablation.md, "Interleaved measurement".
"""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.compare import admission, record as record_mod
from runner.compare.process import Job
from runner.compare.schedule import pass_order
from runner.track import write_json_atomic


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
        print(
            "\ninterleave: Ctrl-C: stopping after this slice; the jobs are then stopped and the report is written "
            "from what was measured (Ctrl-C again to kill the jobs at once)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def calibrated_steps(run_slice, seconds: float, tries: int = 4) -> int:
    """Steps per slice of about ``seconds``, from 2 to ``tries`` slices of growing length until one after the first
    covers half of it; the fastest per-step time wins (timeit's rule: a descheduled moment only slows a slice)."""
    steps, fastest = 2, float("inf")
    for i in range(tries):
        figures = run_slice(steps)
        if not figures or not figures.get("steps"):
            break
        fastest = min(fastest, figures["seconds"] / figures["steps"])
        if i and figures["seconds"] >= seconds / 2:
            break
        steps = max(steps + 1, min(4 * steps, round(seconds / 2 / max(fastest, 1e-6))))
    return 1 if fastest == float("inf") else max(1, round(seconds / max(fastest, 1e-6)))


class Conductor:
    """Runs the jobs of one interleaved comparison (see the module docstring); ``run`` returns when all finished.

    Public state, read by the fallback (runner/compare/fallback.py), the followers under torchrun
    (runner/compare/ranks.py) and the callers: ``jobs`` (name -> ``Job``), ``settings`` (``interleave.*``),
    ``folder``, ``reference``, ``slice_steps``, ``slices`` (every measured slice), ``stopped`` (why each group
    stopped), ``measuring_s`` (seconds spent measuring, start-ups excluded)."""

    def __init__(
        self,
        jobs: list[Job],
        settings: DictConfig,
        folder: Path,
        reference: str,
        aa: str | None,
        retire: Any = None,
        ranks: Any = None,
        enough: Any = None,
    ):
        """``retire``: optional ``retire(comparisons) -> names``, asked after every pass from the
        ``interleave.min_passes``-th on with ``record.compare`` of the slices so far; the jobs it names finish at
        once and leave the passes (racing: the speed tuner retires candidates firmly slower than their
        reference, so the others get the time). ``ranks``: under torchrun, this conductor's place among the
        ranks' conductors (``runner.compare.ranks.Ranks``): rank 0's runs the comparison and tells the others
        what to do to their processes of each job; None with one process. ``enough``: optional ``enough(comparisons)
        -> why or None``, asked like ``retire``: a reason stops the comparison (its caller's verdict is firm)."""
        self.retire, self.enough = retire, enough
        self.ranks = ranks
        self.jobs = {j.name: j for j in jobs}
        for job in jobs:
            job.ranks = ranks
        self.settings = settings
        self.folder = folder
        self.reference = reference
        self.rng = random.Random(settings.seed)
        self.slices: list[dict[str, Any]] = []
        self.slice_steps: int | None = settings.slice_steps
        self.stopped: list[str] = []
        self.fallback: list[Job] = []  # jobs to measure in rounds after the groups (``defer``)
        self.record: dict[str, Any] = {
            "design": "interleaved",
            "reference": reference,
            "aa": aa,
            "settings": dict(settings),
            "started": time.time(),
            "finished": None,
        }
        self.measuring_s = 0.0

    @property
    def resume_steps(self) -> int:
        """Unmeasured steps before each measured slice: ``interleave.resume_steps``, else a quarter of a slice."""
        s = self.settings
        return s.resume_steps if s.resume_steps is not None else -(-self.slice_steps // 4)

    def kill(self) -> None:
        """Kill every resident job (a second Ctrl-C)."""
        for job in self.jobs.values():
            job.kill()

    def _fits(self, resident: list[Job], refs_to_come: int = 0, margin: float | None = None) -> bool:
        return admission.fits(resident, self.settings, self.ranks, refs_to_come, margin)

    def _calibrate(self, reference: Job) -> None:
        if self.slice_steps is None:
            self.slice_steps = calibrated_steps(reference.slice, self.settings.slice_seconds)
        print(
            f"interleave: {self.slice_steps} step(s) per slice"
            + ("" if self.settings.slice_steps else f" (about {self.settings.slice_seconds:g} s of {self.reference})"),
            flush=True,
        )

    def run(self, stop: Stop) -> None:
        """Admit, calibrate, measure group after group and finish every job (the module docstring); returns
        early, with the record written, when the reference fails to start. Ctrl-C: ``stop``."""
        refs = [j for j in self.jobs.values() if j.reference is None or self._is_reference(j.config)]
        order = admission.start_order(self.jobs.values(), self.reference)
        pending = [j for j in order if j not in refs]
        budget_s = 60 * self.settings.max_minutes
        admitted = self._start_first_group(refs, order, pending, stop)
        if admitted is None:
            self.write()
            return
        self._calibrate(self.jobs[self.reference])
        group = 1
        while (admitted or pending) and not stop.requested:
            if not admitted:  # the next group (the first was admitted between the references)
                admitted = self._next_group(refs, pending, group, stop)
                if not admitted:
                    break
            share = budget_s - self.measuring_s
            group_budget = share * len(admitted) / (len(admitted) + len(pending))
            self._measure(group, [j for j in refs if j.resident] + admitted, group_budget, stop)
            if stop.requested:  # Ctrl-C: no final evaluations; conduct stops every job and reports the slices
                break
            for job in admitted:
                job.finish()
                if job.out_of_memory:
                    self.defer(job, "out of memory beside the others")
            admitted, group = [], group + 1
        for job in refs if not stop.requested else []:
            job.finish()
        if self.fallback and not stop.requested:
            from runner.compare.fallback import measure_in_rounds

            measure_in_rounds(self, self.fallback, stop)
        self.write()

    def _next_group(self, refs: list[Job], pending: list[Job], group: int, stop: Stop) -> list[Job]:
        """Admit, from the front of ``pending``, the jobs that fit beside the resident references."""
        admitted: list[Job] = []
        while pending and not stop.requested:
            here = [j for j in refs if j.resident] + admitted
            if admitted and not self._fits(here):
                break
            if not admitted and not self._fits(here, margin=1.0):  # not even alone beside the references
                self.defer(pending.pop(0), "no room beside the references")
                continue
            self._admit(pending.pop(0), group, admitted)
        return admitted

    def _start_first_group(self, refs: list[Job], order: list[Job], pending: list[Job], stop: Stop) -> list[Job] | None:
        """Start the references in ``order`` and admit between them, while they fit (with room kept for the
        references still to start), the first group, taken from the front of ``pending``. Returns the group, or
        None when the comparison's reference failed to start (the reason is in ``self.stopped``)."""
        admitted: list[Job] = []
        for position, job in enumerate(order):
            if job in refs:
                if not job.start() and job.name == self.reference:
                    self.stopped.append(f"the reference {job.name} {job.status}")
                    return None
            elif (
                pending
                and pending[0] is job
                and not stop.requested
                and self._fits(
                    [j for j in refs if j.resident] + admitted,
                    refs_to_come=sum(j in refs for j in order[position + 1 :]),
                    margin=None if admitted else 1.0,
                )
            ):
                self._admit(pending.pop(0), 1, admitted)
        return admitted

    def _admit(self, job: Job, group: int, admitted: list[Job]) -> None:
        job.group = group
        print(f"interleave: group {group}: starting {job.name}", flush=True)
        if job.start():
            admitted.append(job)
        elif job.out_of_memory:
            self.defer(job, "out of memory when it started beside the others")

    def _is_reference(self, name: str) -> bool:
        return any(j.reference == name for j in self.jobs.values())

    def _pairs(self, resident: list[Job]) -> dict[str, list[str]]:
        """Reference -> the resident jobs compared with it this pass (further processes of a reference are
        scheduled beside its first)."""
        by_ref: dict[str, list[str]] = {}
        for j in resident:
            if j.resident and j.reference is not None:
                by_ref.setdefault(j.reference, []).append(j.name)
        for j in resident:
            if j.resident and j.reference is None and j.config != j.name and j.config in by_ref:
                by_ref[j.config].append(j.name)
        return by_ref

    def _measure(self, group: int, resident: list[Job], budget_s: float, stop: Stop) -> None:
        started = time.perf_counter()
        deadline = started + budget_s  # no slice starts after it: the budget bounds the measuring to one slice
        why = None
        for job in resident:  # a settling pass, not measured: each job waited while the group started
            if job.resident and not stop.requested:
                job.slice(self.slice_steps)
        for p in range(self.settings.max_passes):
            by_ref = self._pairs(resident)
            if missing := [r for r in by_ref if not self.jobs[r].resident]:
                why = f"the reference {missing[0]} {self.jobs[missing[0]].status}"
                break
            if not by_ref:
                why = "no job left to compare"
                break
            self._one_pass(group, p, by_ref, stop, deadline)
            elapsed = time.perf_counter() - started
            if self.retire is not None and p + 1 >= self.settings.min_passes:
                self._race(p)
            self.write()
            widest = self._progress(group, p, resident, elapsed)
            why = self._why_stop(p, widest, elapsed, budget_s, stop)
            if why:
                break
        else:
            why = f"interleave.max_passes={self.settings.max_passes} reached"
        self.measuring_s += time.perf_counter() - started
        self.stopped.append(f"group {group}: {why}")
        print(f"interleave: group {group} stopped: {why}", flush=True)

    def _one_pass(self, group: int, p: int, by_ref: dict[str, list[str]], stop: Stop, deadline: float) -> None:
        """Every job of ``by_ref`` (and its reference) trains one measured slice, in the pass's order, until the
        group's ``deadline`` (``time.perf_counter``): a pass cut short pairs only the slices it has."""
        for position, slot in enumerate(pass_order(by_ref, p, self.settings.order, self.rng)):
            if time.perf_counter() >= deadline:
                break
            job = self.jobs[slot.job]
            figures = job.resumed_slice(self.slice_steps, self.resume_steps) if job.resident else None
            if figures is not None:
                self.slices.append(
                    {
                        "group": group,
                        "pass": p,
                        "position": position,
                        "job": slot.job,
                        "pairs_with": slot.pairs_with,
                        **figures,
                        "time": time.time(),
                    }
                )
            if stop.requested:
                break

    def _race(self, p: int) -> None:
        """Finish the configurations ``retire`` names (firmly slower than their reference)."""
        for name in self.retire(record_mod.compare(self.snapshot())):
            processes = [j for j in self.jobs.values() if j.config == name and j.resident and j.reference is not None]
            if processes:
                print(
                    f"interleave: {name} retired after {p + 1} passes (firmly slower than {processes[0].reference})",
                    flush=True,
                )
            for job in processes:
                job.finish()

    def _why_stop(self, p: int, widest: float | None, elapsed: float, budget_s: float, stop: Stop) -> str | None:
        s = self.settings
        if stop.requested:
            return "Ctrl-C"
        if p + 1 >= s.min_passes and widest is not None and widest <= s.target_ci:
            return f"every interval within ±{s.target_ci:.1%} after {p + 1} passes"
        if self.enough is not None and p + 1 >= s.min_passes:
            said = self.enough(record_mod.compare(self.snapshot()))
            if said:
                return f"{said} after {p + 1} passes"
        if elapsed >= budget_s:
            return f"its share of interleave.max_minutes={s.max_minutes:g} spent ({elapsed / 60:.1f} min)"
        return None

    def defer(self, job: Job, why: str) -> None:
        """``job`` cannot be resident beside its reference: it is measured in rounds after the groups."""
        job.group, job.design, job.status = "rounds", "rounds", "pending"
        self.fallback.append(job)
        print(f"interleave: {job.name}: {why}; measured in rounds after the groups", flush=True)

    def _progress(self, group: int, p: int, resident: list[Job], elapsed: float) -> float | None:
        """Print the pass's line; return the widest relative half-width among the group's comparisons (None if
        one has no interval yet)."""
        comparisons = record_mod.compare(self.snapshot())
        names = list(dict.fromkeys(j.config for j in resident if j.reference is not None and j.resident))
        widths = {n: comparisons.get(n).half_width if comparisons.get(n) else None for n in names}
        aa = comparisons.get(self.record["aa"]) if self.record["aa"] else None
        known = {n: w for n, w in widths.items() if w is not None}
        widest = max(known, key=known.get) if known else None
        print(
            f"interleave: group {group} pass {p + 1}: {len(names)} job(s), {elapsed / 60:.1f} min; widest interval "
            + (f"±{known[widest]:.1%} ({widest})" if widest else "none yet")
            + (f"; A/A {record_mod.describe(aa)}" if aa else ""),
            flush=True,
        )
        if None in widths.values() or not known:
            return None
        return known[widest]

    def snapshot(self) -> dict[str, Any]:
        """The record so far (the keys of runner/compare/record.py)."""
        jobs = {
            j.name: {
                "folder": str(j.folder.relative_to(self.folder))
                if j.folder.is_relative_to(self.folder)
                else str(j.folder),
                "config": j.config,
                "reference": j.reference,
                "group": j.group,
                "status": j.status,
                "footprint_mb": j.report.get("footprint_mb"),
                "steps": j.report.get("step"),
                "design": j.design,
            }
            for j in self.jobs.values()
        }
        return {
            **self.record,
            "slice_steps": self.slice_steps,
            "jobs": jobs,
            "slices": self.slices,
            "stopped": self.stopped,
        }

    def write(self) -> None:
        """Write ``interleave.json`` (atomically) with every slice so far; ``finished`` once no job is resident."""
        snapshot = self.snapshot()
        if all(j.status not in ("pending", "resident") for j in self.jobs.values()):
            snapshot["finished"] = time.time()
        write_json_atomic(self.folder / record_mod.FILE, snapshot)


def conduct(conductor: Conductor) -> None:
    """Run ``conductor`` with Ctrl-C handled (``Stop``): the first stops after the current slice, the second at
    once; either way every job is killed (no final evaluation: seconds, not a minute per job), ``interleave.json``
    holds every slice measured, and KeyboardInterrupt is raised for the caller to report (the reports read an
    unfinished job's figures from its slices)."""
    from runner.compare.ranks import END, KILL, follow

    ranks = conductor.ranks
    with Stop() as stop:
        try:
            if ranks is not None and not ranks.leader:
                follow(conductor)  # rank 0's conductor decides; a first Ctrl-C reaches it too
                return
            conductor.run(stop)
            if stop.requested:
                raise KeyboardInterrupt
            if ranks is not None:
                ranks.tell(END)
        except KeyboardInterrupt:
            if ranks is not None and ranks.leader:
                ranks.tell(KILL)
            conductor.kill()
            if ranks is None or ranks.leader:
                conductor.write()
            raise
