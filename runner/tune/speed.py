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
   candidate is left or the search's share of ``tune.budget_minutes`` is spent.
4. **Verification.** Your configuration, its copy, the pick and ``+experiment=fast`` run head to head: the
   pick is recommended only when it is firmly faster than your configuration; otherwise the answer is
   "no change". The pick is never slower than what you run.

Outputs (``harness.write_outputs``): ``speed.csv``/``.md``/``.png``/``.json`` with every candidate of every
round (speed-up, interval, verdict, the guard's loss and departure), and ``experiment/tuned.yaml``: the pick as
a preset, ``python -m runner '+experiment=[<yours>,tuned]' --config-dir <out>``. Each round's processes and
``interleave.json`` stay in ``<out>/rounds/``.

Layout: the candidates in runner/tune/switches.py, the guard in runner/tune/guard.py, the rounds, the search
and the outputs here.

The measured jobs are the tuner's children. Under torchrun (``torchrun --nproc-per-node N -m runner.tune speed
distributed=ddp ...``) every round's job is a DDP job of the N ranks: rank 0's conductor decides and the
other ranks' conductors mirror it (runner/interleave/ranks.py), the guard trains on all ranks, and every
figure a decision rests on (the guard's loss curves, each round's record, the time left) is rank 0's,
broadcast, so the ranks agree on every decision.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.tune.guard import GUARD_WINDOWS, departure, loss_curve
from runner.tune.harness import Tuner, fmt, pyplot, say, with_overrides
from runner.tune.switches import Switch, applied, chosen, is_language_model, switches

# ------------------------------------------------------------------------------------------- measuring


