"""``python -m runner.tune speed``: the fastest configuration of your job, found by measurement and verified.

The method (docs/tuners-and-doctor.md, "The speed tuner"): the candidates that apply and are not on
(runner/tune/switches.py, ``tune.only``, ``tune.switches``); a numerics guard that rejects a candidate whose loss
curve departs from yours more than another seed's does (runner/tune/guard.py); greedy forward selection in rounds of
interleaved, paired measurement through runner/compare/ (runner/tune/rounds.py); a verification of your
configuration, its copy, the pick, the pick with the hopefuls and ``+experiment=fast`` head to head. Only a
configuration firmly faster than yours is recommended.

Outputs (``harness.write_outputs``): ``speed.csv``/``.md``/``.png``/``.json`` (every candidate of every round) and
``experiment/tuned.yaml``, the pick as a preset; each round's processes and ``interleave.json`` in
``<out>/rounds/``. Under torchrun every measured job is a DDP job of the N ranks, rank 0's figures decide and are
broadcast (runner/compare/ranks.py), so the ranks agree on every decision.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.tune.guard import GUARD_WINDOWS, departure, loss_curve
from runner.tune.harness import Tuner, fmt, pyplot, say, with_overrides
from runner.tune.rounds import Round, choose, helps, hopefuls, measure_round, read_round
from runner.tune.switches import Switch, applied, chosen, switches

# ------------------------------------------------------------------------------------------- the fast preset


def fast_config() -> tuple[DictConfig | None, str]:
    """The user's command with ``+experiment=fast`` layered under it (``+experiment=[fast,<theirs>]``: their
    preset's keys win, as in scripts/bench_gpt.py), composed by Hydra; ``(None, why)`` outside a Hydra app or
    when it does not compose."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, "the fast preset is composed from the command line (python -m runner.tune speed ...)"
    overrides = list(HydraConfig.get().overrides.task)
    mine = [o for o in overrides if o.lstrip("+").startswith("experiment=")]
    rest = [o for o in overrides if o not in mine]
    if mine:
        theirs = mine[0].split("=", 1)[1].strip("[]")
        if "fast" in [x.strip() for x in theirs.split(",")]:
            return None, "your command already uses +experiment=fast"
        experiment = f"+experiment=[fast,{theirs}]"
    else:
        experiment = "+experiment=fast"
    try:
        return compose(config_name="config", overrides=[*rest, experiment]), experiment
    except Exception as e:  # noqa: BLE001 - any composition error only drops the comparison
        return None, f"{experiment} does not compose with your overrides ({e})"


# ------------------------------------------------------------------------------------------- the search


def tune_speed(cfg: DictConfig, env, job_dir: Path) -> dict[str, Any]:
    """The search of the module docstring on the composed run config ``cfg``; returns the harness's result
    (``recommended``: ``{"switches", "changes", "speedup", "ci_low", "ci_high"}``; ``override``; ``rows``: one
    per candidate per stage; ``notes``) plus ``rounds`` (each round's jobs, A/A and why it stopped) and
    ``tuned_yaml`` (the preset's text).

    Raises:
        ConfigError: bad ``tune.*`` values (``tune.only``, ``tune.switches``); your configuration cannot train.
    """
    from runner.compare.schedule import settings_problem

    if problem := settings_problem(cfg.interleave):
        raise ConfigError(problem)
    search = _Search(cfg, env, Path(job_dir))
    candidates, search.notes = chosen(cfg, cfg.tune, env.device)
    say(env, f"speed: {len(candidates)} candidate(s): {', '.join(s.name for s in candidates) or 'none'}")
    search.guard_reference()
    incumbent, extra = search.select(search.guard_candidates(candidates))
    while incumbent and not search.guarded(incumbent, "the pick's switches together"):
        search.notes.append(f"{incumbent[-1].name} dropped from the pick")
        incumbent.pop()
    if extra and not search.guarded([*incumbent, *extra], "the pick with the last round's hopefuls"):
        extra = []
    picked, verified = search.verify(incumbent, extra)
    return search.result(picked, verified)


