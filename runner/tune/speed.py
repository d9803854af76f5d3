"""``python -m runner.tune speed``: the fastest configuration of your job, found by measurement and verified.

``+experiment=fast`` is a list chosen in advance; on a real job it can lose (the Shakespeare GPT on a 2-core
CPU ran at x0.93 of its recipe with it). This tuner measures instead, on the job itself:

1. **Candidates.** The speed switches that apply to the job and are not already on (``switches``): compile
   modes, the optimizer's kernel (foreach, fused), on-device data or loader workers and pinning, bf16/AMP/TF32,
   channels_last and cuDNN autotuning (image tasks), ``set_to_none``, fewer host syncs, the CPU's intra-op
   threads; with ``tune.allow=recipe`` also a 2x/4x micro-batch with the LR scaled linearly. ``tune.only``
   narrows the list, ``tune.switches`` adds your own (``name -> {dotted.key: value}``).
2. **Numerics guard.** Every candidate that changes arithmetic, and at the end the pick, trains the first ``tune.guard_steps`` steps from
   the same weights and batches as your configuration (same seed, in this process); a candidate whose loss
   curve departs from yours (relative, in any fifth of the samples seen) by more than yours departs under another
   seed (``trainer.seed + 1``: another initialization and batch order, the spread of equally good runs) and more
   than ``tune.guard_tolerance`` is rejected before any speed is measured (``guard``).
3. **Greedy forward selection by interleaved, paired measurement** (runner/interleave/). Round 1 measures
   each candidate on top of your configuration; every round, the candidates and the incumbent are resident
   processes taking turns in slices of about ``tune.slice_seconds`` (1 s: on a noisy machine, the shorter the
   slices, the closer in time the paired slices, the more drift cancels), a copy of the incumbent (A')
   measures the round's own noise, and each verdict is Holm's over the round (runner/interleave/stats.py);
   a candidate firmly slower is retired from the round after ``interleave.min_passes`` passes. The candidate that helps most (its
   interval's low end above ``tune.min_speedup``) joins the incumbent; candidates measured no faster are
   dropped (racing: López-Ibáñez et al., "The irace package", 2016); the next round measures the rest on
   top of the new incumbent, so interactions are measured, not assumed. It ends when nothing helps, no
   candidate is left or the search's share of ``tune.budget_minutes`` is spent. When it ends because nothing
   was firmly faster, the last round's *hopefuls* (faster, not firmly: ``rounds.hopefuls``) are kept aside:
   effects of 5-15 % are rarely firm in a short round on a noisy machine, and several of them add up.
4. **Verification.** Your configuration, its copy, the pick, the pick with the hopefuls and
   ``+experiment=fast`` run head to head. A configuration is recommended only when it is firmly faster than
   yours, the one with the hopefuls only when it is also firmly faster than the pick (``rounds.choose``);
   otherwise the answer is "no change". The pick is never slower than what you run.

Outputs (``harness.write_outputs``): ``speed.csv``/``.md``/``.png``/``.json`` with every candidate of every
round (speed-up, interval, verdict, the guard's loss and departure), and ``experiment/tuned.yaml``: the pick as
a preset, ``python -m runner '+experiment=[<yours>,tuned]' --config-dir <out>``. Each round's processes and
``interleave.json`` stay in ``<out>/rounds/``.

Layout: the candidates in runner/tune/switches.py, the guard in runner/tune/guard.py, the rounds and the
decisions on them in runner/tune/rounds.py, the search and the outputs here.

The measured jobs are the tuner's children. Under torchrun (``torchrun --nproc-per-node N -m runner.tune speed
distributed=ddp ...``) every round's job is a DDP job of the N ranks: rank 0's conductor decides and the
other ranks' conductors mirror it (runner/interleave/ranks.py), the guard trains on all ranks, and every
figure a decision rests on (the guard's loss curves, each round's record, the time left) is rank 0's,
broadcast, so the ranks agree on every decision.
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
from runner.tune.rounds import Round, choose, helps, hopefuls, job_config, measure_round, read_round
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
    from runner.interleave.ranks import Ranks
    from runner.interleave.schedule import settings_problem

    if problem := settings_problem(cfg.interleave):
        raise ConfigError(problem)
    t = cfg.tune
    ranks = Ranks.join(cfg.distributed.timeout_s) if env.distributed else None

    def agreed(value: Any) -> Any:  # what rank 0 measured or decided, on every rank
        return ranks.share(value) if ranks is not None else value

    budget_s = 60 * t.budget_minutes  # of measuring: the guard, start-ups and compilation come on top
    out = Path(job_dir)
    rounds_dir = _rounds_folder(out)
    candidates, notes = chosen(cfg, t, env.device)
    say(env, f"speed: {len(candidates)} candidate(s): {', '.join(s.name for s in candidates) or 'none'}")
    rows: list[dict[str, Any]] = []

    # 1. the guard: every candidate's first guard_steps against the user's configuration
    from runner.config import global_batch_size

    def batch_of(c: DictConfig) -> int:
        return global_batch_size(c.dataloader.batch_size, c.memory.accumulate_steps, 1)

    def guard(sw: list[Switch]) -> tuple[float, float | None, str]:
        c = applied(cfg, [s for s in sw if s.arithmetic])
        steps = max(1, math.ceil(t.guard_steps * batch_of(cfg) / batch_of(c)))
        losses, note = agreed(loss_curve(c, env, out, steps))
        if losses is None:
            return math.inf, None, note
        tail = losses[-max(1, len(losses) // GUARD_WINDOWS):]
        return departure(reference, losses, batch_of(cfg), batch_of(c)), sum(tail) / len(tail), note

    reference, ref_note = agreed(loss_curve(cfg, env, out, t.guard_steps))
    if reference is None or ref_note:
        raise ConfigError(f"your configuration cannot train its first {t.guard_steps} steps here ({ref_note}); "
                          f"fix that before tuning its speed")
    ref_tail = reference[-max(1, len(reference) // GUARD_WINDOWS):]
    rows.append({"stage": "guard", "switch": "(yours)", "guard_loss": sum(ref_tail) / len(ref_tail),
                 "guard_departure": 0.0, "verdict": "reference"})
    # the spread of equally good runs: yours under another seed (another initialization and batch order). Two
    # runs on the same batches drift apart as training amplifies any difference in rounding (a fused optimizer's
    # 0.9 % on resnet18/CIFAR in 50 steps), so a fixed tolerance alone rejected bf16 and compile there
    other = with_overrides(cfg, trainer__seed=int(cfg.trainer.seed or 0) + 1)
    seed_curve, seed_note = agreed(loss_curve(other, env, out, t.guard_steps))
    spread = 0.0 if seed_curve is None or seed_note else departure(reference, seed_curve, batch_of(cfg), batch_of(cfg))
    tolerance = max(t.guard_tolerance, spread)
    rows.append({"stage": "guard", "switch": "(yours, trainer.seed + 1)", "guard_departure": spread,
                 "guard_loss": seed_curve and sum(seed_curve[-len(ref_tail):]) / len(ref_tail),
                 "verdict": f"the tolerance: {tolerance:.2%} (the larger of this and tune.guard_tolerance)"})
    say(env, f"speed: guard: your configuration under another seed departs {fmt(spread, '.2%')}; a candidate may "
             f"depart up to {tolerance:.2%}")
    passed: list[Switch] = []
    for s in candidates:
        if not s.arithmetic:
            rows.append({"stage": "guard", "switch": s.name, "verdict": "not needed (same batches, same arithmetic)"})
            passed.append(s)
            continue
        dep, loss, note = guard([s])
        ok = dep <= tolerance
        why = note or f"loss departs {fmt(dep, '.1%')}"
        rows.append({"stage": "guard", "switch": s.name, "guard_loss": loss, "guard_departure": dep,
                     "verdict": "passed" if ok else f"rejected ({why})"})
        say(env, f"speed: guard {s.name}: loss after {t.guard_steps} steps {fmt(loss, '.4f')}, departs "
                 f"{fmt(dep, '.2%')} -> {'passed' if ok else 'REJECTED'}")
        if ok:
            passed.append(s)

    # 2. greedy forward selection, one interleaved round per switch added
    settings = copy.deepcopy(cfg.interleave)
    settings.target_ci = t.target_ci
    settings.slice_seconds = t.slice_seconds
    reserve_s = 0.25 * budget_s  # for the verification
    incumbent: list[Switch] = []
    remaining = list(passed)
    rounds: list[Round] = []
    extra: list[Switch] = []  # the last round's hopefuls: faster on top of the pick, not firmly
    while remaining:
        left = agreed(budget_s - sum(r.measured_s for r in rounds) - reserve_s)
        if left < 60:
            notes.append(f"the search stopped with {len(remaining)} candidate(s) unmeasured on top of the pick: "
                         f"tune.budget_minutes={t.budget_minutes:g} spent")
            break
        base = "yours" if not incumbent else "+".join(s.name for s in incumbent)
        jobs = {"incumbent": applied(cfg, incumbent), **{s.name: applied(cfg, [*incumbent, s]) for s in remaining}}
        r = Round(f"round {len(rounds) + 1}: on top of {base}", "incumbent", jobs, minutes=left / 2 / 60)
        say(env, f"speed: {r.title}: {len(remaining)} candidate(s), up to {r.minutes:.1f} min of measuring")
        measure_round(r, rounds_dir / f"round{len(rounds) + 1}", settings, ranks)
        rounds.append(r)
        for s in remaining:
            rows.append({"stage": f"round {len(rounds)}", "switch": s.name, "on_top_of": base, **_figures(r, s.name)})
        winners = [s for s in remaining if helps(r, s.name, t.min_speedup)]
        if not winners:
            notes.append(f"round {len(rounds)}: no candidate was firmly faster than {base}")
            extra = hopefuls(r, remaining)
            break
        best = max(winners, key=lambda s: r.comparisons[s.name].speedup)
        incumbent.append(best)
        say(env, f"speed: {r.title}: {best.name} helps most ({_describe(r.comparisons[best.name])}); kept")
        remaining = [s for s in remaining if s is not best and (best.group is None or s.group != best.group)
                     and r.comparisons.get(s.name) is not None and r.comparisons[s.name].speedup > 1
                     and s.name not in r.failed]

    # 3. the pick's own guard (the switches together), then the verification against yours and fast
    def guarded(sw: list[Switch], what: str) -> bool:
        if not any(s.arithmetic for s in sw):
            return True
        dep, loss, note = guard(sw)
        ok = dep <= tolerance
        rows.append({"stage": "guard", "switch": "+".join(s.name for s in sw), "guard_loss": loss,
                     "guard_departure": dep, "verdict": "passed" if ok else "rejected"})
        if not ok:
            notes.append(f"{what} ({'+'.join(s.name for s in sw)}) departs {fmt(dep, '.1%')} from your loss curve")
        return ok

    while incumbent and not guarded(incumbent, "the pick's switches together"):
        notes.append(f"{incumbent[-1].name} dropped from the pick")
        incumbent.pop()
    if extra and not guarded([*incumbent, *extra], "the pick with the last round's hopefuls"):
        extra = []
    fast, fast_note = fast_config()
    if fast is None:
        notes.append(f"+experiment=fast not compared: {fast_note}")
    options = {name: sw for name, sw in (("pick", incumbent), ("extended", [*incumbent, *extra]))
               if sw and (name == "pick" or extra)}
    label = {name: "+".join(s.name for s in sw) for name, sw in options.items()}
    verify_jobs = {"yours": cfg, **{name: applied(cfg, sw) for name, sw in options.items()}}
    if fast is not None:
        verify_jobs["fast"] = fast
    verified, chosen_name = None, None
    if len(verify_jobs) > 1:
        spent = agreed(sum(r.measured_s for r in rounds))
        minutes = max(1.0, (budget_s - spent) / 60)
        from runner.interleave import record as record_mod

        v = Round("verification", "yours", verify_jobs, minutes=minutes)
        shown = ", ".join(f"the {'pick' if n == 'pick' else 'pick with the hopefuls'} ({label[n]})" for n in options)
        say(env, f"speed: verification: your configuration{', ' + shown if shown else ''}"
                 f"{', +experiment=fast' if fast is not None else ''}; up to {minutes:.1f} min")
        measure_round(v, rounds_dir / "verification", settings, ranks)
        rounds.append(v)
        for name in verify_jobs:
            if name != "yours":
                rows.append({"stage": "verification", "switch": label.get(name, fast_note), "on_top_of": "yours",
                             **_figures(v, name)})
        rows.append({"stage": "verification", "switch": "(yours, A/A)", "on_top_of": "yours",
                     **_paired_cells(v.aa), "verdict": "noise"})
        chosen_name = choose(v, list(options), t.min_speedup)
        if "extended" in options:
            head = record_mod.versus(v.record or {"slices": []}, "extended", "pick") if "pick" in options else None
            notes.append(f"the pick with the last round's hopefuls ({label['extended']})"
                         + (f" against the pick alone, head to head: {_describe(head)}" if head else "")
                         + f": {'recommended' if chosen_name == 'extended' else 'not recommended'}")
        for name in options:
            if name != chosen_name and not helps(v, name, t.min_speedup):
                notes.append(f"{label[name]} was not firmly faster than your configuration head to head "
                             f"({_describe(v.comparisons.get(name))})")
        if chosen_name is not None:
            verified = v.comparisons.get(chosen_name)
            if fast is not None:
                head = record_mod.versus(v.record or {"slices": []}, chosen_name, "fast")
                if head is not None:
                    notes.append(f"the pick against +experiment=fast, head to head: {_describe(head)}")
    incumbent = options.get(chosen_name, []) if chosen_name else []
    pick_name = "+".join(s.name for s in incumbent) or None
    recommended = {"switches": [s.name for s in incumbent],
                   "changes": {k: v for s in incumbent for k, v in s.changes.items()},
                   "speedup": verified.speedup if incumbent and verified else 1.0,
                   "ci_low": verified.ci_low if incumbent and verified else None,
                   "ci_high": verified.ci_high if incumbent and verified else None}
    if incumbent:
        override = " ".join(o for s in incumbent for o in s.overrides)
        notes.insert(0, f"the pick {pick_name}: ×{verified.speedup:.3f} [{verified.ci_low:.3f}–{verified.ci_high:.3f}] "
                        f"your configuration's samples/s, measured head to head")
    else:
        override = "(no change)"
        notes.insert(0, "no change: no switch made your job firmly faster on this machine")
    biased = [r for r in rounds if r.aa is not None and (r.aa.ci_low > 1 or r.aa.ci_high < 1)]
    if biased:
        notes.insert(1, "warning: " + "; ".join(f"{r.title.split(':')[0]}: your configuration against its own copy "
                                                  f"read {_describe(r.aa)}" for r in biased)
                     + ": the round's own noise check failed, so its verdicts are less sure than their intervals "
                       "say (a switch is kept only when it beats both copies; more processes per configuration, "
                       "interleave.processes, widen the intervals to what the machine does)")
    if rounds and rounds[-1].aa is not None:
        from runner.interleave.stats import minimum_detectable

        notes.append(f"noise: your configuration against its own copy read {_describe(rounds[-1].aa)}; effects below "
                     f"about {minimum_detectable(rounds[-1].aa):.1%} could not be resolved")
    notes.append(f"measured by interleaved slices of resident processes (runner/interleave/), "
                 f"slices of {settings.slice_seconds:g} s (tune.slice_seconds); the guard: {t.guard_steps} steps, tolerance "
                 f"{tolerance:.1%} (yours under another seed, at least tune.guard_tolerance); the rounds' processes and interleave.json: {rounds_dir}")
    return {"recommended": recommended, "override": override, "rows": rows, "notes": notes,
            "rounds": [{"title": r.title, "aa": _paired_cells(r.aa), "stopped": r.stopped, "failed": r.failed}
                       for r in rounds],
            "files": {"experiment/tuned.yaml": tuned_yaml(incumbent, recommended)}}


def _rounds_folder(job_dir: Path) -> Path:
    """Where the rounds' processes write: ``<out>/rounds`` (the tuner's folder, found through Hydra when the
    CLI runs it; else a scratch folder under ``job_dir``)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir) / "rounds"
    return Path(job_dir) / "rounds"


