"""The convergence report's files: report.md and report.csv in the sweep folder, the ``--doc`` document and the
agreement table of ``--replication`` (``write_convergence_report``). The rows are runner/report/convergence.py's.

Ratios are config ÷ baseline: below 1 the configuration needs fewer samples (less time) than the baseline; the
throughput ratio is config ÷ baseline samples/s (above 1: faster steps). Intervals are 95 % (the sweep's
confidence); an end that seeds which never reached the target leave open reads 0 or ∞.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from runner.compare.convergence import TargetRatio
from runner.compare.stats import HELPS, HURTS, Interval
from runner.files import open_own, write_own
from runner.report.convergence import NEEDS_THROUGHPUT, REFERENCE, Variant, build_variants, median_samples
from runner.report.sweep import sweep_command

#: Columns of report.csv, in order (ratios config ÷ baseline; ``*_p``: the p-value of "no difference").
COLUMNS = [
    "configuration",
    "technique",
    "step_cost",
    "seeds",
    "reached",
    "failed",
    "eval_every_samples",
    "samples_to_target_median",
    "samples_ratio",
    "samples_ci_low",
    "samples_ci_high",
    "samples_p",
    "samples_verdict",
    "throughput_ratio",
    "throughput_ci_low",
    "throughput_ci_high",
    "time_ratio",
    "time_ci_low",
    "time_ci_high",
    "time_p",
    "verdict",
]
#: verdicts a replication must reproduce
FIRM = (HELPS, HURTS)


def _x(value: float) -> str:
    return "∞" if math.isinf(value) else "0" if value == 0 else f"{value:.2f}"


def ratio_text(r: Any) -> str:
    """``"0.80 [0.71–0.90]"``, ``"1 (same step cost)"`` or ``"–"``."""
    if r is None:
        return "–"
    if isinstance(r, (int, float)):
        return f"{r:g} (same step cost)"
    return f"{_x(r.estimate)} [{_x(r.low)}–{_x(r.high)}]"


def _bold(verdict: str) -> str:
    return f"**{verdict}**" if verdict in FIRM else verdict


def table(rows: list[Variant]) -> list[str]:
    """The markdown table of the rows."""
    lines = [
        "| configuration | seeds reached | median samples to target | eval every (samples) | samples ratio "
        "[95 % CI] | samples verdict | throughput ratio [95 % CI] | time-to-target ratio [95 % CI] | verdict |",
        "|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for v in rows:
        failed = f" ({len(v.failed)} failed)" if v.failed else ""
        lines.append(
            f"| {v.name} | {v.reached}/{len(v.seeds)}{failed} | {median_samples(v.seeds)} | "
            f"{'–' if v.eval_samples is None else f'{v.eval_samples:,}'} | {ratio_text(v.samples)} | "
            f"{_bold(v.samples_verdict)} | {ratio_text(v.throughput) if v.name != REFERENCE else '–'} | "
            f"{ratio_text(v.time)} | {_bold(v.verdict)} |"
        )
    return lines


def _target_text(rows: list[Variant]) -> str:
    trainer = next((v.config.get("trainer") or {} for v in rows if v.config), {})
    said = [
        f"eval_accuracy >= {trainer['target_accuracy']:g}" if trainer.get("target_accuracy") is not None else "",
        f"eval_loss <= {trainer['target_loss']:g}" if trainer.get("target_loss") is not None else "",
    ]
    return " and ".join(s for s in said if s) or "(not recorded)"


def _notes(rows: list[Variant], throughput: Path | None) -> list[str]:
    """Failed seeds, rows waiting for a throughput measurement, and the command that gives it."""
    lines: list[str] = []
    failed = [f"`{f}`" for v in rows for f in v.failed]
    if failed:
        lines += [
            f"**Failed seeds:** {len(failed)} job(s) left no summary.json ({', '.join(failed)}: failed, "
            f"diverged or still running). Each is counted as a seed that did not reach the target within its "
            f"budget (trainer.max_steps × the global batch), never dropped.",
            "",
        ]
    waiting = [v.name for v in rows if v.verdict == NEEDS_THROUGHPUT]
    if waiting:
        lines += [
            f"**Throughput not measured** for {', '.join(waiting)}: a technique that changes what a step "
            f"costs (runner/techniques/ `step_cost`), so the time to target needs its samples/s against the "
            f"baseline's, measured interleaved: `python -m runner -m +experiment=ablation "
            f"ablation/variant={REFERENCE},{','.join(waiting)} <this job's overrides>`, then `python -m "
            f"runner.report <this sweep> --throughput <that sweep>`.",
            "",
        ]
    if throughput is not None:
        lines += [f"Throughput ratios: the interleaved comparisons of `{throughput}`.", ""]
    fewest = min(len(v.seeds) for v in rows)
    if fewest < 4:
        lines += [
            f"**Too few seeds for a verdict:** {fewest} seeds on a side. The exact 95 % interval cannot exclude "
            f"1 below 4 seeds per side (with 3 it is 0–∞); 8 per side resolve a 20 % difference at a 5 % spread "
            f"per seed: trainer.seed=range(0,8).",
            "",
        ]
    return lines


READING = [
    "## How to read it",
    "",
    "- **seeds reached**: seeds that met the target within their budget, of the seeds run; a seed that did not (or "
    "failed) is counted, and bounds the interval instead of being dropped.",
    "- **median samples to target**: global samples trained when an evaluation first met the target (a seed that "
    "did not reach it counts as later than every one that did). **eval every**: the evaluation interval in "
    "samples, the resolution of that date (ablation.eval_samples).",
    "- **samples ratio**: samples to target ÷ the baseline's, the Hodges–Lehmann estimate with the exact "
    "Mann–Whitney 95 % interval over seeds (below 1: fewer samples). Not a repeat-based figure: samples to target "
    "do not depend on the machine's load, only on the arithmetic and the seed.",
    "- **throughput ratio**: samples/s ÷ the baseline's; exactly 1 for a technique that does not change a step's "
    "cost (an LR schedule), else the interleaved comparison given with --throughput.",
    "- **time-to-target ratio**: samples ratio ÷ throughput ratio (training time; evaluations excluded), its "
    "interval the two intervals at 97.5 % combined (Bonferroni). **verdict**: Holm's step-down over the family of "
    "time-to-target ratios (helps: less time); the samples verdict is Holm over the samples ratios.",
    "",
]


def markdown(
    rows: list[Variant],
    sweep: Path,
    record: dict[str, Any],
    throughput: Path | None,
    title: str = "Convergence report: what each technique buys in time to target",
) -> str:
    """report.md's text (also the body of ``--doc``)."""
    seeds = sorted({s.seed for v in rows for s in v.seeds if s.seed is not None})
    lines = [
        f"# {title}",
        "",
        "| | |",
        "|---|---|",
        f"| command | `{record.get('command', '(not recorded)')}` |",
        f"| sweep folder | `{sweep}` |",
        f"| target | {_target_text(rows)} (runs stop there: trainer.stop_at_target) |",
        f"| seeds | {', '.join(map(str, seeds))} per configuration (trainer.seed) |",
        "",
        *_notes(rows, throughput),
        "## Configurations",
        "",
        *table(rows),
        "",
        *READING,
    ]
    return "\n".join(lines)


