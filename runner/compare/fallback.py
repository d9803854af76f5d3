"""The interleaved comparison's fallback to rounds: jobs that could not be resident beside their reference.

Which jobs, how they are measured and why drift cancels less well: docs/ablation.md, "Interleaved measurement"
(Fallback to rounds).
"""

from __future__ import annotations

import time
from typing import Any

from runner.files import replace_own

#: A fallback run's measured slice, in slices: each run is one figure, so it is longer than an interleaved slice.
ROUNDS_SLICES = 4
#: What a fallback run's ``summary.json`` is renamed to (the reports take every ``summary.json`` for a job).
RUN_SUMMARY = "run-summary.json"


def measure_in_rounds(conductor: Any, fallback: list[Any], stop: Any) -> None:
    """Measure the deferred jobs (``Conductor.defer``) once the groups and references have finished: per
    configuration, ``interleave.fallback_pairs`` ABBA passes of a fresh reference process and a fresh job process,
    each measured over one slice of ``ROUNDS_SLICES`` x the sweep's slice steps after its warm-up and a settling
    slice; a pass's job slice pairs with its reference slice (group ``"rounds"``). Each run writes into
    ``<folder>/rounds/pass<N>`` (its summary as ``RUN_SUMMARY``); the last one's becomes the job's ``summary.json``.
    ``conductor``: the comparison's ``Conductor``; ``fallback``: its deferred ``Job``s; ``stop``: its ``Stop``."""
    by_config: dict[str, list[Any]] = {}
    for job in fallback:
        by_config.setdefault(job.config, []).append(job)
    passes = 0
    for config, processes in by_config.items():
        processes.sort(key=lambda j: j.name)
        reference = conductor.jobs[processes[0].reference]
        print(
            f"interleave: rounds: {config} against {reference.name}, {conductor.settings.fallback_pairs} pair(s) "
            f"of fresh processes",
            flush=True,
        )
        for i in range(conductor.settings.fallback_pairs):
            if stop.requested:
                return
            job = processes[i % len(processes)]
            pair = [reference, job] if i % 2 == 0 else [job, reference]
            figures = {}
            for position, template in enumerate(pair):
                run = template.fresh(template.folder / "rounds" / f"pass{passes}")
                result = fresh_run(run, conductor.slice_steps)
                if result is not None:
                    figures[template.name] = position
                    conductor.slices.append(
                        {
                            "group": "rounds",
                            "pass": passes,
                            "position": position,
                            "job": template.name,
                            "pairs_with": None,
                            **result,
                            "resume_steps": 0,
                            "time": time.time(),
                            "design": "rounds",
                        }
                    )
                elif template is job:
                    job.status = run.status
            for sl in conductor.slices[-len(figures) :] if figures else []:
                if sl["job"] == job.name and reference.name in figures:
                    sl["pairs_with"] = figures[reference.name]
            passes += 1
            conductor.write()
        for job in processes:
            runs = sorted((job.folder / "rounds").glob(f"pass*/{RUN_SUMMARY}"), key=lambda p: p.stat().st_mtime)
            if runs:
                replace_own(job.folder / "summary.json", runs[-1].read_bytes())
                (job.folder / "failed.json").unlink(missing_ok=True)
                job.status = "measured"
            elif job.status == "pending":
                job.status = "not run (the fallback's passes went to its other processes)"
        measured = sum(
            1
            for sl in conductor.slices
            if sl["group"] == "rounds" and sl["job"] in {p.name for p in processes} and sl["pairs_with"] is not None
        )
        conductor.stopped.append(
            f"rounds: {config}: {measured} of {conductor.settings.fallback_pairs} pair(s) measured"
        )


def fresh_run(run: Any, slice_steps: int) -> dict[str, Any] | None:
    """Start ``run`` (a fresh ``Job``), let it settle for a slice of ``slice_steps``, measure one slice of
    ``ROUNDS_SLICES`` slices, finish it."""
    if not run.start() or run.slice(slice_steps) is None:
        return None
    figures = run.slice(ROUNDS_SLICES * slice_steps)
    run.finish()
    summary = run.folder / "summary.json"
    if summary.is_file():  # the reports read every summary.json under the sweep as a job of its own
        summary.rename(run.folder / RUN_SUMMARY)
    return figures if run.status == "measured" else None