def _paired_cells(c) -> dict[str, Any]:
    return {"speedup": c.speedup, "ci_low": c.ci_low, "ci_high": c.ci_high} if c else {}


def _figures(r: Round, name: str) -> dict[str, Any]:
    from runner.interleave.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    verdict = r.failed.get(name) if name in r.failed and c is None else r.verdicts.get(name) or "not measured"
    if verdict == HELPS and r.aa is not None and not (copy_c and copy_c.ci_low > 1):
        verdict = "helps vs the reference, not vs its copy"
    return {**_paired_cells(c), "verdict": verdict, "samples_per_sec": r.samples_per_sec.get(name),
            "vs_copy": copy_c.speedup if copy_c else None, "aa_speedup": r.aa.speedup if r.aa else None}


def _describe(c) -> str:
    return f"×{c.speedup:.3f} [{c.ci_low:.3f}–{c.ci_high:.3f}]" if c else "no interval"


def tuned_yaml(picked: list[Switch], recommended: dict[str, Any]) -> str:
    """The pick as a preset (``experiment/tuned.yaml``, package ``_global_``)."""
    lines = ["# @package _global_", "# python -m runner.tune speed: the pick, verified head to head against the "
             "configuration it was tuned on", f"# switches: {', '.join(recommended['switches']) or 'none (no change)'}"]
    if recommended.get("ci_low") is not None:
        lines.append(f"# samples/s x{recommended['speedup']:.3f} [{recommended['ci_low']:.3f}-{recommended['ci_high']:.3f}]")
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
    return row.get("stage") == "verification" and row.get("switch") == "+".join(rec["switches"]) and bool(rec["switches"])


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

__all__ = ["TUNER", "Switch", "switches", "chosen", "applied", "loss_curve", "departure", "job_config", "Round",
           "measure_round", "read_round", "helps", "hopefuls", "choose", "fast_config", "tune_speed", "tuned_yaml"]