class _Search:
    """The state of one search (``tune_speed``): the run config, the rows and notes of the report, the rounds
    measured so far and the guard's reference curve and tolerance. Under torchrun every figure a decision rests on
    is rank 0's (``agreed``)."""

    def __init__(self, cfg: DictConfig, env, out: Path):
        from runner.compare.ranks import Ranks

        self.cfg, self.env, self.out, self.t = cfg, env, out, cfg.tune
        self.ranks = Ranks.join(cfg.distributed.timeout_s) if env.distributed else None
        self.budget_s = 60 * self.t.budget_minutes  # of measuring: the guard, start-ups and compilation on top
        self.rounds_dir = _rounds_folder(out)
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.rounds: list[Round] = []
        self.reference: list[float] = []
        self.tolerance = self.t.guard_tolerance
        self.settings = copy.deepcopy(cfg.interleave)
        self.settings.target_ci = self.t.target_ci
        self.settings.slice_seconds = self.t.slice_seconds

    def agreed(self, value: Any) -> Any:
        """What rank 0 measured or decided, on every rank."""
        return self.ranks.share(value) if self.ranks is not None else value

    @staticmethod
    def batch_of(c: DictConfig) -> int:
        from runner.config import global_batch_size

        return global_batch_size(c.dataloader.batch_size, c.memory.accumulate_steps, 1)

    # ----------------------------------------------------------------------------------------- 1. the guard
    def guard(self, sw: list[Switch]) -> tuple[float, float | None, str]:
        """How far ``sw``'s loss curve departs from yours over the guard's samples, its last losses' mean, a note."""
        c = applied(self.cfg, [s for s in sw if s.arithmetic])
        steps = max(1, math.ceil(self.t.guard_steps * self.batch_of(self.cfg) / self.batch_of(c)))
        losses, note = self.agreed(loss_curve(c, self.env, self.out, steps))
        if losses is None:
            return math.inf, None, note
        tail = losses[-max(1, len(losses) // GUARD_WINDOWS):]
        return departure(self.reference, losses, self.batch_of(self.cfg), self.batch_of(c)), sum(tail) / len(tail), note

    def guard_reference(self) -> None:
        """Your loss curve, and the tolerance: the larger of ``tune.guard_tolerance`` and how far yours departs under
        another seed (another initialization and batch order: the spread of equally good runs). Two runs on the
        same batches drift apart as training amplifies any difference in rounding (a fused optimizer's 0.9 % on
        resnet18/CIFAR in 50 steps), so a fixed tolerance alone rejected bf16 and compile there."""
        t, cfg = self.t, self.cfg
        reference, ref_note = self.agreed(loss_curve(cfg, self.env, self.out, t.guard_steps))
        if reference is None or ref_note:
            raise ConfigError(f"your configuration cannot train its first {t.guard_steps} steps here ({ref_note}); "
                              f"fix that before tuning its speed")
        self.reference = reference
        ref_tail = reference[-max(1, len(reference) // GUARD_WINDOWS):]
        self.rows.append({"stage": "guard", "switch": "(yours)", "guard_loss": sum(ref_tail) / len(ref_tail),
                          "guard_departure": 0.0, "verdict": "reference"})
        other = with_overrides(cfg, trainer__seed=int(cfg.trainer.seed or 0) + 1)
        seed_curve, seed_note = self.agreed(loss_curve(other, self.env, self.out, t.guard_steps))
        spread = 0.0 if seed_curve is None or seed_note else departure(reference, seed_curve, self.batch_of(cfg),
                                                                       self.batch_of(cfg))
        self.tolerance = max(t.guard_tolerance, spread)
        self.rows.append({"stage": "guard", "switch": "(yours, trainer.seed + 1)", "guard_departure": spread,
                          "guard_loss": seed_curve and sum(seed_curve[-len(ref_tail):]) / len(ref_tail),
                          "verdict": f"the tolerance: {self.tolerance:.2%} (the larger of this and "
                                     f"tune.guard_tolerance)"})
        say(self.env, f"speed: guard: your configuration under another seed departs {fmt(spread, '.2%')}; a candidate "
                      f"may depart up to {self.tolerance:.2%}")

    def guard_candidates(self, candidates: list[Switch]) -> list[Switch]:
        """The candidates whose first ``tune.guard_steps`` stay within the tolerance of yours (or that change no
        arithmetic)."""
        passed: list[Switch] = []
        for s in candidates:
            if not s.arithmetic:
                self.rows.append({"stage": "guard", "switch": s.name,
                                  "verdict": "not needed (same batches, same arithmetic)"})
                passed.append(s)
                continue
            dep, loss, note = self.guard([s])
            ok = dep <= self.tolerance
            why = note or f"loss departs {fmt(dep, '.1%')}"
            self.rows.append({"stage": "guard", "switch": s.name, "guard_loss": loss, "guard_departure": dep,
                              "verdict": "passed" if ok else f"rejected ({why})"})
            say(self.env, f"speed: guard {s.name}: loss after {self.t.guard_steps} steps {fmt(loss, '.4f')}, departs "
                          f"{fmt(dep, '.2%')} -> {'passed' if ok else 'REJECTED'}")
            if ok:
                passed.append(s)
        return passed

    def guarded(self, sw: list[Switch], what: str) -> bool:
        """The guard on switches together (the pick); a row, and a note when it fails."""
        if not any(s.arithmetic for s in sw):
            return True
        dep, loss, note = self.guard(sw)
        ok = dep <= self.tolerance
        self.rows.append({"stage": "guard", "switch": "+".join(s.name for s in sw), "guard_loss": loss,
                          "guard_departure": dep, "verdict": "passed" if ok else "rejected"})
        if not ok:
            self.notes.append(f"{what} ({'+'.join(s.name for s in sw)}) departs {fmt(dep, '.1%')} from your loss curve")
        return ok

    # ----------------------------------------------------------------------------- 2. greedy forward selection
    def select(self, remaining: list[Switch]) -> tuple[list[Switch], list[Switch]]:
        """One interleaved round per switch added (the module docstring); returns the pick and the last round's
        hopefuls (faster on top of the pick, not firmly)."""
        incumbent: list[Switch] = []
        reserve_s = 0.25 * self.budget_s  # for the verification
        while remaining:
            left = self.agreed(self.budget_s - sum(r.measured_s for r in self.rounds) - reserve_s)
            if left < 60:
                self.notes.append(f"the search stopped with {len(remaining)} candidate(s) unmeasured on top of the "
                                  f"pick: tune.budget_minutes={self.t.budget_minutes:g} spent")
                break
            base = "yours" if not incumbent else "+".join(s.name for s in incumbent)
            jobs = {"incumbent": applied(self.cfg, incumbent),
                    **{s.name: applied(self.cfg, [*incumbent, s]) for s in remaining}}
            r = Round(f"round {len(self.rounds) + 1}: on top of {base}", "incumbent", jobs, minutes=left / 2 / 60)
            say(self.env, f"speed: {r.title}: {len(remaining)} candidate(s), up to {r.minutes:.1f} min of measuring")
            measure_round(r, self.rounds_dir / f"round{len(self.rounds) + 1}", self.settings, self.ranks)
            self.rounds.append(r)
            for s in remaining:
                self.rows.append({"stage": f"round {len(self.rounds)}", "switch": s.name, "on_top_of": base,
                                  **_figures(r, s.name)})
            winners = [s for s in remaining if helps(r, s.name, self.t.min_speedup)]
            if not winners:
                self.notes.append(f"round {len(self.rounds)}: no candidate was firmly faster than {base}")
                return incumbent, hopefuls(r, remaining)
            best = max(winners, key=lambda s: r.comparisons[s.name].estimate)
            incumbent.append(best)
            say(self.env, f"speed: {r.title}: {best.name} helps most ({_describe(r.comparisons[best.name])}); kept")
            remaining = [s for s in remaining if s is not best and (best.group is None or s.group != best.group)
                         and r.comparisons.get(s.name) is not None and r.comparisons[s.name].estimate > 1
                         and s.name not in r.failed]
        return incumbent, []

    # ------------------------------------------------------------------------------------------ 3. verification
    def verify(self, incumbent: list[Switch], extra: list[Switch]) -> tuple[list[Switch], Any]:
        """Yours, its copy, the pick, the pick with the hopefuls and ``+experiment=fast`` head to head; returns the
        switches recommended (none: no change) and their interval against yours."""
        fast, fast_note = fast_config()
        if fast is None:
            self.notes.append(f"+experiment=fast not compared: {fast_note}")
        options = {name: sw for name, sw in (("pick", incumbent), ("extended", [*incumbent, *extra]))
                   if sw and (name == "pick" or extra)}
        label = {name: "+".join(s.name for s in sw) for name, sw in options.items()}
        jobs = {"yours": self.cfg, **{name: applied(self.cfg, sw) for name, sw in options.items()}}
        if fast is not None:
            jobs["fast"] = fast
        if len(jobs) == 1:
            return [], None
        minutes = max(1.0, (self.budget_s - self.agreed(sum(r.measured_s for r in self.rounds))) / 60)
        v = Round("verification", "yours", jobs, minutes=minutes)
        shown = ", ".join(f"the {'pick' if n == 'pick' else 'pick with the hopefuls'} ({label[n]})" for n in options)
        say(self.env, f"speed: verification: your configuration{', ' + shown if shown else ''}"
                      f"{', +experiment=fast' if fast is not None else ''}; up to {minutes:.1f} min")
        measure_round(v, self.rounds_dir / "verification", self.settings, self.ranks)
        self.rounds.append(v)
        for name in jobs:
            if name != "yours":
                self.rows.append({"stage": "verification", "switch": label.get(name, fast_note), "on_top_of": "yours",
                                  **_figures(v, name)})
        self.rows.append({"stage": "verification", "switch": "(yours, A/A)", "on_top_of": "yours",
                          **_paired_cells(v.aa), "verdict": "noise"})
        chosen_name = choose(v, list(options), self.t.min_speedup)
        self._verification_notes(v, options, label, chosen_name, fast is not None)
        if chosen_name is None:
            return [], None
        return options[chosen_name], v.comparisons.get(chosen_name)

    def _verification_notes(self, v: Round, options: dict, label: dict, chosen_name: str | None, fast: bool) -> None:
        from runner.compare import record as record_mod

        record = v.record or {"slices": [], "jobs": {}}
        if "extended" in options:
            head = record_mod.versus(record, "extended", "pick") if "pick" in options else None
            self.notes.append(f"the pick with the last round's hopefuls ({label['extended']})"
                              + (f" against the pick alone, head to head: {_describe(head)}" if head else "")
                              + f": {'recommended' if chosen_name == 'extended' else 'not recommended'}")
        for name in options:
            if name != chosen_name and not helps(v, name, self.t.min_speedup):
                self.notes.append(f"{label[name]} was not firmly faster than your configuration head to head "
                                  f"({_describe(v.comparisons.get(name))})")
        if chosen_name is not None and fast:
            head = record_mod.versus(record, chosen_name, "fast")
            if head is not None:
                self.notes.append(f"the pick against +experiment=fast, head to head: {_describe(head)}")

    # ----------------------------------------------------------------------------------------------- the result
    def result(self, picked: list[Switch], verified: Any) -> dict[str, Any]:
        """The harness's result (``tune_speed``'s return value) for the recommended switches ``picked``."""
        recommended = {"switches": [s.name for s in picked],
                       "changes": {k: v for s in picked for k, v in s.changes.items()},
                       "speedup": verified.estimate if picked and verified else 1.0,
                       "ci_low": verified.low if picked and verified else None,
                       "ci_high": verified.high if picked and verified else None}
        notes = self.notes
        if picked:
            override = " ".join(o for s in picked for o in s.overrides)
            notes.insert(0, f"the pick {'+'.join(s.name for s in picked)}: ×{verified.estimate:.3f} "
                            f"[{verified.low:.3f}–{verified.high:.3f}] your configuration's samples/s, measured head "
                            f"to head")
        else:
            override = "(no change)"
            notes.insert(0, "no change: no switch made your job firmly faster on this machine")
        biased = [r for r in self.rounds if r.aa is not None and (r.aa.low > 1 or r.aa.high < 1)]
        if biased:
            notes.insert(1, "warning: " + "; ".join(f"{r.title.split(':')[0]}: your configuration against its own "
                                                      f"copy read {_describe(r.aa)}" for r in biased)
                         + ": the round's own noise check failed, so its verdicts are less sure than their intervals "
                           "say (a switch is kept only when it beats both copies; more processes per configuration, "
                           "interleave.processes, widen the intervals to what the machine does)")
        if self.rounds and self.rounds[-1].aa is not None:
            from runner.compare.stats import minimum_detectable

            aa = self.rounds[-1].aa
            notes.append(f"noise: your configuration against its own copy read {_describe(aa)}; effects below about "
                         f"{minimum_detectable(aa):.1%} could not be resolved")
        notes.append(f"measured by interleaved slices of resident processes (runner/compare/), slices of "
                     f"{self.settings.slice_seconds:g} s (tune.slice_seconds); the guard: {self.t.guard_steps} steps, "
                     f"tolerance {self.tolerance:.1%} (yours under another seed, at least tune.guard_tolerance); the "
                     f"rounds' processes and interleave.json: {self.rounds_dir}")
        return {"recommended": recommended, "override": override, "rows": self.rows, "notes": notes,
                "rounds": [{"title": r.title, "aa": _paired_cells(r.aa), "stopped": r.stopped, "failed": r.failed}
                           for r in self.rounds],
                "files": {"experiment/tuned.yaml": tuned_yaml(picked, recommended)}}


def _rounds_folder(job_dir: Path) -> Path:
    """Where the rounds' processes write: ``<out>/rounds`` (the tuner's folder, found through Hydra when the
    CLI runs it; else a scratch folder under ``job_dir``)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir) / "rounds"
    return Path(job_dir) / "rounds"


def _paired_cells(c) -> dict[str, Any]:
    return {"speedup": c.estimate, "ci_low": c.low, "ci_high": c.high} if c else {}


def _figures(r: Round, name: str) -> dict[str, Any]:
    from runner.compare.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    verdict = r.failed.get(name) if name in r.failed and c is None else r.verdicts.get(name) or "not measured"
    if verdict == HELPS and r.aa is not None and not (copy_c and copy_c.low > 1):
        verdict = "helps vs the reference, not vs its copy"
    return {**_paired_cells(c), "verdict": verdict, "samples_per_sec": r.samples_per_sec.get(name),
            "vs_copy": copy_c.estimate if copy_c else None, "aa_speedup": r.aa.estimate if r.aa else None}


def _describe(c) -> str:
    return f"×{c.estimate:.3f} [{c.low:.3f}–{c.high:.3f}]" if c else "no interval"


def tuned_yaml(picked: list[Switch], recommended: dict[str, Any]) -> str:
    """The pick as a preset (``experiment/tuned.yaml``, package ``_global_``)."""
    lines = ["# @package _global_", "# python -m runner.tune speed: the pick, verified head to head against the "
             "configuration it was tuned on", f"# switches: {', '.join(recommended['switches']) or 'none (no change)'}"]
    if recommended.get("ci_low") is not None:
        lines.append(f"# samples/s x{recommended['speedup']:.3f} "
                     f"[{recommended['ci_low']:.3f}-{recommended['ci_high']:.3f}]")
    tree: dict[str, Any] = {}
    for s in picked:
        for key, value in s.changes.items():
            node = tree
            *path, last = key.split(".")
            for p in path:
                node = node.setdefault(p, {})
            node[last] = value
    body = OmegaConf.to_yaml(OmegaConf.create(tree)) if tree else "{}\n"
    return "\n".join(lines) + "\n" + body


def _plot(result: dict[str, Any]):
    plt = pyplot()
    rows = [r for r in result["rows"] if r.get("speedup") is not None]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(rows) + 1)))
    for i, r in enumerate(rows):
        color = "tab:green" if r["verdict"] == "helps" else "tab:red" if r["verdict"] == "hurts" else "tab:gray"
        ax.errorbar(r["speedup"], i, xerr=[[r["speedup"] - r["ci_low"]], [r["ci_high"] - r["speedup"]]], fmt="o",
                    color=color, capsize=3)
    ax.set_yticks(range(len(rows)), [f"{r['stage']}: {r['switch']}" for r in rows], fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s ÷ the round's reference (95 % interval)")
    ax.set_title("runner.tune speed")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _is_pick(row: dict, rec: dict) -> bool:
    return (row.get("stage") == "verification" and row.get("switch") == "+".join(rec["switches"])
            and bool(rec["switches"]))


TUNER = Tuner(
    name="speed",
    help="the fastest combination of the speed switches that apply to your job (compile, fused/foreach\n"
         "optimizer, on-device data, workers, bf16/AMP/TF32, channels_last, threads, ...): guarded against\n"
         "a changed loss, chosen by greedy forward selection with interleaved paired measurement, verified\n"
         "head to head against your configuration and +experiment=fast; writes experiment/tuned.yaml",
    tune=tune_speed,
    columns=[("stage", "stage", ""), ("switch", "switch", ""), ("on_top_of", "on top of", ""),
             ("speedup", "speed-up ×", ".3f"), ("ci_low", "95 % low", ".3f"), ("ci_high", "95 % high", ".3f"),
             ("verdict", "verdict", ""), ("vs_copy", "× its copy", ".3f"), ("samples_per_sec", "samples/s", ",.1f"),
             ("guard_loss", "loss at guard_steps", ".4f"), ("guard_departure", "departure", ".2%")],
    is_pick=_is_pick,
    plot=_plot,
    console_rows=None,  # every row is a decision: the console shows the verification against fast too
)

__all__ = ["TUNER", "Switch", "switches", "chosen", "applied", "loss_curve", "departure", "Round",
           "measure_round", "read_round", "helps", "hopefuls", "choose", "fast_config", "tune_speed", "tuned_yaml"]
