"""The figures of an interleaved sweep (``hydra/launcher=interleaved``) in its reports.

A sweep measured by the interleaved launcher holds ``interleave.json`` (runner/compare/record.py): every
slice's samples/s and which reference slice it pairs with. From it:

- ``job_comparisons``: per job, the paired speed-up over its reference with its 95 % interval, Holm's verdict (the
  reference's copy left out of the family) and the number of pairs, for the plain sweep report's columns.
- ``apply_to_rows``: the same for an ablation's rows (runner/report/rows.py): the speed-up against the
  baseline (a leave-one-out configuration through the fast preset, pass by pass) and the effect against
  the row's own reference replace the point figures, with Holm's verdicts and the ranks.
- ``noise_lines``: the sweep's A/A interval (the reference against its copy), the minimum detectable effect
  at its level, and how the sweep ran (groups, slices, why it stopped), as markdown.
"""

from __future__ import annotations

import time
from typing import Any

from runner.compare import record as record_mod, stats as paired_stats
from runner.compare.stats import NO_INTERVAL, Interval

DESIGN = "interleaved"


def _word(verdict: str, c: Interval | None, faster: str, slower: str) -> str:
    if c is None:
        return NO_INTERVAL
    if verdict == paired_stats.HELPS:
        return faster
    if verdict == paired_stats.HURTS:
        return slower
    said = f"no effect larger than ±{paired_stats.equivalence_margin(c):.1%}"
    if c.low > 1 or c.high < 1:  # apart from 1 by its own interval, not after Holm's step-down over the sweep
        said += f" ({faster if c.low > 1 else slower} by its own interval, not firm after Holm)"
    return said


