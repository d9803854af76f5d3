"""The end of ``hydra/sweeper=search`` (runner/sweeps/search.py): the trials' table, the best trials, their
verification against the starting recipe on fresh seeds (runner/sweeps/search_verify.py), the line to paste, the
search's wall time and its verification's share, and ``<sweep>/optimization_results.yaml``.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn
from omegaconf import OmegaConf

from runner.objective import TO_TARGET
from runner.sweeps.search_verify import override_line, verify


def job_folder(ret: JobReturn) -> Path:
    """The folder a job ran in (its summary.json, .hydra/)."""
    return Path(str(OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir")))


def in_space(trial: Any, space: dict[str, Any]) -> bool:
    """Whether a stored trial's parameters are exactly the search's keys, each with a value its distribution holds:
    a shared study's rows are data, and a planted one (``model._target_=numpy.load``) is never launched."""
    if set(trial.params) != set(space):
        return False
    try:
        return all(space[k]._contains(space[k].to_internal_repr(v)) for k, v in trial.params.items())
    except (ValueError, TypeError, KeyError):
        return False


#: A trial's user attribute that a search of runner's writes as it tells the study a job's value: ``{"folder": the
#: job's run folder, "value": the value told}``
RUN = "run"


def own(trial: Any) -> bool:
    """Whether a completed trial was run by a search of runner's: it has the ``RUN`` record, with the value it was
    told, and its run folder, where it is on this machine, holds the run's summary.json (a folder on another
    machine of a shared study cannot be checked from here). A row planted in a shared study has no such record."""
    run = trial.user_attrs.get(RUN)
    if not isinstance(run, dict) or run.get("value") != trial.value or not isinstance(run.get("folder"), str):
        return False
    folder = Path(run["folder"])
    return not folder.exists() or (folder / "summary.json").is_file()


def foreign(trial: Any) -> bool:
    """A completed trial that a search of runner's did not run (``own``)."""
    from optuna.trial import TrialState

    return trial.state == TrialState.COMPLETE and not own(trial)


def best_trials(study: Any, metric: str, direction: str, space: dict[str, Any], n: int = 1) -> list[Any]:
    """The ``n`` best complete trials of the search ``space`` (``in_space``) that a search of runner's ran (``own``),
    best first, one per point; for a to-target metric only among those that reached the target (a censored trial's
    value is a penalty, not a measurement)."""
    from optuna.trial import TrialState

    done = [t for t in study.trials if t.state == TrialState.COMPLETE and in_space(t, space) and own(t)]
    if metric in TO_TARGET:
        done = [t for t in done if t.user_attrs.get("reached")]
    out: list[Any] = []
    for t in sorted(done, key=lambda t: t.value, reverse=direction == "maximize"):
        if len(out) < n and all(t.params != o.params for o in out):
            out.append(t)
    return out


def best_trial(study: Any, metric: str, direction: str, space: dict[str, Any]) -> Any:
    """The best trial of ``best_trials``, or None when there is none."""
    return next(iter(best_trials(study, metric, direction, space)), None)


def trials_table(study: Any, metric: str) -> list[str]:
    keys = sorted({k for t in study.trials for k in t.params})
    lines = [
        f"| trial | {' | '.join(f'`{k}`' for k in keys)} | {metric} | note | job |",
        "|---:|" + "---|" * len(keys) + "---:|---|---|",
    ]
    for t in study.trials:
        cells = [_short(t.params.get(k, "")) for k in keys]
        value = f"{t.value:.4g}" if t.value is not None else "-"
        note = "foreign: not run by a search of runner's" if foreign(t) else t.user_attrs.get("note", "")
        lines.append(f"| {t.number + 1} | {' | '.join(cells)} | {value} | {note} | `{t.user_attrs.get('job', '')}` |")
    return lines


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def paste_line(
    fixed: Sequence[str], params: dict[str, Any], recipe: Sequence[str] = (), config_dir: str | None = None
) -> str:
    """``python -m runner`` with the search's ``--config-dir`` (where its presets came from), the command line's
    own overrides (less the search file) and the best trial's. ``recipe`` (``hydra.sweeper.recipe``) comes first:
    the overrides that give the preset a search file composes itself (``+experiment=shakespeare_char`` for
    conf/hparams_search/gpt_optuna.yaml), which leaving the search file out would otherwise lose."""
    kept = [o for o in fixed if not o.startswith(("hparams_search=", "hydra/sweeper=", "optimized_metric="))]
    where = ["--config-dir", str(Path(config_dir).resolve())] if config_dir else []
    return "python -m runner " + " ".join(shlex.quote(o) for o in [*where, *recipe, *kept, *override_line(params)])


