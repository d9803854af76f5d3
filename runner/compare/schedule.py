"""The order of one pass of an interleaved sweep, and which slices pair up.

``order="rmit"`` (the default; randomized multiple interleaved trials, Abedi & Brecht, ICPE 2017): every job,
references included, runs once per pass in a fresh random order and pairs with its reference's slice of that pass.
``"abba"`` places each job next to a reference slice, two jobs per reference slice::

    R  J1  J2  R  J3  J4  R  J5

(J1 and J3 pair with the reference slice before them, J2 and J4 with the one after, J5 with the one before) and
reverses the whole pass every other pass (A-B-B-A); ``"random"`` reverses each pass with probability 1/2. The jobs
between reference slices are shuffled every pass (seeded). Why ``rmit`` is the default: docs/ablation.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

ORDERS = ("rmit", "abba", "random")


@dataclass(frozen=True)
class Slot:
    """One slice of a pass: ``job``'s name and, for a measured job, the position in the pass of the reference
    slice it pairs with (None for a reference slice)."""

    job: str
    pairs_with: int | None = None


def pass_order(members: dict[str, list[str]], pass_index: int, order: str, rng: random.Random) -> list[Slot]:
    """The slots of pass ``pass_index``.

    Args:
        members: reference name -> the jobs compared with it (a reference may itself be a member of another
            reference, like the fast preset in an ablation). References are visited in their given order,
            reversed with the pass under ``abba``.
        pass_index: 0, 1, ...
        order: ``"abba"`` or ``"random"`` (the module docstring).
        rng: the sweep's generator (``interleave.seed``): shuffles, and the coin of ``random``.

    Raises:
        ValueError: an unknown ``order``.
    """
    if order not in ORDERS:
        raise ValueError(f"interleave.order={order!r}: choose one of {', '.join(ORDERS)}")
    if order == "rmit":  # every job once per pass, references included, in a fresh random order
        jobs = list(dict.fromkeys([*members, *(j for js in members.values() for j in js)]))
        rng.shuffle(jobs)
        at = {j: i for i, j in enumerate(jobs)}
        ref_of = {j: r for r, js in members.items() for j in js}
        return [Slot(j, at[ref_of[j]] if j in ref_of else None) for j in jobs]
    slots: list[Slot] = []
    for reference, jobs in members.items():
        jobs = list(jobs)
        rng.shuffle(jobs)
        part = [Slot(reference)]
        for i in range(0, len(jobs), 2):
            first = len(slots) + len(part) - 1  # the reference slot just added
            part.append(Slot(jobs[i], first))
            if i + 1 < len(jobs):
                part.append(Slot(jobs[i + 1], first + 3))
                part.append(Slot(reference))
        slots.extend(part)
    flip = pass_index % 2 == 1 if order == "abba" else rng.random() < 0.5
    if not flip:
        return slots
    last = len(slots) - 1
    return [Slot(s.job, None if s.pairs_with is None else last - s.pairs_with) for s in reversed(slots)]


def settings_problem(s: Any) -> str | None:
    """One line naming the bad ``interleave.*`` value (``s``: the node) and the fix, or None."""
    if not isinstance(s.processes, int) or s.processes < 1:
        return f"interleave.processes={s.processes!r}: give the processes per configuration, e.g. 3 (1: one each)"
    if s.processes > 1 and s.order != "rmit":
        return (
            f"interleave.order={s.order} pairs each job with one reference slice; with interleave.processes="
            f"{s.processes} every process trains once per pass: use interleave.order=rmit or "
            f"interleave.processes=1"
        )
    if not isinstance(s.get("fallback_pairs", 4), int) or s.get("fallback_pairs", 4) < 2:
        return (
            f"interleave.fallback_pairs={s.fallback_pairs!r}: a job measured in rounds needs at least 2 pairs "
            f"for an interval, e.g. 4"
        )
    return None
