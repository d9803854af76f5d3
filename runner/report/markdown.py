"""The text of an ablation report: ``report.md`` (also the body of ``--doc``), the generated reading of
``--doc`` (``reading``) and the agreement table of ``--replication`` (``agreement``).

Every figure is printed with its unit in the column name (samples/s, ms, MiB, s); speed-ups and effects are
dimensionless factors with their 95 % intervals from the paired slices (runner/report/paired.py). A figure
the sweep lacks is printed as ``–``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.compare.stats import HELPS, HURTS, NO_EFFECT, NO_INTERVAL, Interval
from runner.report import paired
from runner.report.load import Job, Row
from runner.report.sweep import budget_lines


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _ci_text(ci: Interval | None) -> str:
    return "–" if ci is None else f"{ci.low:.2f}–{ci.high:.2f}"


def describe(machine: dict[str, Any]) -> str:
    """One line: CPU (cores), memory, GPUs, native bf16, versions; parts the record lacks are left out."""
    m = machine
    parts = [
        f"{m['cpu']}, {m.get('cpu_cores', '?')} cores" if m.get("cpu") else None,
        f"{m['memory_gib']} GiB RAM" if m.get("memory_gib") else None,
        ", ".join(m["gpus"]) if m.get("gpus") else "no GPU" if "gpus" in m else None,
        f"CPU native bf16: {'yes' if m['cpu_native_bf16'] else 'no'}" if "cpu_native_bf16" in m else None,
        f"torch {m['torch']}, Python {m.get('python')}" if m.get("torch") else None,
        m.get("os"),
    ]
    return "; ".join(p for p in parts if p) or "(not recorded)"


def markdown(
    rows: list[Row],
    jobs: list[Job],
    sweep: Path,
    record: dict[str, Any],
    image: str,
    title: str = "Ablation report: what each technique buys",
) -> str:
    """report.md's text (also the body of ``--doc``): the sweep's record (command, machine, load, job,
    measurement), warnings (a busy machine, jobs killed before their summary), how the sweep measured and its
    noise, the rows ranked by speed-up, what each technique buys, what was skipped and why, where the sweep's time
    went (s) and the plot.

    Args:
        rows: from ``build_rows`` (a baseline among them); jobs: from ``load_jobs``.
        record: ``load_record(sweep)``, with the interleaved record under ``"interleave"``; image: the plot's path
            relative to the written file.

    Raises:
        StopIteration: ``rows`` has no baseline (``build_rows`` never returns such rows).
    """
    interleaved = record.get("interleave")
    lines = [
        f"# {title}",
        "",
        *_record_lines(rows, sweep, record),
        "",
        *_warning_lines(jobs, record),
        *(paired.noise_lines(interleaved) if interleaved else []),  # how the sweep measured: before the table
        *_ranked_lines(rows),
        "",
        *_technique_lines(rows),
        *_skipped_lines(rows, jobs),
        "",
    ]
    lines += budget_lines([j.times for j in jobs], _sweep_wall_s(record), "ablation.json: start to end")
    lines += [*_job_lines(jobs), "", "## Plot", "", f"![speed-up over the baseline]({image})", ""]
    return "\n".join(lines)


def _record_lines(rows: list[Row], sweep: Path, record: dict[str, Any]) -> list[str]:
    """The table of what ran: command, folder, machine, load, dates, the job, how it was measured."""
    baseline = next(r for r in rows if r.configuration == "baseline")
    base_cfg = baseline.jobs[0].summary["config"] if baseline.jobs[0].summary else {}
    machine = record.get("machine") or {}
    lines = ["| | |", "|---|---|"]
    lines.append(f"| command | `{record.get('command', '(not recorded)')}` |")
    lines.append(f"| sweep folder | `{sweep}` |")
    note = f" ({record['machine_note']})" if record.get("machine_note") else ""
    lines.append(f"| machine | {describe(machine)}{note} |")
    load = [machine.get("load_average_1min"), record.get("load_average_1min_at_end")]
    if load[0] is not None:
        lines.append(
            f"| load average (1 min) | {load[0]} at the start, {load[1] if load[1] is not None else '?'} at the end |"
        )
    if record.get("started"):
        lines.append(f"| ran | {record['started']} to {record.get('finished', '?')} |")
    model, data = base_cfg.get("model", {}), base_cfg.get("data", {})
    stem = " (cifar_stem)" if model.get("cifar_stem") else ""
    first = baseline.jobs[0].summary or {}
    dev = first.get("device_name") if first.get("device") == "cuda" else first.get("device")
    lines.append(
        f"| job | model `{model.get('_target_')}`{stem}, data `{data.get('name')}`, optimizer "
        f"`{base_cfg.get('optimizer', {}).get('_target_')}`, baseline batch "
        f"{_f(baseline.figures.get('batch_size'), '.0f')}, device {dev} |"
    )
    interleaved = record.get("interleave")
    if interleaved:
        k = interleaved.get("settings", {}).get("processes") or 1
        if k > 1:
            lines.append(
                f"| measurement | interleaved: {k} resident processes per configuration (the baseline "
                f"twice: A and A'), taking turns in slices of {interleaved.get('slice_steps')} step(s); "
                f"configurations are compared between their processes (below) |"
            )
        else:
            lines.append(
                f"| measurement | interleaved: one resident process per configuration (the baseline twice: "
                f"A and A'), taking turns in slices of {interleaved.get('slice_steps')} step(s); every "
                f"figure is a paired ratio of adjacent slices (below) |"
            )
    else:
        lines.append(
            "| measurement | not interleaved (no interleave.json): each job measured on its own, so no "
            "interval, no verdict and no rank |"
        )
    return lines


def _warning_lines(jobs: list[Job], record: dict[str, Any]) -> list[str]:
    """Warnings: a machine busy at the start or while jobs measured, jobs killed before their summary."""
    machine = record.get("machine") or {}
    load = machine.get("load_average_1min")
    measured = [j.summary for j in jobs if j.summary and j.summary.get("samples_per_sec")]
    lines: list[str] = []
    cores = machine.get("cpu_cores")
    if load is not None and cores and load > cores / 2:
        lines += [
            f"**Warning:** the machine was busy when the sweep started (load average {load} on {cores} "
            f"cores): other processes share the cores, so figures are slower and noisier than on a quiet "
            f"machine. Rerun when it is quiet for figures to publish.",
            "",
        ]
    noisy = [j for j in jobs if j.summary and j.summary.get("warnings")]
    if noisy:
        first = noisy[0]
        lines += [
            f"**Warning:** {len(noisy)} of {len(measured)} measured jobs recorded a busy machine while they "
            f"measured (summary.json `warnings`; e.g. {first.variant} r{first.repeat}: "
            f"{first.summary['warnings'][0]}): their figures are slower and noisier than on a quiet machine.",
            "",
        ]
    unfinished = [j for j in jobs if j.summary and j.summary.get("unfinished")]
    if unfinished:
        lines += [
            f"**Warning:** {len(unfinished)} job(s) were killed before they wrote summary.json (e.g. "
            f"`{unfinished[0].folder}`; the sweep did not finish: a hard kill or a lost machine): their "
            f"samples/s and step time come from their measured slices in interleave.json, and they have no "
            f"evaluation, memory or technique figures.",
            "",
        ]
    return lines


def _ranked_lines(rows: list[Row]) -> list[str]:
    """The table of the rows, ranked by speed-up, with their intervals, verdicts and figures."""
    lines = [
        "## Configurations ranked by speed-up",
        "",
        "| rank | configuration | speed-up × | 95 % CI | effect × | effect 95 % CI | verdict | samples/s | "
        "step ms | data wait | peak MiB (Δ) | final loss | setup s | techniques (applied / skipped) |",
        "|---:|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        fig = r.figures
        peak = fig.get("peak_memory_mb")
        peak_text = (
            "–"
            if peak is None
            else f"{peak:,.0f}"
            + (f" ({r.peak_change_pct:+.0f}%)" if r.peak_change_pct is not None and r.kind != "baseline" else "")
        )
        verdict_text = f"**{r.verdict}**" if r.verdict in (HELPS, "faster") else r.verdict
        status = r.status.replace("|", "/") if r.runs else "–"
        effect_ci = _ci_text(r.effect_ci) if r.kind != "baseline" else "–"
        lines.append(
            f"| {r.rank or '–'} | {r.configuration} | {_f(r.speedup, '.2f')} | {_ci_text(r.speedup_ci)} | "
            f"{_f(r.effect, '.2f')} | {effect_ci} | {verdict_text} | {_f(r.median, ',.1f')} | "
            f"{_f(fig.get('step_time_ms_median'), ',.1f')} | {_f(fig.get('data_wait_fraction'), '.1%')} | "
            f"{peak_text} | {_f(fig.get('final_loss'), '.3f')} | {_f(fig.get('setup_s'), '.1f')} | "
            f"{status} |"
        )
    return lines


def _technique_lines(rows: list[Row]) -> list[str]:
    """What each technique buys, on alone and off in the fast preset."""
    lines = [
        "## What each technique buys",
        "",
        "Effect × (95 % interval), verdict.",
        "",
        "| technique | on alone (baseline + it) | off in fast (fast − it) |",
        "|---|---|---|",
    ]
    by_technique: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.technique:
            by_technique.setdefault(r.technique, {})[r.kind] = r
    for tech, pair in sorted(by_technique.items(), key=lambda kv: -max((r.effect or 0) for r in kv[1].values())):
        cells = []
        for kind in ("leave-one-in", "leave-one-out"):
            r = pair.get(kind)
            cells.append(
                "(not in the sweep)"
                if r is None
                else (f"×{r.effect:.2f} ({_ci_text(r.effect_ci)}), {r.verdict}" if r.effect is not None else r.verdict)
            )
        lines.append(f"| {tech} | {cells[0]} | {cells[1]} |")
    return lines


def _skipped_lines(rows: list[Row], jobs: list[Job]) -> list[str]:
    """What was skipped on this machine and why, and the configurations that measured nothing."""
    lines: list[str] = []
    skipped = sorted(
        {
            (k, v)
            for j in jobs
            if j.summary
            for k, v in (j.summary.get("techniques") or {}).items()
            if v.startswith("skipped")
        }
    )
    if skipped:
        lines += ["", "## Skipped on this machine (and why)", ""] + [
            f"- `{k}`: {v[len('skipped: ') :]}" for k, v in skipped
        ]
    problems = [r for r in rows if not r.runs]
    if problems:
        lines += ["", "## Not measured", ""] + [f"- {r.configuration}: {r.verdict}" for r in problems]
    return lines


def _job_lines(jobs: list[Job]) -> list[str]:
    """Per job: its samples/s and where its wall time went."""
    lines = [
        "Per job (jobs.csv has every figure): setup = process start, imports, dataset load, model build "
        "and FLOP count, before the first step.",
        "",
        "| configuration | repeat | samples/s | job s | setup s | training s | measured s | eval s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for j in sorted(jobs, key=lambda j: (j.variant, j.repeat)):
        t = j.times
        lines.append(
            f"| {j.variant} | {j.repeat} | {_f(j.samples_per_sec, ',.1f')} | {_f(t.get('wall_s'), '.1f')} | "
            f"{_f(t.get('setup_s'), '.1f')} | {_f(t.get('train_s'), '.1f')} | "
            f"{_f(t.get('measured_s'), '.1f')} | {_f(t.get('eval_s'), '.1f')} |"
        )
    return lines


def _sweep_wall_s(record: dict[str, Any]) -> float | None:
    start, end = record.get("started_s"), record.get("finished_s")
    return end - start if isinstance(start, (int, float)) and isinstance(end, (int, float)) else None


def reading(rows: list[Row]) -> str:
    """A generated first reading for ``--doc``: which techniques helped, hurt, did nothing, were skipped."""
    groups: dict[str, list[str]] = {HELPS: [], HURTS: [], NO_EFFECT: [], "skipped here": [], NO_INTERVAL: []}
    for r in rows:
        # an interleaved sweep words it as an equivalence margin ("no effect larger than ±X%")
        key = NO_EFFECT if r.verdict.startswith("no effect larger than") else r.verdict
        if r.technique and key in groups:
            where = "on alone" if r.kind == "leave-one-in" else "off in fast"
            groups[key].append(
                f"{r.technique} ({where}, ×{r.effect:.2f} [{_ci_text(r.effect_ci)}])"
                if r.effect
                else f"{r.technique} ({where})"
            )
    fast = next((r for r in rows if r.configuration == "fast"), None)
    lines = ["## Reading", ""]
    if fast and fast.speedup:
        lines.append(
            f"The fast preset ran at ×{fast.speedup:.2f} the baseline (95 % interval "
            f"{_ci_text(fast.speedup_ci)}; {fast.verdict})."
        )
    for key, label in (
        (HELPS, "Helped"),
        (HURTS, "Hurt"),
        (NO_EFFECT, "No measurable effect"),
        ("skipped here", "Skipped here"),
        (NO_INTERVAL, "No interval"),
    ):
        if groups[key] or key != NO_INTERVAL:
            lines.append(f"- **{label}:** " + (", ".join(groups[key]) or "none"))
    lines += [
        "",
        "<!-- Why: add one or two sentences per finding (hardware, model size, what the technique changes). -->",
        "",
    ]
    return "\n".join(lines)


#: verdicts a replication must reproduce (a firm claim); "no measurable effect" may turn either way
FIRM = (HELPS, HURTS, "faster", "slower")


def agreement(rows: list[Row], replication: list[Row], name: str = "replication") -> tuple[str, list[str]]:
    """Compare the verdicts of two independent sweeps of the same job, configuration by configuration.

    Returns a markdown section (a table: each configuration's effect, its 95 % interval and verdict in both
    sweeps, and whether they agree) and the configurations where this sweep's verdict is firm (``FIRM``:
    helps, hurts, faster, slower) and the replication's differs. A "no measurable effect" row is shown but not
    counted against agreement (its interval contains 1); configurations neither sweep measured, for the same
    reason, are named in one line under the table.
    """
    theirs = {r.configuration: r for r in replication}
    lines = [
        f"| configuration | effect [95 % CI], this sweep | verdict | effect [95 % CI], {name} | verdict | agree |",
        "|---|---:|---|---:|---|---|",
    ]
    disagree, unmeasured = [], []
    for r in rows:
        if r.kind == "baseline":
            continue
        o = theirs.get(r.configuration)
        same = o is not None and o.verdict == r.verdict
        if same and r.effect is None and o.effect is None:  # not run in either, for the same reason
            unmeasured.append(r.configuration)
            continue
        if r.verdict in FIRM and not same:
            disagree.append(r.configuration)
        mark = "yes" if same else ("**no**" if r.verdict in FIRM else "—")
        other = f"{_f(o.effect, '.2f')} {_ci_text(o.effect_ci)} | {o.verdict}" if o is not None else "— | not run"
        lines.append(
            f"| {r.configuration} | {_f(r.effect, '.2f')} {_ci_text(r.effect_ci)} | {r.verdict} | {other} | {mark} |"
        )
    firm = [r for r in rows if r.verdict in FIRM]
    head = (
        f"The {name} agrees on all {len(firm)} configurations this sweep gives a firm verdict ({', '.join(FIRM)})."
        if not disagree
        else f"The {name} disagrees on {len(disagree)} of the {len(firm)} configurations this sweep gives a firm "
        f"verdict: {', '.join(disagree)}."
    )
    if unmeasured:
        lines += [
            "",
            f"Not measured in either sweep, for the same reason (the ranking above says why): {', '.join(unmeasured)}.",
        ]
    return "\n".join([head, "", *lines]), disagree