def config_dir(config: Any) -> str | None:
    """The ``--config-dir`` of the running Hydra command (its ``hydra.runtime.config_sources``), or None."""
    sources = OmegaConf.select(config, "hydra.runtime.config_sources") or []
    given = [s.path for s in sources if s.provider == "command-line"]
    return given[0] if given else None


def finish(sweeper: Any, study: Any, plan: dict[str, Any]) -> None:
    """Print the trials' table, verify the best trial, print the line to paste; write optimization_results.yaml."""
    metric, direction = plan["metric"], plan["direction"]
    sweep_dir = Path(str(sweeper.config.hydra.sweep.dir))
    print(
        f"\nsearch {sweep_dir}: {len(study.trials)} trials, {metric} ({direction}):",
        *trials_table(study, metric),
        sep="\n",
        flush=True,
    )
    trials_s = time.monotonic() - sweeper.started
    planted = [t.number + 1 for t in study.trials if foreign(t)]
    if planted:
        print(
            f"note: trial(s) {', '.join(map(str, planted))} of the study were not run by a search of runner's (no "
            f"record of their run folder and summary): listed, never the recipe found",
            flush=True,
        )
    candidates = best_trials(study, metric, direction, plan["space"], max(1, sweeper.verify_candidates))
    results: dict[str, Any] = {"name": study.study_name, "optimized_metric": metric, "direction": direction}
    if not candidates:
        _write(sweep_dir, results | {"best_params": None})
        if study.trials and all(t.value is None for t in study.trials):  # not one figure: the search failed
            notes = "; ".join(sorted({str(t.user_attrs.get("note", "")) for t in study.trials}))
            print(
                f"error: no trial gave {metric} ({notes}): check that optimized_metric is a figure this task "
                f"reports, and narrow the space where every trial diverged",
                file=sys.stderr,
            )
            sys.exit(1)
        why = "reached the target" if metric in TO_TARGET else "completed"
        print(f"no trial {why}: nothing to verify; widen the search space or raise trainer.max_steps", flush=True)
        return
    print(f"best trial: {candidates[0].number + 1}, {metric} = {candidates[0].value:.4g}", flush=True)
    lines, record, found = verify(sweeper, plan, candidates)
    line = paste_line(plan["fixed"], found.params, sweeper.recipe, config_dir(sweeper.config))
    wall = {"trials_s": trials_s, "verification_s": time.monotonic() - sweeper.started - trials_s}
    wall["total_s"] = wall["trials_s"] + wall["verification_s"]
    share = wall["verification_s"] / wall["total_s"] if wall["total_s"] > 0 else 0.0
    busy = "" if sweeper.busy_share is None else f"; the trials' slots were busy {sweeper.busy_share:.0%} of their time"
    print(
        "\n".join(lines),
        f"\nwall time: {wall['total_s'] / 60:.1f} min, the trials {wall['trials_s'] / 60:.1f} and "
        f"the verification {wall['verification_s'] / 60:.1f} ({share:.0%}){busy}",
        "",
        "the recipe found (paste it):",
        line,
        sep="\n",
        flush=True,
    )
    _write(
        sweep_dir,
        results
        | {
            "best_params": dict(found.params),
            "best_value": found.value,
            "verification": record,
            "command": line,
            "wall": wall | {"slots_busy": sweeper.busy_share},
        },
    )


def _write(sweep_dir: Path, results: dict[str, Any]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
