"""What the speed tuner (runner/tune/speed.py) reports and writes: a row's figures, the pick as a preset
(``experiment/tuned.yaml``) and the plot of every round's intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.tune.harness import fmt, pyplot
from runner.tune.rounds import Round, head_to_head, helps
from runner.tune.switches import Switch


def paired_cells(c) -> dict[str, Any]:
    """A row's interval cells from a ``compare.Interval`` (none for None)."""
    return {"speedup": c.estimate, "ci_low": c.low, "ci_high": c.high} if c else {}


def round_figures(r: Round, name: str) -> dict[str, Any]:
    """A row's figures for ``name`` in round ``r``: its interval against the reference, the verdict (a "helps" that
    does not beat the reference's copy too is said so), its median samples/s, its ratio to the copy and the A/A, and
    its process's busy-machine warnings (``load_warnings``, which the harness's note counts)."""
    from runner.compare.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    verdict = r.failed.get(name) if name in r.failed and c is None else r.verdicts.get(name) or "not measured"
    if verdict == HELPS and r.aa is not None and not (copy_c and copy_c.low > 1):
        verdict = "helps vs the reference, not vs its copy"
    return {
        **paired_cells(c),
        "verdict": verdict,
        "samples_per_sec": r.samples_per_sec.get(name),
        "vs_copy": copy_c.estimate if copy_c else None,
        "aa_speedup": r.aa.estimate if r.aa else None,
        "load_warnings": "; ".join(r.warnings.get(name, [])),
    }


def describe(c) -> str:
    """``×1.234 [1.100–1.380]``, or "no interval"."""
    return f"×{c.estimate:.3f} [{c.low:.3f}–{c.high:.3f}]" if c else "no interval"


def tuned_yaml(
    picked: list[Switch], recommended: dict[str, Any], objective: str = "job", cache: Path | None = None
) -> str:
    """The pick as a preset (``experiment/tuned.yaml``, package ``_global_``), naming ``cache`` (the pick's compiled
    code, ``compile.cache``) when given."""
    lines = [
        "# @package _global_",
        "# python -m runner.tune speed: the pick, verified head to head against the configuration it was tuned on",
        f"# switches: {', '.join(recommended['switches'])}",
        f"# objective: {objective} (tune.objective: job = the whole job's wall time, one-time costs included; "
        f"throughput = steady samples/s)",
    ]
    if recommended.get("ci_low") is not None:
        lines.append(
            f"# samples/s x{recommended['speedup']:.3f} [{recommended['ci_low']:.3f}-{recommended['ci_high']:.3f}]"
        )
    tree: dict[str, Any] = {}
    changes = [(k, v) for s in picked for k, v in s.changes.items()]
    changes += [("compile.cache", str(cache))] if cache else []
    for key, value in changes:
        node = tree
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    body = OmegaConf.to_yaml(OmegaConf.create(tree)) if tree else "{}\n"
    return "\n".join(lines) + "\n" + body


