"""``interleave.json``: what an interleaved comparison measured, and the comparisons it supports.

The conductor rewrites it after every pass; its keys: docs/ablation.md, "Interleaved measurement" (What it
writes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from runner.compare import stats

FILE = "interleave.json"


def load(sweep: Path) -> dict[str, Any] | None:
    """The record of the sweep in ``sweep``, or None when it was not interleaved.

    Raises:
        ValueError: the file exists but cannot be read (the message names it).
    """
    path = Path(sweep) / FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({e}); run the sweep again") from e
    wrong = malformed(record)
    if wrong:
        raise ValueError(
            f"{path} is not a record runner's conductor wrote: {wrong}; run the sweep again (or restore the file)"
        )
    return record


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _group(v: Any) -> bool:  # a group's number, or "rounds" (measured in rounds of fresh processes: fallback.py)
    return _integer(v) or v == "rounds"


#: what the conductor writes, per key: the test its value passes; a key marked optional may be absent or null
_TOP = {
    "reference": (_text, False),
    "aa": (_text, True),
    "settings": (lambda v: isinstance(v, dict), False),
    "started": (_number, True),
    "finished": (_number, True),
    "slice_steps": (_integer, True),
    "jobs": (lambda v: isinstance(v, dict), False),
    "slices": (lambda v: isinstance(v, list), False),
    "stopped": (lambda v: isinstance(v, list) and all(map(_text, v)), True),
    "design": (_text, True),
}
_JOB = {
    "folder": (_text, True),
    "config": (_text, True),
    "reference": (_text, True),
    "group": (_group, True),
    "status": (_text, False),
    "footprint_mb": (_number, True),
    "steps": (_integer, True),
    "design": (_text, True),
}
_SLICE = {
    "group": (_group, False),
    "pass": (_integer, False),
    "position": (_integer, True),
    "job": (_text, False),
    "pairs_with": (_integer, True),
    "steps": (_integer, True),
    "seconds": (_number, True),
    "samples_per_sec": (lambda v: _number(v) and v >= 0, True),
    "resume_steps": (_integer, True),
    "time": (_number, True),
}


def _wrong(where: str, item: Any, spec: dict[str, tuple[Any, bool]]) -> str | None:
    if not isinstance(item, dict):
        return f"{where} is {type(item).__name__}, not an object"
    for key, (test, optional) in spec.items():
        value = item.get(key)
        if (value is None and not optional) or (value is not None and not test(value)):
            return f"{where}{'.' if where else ''}{key} is {value!r}"
    return None


def malformed(record: Any) -> str | None:
    """What in a parsed ``interleave.json`` is not what the conductor writes (the first key of the wrong type or
    missing, or a slice naming no job), or None: the readers index it without checking."""
    wrong = _wrong("", record, _TOP)
    if (
        wrong is None
        and (confidence := record.get("settings", {}).get("confidence")) is not None
        and not (_number(confidence) and 0 < confidence < 1)
    ):
        wrong = f"settings.confidence is {confidence!r}"
    for name, job in (record.get("jobs") or {}).items() if wrong is None else ():
        if (wrong := _wrong(f"jobs.{name}", job, _JOB)) is not None:
            return wrong
    for i, piece in enumerate(record.get("slices") or []) if wrong is None else ():
        if wrong := _wrong(f"slices[{i}]", piece, _SLICE) or (
            None if piece["job"] in record["jobs"] else f"slices[{i}].job {piece['job']!r} is not in jobs"
        ):
            return wrong
    return wrong


def configs(record: dict[str, Any]) -> dict[str, list[str]]:
    """Configuration -> the names of its processes (one each unless ``interleave.processes`` > 1)."""
    out: dict[str, list[str]] = {}
    for name, job in record["jobs"].items():
        out.setdefault(job.get("config") or name, []).append(name)
    return out


def replicated(record: dict[str, Any]) -> bool:
    """True when some configuration ran in more than one process: comparisons are then between processes."""
    return any(len(names) > 1 for names in configs(record).values())


def process_means(record: dict[str, Any]) -> dict[str, float]:
    """Process -> its mean log samples/s relative to the sweep reference's processes in the same pass: per
    (group, pass), ``log x - mean(log r)`` over the reference configuration's slices of that pass; passes without
    a reference slice are left out (the reference's processes are resident throughout)."""
    reference = set(configs(record).get(record["reference"], [record["reference"]]))
    by_pass: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for s in record.get("slices", []):
        if s.get("samples_per_sec"):
            by_pass.setdefault((s["group"], s["pass"]), []).append(s)
    sums: dict[str, list[float]] = {}
    for slices in by_pass.values():
        ref = [math.log(s["samples_per_sec"]) for s in slices if s["job"] in reference]
        if not ref:
            continue
        centre = sum(ref) / len(ref)
        for s in slices:
            sums.setdefault(s["job"], []).append(math.log(s["samples_per_sec"]) - centre)
    return {name: sum(v) / len(v) for name, v in sums.items()}


def _between(record: dict[str, Any], confidence: float | None) -> Any:
    """``compare(a, b)`` for a replicated record: configuration ``a`` against ``b`` (``stats.between_processes``,
    the spread pooled over every configuration of the sweep)."""
    level = confidence or record.get("settings", {}).get("confidence", 0.95)
    means, groups = process_means(record), configs(record)
    per_config = {c: [means[n] for n in names if n in means] for c, names in groups.items()}
    sd, df = stats.pooled_spread(list(per_config.values()))
    return lambda a, b: stats.between_processes(per_config.get(a, []), per_config.get(b, []), sd, df, level)


def _pass_ratios(record: dict[str, Any]) -> dict[tuple[int, int], dict[str, float]]:
    """(group, pass) -> job -> ``log(job samples/s ÷ its reference's in the paired slice)``, in order of
    measurement; slices without a measured partner are left out."""
    slices: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for s in record.get("slices", []):
        slices.setdefault((s["group"], s["pass"]), {})[s["position"]] = s
    out: dict[tuple[int, int], dict[str, float]] = {}
    for key, by_position in slices.items():
        for s in by_position.values():
            partner = by_position.get(s["pairs_with"]) if s.get("pairs_with") is not None else None
            if partner and s["samples_per_sec"] and partner["samples_per_sec"]:
                out.setdefault(key, {})[s["job"]] = math.log(s["samples_per_sec"] / partner["samples_per_sec"])
    return out


def log_ratios(record: dict[str, Any]) -> dict[str, list[float]]:
    """Every job's paired log ratios with its reference, one per pass that measured both."""
    out: dict[str, list[float]] = {}
    for ratios in _pass_ratios(record).values():
        for job, value in ratios.items():
            out.setdefault(job, []).append(value)
    return out


def compare(record: dict[str, Any], confidence: float | None = None) -> dict[str, stats.Interval | None]:
    """Each compared configuration's comparison with its own reference: ``stats.paired`` over passes (None below
    2 pairs), or with several processes per configuration ``stats.between_processes`` (keyed by configuration)."""
    level = confidence or record.get("settings", {}).get("confidence", 0.95)
    if replicated(record):
        between = _between(record, level)
        return {
            c: between(c, record["jobs"][names[0]]["reference"])
            for c, names in configs(record).items()
            if record["jobs"][names[0]].get("reference") is not None
        }
    ratios = log_ratios(record)
    return {
        name: stats.paired(ratios.get(name, []), level)
        for name, job in record["jobs"].items()
        if job.get("reference") is not None
    }


def chained(record: dict[str, Any], name: str, target: str, confidence: float | None = None) -> stats.Interval | None:
    """``name`` against ``target`` when ``name``'s reference is itself compared with ``target`` (a
    leave-one-out job against the baseline, through the fast preset): per pass, the sum of the two paired log
    ratios of that pass; None when the chain does not reach ``target`` or has fewer than 2 passes. With several
    processes per configuration, every process is measured against the sweep's reference, so ``name`` is
    compared with ``target`` directly."""
    if replicated(record):
        return _between(record, confidence)(name, target)
    jobs, chain = record["jobs"], [name]
    while chain[-1] != target:
        ref = jobs.get(chain[-1], {}).get("reference")
        if ref is None or ref in chain:
            return None
        chain.append(ref)
    per_pass = _pass_ratios(record)
    sums = [sum(d[j] for j in chain[:-1]) for d in per_pass.values() if all(j in d for j in chain[:-1])]
    return stats.paired(sums, confidence or record.get("settings", {}).get("confidence", 0.95))


def versus(record: dict[str, Any], name: str, other: str, confidence: float | None = None) -> stats.Interval | None:
    """``name`` against ``other`` when both are compared with the same reference (a job against the reference's
    copy A'): per pass, ``name``'s paired log ratio minus ``other``'s; None below 2 passes that measured both.
    With several processes per configuration: the two configurations' processes compared directly."""
    if replicated(record):
        return _between(record, confidence)(name, other)
    diffs = [d[name] - d[other] for d in _pass_ratios(record).values() if name in d and other in d]
    return stats.paired(diffs, confidence or record.get("settings", {}).get("confidence", 0.95))


def aa_comparison(record: dict[str, Any]) -> stats.Interval | None:
    """The reference against its copy (A'): the sweep's own noise, or None without a copy."""
    aa = record.get("aa")
    return compare(record).get(aa) if aa else None


def describe(c: stats.Interval | None) -> str:
    """``"×1.003 [0.981–1.026]"`` or ``"no interval"``."""
    return f"×{c.estimate:.3f} [{c.low:.3f}–{c.high:.3f}]" if c else "no interval"