def job_comparisons(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Folder name -> ``{"speedup", "ci_low", "ci_high", "verdict", "design", "pairs", "reference"}`` for
    every job of a plain interleaved sweep (the reference: speed-up 1, verdict ``reference``)."""
    comparisons = record_mod.compare(record)
    aa = record.get("aa")
    config_of = {name: job.get("config") or name for name, job in record["jobs"].items()}
    family = [n for n in comparisons if n != aa]
    verdicts = dict(
        zip(family, paired_stats.verdicts([comparisons[n] for n in family], record["settings"].get("confidence", 0.95)))
    )
    if aa in comparisons:  # the noise check: its own test, outside the family
        verdicts[aa] = paired_stats.verdicts([comparisons[aa]])[0]
    out: dict[str, dict[str, Any]] = {}
    for name, job in record["jobs"].items():
        config = config_of[name]
        c = comparisons.get(config)
        if job.get("reference") is None:
            out[name] = {
                "speedup": 1.0,
                "ci_low": None,
                "ci_high": None,
                "verdict": "reference",
                "design": job.get("design", DESIGN),
                "pairs": None,
                "reference": None,
            }
            continue
        out[name] = {
            "speedup": c and c.estimate,
            "ci_low": c and c.low,
            "ci_high": c and c.high,
            "verdict": _word(verdicts.get(config, ""), c, "faster", "slower")
            + (" (A/A: the reference's copy)" if config == aa else ""),
            "design": job.get("design", DESIGN),
            "pairs": c and c.n,
            "reference": job["reference"],
        }
    return out


def _unmeasured(row: Any) -> bool:
    """A row none of whose jobs measured, and whose jobs say why (``failed.json`` or ``not_run.json``)."""
    return not row.runs and any(j.failed is not None or j.not_run for j in row.jobs)


def apply_to_rows(rows: list[Any], record: dict[str, Any]) -> None:
    """Replace each measured ablation row's (``runner.report.load.Row``) speed-up, effect, their intervals and verdict
    with the paired figures of ``record`` (see the module docstring); rank the rows again. Rows whose job has no pairs
    keep no interval; rows without a measured process (failed, not run) keep the reason their jobs gave."""
    confidence = record["settings"].get("confidence", 0.95)
    comparisons = record_mod.compare(record)
    baseline = record["reference"]
    named = {str(j.folder): r for r in rows for j in r.jobs if j.repeat == 0}
    effects: dict[str, Interval | None] = {}
    for name, row in named.items():
        if name not in record["jobs"] or _unmeasured(row):  # a failed or not-run job keeps its reason as verdict
            continue
        row.design = record["jobs"][name].get("design", DESIGN)
        if row.kind == "baseline":
            continue
        own = comparisons.get(name)
        to_base = (
            own
            if record["jobs"][name].get("reference") == baseline
            else record_mod.chained(record, name, baseline, confidence)
        )
        row.speedup_ci = to_base
        row.speedup = to_base.estimate if to_base else row.speedup
        row.effect_ci = (own.inverted() if row.kind == "leave-one-out" else own) if own else None
        row.effect = row.effect_ci.estimate if own else None
        if not row.all_skipped:
            effects[name] = own
    verdicts = dict(zip(effects, paired_stats.verdicts(list(effects.values()), confidence)))
    for name, verdict in verdicts.items():
        row, c = named[name], effects[name]
        if row.kind == "leave-one-out" and verdict in (paired_stats.HELPS, paired_stats.HURTS):
            verdict = paired_stats.HURTS if verdict == paired_stats.HELPS else paired_stats.HELPS  # fast ÷ this
        faster, slower = ("faster", "slower") if row.kind == "fast" else (paired_stats.HELPS, paired_stats.HURTS)
        row.verdict = _word(verdict, c.inverted() if row.kind == "leave-one-out" and c else c, faster, slower)
    aa = record_mod.aa_comparison(record)
    base = named.get(next((n for n in named if named[n].kind == "baseline"), ""), None)
    if base is not None:
        base.speedup, base.effect = 1.0, 1.0
        base.speedup_ci = aa
    rows.sort(key=lambda r: (r.speedup is None, -(r.speedup or 0), r.configuration))
    rank = 0
    for row in rows:
        row.rank = None
        if row.speedup_ci and row.speedup_ci.low > 1 and not row.all_skipped and row.kind != "baseline":
            rank += 1
            row.rank = rank


#: The pass order (``interleave.order``, runner/compare/schedule.py) in one sentence.
ORDER_TEXT = {
    "rmit": "In each pass every job, the references included, trained one slice, in a fresh random order "
    "(randomized multiple interleaved trials), and each job pairs with its reference's slice of that pass.",
    "abba": "In each pass every job trained one slice next to a slice of its reference (R J J R ..., reversed every "
    "other pass), and pairs with that adjacent slice.",
    "random": "In each pass every job trained one slice next to a slice of its reference (R J J R ..., reversed at "
    "random), and pairs with that adjacent slice.",
}


def _resume(record: dict[str, Any]) -> str:
    steps = {sl.get("resume_steps") for sl in record.get("slices", []) if sl.get("resume_steps") is not None}
    return "/".join(str(v) for v in sorted(steps)) or "0"


def _units(record: dict[str, Any]) -> str:
    return "processes" if record_mod.replicated(record) else "pairs"


def noise_lines(record: dict[str, Any]) -> list[str]:
    """Markdown: how the interleaved sweep measured, its A/A interval and minimum detectable effect."""
    s, aa = record["settings"], record_mod.aa_comparison(record)
    jobs = record["jobs"]
    groups: dict[Any, list[str]] = {}
    for name, job in jobs.items():
        groups.setdefault(job.get("group"), []).append(name)
    refs = groups.pop(None, [])
    fallback = groups.pop("rounds", [])
    passes = {}
    for sl in record.get("slices", []):
        passes[sl["group"]] = max(passes.get(sl["group"], 0), sl["pass"] + 1)
    level, order = s.get("confidence", 0.95), ORDER_TEXT.get(s.get("order"), "")
    if record_mod.replicated(record):
        order = (
            "In each pass every process trained one slice, in a fresh random order (randomized multiple "
            "interleaved trials)."
        )
        df = sum(len(names) - 1 for names in record_mod.configs(record).values())
        statistic = (
            f"Every configuration ran in {s.get('processes')} processes (the process is the unit of replication: "
            f"identical processes can differ for their whole life; on this project's CPU VM by up to 25 % with "
            f"glibc's malloc as it comes, by about 2 % with trainer.host_allocator=reuse, the default). A process's "
            f"figure is its mean log samples/s relative to the reference's processes in the same passes, so drift "
            f"slower than a pass cancels; a speed-up is exp(difference of the configurations' means over their "
            f"processes) with a {level:.0%} two-sample t interval whose spread is pooled between the processes of "
            f"every configuration ({df} degrees of freedom)"
        )
    else:
        statistic = (
            "A job's figure per pass is the ratio of its slice's samples/s to its reference's paired slice (the "
            "paired ratio), so drift slower than a pass cancels. A speed-up is exp(mean log ratio) over the passes "
            f"with a {level:.0%} Student-t interval (paired t-test on log ratios)"
        )
    lines = [
        "## How this sweep was measured: interleaved",
        "",
        f"Every job was resident in its own process; the jobs took turns training {record.get('slice_steps')} "
        f"optimizer step(s) per slice (after {_resume(record)} unmeasured step(s)) while the others waited "
        f"(blocked on a pipe: no core, no GPU work). {order} {statistic}; verdicts "
        f"use Holm's step-down procedure over the sweep's comparisons (family-wise error {1 - level:.0%}).",
        "",
        f"- References (resident throughout): {', '.join(f'`{r}`' for r in refs)}",
    ]
    for g in sorted(groups):
        lines.append(
            f"- Group {g}: {len(groups[g])} job(s), {passes.get(g, 0)} pass(es): "
            + ", ".join(f"`{n}`" for n in groups[g])
        )
    if fallback:
        pairs = sum(
            1 for sl in record.get("slices", []) if sl["group"] == "rounds" and sl.get("pairs_with") is not None
        )
        lines.append(
            "- Measured in rounds instead (no room beside the references, or out of memory there): "
            + ", ".join(f"`{n}`" for n in fallback)
            + f"; {pairs} pair(s) of fresh processes in all, each "
            "the reference and then the job (reversed every other pair), minutes apart: the `design` "
            "column says `rounds`"
        )
    lines += [f"- Stopped: {'; '.join(record.get('stopped') or ['(still running)'])}"]
    if record.get("started") and record.get("finished"):
        lines.append(
            f"- Ran {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record['started']))} to "
            f"{time.strftime('%H:%M:%S', time.localtime(record['finished']))} "
            f"({(record['finished'] - record['started']) / 60:.1f} min, setup included)"
        )
    failed = {n: j["status"] for n, j in jobs.items() if j["status"] not in ("measured",)}
    for name, status in failed.items():
        lines.append(f"- `{name}`: {status}")
    lines.append("")
    if aa is not None:
        mde = paired_stats.minimum_detectable(aa)
        lines += [
            f"**Noise (A/A):** the reference against its copy `{record.get('aa')}`: "
            f"{record_mod.describe(aa)} over {aa.n} {_units(record)} (±{aa.half_width:.1%}). The smallest "
            f'effect this sweep detects with 80 % power at its level is about ±{mde:.1%}; a verdict of "no '
            f'effect larger than ±X %" means the interval lies within 1 ± X.',
            "",
        ]
    else:
        lines += ["**Noise (A/A):** no copy of the reference measured (fewer than 2 pairs).", ""]
    return lines