def plot(result: dict[str, Any]):
    plt = pyplot()
    rows = [r for r in result["rows"] if r.get("speedup") is not None]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(rows) + 1)))
    for i, r in enumerate(rows):
        color = "tab:green" if r["verdict"] == "helps" else "tab:red" if r["verdict"] == "hurts" else "tab:gray"
        ax.errorbar(
            r["speedup"],
            i,
            xerr=[[r["speedup"] - r["ci_low"]], [r["ci_high"] - r["speedup"]]],
            fmt="o",
            color=color,
            capsize=3,
        )
    ax.set_yticks(range(len(rows)), [f"{r['stage']}: {r['switch']}" for r in rows], fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s ÷ the round's reference (95 % interval)")
    ax.set_title("runner.tune speed")
    ax.grid(axis="x", alpha=0.3)
    return fig


def is_pick(row: dict, rec: dict) -> bool:
    return (
        row.get("stage") == "verification" and row.get("switch") == "+".join(rec["switches"]) and bool(rec["switches"])
    )


def verification_notes(
    v: Round,
    options: dict[str, list[Switch]],
    label: dict[str, str],
    chosen_name: str | None,
    fast: bool,
    min_speedup: float,
) -> list[str]:
    """The verification's notes: the whole combination against the pick, each option not firmly faster than yours,
    the pick against ``+experiment=fast`` and each job's compile time, warm (a preset's cache) or cold."""
    notes = []
    if "extended" in options:
        head = head_to_head(v, "extended", "pick") if "pick" in options else None
        notes.append(
            f"the whole combination ({label['extended']})"
            + (f" against the pick alone, head to head: {describe(head)}" if head else "")
            + f": {'recommended' if chosen_name == 'extended' else 'not recommended'}"
        )
    for name in options:
        if name != chosen_name and not helps(v, name, min_speedup):
            notes.append(
                f"{label[name]} was not firmly faster than your configuration head to head "
                f"({describe(v.comparisons.get(name))})"
            )
    if chosen_name is not None and fast:
        head = head_to_head(v, chosen_name, "fast")
        if head is not None:
            notes.append(f"the pick against +experiment=fast, head to head: {describe(head)}")
    said = [
        f"{label.get(n, n)} {fmt(v.compiled[n][0], '.1f')} s ({'warm' if n in options else 'cold'})"
        for n in v.jobs
        if v.compiled.get(n, (None,))[0] is not None
    ]
    if said:
        notes.append(
            f"compile in the projected jobs: {', '.join(said)}; warm: the pick with the compile cache its "
            f"preset carries, cold: as a job compiles on a fresh node"
        )
    return notes


def result(search, picked: list[Switch], verified: Any) -> dict[str, Any]:
    """The harness's result (``tune_speed``'s return value) for the recommended switches ``picked`` of the speed
    tuner's ``search`` (its notes, rows, rounds and settings)."""
    recommended = {
        "switches": [s.name for s in picked],
        "changes": {k: v for s in picked for k, v in s.changes.items()},
        "speedup": verified.estimate if picked and verified else 1.0,
        "ci_low": verified.low if picked and verified else None,
        "ci_high": verified.high if picked and verified else None,
    }
    notes = search.notes
    cache = search.preset_cache(picked) if picked else None
    if picked:
        override = " ".join(o for s in picked for o in s.overrides)
        notes.insert(
            0,
            f"the pick {'+'.join(s.name for s in picked)}: ×{verified.estimate:.3f} "
            f"[{verified.low:.3f}–{verified.high:.3f}] your configuration's samples/s, measured head "
            f"to head (tune.objective={search.t.objective})",
        )
    else:
        override = "(no change)"
        notes.insert(0, "no change: no switch made your job firmly faster on this machine (no preset written)")
    biased = [r for r in search.rounds if r.aa is not None and (r.aa.low > 1 or r.aa.high < 1)]
    if biased:
        notes.insert(
            1,
            "warning: "
            + "; ".join(
                f"{r.title.split(':')[0]}: your configuration against its own copy read {describe(r.aa)}"
                for r in biased
            )
            + ": the round's own noise check failed, so its verdicts are less sure than their intervals "
            "say (a switch is kept only when it beats both copies; more processes per configuration, "
            "interleave.processes, widen the intervals to what the machine does)",
        )
    if search.rounds and search.rounds[-1].aa is not None:
        from runner.compare.stats import minimum_detectable

        aa = search.rounds[-1].aa
        notes.append(
            f"noise: your configuration against its own copy read {describe(aa)}; effects below about "
            f"{minimum_detectable(aa):.1%} could not be resolved"
        )
    notes.append(
        f"measured by interleaved slices of resident processes (runner/compare/), slices of "
        f"{search.settings.slice_seconds:g} s (tune.slice_seconds); the guard: {search.t.guard_steps} steps, "
        f"tolerance {search.tolerance:.1%} (yours under another seed, at least tune.guard_tolerance); the "
        f"rounds' processes and interleave.json: {search.rounds_dir}"
    )
    return {
        "recommended": recommended,
        "override": override,
        "rows": search.rows,
        "notes": notes,
        "rounds": [
            {"title": r.title, "aa": paired_cells(r.aa), "stopped": r.stopped, "failed": r.failed}
            for r in search.rounds
        ],
        "objective": search.t.objective,
        "job_steps": search.job_steps,
        "command": run_line(picked, cache) if picked else None,
        "files": {"experiment/tuned.yaml": picked and tuned_yaml(picked, recommended, search.t.objective, cache)},
    }


def run_line(picked: list[Switch], cache: Path | None) -> str | None:
    """The command that trains the job with the pick, to paste: ``python -m runner`` with the tuner command's own
    ``--config-dir`` and overrides (less the tuner's ``tune.*`` and ``interleave.*``), then the pick's overrides
    (last: they win, as the tuner applied them over your configuration) and ``compile.cache`` naming the preset's
    compiled code. None outside a Hydra app."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    yours = [o for o in hydra.overrides.task if not o.lstrip("+~").startswith(("tune.", "interleave."))]
    where = [s.path for s in OmegaConf.select(hydra, "runtime.config_sources") or [] if s.provider == "command-line"]
    words = [
        *(["--config-dir", str(Path(where[0]).resolve())] if where else []),
        *yours,
        *(o for s in picked for o in s.overrides),
        *([f"compile.cache={cache.resolve()}"] if cache else []),
    ]
    return "python -m runner " + " ".join(shlex.quote(w) for w in words)