def job_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` resolved and made a measured job of a round: trains until told to finish (no step limit, no
    evaluation but one batch at the end, no checkpoint, no logger, no samples, no doctor, no early stop)."""
    from runner.config import LOGGERS

    out = copy.deepcopy(cfg)
    OmegaConf.resolve(out)
    quiet = {**{f"logger.{name}": None for name in LOGGERS}, "trainer.progress": "off", "trainer.max_steps": 10**9,
             "trainer.eval_every": 10**9, "trainer.eval_max_batches": 1, "trainer.doctor": False,
             "trainer.target_loss": None, "trainer.target_accuracy": None,
             "trainer.early_stopping.metric": None, "checkpoint.resume": "never", "checkpoint.at_end": False,
             "checkpoint.every_steps": None, "checkpoint.every_minutes": None, "checkpoint.keep_best": False,
             "ablation.isolate": False}
    if is_language_model(cfg):
        quiet["task.sample_tokens"] = 0
    for key, value in quiet.items():
        if OmegaConf.select(out, key, default="<missing>") != "<missing>":
            OmegaConf.update(out, key, value, merge=False)
    return out


@dataclass
class Round:
    """One interleaved measurement: ``jobs`` (name -> config) against ``reference`` (a name of ``jobs``)."""

    title: str
    reference: str
    jobs: dict[str, DictConfig]
    minutes: float
    comparisons: dict[str, Any] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    aa: Any = None
    vs_copy: dict[str, Any] = field(default_factory=dict)  # name -> stats.Paired against the reference's copy A'
    samples_per_sec: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)  # the round's interleave.json (rank 0's)
    measured_s: float = 0.0  # seconds spent measuring (start-ups excluded)


def measure_round(r: Round, folder: Path, settings: DictConfig, ranks: Any = None) -> Round:
    """Measure ``r``'s jobs side by side with the interleaved conductor (runner/interleave/coordinator.py):
    each job resident in its own process, slices in random order per pass, the reference's copy as A', until
    every interval is within ``settings.target_ci`` or ``r.minutes`` of measuring are spent. Fills
    ``r.comparisons`` (name -> ``stats.Paired`` against the reference, or None), ``r.verdicts`` (Holm over the
    round), ``r.aa``, ``r.samples_per_sec`` (each job's median slice) and ``r.failed`` (a job that crashed, e.g.
    out of memory: name -> status) and ``r.record`` (the conductor's ``interleave.json``). Ctrl-C stops the
    round after the current slice. ``ranks``: under torchrun (runner/interleave/ranks.py), every rank's
    conductor mirrors rank 0's, and every rank gets rank 0's record."""
    from runner.interleave import record as record_mod, stats
    from runner.interleave.coordinator import Conductor, Job, conduct

    folder.mkdir(parents=True, exist_ok=True)
    aa = f"{r.reference}-aa"
    configs = [(r.reference, r.jobs[r.reference], None), (aa, r.jobs[r.reference], r.reference)]
    configs += [(name, c, r.reference) for name, c in r.jobs.items() if name != r.reference]
    jobs = [Job(name if p == 0 else f"{name}-p{p}", job_config(c), folder / (name if p == 0 else f"{name}-p{p}"),
                ref, config=name) for name, c, ref in configs for p in range(settings.processes)]
    s = copy.deepcopy(settings)
    s.max_minutes = r.minutes

    def retire(comparisons: dict[str, Any]) -> list[str]:  # racing: firmly slower candidates stop early
        names = [n for n in comparisons if n != aa and comparisons[n] is not None]
        verdicts = stats.verdicts([comparisons[n] for n in names], s.confidence)
        return [n for n, v in zip(names, verdicts) if v == stats.HURTS]

    conductor = Conductor(jobs, s, folder, r.reference, aa, retire=retire, ranks=ranks)
    conduct(conductor)
    r.measured_s = conductor.measuring_s
    record = record_mod.load(folder) if ranks is None or ranks.leader else None
    record = (ranks.share(record) if ranks is not None else record) or {"jobs": {}, "slices": []}
    r.record = record
    comparisons = record_mod.compare(record)
    r.aa = comparisons.pop(aa, None)
    r.comparisons = comparisons
    r.vs_copy = {n: record_mod.versus(record, n, aa) for n in comparisons}
    names = list(comparisons)
    r.verdicts = dict(zip(names, stats.verdicts([comparisons[n] for n in names], s.confidence)))
    for name, job in record["jobs"].items():
        if job["status"] not in ("measured",):
            r.failed.setdefault(job.get("config") or name, job["status"])
    for config, processes in record_mod.configs(record).items():
        rates = sorted(x["samples_per_sec"] for x in record["slices"]
                       if x["job"] in processes and x["samples_per_sec"])
        if rates:
            r.samples_per_sec[config] = rates[len(rates) // 2]
    r.stopped = list(record.get("stopped", []))
    return r


def helps(r: Round, name: str, min_speedup: float) -> bool:
    """True when ``name`` is firmly faster than the round's reference: Holm's verdict is "helps", its interval's
    low end exceeds ``min_speedup``, and it is faster than the reference's copy A' too (interval above 1). The
    last is a guard against the process itself: on a shared VM two processes of one configuration can differ
    by 10-30 % for their whole life (docs/ablation.md), so an unlucky reference process would make every
    candidate look faster; beating both copies makes that unlikely."""
    from runner.interleave.stats import HELPS

    c, copy_c = r.comparisons.get(name), r.vs_copy.get(name)
    return (c is not None and r.verdicts.get(name) == HELPS and c.ci_low > min_speedup
            and (r.aa is None or (copy_c is not None and copy_c.ci_low > 1)))


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
            break
        best = max(winners, key=lambda s: r.comparisons[s.name].speedup)
        incumbent.append(best)
        say(env, f"speed: {r.title}: {best.name} helps most ({_describe(r.comparisons[best.name])}); kept")
        remaining = [s for s in remaining if s is not best and (best.group is None or s.group != best.group)
                     and r.comparisons.get(s.name) is not None and r.comparisons[s.name].speedup > 1
                     and s.name not in r.failed]

    # 3. the pick's own guard (the switches together), then the verification against yours and fast
    while any(s.arithmetic for s in incumbent):
        dep, loss, note = guard(incumbent)
        ok = dep <= tolerance
        rows.append({"stage": "guard", "switch": "+".join(s.name for s in incumbent), "guard_loss": loss,
                     "guard_departure": dep, "verdict": "passed" if ok else "rejected"})
        if ok:
            break
        notes.append(f"the switches together ({'+'.join(s.name for s in incumbent)}) depart {fmt(dep, '.1%')} from "
                     f"your loss curve: {incumbent[-1].name} dropped")
        incumbent.pop()
    fast, fast_note = fast_config()
    if fast is None:
        notes.append(f"+experiment=fast not compared: {fast_note}")
    pick_name = "+".join(s.name for s in incumbent) or None
    verify_jobs = {"yours": cfg}
    if incumbent:
        verify_jobs["pick"] = applied(cfg, incumbent)
    if fast is not None:
        verify_jobs["fast"] = fast
    verified = None
    if len(verify_jobs) > 1:
        spent = agreed(sum(r.measured_s for r in rounds))
        minutes = max(1.0, (budget_s - spent) / 60)
        v = Round("verification", "yours", verify_jobs, minutes=minutes)
        say(env, f"speed: verification: your configuration, {'the pick (' + pick_name + '), ' if pick_name else ''}"
                 f"{'+experiment=fast' if fast is not None else ''}; up to {minutes:.1f} min")
        measure_round(v, rounds_dir / "verification", settings, ranks)
        rounds.append(v)
        for name in verify_jobs:
            if name != "yours":
                rows.append({"stage": "verification", "switch": pick_name if name == "pick" else fast_note,
                             "on_top_of": "yours", **_figures(v, name)})
        rows.append({"stage": "verification", "switch": "(yours, A/A)", "on_top_of": "yours",
                     **_paired_cells(v.aa), "verdict": "noise"})
        verified = v.comparisons.get("pick") if incumbent else None
        if incumbent and fast is not None:
            from runner.interleave import record as record_mod

            head = record_mod.versus(v.record or {"slices": []}, "pick", "fast")
            if head is not None:
                notes.append(f"the pick against +experiment=fast, head to head: {_describe(head)}")
        if incumbent and not helps(v, "pick", t.min_speedup):
            notes.append(f"the pick {pick_name} was not firmly faster than your configuration head to head "
                         f"({_describe(verified)}): no change recommended")
            incumbent = []
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
)

__all__ = ["TUNER", "Switch", "switches", "chosen", "applied", "loss_curve", "departure", "job_config", "Round",
           "measure_round", "helps", "fast_config", "tune_speed", "tuned_yaml"]
