"""Which jobs may be resident together, and in which order processes start.

The rule and why its margin is 3: docs/ablation.md, "Interleaved measurement" (Memory).
"""

from __future__ import annotations

from typing import Any, Iterable

from omegaconf import DictConfig

from runner.compare.process import Job


def fits(
    resident: list[Job], settings: DictConfig, ranks: Any = None, refs_to_come: int = 0, margin: float | None = None
) -> bool:
    """Whether one more job may start beside ``resident`` while ``refs_to_come`` references (which start whatever
    the memory) are still to start: the least free memory a resident job reported (the latest, as memory only
    fills while jobs start) must exceed the largest footprint so far x (``settings.memory_margin`` +
    ``refs_to_come``); ``margin`` replaces ``settings.memory_margin`` (1: room for the job itself). Under torchrun
    (``ranks``) a job's footprint counts once per process of it on this node."""
    if settings.max_resident is not None and len(resident) + refs_to_come >= settings.max_resident:
        return False
    footprint = max((j.report.get("footprint_mb") or 0.0 for j in resident), default=0.0)
    footprint *= ranks.per_node if ranks is not None else 1
    reports = [j.report["available_mb"] for j in resident if j.report.get("available_mb")]
    free = min(reports, default=None)
    margin = settings.memory_margin if margin is None else margin
    return free is None or free > footprint * (margin + refs_to_come)


def start_order(jobs: Iterable[Job], reference: str) -> list[Job]:
    """The order in which processes start: the first process of every configuration (the reference's first),
    then the second of every configuration, and so on: processes started back to back can share a speed for
    their whole life (docs/benchmarks/ablation-methods.md)."""
    by_config: dict[str, list[Job]] = {}
    for job in sorted(jobs, key=lambda j: j.config != reference):
        by_config.setdefault(job.config, []).append(job)
    rounds = max((len(js) for js in by_config.values()), default=0)
    return [js[r] for r in range(rounds) for js in by_config.values() if r < len(js)]