def _cell(v: Any) -> Any:
    return "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)


def _ends(r: Interval | TargetRatio | float | None) -> list[Any]:
    """A ratio's estimate, low and high end (a number known exactly: itself three times)."""
    if r is None:
        return [None, None, None]
    if isinstance(r, (int, float)):
        return [r, r, r]
    return [r.estimate, r.low, r.high]


def write_csv(rows: list[Variant], path: Path) -> None:
    """report.csv: one row per configuration, ``COLUMNS``."""
    with open_own(path, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for v in rows:
            values = [
                v.name,
                v.technique,
                v.step_cost,
                len(v.seeds),
                v.reached,
                len(v.failed),
                v.eval_samples,
                median_samples(v.seeds),
                *_ends(v.samples),
                v.samples and v.samples.p_value,
                v.samples_verdict,
                *_ends(v.throughput),
                *_ends(v.time),
                v.time and v.time.p_value,
                v.verdict,
            ]
            writer.writerow([_cell(x) for x in values])


def agreement(rows: list[Variant], replication: list[Variant]) -> tuple[str, list[str]]:
    """The verdicts of two sweeps of the same job with different seeds, configuration by configuration: a markdown
    section and the configurations where this sweep's firm verdict (samples or time; helps/hurts) is not the
    replication's. A "no measurable effect" may come out either way and is not counted against agreement."""
    theirs = {v.name: v for v in replication}
    lines = [
        "| configuration | samples ratio, this sweep | replication | time ratio, this sweep | replication | agree |",
        "|---|---|---|---|---|---|",
    ]
    disagree = []
    for v in rows[1:]:
        o = theirs.get(v.name)
        pairs = [(v.samples_verdict, o and o.samples_verdict), (v.verdict, o and o.verdict)]
        broken = any(mine in FIRM and mine != other for mine, other in pairs)
        if broken:
            disagree.append(v.name)
        mark = "**no**" if broken else "yes" if any(mine in FIRM for mine, _ in pairs) else "—"
        cells = [
            f"{ratio_text(v.samples)} {v.samples_verdict}",
            f"{ratio_text(o.samples)} {o.samples_verdict}" if o else "not run",
            f"{ratio_text(v.time)} {v.verdict}",
            f"{ratio_text(o.time)} {o.verdict}" if o else "not run",
        ]
        lines.append(f"| {v.name} | {' | '.join(cells)} | {mark} |")
    firm = [v.name for v in rows[1:] if v.samples_verdict in FIRM or v.verdict in FIRM]
    head = (
        f"The replication agrees on every firm verdict ({len(firm)} configuration(s) with one)."
        if not disagree
        else f"The replication disagrees on {len(disagree)} of the {len(firm)} configuration(s) with a firm "
        f"verdict: {', '.join(disagree)}."
    )
    return "\n".join([head, "", *lines]), disagree


def _record(sweep: Path) -> dict[str, Any]:
    """The multirun's command, from its multirun.yaml (empty without one)."""
    path = sweep / "multirun.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    return {"command": sweep_command(OmegaConf.load(path).hydra)}


def write_convergence_report(
    sweep: Path,
    throughput: Path | None = None,
    doc: Path | None = None,
    replication: Path | None = None,
    rows: list[Variant] | None = None,
) -> list[Path]:
    """Write report.md and report.csv of the convergence sweep in ``sweep`` there (and ``doc``, with the agreement
    table of the ``replication`` sweep, built with the same ``throughput``). Returns the written paths.

    Args:
        rows: the sweep's ``build_variants(sweep, throughput)`` where the caller has them already.

    Raises:
        ReportError: see ``runner.report.convergence.build_variants``.
    """
    sweep = Path(sweep)
    rows = rows if rows is not None else build_variants(sweep, throughput)
    written = [sweep / "report.md", sweep / "report.csv"]
    write_own(written[0], markdown(rows, sweep, _record(sweep), throughput))
    write_csv(rows, written[1])
    if doc is not None:
        doc = Path(doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        text = markdown(rows, sweep, _record(sweep), throughput, title="Time to target: the convergence ablation")
        if replication is not None:
            other = build_variants(Path(replication), throughput)
            section, _ = agreement(rows, other)
            command = _record(Path(replication)).get("command", "(command not recorded)")
            text += f"\n## Replication: the same job with other seeds\n\n`{command}` in `{replication}`.\n\n{section}\n"
        write_own(doc, text)
        written.append(doc)
    return written
