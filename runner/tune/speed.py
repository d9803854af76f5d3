"""``python -m runner.tune speed``: the fastest configuration of your job, found by measurement and verified.

The method (docs/tuners-and-doctor.md, "The speed tuner"): the candidates that apply and are not on
(runner/tune/switches.py, ``tune.only``, ``tune.switches``); a numerics guard that rejects a candidate whose loss
curve departs from yours more than another seed's does (runner/tune/guard.py); a first round of each switch alone and
all of them together, then backward elimination from the combination, each round an interleaved, paired measurement
through runner/compare/ (runner/tune/rounds.py); a verification of your configuration, its copy, the pick, the whole
combination and ``+experiment=fast`` head to head. Only a configuration firmly faster than yours is recommended, and
with ``tune.objective=job`` only one whose projected job (one-time costs included) is shorter.

Outputs (``harness.write_outputs``): ``speed.csv``/``.md``/``.png``/``.json`` (every candidate of every round) and
``experiment/tuned.yaml``, the pick as a preset; each round's processes and ``interleave.json`` in
``<out>/rounds/``. Under torchrun every measured job is a DDP job of the N ranks, rank 0's figures decide and are
broadcast (runner/compare/ranks.py), so the ranks agree on every decision.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, compile_cache
from runner.tune import speed_report
from runner.tune.guard import GUARD_WINDOWS, departure, loss_curve
from runner.tune.harness import COMMAND_STARTED_S, Tuner, fmt, say, with_overrides
from runner.tune.rounds import (
    Round,
    cheap_to_remove,
    choose,
    firmly_hurting,
    group_best,
    helps,
    measure_round,
    read_round,
)
from runner.tune.speed_report import describe, is_pick, paired_cells, plot, round_figures, tuned_yaml
from runner.tune.switches import Switch, applied, chosen, fast_config, switches

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
    return speed_report.result(search, *search.run(candidates))


class _Search:
    """The state of one search (``tune_speed``): the run config, the rows and notes of the report, the rounds
    measured so far and the guard's reference curve and tolerance. Under torchrun every figure a decision rests on
    is rank 0's (``agreed``)."""

    def __init__(self, cfg: DictConfig, env, out: Path):
        from runner.compare.ranks import Ranks

        self.cfg, self.env, self.out, self.t = cfg, env, out, cfg.tune
        self.ranks = Ranks.join(cfg.distributed.timeout_s) if env.distributed else None
        self.budget_s = 60 * self.t.budget_minutes  # of wall time: the whole command, from runner's import
        self.deadline = COMMAND_STARTED_S[0] + self.budget_s  # time.perf_counter()'s
        self.startup_s = START_GUESS_S  # a job process's start-up and finish, as the last round paid them
        self.cold_compile_s = 0.0  # the guard's longest compile: what a job that carries no cache pays
        self.rounds_dir = _rounds_folder(out)
        # the compile cache every round's compiled jobs share (and the guard's compiles feed): each configuration's
        # graphs compile once in the whole search (runner/techniques/compile_cache.py)
        self.cache = self.rounds_dir / compile_cache.FOLDER
        self.store = compile_cache.Store(None, self.cache, env.is_main)
        self.chosen_name: str | None = None  # the verification's pick ("pick" or "extended")
        self.compile_s: float | None = None  # the last guard's compile seconds (cold but for kernels shared before)
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.rounds: list[Round] = []
        self.reference: list[float] = []
        self.job_steps: int | None = None  # the job's optimizer steps as configured (from the guard's build)
        self.alone: dict[str, Any] = {}  # round 1: each switch alone against yours
        self.whole: list[Switch] | None = None  # the combination verified beside the pick, where not round 1's
        self.tolerance = self.t.guard_tolerance
        self.settings = copy.deepcopy(cfg.interleave)
        self.settings.target_ci = self.t.target_ci
        self.settings.slice_seconds = self.t.slice_seconds
        self.settings.processes = self.t.processes or (1 if env.device.type == "cpu" else self.settings.processes)

    def sharing(self, c: DictConfig) -> DictConfig:
        """``c`` with the search's compile cache as its ``compile.cache`` (a compiled configuration; else ``c``)."""
        if not (c.compile.mode or c.compile.optimizer):
            return c
        out = copy.deepcopy(c)
        out.compile.cache = str(self.cache)
        return out

    def agreed(self, value: Any) -> Any:
        """What rank 0 measured or decided, on every rank."""
        return self.ranks.share(value) if self.ranks is not None else value

    @staticmethod
    def batch_of(c: DictConfig) -> int:
        from runner.config import global_batch_size

        return global_batch_size(c.dataloader.batch_size, c.memory.accumulate_steps, 1)

    # ----------------------------------------------------------------------------------------- 1. the guard
    def guard(self, sw: list[Switch]) -> tuple[float, float | None, str]:
        """How far ``sw``'s loss curve departs from yours over the guard's samples, its last losses' mean, a note
        (a switch whose builder recorded it skipped does not act on this job: rejected with the builder's reason)."""
        c = applied(self.cfg, [s for s in sw if s.arithmetic])
        steps = max(1, math.ceil(self.t.guard_steps * self.batch_of(self.cfg) / self.batch_of(c)))
        built: dict[str, Any] = {}
        losses, note = self.agreed(loss_curve(c, self.env, self.out, steps, built=built))
        compiled = c.compile.mode or c.compile.optimizer
        self.compile_s = self.agreed(built.get("compile_s")) if compiled else None
        statuses = built.get("techniques", {})
        skipped = [
            f"{s.name} {statuses[k]}"
            for s in sw
            if s.name in TECHNIQUES
            for k in TECHNIQUES[s.name].statuses or (s.name,)
            if str(statuses.get(k)).startswith("skipped")
        ]
        if skipped:
            return math.inf, None, self.agreed(f"it does not act on this job ({skipped[0]})")
        if losses is None:
            return math.inf, None, note
        tail = losses[-max(1, len(losses) // GUARD_WINDOWS) :]
        return departure(self.reference, losses, self.batch_of(self.cfg), self.batch_of(c)), sum(tail) / len(tail), note

    def guard_reference(self) -> None:
        """Your loss curve, and the tolerance: the larger of ``tune.guard_tolerance`` and how far yours departs under
        another seed (another initialization and batch order: the spread of equally good runs). Two runs on the
        same batches drift apart as training amplifies any difference in rounding (a fused optimizer's 0.9 % on
        resnet18/CIFAR in 50 steps), so a fixed tolerance alone rejected bf16 and compile there."""
        t, cfg = self.t, self.cfg
        plan: dict[str, int] = {}
        reference, ref_note = self.agreed(loss_curve(cfg, self.env, self.out, t.guard_steps, plan))
        self.job_steps = self.agreed(plan.get("steps"))
        if reference is None or ref_note:
            raise ConfigError(
                f"your configuration cannot train its first {t.guard_steps} steps here ({ref_note}); "
                f"fix that before tuning its speed"
            )
        self.reference = reference
        ref_tail = reference[-max(1, len(reference) // GUARD_WINDOWS) :]
        self.rows.append(
            {
                "stage": "guard",
                "switch": "(yours)",
                "guard_loss": sum(ref_tail) / len(ref_tail),
                "guard_departure": 0.0,
                "verdict": "reference",
            }
        )
        other = with_overrides(cfg, trainer__seed=int(cfg.trainer.seed or 0) + 1)
        seed_curve, seed_note = self.agreed(loss_curve(other, self.env, self.out, t.guard_steps))
        spread = (
            0.0
            if seed_curve is None or seed_note
            else departure(reference, seed_curve, self.batch_of(cfg), self.batch_of(cfg))
        )
        self.tolerance = max(t.guard_tolerance, spread)
        self.rows.append(
            {
                "stage": "guard",
                "switch": "(yours, trainer.seed + 1)",
                "guard_departure": spread,
                "guard_loss": seed_curve and sum(seed_curve[-len(ref_tail) :]) / len(ref_tail),
                "verdict": f"the tolerance: {self.tolerance:.2%} (the larger of this and tune.guard_tolerance)",
            }
        )
        say(
            self.env,
            f"speed: guard: your configuration under another seed departs {fmt(spread, '.2%')}; a candidate "
            f"may depart up to {self.tolerance:.2%}",
        )

    def run(self, candidates: list[Switch]) -> tuple[list[Switch], Any]:
        """The search from the guarded reference on: the guard, round 1, the elimination and the verification of
        ``candidates``; returns the switches recommended (none: no change) and their interval against yours. Every
        decision is a function of what the rounds measured (runner/tune/rounds.py), so a search can be replayed
        from its rounds' records (tests/test_tune_replay.py)."""
        passed = self.guard_candidates(candidates)
        combination = self.screen(passed)
        incumbent = self.eliminate(list(combination), passed) if len(combination) > 1 else combination
        while incumbent and not self.guarded(incumbent, "the pick's switches together"):
            self.notes.append(f"{incumbent[-1].name} dropped from the pick")
            incumbent.pop()
        combination = self.whole or combination
        whole = combination if len(combination) > 1 and combination != incumbent else incumbent
        if whole is not incumbent and not self.guarded(whole, "the whole combination"):
            whole = incumbent
        return self.verify(incumbent, whole)

    def wall_left(self) -> float:
        """Seconds left of ``tune.budget_minutes`` (the whole command's wall time), rank 0's."""
        return self.agreed(self.deadline - time.perf_counter())

    def verification_reserve(self) -> float:
        """The wall time kept for the verification: a quarter of the budget, or what its five configurations'
        processes need (start-ups, ``VERIFICATION_PASSES`` slices each, a cold compile) where that is more."""
        jobs = 5 * self.settings.processes  # yours, its copy, the pick, the whole combination, +experiment=fast
        slices = VERIFICATION_PASSES * self.settings.slice_seconds * SLICE_COST
        need = jobs * (self.startup_s + slices) + self.cold_compile_s
        return max(0.25 * self.budget_s, need)

    def guard_candidates(self, candidates: list[Switch]) -> list[Switch]:
        """The candidates within the guard's tolerance over ``tune.guard_steps`` (or that change no arithmetic);
        those not guarded once ``GUARD_SHARE`` of the budget is spent are left out, named in a note."""
        passed: list[Switch] = []
        for i, s in enumerate(candidates):
            if s.arithmetic and self.wall_left() < (1 - GUARD_SHARE) * self.budget_s:
                left = [c.name for c in candidates[i:] if c.arithmetic]
                self.notes.append(
                    f"not guarded, so not measured: {', '.join(left)} (the guard had spent "
                    f"{GUARD_SHARE:.0%} of tune.budget_minutes={self.t.budget_minutes:g})"
                )
                passed += [c for c in candidates[i:] if not c.arithmetic]
                break
            if not s.arithmetic:
                self.rows.append(
                    {"stage": "guard", "switch": s.name, "verdict": "not needed (same batches, same arithmetic)"}
                )
                passed.append(s)
                continue
            dep, loss, note = self.guard([s])
            ok = dep <= self.tolerance
            why = note or f"loss departs {fmt(dep, '.1%')}"
            self.rows.append(
                {
                    "stage": "guard",
                    "switch": s.name,
                    "guard_loss": loss,
                    "guard_departure": dep,
                    "compile_s": self.compile_s,
                    "verdict": "passed" if ok else f"rejected ({why})",
                }
            )
            say(
                self.env,
                f"speed: guard {s.name}: loss after {self.t.guard_steps} steps {fmt(loss, '.4f')}, departs "
                f"{fmt(dep, '.2%')} -> {'passed' if ok else 'REJECTED'}",
            )
            if ok:
                passed.append(s)
            self.cold_compile_s = max(self.cold_compile_s, self.compile_s or 0.0)
        self.store.save()  # what the guard compiled: the rounds' jobs of the same configurations load it
        return passed

    def guarded(self, sw: list[Switch], what: str) -> bool:
        """The guard on switches together (the pick); a row, and a note when it fails."""
        if not any(s.arithmetic for s in sw):
            return True
        dep, loss, note = self.guard(sw)
        self.store.save()  # its compiled code: the verification's job of the same switches loads it
        ok = dep <= self.tolerance
        self.rows.append(
            {
                "stage": "guard",
                "switch": "+".join(s.name for s in sw),
                "guard_loss": loss,
                "guard_departure": dep,
                "verdict": "passed" if ok else "rejected",
                "compile_s": self.compile_s,
            }
        )
        if not ok:
            self.notes.append(f"{what} ({'+'.join(s.name for s in sw)}) departs {fmt(dep, '.1%')} from your loss curve")
        return ok

    # ------------------------------------------------------------ 2. the combination, then backward elimination
    def round(self, title: str, reference: str, jobs: dict[str, DictConfig], share: float = 0.5) -> Round | None:
        """Measure one round with ``share`` of the wall time left past the verification's (``verification_reserve``)
        and its processes' start-ups; None (and a note) when under a minute, or under ``interleave.min_passes``
        passes of its slices, is left."""
        processes = (len(jobs) + 1) * self.settings.processes  # + 1: the reference's copy
        left = self.wall_left() - self.verification_reserve() - processes * self.startup_s
        per_pass = (len(jobs) + 1) * self.settings.slice_seconds * SLICE_COST
        fewest = min(self.settings.max_passes, max(self.settings.min_passes, ROUND_PASSES))
        if share * left < fewest * per_pass:  # too little for this round and another: this one takes it all
            share = 1.0
        if left < 60 or (self.settings.slice_steps is None and share * left < fewest * per_pass):
            self.notes.append(
                f"{title.split(':')[0]} not measured: tune.budget_minutes={self.t.budget_minutes:g} "
                f"spent (under {fewest} passes of its {len(jobs) + 1} jobs left)"
            )
            return None
        r = Round(title, reference, {name: self.sharing(c) for name, c in jobs.items()}, minutes=share * left / 60)
        say(self.env, f"speed: {r.title}: {len(jobs) - 1} against {reference}, up to {r.minutes:.1f} min of measuring")
        started = time.perf_counter()
        measure_round(r, self.rounds_dir / f"round{len(self.rounds) + 1}", self.settings, self.ranks)
        self.startup_s = max(1.0, self.agreed(time.perf_counter() - started - r.measured_s) / processes)
        self.rounds.append(r)
        return r

    def screen(self, candidates: list[Switch]) -> list[Switch]:
        """Round 1: each candidate alone on top of yours and, with two or more, all of them together (one of each
        group: the first offered; elimination tries the others). Returns that combination, or with one candidate
        that candidate when it is firmly faster."""
        combination = list({s.group or s.name: s for s in reversed(candidates)}.values())[::-1]
        jobs = {"yours": self.cfg, **{s.name: applied(self.cfg, [s]) for s in candidates}}
        if len(combination) > 1:
            jobs[ALL] = applied(self.cfg, combination)
        r = self.round("round 1: each switch alone, and all together", "yours", jobs) if candidates else None
        if r is None:
            return []
        for name in jobs:
            if name != "yours":
                self.rows.append(
                    {
                        "stage": "round 1",
                        "switch": _label(combination) if name == ALL else name,
                        "on_top_of": "yours",
                        **self.figures(r, name, "yours"),
                    }
                )
        self.alone = {s.name: r.comparisons.get(s.name) for s in candidates}
        if len(combination) < 2:
            return [s for s in candidates if helps(r, s.name, self.t.min_speedup)]
        best = group_best(combination, candidates, r)
        self.notes += [
            f"round 1: the elimination starts with {b.name} in place of {c.name}, firmly faster alone "
            f"({describe(self.alone[b.name])} against {describe(self.alone[c.name])})"
            for c, b in zip(combination, best)
            if b is not c
        ]
        return best

    def eliminate(self, pick: list[Switch], candidates: list[Switch]) -> list[Switch]:
        """Backward elimination from the combination ``pick`` (docs/tuners-and-doctor.md): each round measures it
        without each switch, with each group alternative and with each switch the last round dropped added back; it
        takes the firmly fastest swap or add-back and drops every switch whose removal is firmly faster, or with
        nothing firm the one whose removal reads best, if not firmly slower and, where it reads slower, shown to
        cost under ``tune.target_ci`` (low end above 1 - target_ci). Steady samples/s: one process's one-time
        costs are too noisy to decide on. Ends when no switch can go or the time is spent (the rules: rounds.py's
        ``helps``, ``firmly_hurting``, ``cheap_to_remove``)."""
        dropped: list[Switch] = []
        while pick or dropped:
            moves = {
                f"{s.name}->{a.name}": [a if x is s else x for x in pick]
                for s in pick
                for a in candidates
                if s.group and a.group == s.group and a is not s
            }
            moves |= {f"+{d.name}": [*pick, d] for d in dropped if d not in pick}
            jobs = {
                ALL: applied(self.cfg, pick),
                **{f"-{s.name}": applied(self.cfg, [x for x in pick if x is not s]) for s in pick},
            }
            jobs |= {name: applied(self.cfg, sw) for name, sw in moves.items()}
            r = self.round(f"round {len(self.rounds) + 1}: backward elimination from {_label(pick)}", ALL, jobs)
            if r is None and len(self.rounds) == 1:  # no elimination round fits: round 1's reading decides
                return self.unmeasured_pick(pick)
            if r is None or ALL in r.failed:  # no time left, or no reference to compare with (a note)
                self.notes += [f"round {len(self.rounds)}: the combination failed ({r.failed[ALL]})"] if r else []
                break
            for name in jobs:
                if name != ALL:
                    self.rows.append(
                        {
                            "stage": f"round {len(self.rounds)}",
                            "switch": name,
                            "on_top_of": _label(pick),
                            **self.figures(r, name, ALL),
                        }
                    )
            dropped = firmly_hurting(r, pick, self.t.min_speedup)
            firm = [n for n in moves if helps(r, n, self.t.min_speedup)]
            if firm:
                move = max(firm, key=lambda n: r.comparisons[n].estimate)
                pick = moves[move]
                old, _, new = move.partition("->")
                what = f"{new} in place of {old}" if new else f"{old[1:]} added back"
                self.notes.append(f"round {len(self.rounds)}: {what}, firmly faster in the combination")
            elif not dropped:
                removable = cheap_to_remove(r, pick, self.t.target_ci)
                if not removable:
                    self.notes.append(
                        f"round {len(self.rounds)}: no switch of {_label(pick)} goes: removing each "
                        f"reads slower and is not shown to cost under {self.t.target_ci:.0%}"
                    )
                    break
                dropped = [max(removable, key=lambda s: r.comparisons[f"-{s.name}"].estimate)]
            dropped = [s for s in dropped if s in pick]
            for s in dropped:
                self.interaction(s, r.comparisons[f"-{s.name}"], dropped=True)
            if len(dropped) > 1:
                self.notes.append(
                    f"round {len(self.rounds)}: {', '.join(s.name for s in dropped)} dropped together, "
                    f"each firmly slower in the combination"
                )
            pick = [x for x in pick if x not in dropped]
        for s in pick:
            if self.rounds and (c := self.rounds[-1].comparisons.get(f"-{s.name}")) is not None:
                self.interaction(s, c, dropped=False)
        return pick

    def unmeasured_pick(self, combination: list[Switch]) -> list[Switch]:
        """The pick when no elimination round fits the budget: the combination without the switches that read slower
        alone in round 1 (a note names them). The verification measures beside it the combination without only
        those firmly slower alone (``self.whole``), and keeps the others only if that is firmly faster."""
        from runner.compare.stats import HURTS

        self.whole = [s for s in combination if self.rounds[0].verdicts.get(s.name) != HURTS]
        slower = [s for s in self.whole if (c := self.alone.get(s.name)) is not None and c.estimate < 1]
        if not slower or len(slower) == len(self.whole):
            return self.whole
        self.notes.append(
            f"no elimination round fitted tune.budget_minutes={self.t.budget_minutes:g}: the pick "
            f"leaves out {', '.join(f'{s.name} ({describe(self.alone[s.name])} alone)' for s in slower)}"
            f"; the verification measures the combination with them beside it"
        )
        return [s for s in self.whole if s not in slower]

    def interaction(self, s: Switch, without: Any, dropped: bool) -> None:
        """A note when a switch's effect in the combination differs from its effect alone (round 1)."""
        alone = self.alone.get(s.name)
        if alone is None or without is None:
            return
        inside = 1 / without.estimate
        if (alone.estimate > 1) != (inside > 1):
            self.notes.append(
                f"interaction: {s.name} alone ×{alone.estimate:.3f}, in the combination ×{inside:.3f}"
                f"{' (dropped)' if dropped else ''}: it "
                f"{'helps only with' if inside > 1 else 'hurts with'} the others"
            )

    def figures(self, r: Round, name: str, reference: str) -> dict[str, Any]:
        """A row's figures (``_figures``) plus the job's projected wall time against the reference's
        (``job_speedup``: one-time costs as measured in the round, steps at its median samples/s) and the step
        count after which its one-time costs are paid back (``pays_after_steps``)."""
        out = round_figures(r, name)
        mine, theirs = self.job_time(r, name), self.job_time(r, reference)
        if mine and theirs:
            out["job_speedup"] = theirs / mine
            step = {n: self.batch_of(r.jobs[n]) / r.samples_per_sec[n] for n in (name, reference)}
            cost = r.one_time[name] - r.one_time[reference]
            gain = step[reference] - step[name]  # s per step
            out["pays_after_steps"] = None if gain <= 0 else 0 if cost <= 0 else math.ceil(cost / gain)
        return out

    def job_time(self, r: Round, name: str) -> float | None:
        """The projected seconds of the job as configured (``self.job_steps``) in ``name``'s configuration."""
        sps, once = r.samples_per_sec.get(name), r.one_time.get(name)
        if not sps or once is None or not self.job_steps or name not in r.jobs:
            return None
        return once + self.job_steps * self.batch_of(r.jobs[name]) / sps

    # ------------------------------------------------------------------------------------------ 3. verification
    def verify(self, incumbent: list[Switch], whole: list[Switch]) -> tuple[list[Switch], Any]:
        """Yours, its copy, the pick, the whole combination (``whole``, when it differs) and ``+experiment=fast`` head
        to head; returns the switches recommended (none: no change) and their interval against yours."""
        fast, fast_note = fast_config()
        if fast is None:
            self.notes.append(f"+experiment=fast not compared: {fast_note}")
        options = {
            name: sw
            for name, sw in (("pick", incumbent), ("extended", whole))
            if sw and (name == "pick" or whole != incumbent)
        }
        label = {name: "+".join(s.name for s in sw) for name, sw in options.items()}
        # the options with the search's compile cache, as their preset carries it; yours and fast compile cold, as a
        # job started from them on a fresh node does: each one-time cost is what its job will pay (tune.objective=job)
        jobs = {"yours": self.cfg, **{name: self.sharing(applied(self.cfg, sw)) for name, sw in options.items()}}
        if fast is not None:
            jobs["fast"] = fast
        if len(jobs) == 1:
            return [], None
        starting = len(jobs) * (self.settings.processes * self.startup_s) + self.cold_compile_s
        minutes = max(1.0, (self.wall_left() - starting) / 60)
        v = Round("verification", "yours", jobs, minutes=minutes)
        shown = ", ".join(f"the {'pick' if n == 'pick' else 'whole combination'} ({label[n]})" for n in options)
        say(
            self.env,
            f"speed: verification: your configuration{', ' + shown if shown else ''}"
            f"{', +experiment=fast' if fast is not None else ''}; up to {minutes:.1f} min",
        )
        settings = copy.deepcopy(self.settings)  # the decisive round: pairs over minutes, not one calm moment
        settings.min_passes = min(settings.max_passes, max(settings.min_passes, VERIFICATION_PASSES))
        measure_round(v, self.rounds_dir / "verification", settings, self.ranks)
        self.rounds.append(v)
        for name in jobs:
            if name != "yours":
                self.rows.append(
                    {
                        "stage": "verification",
                        "switch": label.get(name, fast_note),
                        "on_top_of": "yours",
                        **self.figures(v, name, "yours"),
                    }
                )
        self.rows.append(
            {
                "stage": "verification",
                "switch": "(yours, A/A)",
                "on_top_of": "yours",
                **paired_cells(v.aa),
                "verdict": "noise",
            }
        )
        chosen_name = choose(v, list(options), self.t.min_speedup)
        if self.t.objective == "job" and chosen_name is not None:
            chosen_name = self.shortest_job(v, options, label, chosen_name)
        self.notes += speed_report.verification_notes(
            v, options, label, chosen_name, fast is not None, self.t.min_speedup
        )
        self.chosen_name = chosen_name
        if chosen_name is None:
            return [], None
        return options[chosen_name], v.comparisons.get(chosen_name)

    def shortest_job(self, v: Round, options: dict, label: dict, chosen_name: str) -> str | None:
        """``tune.objective=job``: ``chosen_name`` (``choose``'s: fewer switches unless more are firmly faster) when
        its projected job is shorter than yours, else the option firmly faster than yours whose job is shortest
        (None when none is shorter: the break-even in a note); ``chosen_name`` where the projection cannot be made
        (no measured one-time costs, or the job's steps unknown). A projection has no interval to rank by."""
        rows = {n: self.figures(v, n, "yours") for n in options}
        if any("job_speedup" not in f for f in rows.values()) or rows[chosen_name]["job_speedup"] > 1:
            return chosen_name
        firm = [n for n in options if helps(v, n, self.t.min_speedup)]
        shorter = [n for n in firm if rows[n]["job_speedup"] > 1]
        if shorter:
            return max(shorter, key=lambda n: rows[n]["job_speedup"])
        f, pays = rows[chosen_name], rows[chosen_name].get("pays_after_steps")
        pays = "never (it is not faster per step)" if pays is None else f"{pays:,} steps"
        self.notes.append(
            f"{label[chosen_name]} is firmly faster per step (×{f['speedup']:.3f}) but your job of "
            f"{self.job_steps:,} steps would take ×{1 / f['job_speedup']:.2f} as long: its one-time "
            f"costs (compilation, autotuning) pay after {pays}; "
            f"tune.objective=throughput ranks by steady samples/s alone"
        )
        return None

    # ----------------------------------------------------------------------------------------------- the result
    def preset_cache(self, picked: list[Switch]) -> Path | None:
        """The pick's compiled code for its preset: its verification job's signed cache copied (checked first) to
        ``experiment/compile_cache/`` beside ``tuned.yaml``, which names it, so the first job of the preset on any
        node of yours starts warm. None (and a note) for a pick that does not compile, or a cache that cannot be
        copied."""
        c = applied(self.cfg, picked)
        if not (c.compile.mode or c.compile.optimizer) or self.chosen_name is None:
            return None
        source = self.rounds_dir / "verification" / self.chosen_name / compile_cache.FOLDER
        folder = self.rounds_dir.parent / "experiment" / compile_cache.FOLDER
        problem = compile_cache.copy_entry(source, folder / "pick") if self.env.is_main else None
        if self.agreed(problem):
            self.notes.append(f"the preset carries no compile cache ({problem}): its first job compiles cold")
            return None
        self.notes.append(
            f"the preset carries the pick's compiled code ({folder}, signed with your key): its first "
            f"job on any node of yours loads it instead of compiling cold"
        )
        return folder


ALL = "all"  # the round's job with every switch of the combination
#: The guard's share of ``tune.budget_minutes`` at most; candidates not guarded by then are left out (a note)
GUARD_SHARE = 0.4
#: The fewest passes a round is measured with (or interleave.min_passes where more): with 14 jobs and Holm's
#: correction, 4 passes read ×0.5-2.0 for every switch on the CPU GPT, resolving nothing
ROUND_PASSES = 6
#: A slice's wall time over ``tune.slice_seconds``: its resume steps (a quarter slice) and the switch of process
SLICE_COST = 1.5
#: A job process's start-up and finish (fork, data, model, warm-up, final step) before a round has measured one
START_GUESS_S = 5.0
#: The verification's fewest passes: pairs over minutes, so that a passing calm or load does not decide (docs)
VERIFICATION_PASSES = 16


def _label(switches: list[Switch]) -> str:
    return "+".join(s.name for s in switches)


def _rounds_folder(job_dir: Path) -> Path:
    """Where the rounds' processes write: ``<out>/rounds`` (the tuner's folder, found through Hydra when the
    CLI runs it; else a scratch folder under ``job_dir``)."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    return Path(OmegaConf.select(hydra, "runtime.output_dir", default=None) or job_dir if hydra else job_dir) / "rounds"


TUNER = Tuner(
    name="speed",
    tune=tune_speed,
    is_pick=is_pick,
    plot=plot,
    help="the fastest combination of the speed switches that apply to your job (compile, fused/foreach\n"
    "optimizer, on-device data, workers, bf16/AMP/TF32, channels_last, threads, ...): guarded against\n"
    "a changed loss, found by backward elimination from all of them together with interleaved paired\n"
    "measurement, ranked by the whole job's time (tune.objective), verified head to head against your\n"
    "configuration and +experiment=fast; writes experiment/tuned.yaml",
    columns=[
        ("stage", "stage", ""),
        ("switch", "switch", ""),
        ("on_top_of", "on top of", ""),
        ("speedup", "speed-up ×", ".3f"),
        ("ci_low", "95 % low", ".3f"),
        ("ci_high", "95 % high", ".3f"),
        ("verdict", "verdict", ""),
        ("vs_copy", "× its copy", ".3f"),
        ("samples_per_sec", "samples/s", ",.1f"),
        ("job_speedup", "job time ÷", ".3f"),
        ("pays_after_steps", "pays after steps", ",d"),
        ("compile_s", "compile s (guard)", ".1f"),
        ("guard_loss", "loss at guard_steps", ".4f"),
        ("guard_departure", "departure", ".2%"),
    ],
    console_rows=None,  # every row is a decision: the console shows the verification against fast too
)

__all__ = [
    "TUNER",
    "Switch",
    "switches",
    "chosen",
    "applied",
    "loss_curve",
    "departure",
    "Round",
    "measure_round",
    "read_round",
    "helps",
    "choose",
    "fast_config",
    "tune_speed",
    "tuned_yaml",
]
