"""The convergence ablation (``+experiment=convergence``): its preset, its report (runner/report/convergence.py,
convergence_text.py) from synthetic run folders, the EMA's target (``trainer.target_weights=ema``), and one tiny
real multirun through the CLI.

The synthetic folders hold what the report reads: each seed's ``.hydra/config.yaml`` and, unless the seed failed,
its ``summary.json`` (``samples_to_target``, ``time_to_target_s`` where it reached the target, ``steps``,
``global_batch_size``, ``config``). Seeds need log-normal samples to target (5 % spread), dated on the grid of
evaluations.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import compose_cfg, read_csv, run_cli, run_tiny
from runner import REPO_ROOT
from runner.compare import convergence as cv, stats
from runner.errors import ConfigError
from runner.report import ReportError, build_variants, is_ablation, is_convergence, write_convergence_report
from runner.report.__main__ import main as report_main
from runner.report.convergence import NEEDS_THROUGHPUT
from runner.report.convergence_text import COLUMNS
from runner.techniques import step_cost

BATCH, EVERY, LIMIT = 64, 10, 400  # global batch, evaluation interval (steps), step limit
#: the convergence preset's configurations (conf/experiment/convergence.yaml)
PRESET = [
    "baseline",
    "baseline+onecycle",
    "baseline+cosine",
    "baseline+cyclic",
    "baseline+big_batch",
    "baseline+big_batch_sqrt",
    "baseline+normalize",
    "baseline+adamw",
    "baseline+muon",
    "baseline+ema",
    "baseline+qat",
]
TECHNIQUE = {"baseline+onecycle": "onecycle", "baseline+cosine": "cosine", "baseline+adamw": "adamw"}


def job_config(variant: str, seed: int) -> dict:
    return {
        "model": {"_target_": "runner.models.MLP"},
        "ablation": {
            "variant": variant,
            "technique": TECHNIQUE.get(variant),
            "measure": "convergence",
            "kind": "baseline" if variant == "baseline" else "leave-one-in",
        },
        "trainer": {
            "seed": seed,
            "max_steps": LIMIT,
            "eval_every": EVERY,
            "target_accuracy": 0.98,
            "stop_at_target": True,
        },
        "dataloader": {"batch_size": BATCH},
        "memory": {"accumulate_steps": 1},
    }


def write_seed(sweep: Path, variant: str, seed: int, samples: float | None, failed: bool = False) -> Path:
    """One seed's job folder: reached the target at ``samples`` (dated at the next evaluation), or not (None: it
    trained to its limit), or ``failed`` (no summary.json)."""
    folder = sweep / variant / f"s{seed}"
    (folder / ".hydra").mkdir(parents=True)
    cfg = job_config(variant, seed)
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    if failed:
        return folder
    steps = None if samples is None else EVERY * math.ceil(samples / BATCH / EVERY)
    if steps is not None and steps > LIMIT:
        steps = None
    summary = {
        "steps": steps or LIMIT,
        "global_batch_size": BATCH,
        "steps_to_target": steps,
        "samples_to_target": steps and steps * BATCH,
        "time_to_target_s": steps and steps * 0.01,
        "config": cfg,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def write_sweep(
    sweep: Path,
    scales: dict[str, float],
    n: int = 8,
    first_seed: int = 0,
    seed: int = 0,
    failed: dict[str, int] | None = None,
    missed: dict[str, int] | None = None,
) -> Path:
    """A convergence sweep: ``n`` seeds per configuration needing ``scale`` × 20,000 samples (5 % spread);
    ``failed``/``missed``: how many of a configuration's seeds left no summary / did not reach the target."""
    rng = random.Random(seed)
    for variant, scale in scales.items():
        for i in range(n):
            s = first_seed + i
            if i < (failed or {}).get(variant, 0):
                write_seed(sweep, variant, s, None, failed=True)
            elif i < (failed or {}).get(variant, 0) + (missed or {}).get(variant, 0):
                write_seed(sweep, variant, s, None)
            else:
                write_seed(sweep, variant, s, 20_000 * scale * math.exp(rng.gauss(0, 0.05)))
    (sweep / "multirun.yaml").write_text(
        OmegaConf.to_yaml(
            OmegaConf.create(
                {"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": ["+experiment=convergence"]}}}
            )
        )
    )
    return sweep


def throughput_sweep(root: Path, speeds: dict[str, float], passes: int = 10, seed: int = 1) -> Path:
    """The interleave.json an interleaved ablation of ``speeds`` (samples/s) leaves: ``<variant>/r0`` each and the
    baseline's copy ``baseline/r1``, slices paired with the baseline's of the same pass (drift ±20 %, noise 2 %)."""
    rng = np.random.default_rng(seed)
    names = {f"{v}/r0": sps for v, sps in speeds.items()} | {"baseline/r1": speeds["baseline"]}
    jobs = {
        n: {
            "config": n,
            "reference": None if n == "baseline/r0" else "baseline/r0",
            "status": "measured",
            "group": None if n == "baseline/r0" else 1,
        }
        for n in names
    }
    order = sorted(names, key=lambda n: n != "baseline/r0")
    slices = [
        {
            "group": 1,
            "pass": p,
            "position": i,
            "job": n,
            "pairs_with": None if i == 0 else 0,
            "steps": 10,
            "seconds": 1.0,
            "samples_per_sec": names[n] * (1 + 0.2 * math.sin(p)) * math.exp(rng.normal(0, 0.02)),
        }
        for p in range(passes)
        for i, n in enumerate(order)
    ]
    root.mkdir(parents=True)
    (root / "interleave.json").write_text(
        json.dumps(
            {
                "design": "interleaved",
                "reference": "baseline/r0",
                "aa": "baseline/r1",
                "slice_steps": 10,
                "settings": {"confidence": 0.95, "processes": 1},
                "jobs": jobs,
                "slices": slices,
            }
        )
    )
    return root


def by_name(rows) -> dict:
    return {v.name: v for v in rows}


# ------------------------------------------------------------------------------------------- the report
def test_a_configuration_needing_20_percent_fewer_samples_helps_and_its_time_is_its_samples(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {"baseline": 1.0, "baseline+onecycle": 0.8, "baseline+cosine": 1.0})
    assert is_convergence(sweep)
    rows = by_name(build_variants(sweep))
    one = rows["baseline+onecycle"]
    expected = cv.samples_to_target(one.seeds, rows["baseline"].seeds)
    assert one.samples == expected and 0.74 < one.samples.estimate < 0.86 and one.samples.high < 1
    assert one.samples_verdict == stats.HELPS and one.verdict == stats.HELPS
    # an LR schedule changes no step's cost: throughput exactly 1, time ratio = samples ratio
    assert one.throughput == 1.0 and (one.time.estimate, one.time.low, one.time.high) == (
        one.samples.estimate,
        one.samples.low,
        one.samples.high,
    )
    assert rows["baseline+cosine"].verdict == stats.NO_EFFECT and rows["baseline+cosine"].samples.low < 1
    assert rows["baseline"].verdict == "reference" and rows["baseline"].reached == 8
    assert rows["baseline"].eval_samples == EVERY * BATCH
    written = write_convergence_report(sweep)
    md = written[0].read_text()
    row = next(line for line in md.splitlines() if line.startswith("| baseline+onecycle |"))
    assert "| 8/8 | " in row and f"{one.samples.estimate:.2f} [{one.samples.low:.2f}–{one.samples.high:.2f}]" in row
    assert "1 (same step cost)" in row and row.endswith("| **helps** |")
    csv_rows = {r["configuration"]: r for r in read_csv(written[1])}
    assert list(csv_rows["baseline+onecycle"]) == COLUMNS
    assert float(csv_rows["baseline+onecycle"]["time_ratio"]) == pytest.approx(one.samples.estimate, rel=1e-5)
    assert csv_rows["baseline+onecycle"]["verdict"] == "helps" and csv_rows["baseline+cosine"]["step_cost"] == "False"


def test_failed_and_unreached_seeds_are_counted_not_dropped(tmp_path):
    sweep = write_sweep(
        tmp_path / "sweep",
        {"baseline": 1.0, "baseline+cosine": 1.1},
        failed={"baseline+cosine": 1},
        missed={"baseline+cosine": 2},
    )
    rows = by_name(build_variants(sweep))
    cos = rows["baseline+cosine"]
    assert (cos.reached, len(cos.seeds), cos.failed) == (5, 8, ["baseline+cosine/s0"])
    failed = next(s for s in cos.seeds if s.seed == 0)
    assert failed == cv.Seed(LIMIT * BATCH, False, 0, None, str(sweep / "baseline+cosine" / "s0"))
    assert cos.samples.counts == "5/8 vs 8/8" and cos.samples.high == math.inf  # unreached seeds leave it open
    dropped = cv.samples_to_target([s for s in cos.seeds if s.reached], rows["baseline"].seeds)
    assert cos.samples.estimate > dropped.estimate
    written = write_convergence_report(sweep)
    md = written[0].read_text()
    assert "| baseline+cosine | 5/8 (1 failed) |" in md and "`baseline+cosine/s0`" in md and "never dropped" in md
    r = {r["configuration"]: r for r in read_csv(written[1])}["baseline+cosine"]
    assert (r["seeds"], r["reached"], r["failed"], r["samples_ci_high"]) == ("8", "5", "1", "inf")


def test_a_step_cost_technique_needs_a_throughput_measurement_and_gets_the_combined_interval(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {"baseline": 1.0, "baseline+adamw": 0.8, "baseline+onecycle": 0.8})
    rows = by_name(build_variants(sweep))
    adamw = rows["baseline+adamw"]
    assert step_cost("adamw") and adamw.samples_verdict == stats.HELPS  # fewer samples, but at what cost per step?
    assert adamw.throughput is None and adamw.time is None and adamw.verdict == NEEDS_THROUGHPUT
    md = write_convergence_report(sweep)[0].read_text()
    assert "ablation/variant=baseline,baseline+adamw" in md and NEEDS_THROUGHPUT in md
    # measured interleaved: AdamW's steps at half the baseline's samples/s, so it takes longer to the target
    measured = throughput_sweep(tmp_path / "speed", {"baseline": 100.0, "baseline+adamw": 50.0})
    rows = by_name(build_variants(sweep, measured))
    adamw, base = rows["baseline+adamw"], rows["baseline"]
    assert 0.48 < adamw.throughput.estimate < 0.52 and adamw.throughput.high < 0.55
    assert adamw.time == cv.time_to_target(adamw.seeds, base.seeds, adamw.throughput)
    assert adamw.time.estimate == pytest.approx(adamw.samples.estimate / adamw.throughput.estimate)
    assert adamw.time.low > 1 and adamw.verdict == stats.HURTS
    assert rows["baseline+onecycle"].throughput == 1.0  # not read from the sweep: exactly 1
    out = tmp_path / "doc.md"
    assert report_main([str(sweep), "--throughput", str(measured), "--doc", str(out)]) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| baseline+adamw |"))
    assert f"{adamw.throughput.estimate:.2f} [" in row and f"{adamw.time.estimate:.2f} [" in row and "**hurts**" in row


def test_a_throughput_sweep_without_the_variant_or_the_baseline_says_so(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {"baseline": 1.0, "baseline+adamw": 0.8}, n=4)
    other = throughput_sweep(tmp_path / "speed", {"baseline": 100.0, "baseline+amp": 150.0})
    assert build_variants(sweep, other)[1].verdict.startswith("not in the throughput sweep")
    with pytest.raises(ReportError, match="no interleave.json"):
        build_variants(sweep, tmp_path / "sweep")
    assert report_main([str(tmp_path / "speed"), "--throughput", str(other)]) == 2  # not a convergence sweep
    baseline = other / "baseline" / "r0"
    baseline.mkdir(parents=True)
    (baseline / "summary.json").write_text(json.dumps({"config": {"model": {"_target_": "runner.models.ResNet"}}}))
    with pytest.raises(ReportError, match="measured another job"):
        build_variants(sweep, other)


def test_a_replication_with_other_seeds_agrees_on_every_firm_verdict(tmp_path):
    scales = {"baseline": 1.0, "baseline+onecycle": 0.8, "baseline+cosine": 1.0}
    first = write_sweep(tmp_path / "a", scales)
    second = write_sweep(tmp_path / "b", scales, first_seed=8, seed=1)
    doc = tmp_path / "docs" / "convergence.md"
    assert report_main([str(first), "--doc", str(doc), "--replication", str(second)]) == 0
    text = doc.read_text()
    assert "agrees on every firm verdict (1 configuration(s) with one)" in text
    agreement = [line for line in text.splitlines() if line.startswith("| baseline+onecycle |")][-1]
    assert agreement.endswith("| yes |") and agreement.count("**helps**") == 0 and agreement.count("helps") == 4
    third = write_sweep(
        tmp_path / "c", {"baseline": 1.0, "baseline+onecycle": 1.0, "baseline+cosine": 1.0}, first_seed=8, seed=2
    )
    assert report_main([str(first), "--doc", str(doc), "--replication", str(third)]) == 0
    assert "disagrees on 1 of the 1 configuration(s) with a firm verdict: baseline+onecycle" in doc.read_text()


def test_a_sweep_without_a_baseline_or_with_a_seed_twice_is_one_clear_error(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {"baseline+onecycle": 0.8}, n=3)
    with pytest.raises(ReportError, match="no baseline"):
        build_variants(sweep)
    write_seed(tmp_path / "sweep" / "again", "baseline+onecycle", 0, 20_000)
    with pytest.raises(ReportError, match=r"seed\(s\) \[0\] appear more than once"):
        build_variants(sweep)


def test_the_step_cost_of_each_technique_of_the_preset():
    assert [step_cost(t) for t in ("onecycle", "cosine", "cyclic")] == [False] * 3  # the same work per step
    assert all(step_cost(t) for t in ("big_batch", "big_batch_sqrt", "normalize", "adamw", "ema", "amp"))
    assert step_cost(None) is False  # the reference


# ------------------------------------------------------------------------------------------- the preset
def preset(*overrides: str):
    return preset_config("+experiment=convergence", *overrides, hydra=True)


def test_the_preset_sweeps_the_configurations_over_seeds_on_the_basic_launcher():
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = preset()
    params = cfg.hydra.sweeper.params
    assert [v.strip() for v in params["ablation/variant"].split(",")] == PRESET
    assert params["trainer.seed"] == "0,1,2,3,4"
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher") and "sweep_report" in cfg.hydra.callbacks
    assert cfg.hydra.sweep.subdir == "baseline/s0" and cfg.ablation.measure == "convergence"
    t = cfg.trainer
    assert (t.stop_at_target, t.target_accuracy, cfg.checkpoint.at_end, t.eval_max_batches) == (True, 0.98, False, None)
    assert (cfg.model._target_, cfg.data.name, cfg.scheduler.name, cfg.optimizer.lr_scaling) == (
        "runner.models.MnistCNN",
        "mnist",
        "constant",
        "none",
    )  # the default job, the baseline's recipe
    # the budget and the evaluation interval are in samples: a 4x bigger batch gets 4x fewer steps
    assert (t.max_steps, t.eval_every) == (math.ceil(81_920 / 64), 20)
    big = preset("ablation/variant=baseline+big_batch_sqrt").trainer
    assert (big.max_steps, big.eval_every) == (math.ceil(81_920 / 256), 5)
    # a replication with other seeds is one override: the command line wins over the preset's seeds
    command_line = [f"{k}={v}" for k, v in params.items()] + ["trainer.seed=5,6,7,8,9"]
    parsed = OverridesParser.create().parse_overrides(command_line)
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    assert len(jobs) == len(PRESET) * 5 and {j[1] for j in jobs} == {f"trainer.seed={s}" for s in range(5, 10)}


def test_the_gpt_preset_is_the_recipe_with_the_convergence_ablation_and_a_loss_target():
    """``+experiment=convergence_gpt`` is ``+experiment=[shakespeare_char,convergence]`` with the validation-loss
    target and the recipe's 2,000 steps as the budget: the same job, key for key."""
    job = ["ablation/variant=baseline+muon", "trainer.seed=3"]
    gpt = preset_config("+experiment=convergence_gpt", *job)
    listed = preset_config(
        "+experiment=[shakespeare_char,convergence]",
        *job,
        "trainer.target_accuracy=null",
        "trainer.target_loss=1.96",
        "ablation.max_samples=24000",
        "ablation.eval_samples=1200",
    )
    assert OmegaConf.to_container(gpt, resolve=True) == OmegaConf.to_container(listed, resolve=True)
    assert (gpt.model._target_, gpt.trainer.max_steps, gpt.trainer.eval_every) == ("runner.models.gpt.GPT", 2000, 100)
    assert (gpt.scheduler.name, gpt.trainer.stop_at_target, gpt.trainer.target_weights) == ("constant", True, "model")
    variants = preset_config("+experiment=convergence_gpt", hydra=True).hydra.sweeper.params["ablation/variant"]
    variants = variants.split(",")
    assert variants[0] == "baseline" and {v.removeprefix("baseline+") for v in variants[1:]} == {
        "onecycle",
        "cosine",
        "muon",
        "ema",
    }


def preset_config(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.mark.parametrize("variant", PRESET[1:])
def test_each_configuration_of_the_preset_composes_and_switches_its_technique(variant):
    from runner.engine.validate import validate
    from runner.techniques import by_variant

    cfg = compose_cfg("+experiment=convergence", f"ablation/variant={variant}", tiny=False)
    validate(cfg)
    technique = by_variant(cfg.ablation.technique)
    if technique is not None:
        assert technique.is_on(cfg)
    assert variant == f"baseline+{cfg.ablation.technique}" and cfg.ablation.kind == "leave-one-in"


# ------------------------------------------------------------------------------------------- EMA's target
def test_the_ema_can_meet_the_target(tmp_path):
    summary = run_tiny(
        tmp_path / "ema",
        "trainer.eval_every=2",
        "trainer.target_loss=1000",
        "trainer.stop_at_target=true",
        "trainer.ema_decay=0.9",
        "trainer.target_weights=ema",
    )
    assert summary["steps_to_target"] == 2 and summary["stopped_early"].startswith(
        "reached the targets: eval_loss_ema "
    )
    with pytest.raises(ConfigError, match="trainer.target_weights=ema reads the targets from the EMA"):
        run_tiny(tmp_path / "no-ema", "trainer.target_loss=1000", "trainer.target_weights=ema")


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # 6 jobs, one after the other (~20 s on 2 cores)
def test_a_convergence_multirun_ends_with_its_report(tmp_path):
    shutil.copy(REPO_ROOT / "tests" / "user_data.py", tmp_path)  # the folder python -m runner runs from
    proc = run_cli(
        "-m",
        "+experiment=convergence",
        "ablation/variant=baseline,baseline+onecycle",
        "trainer.seed=0,1,2",
        "data=custom",
        "data._target_=user_data.tabular",
        "model=mlp",
        "trainer.target_accuracy=0.95",
        "ablation.max_samples=2560",
        "ablation.eval_samples=64",
        "logger=none",
        "trainer.device=cpu",
        "trainer.warmup_steps=1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "outputs" / "convergence").glob("*/*"))
    assert "convergence sweep" in proc.stdout and "| baseline+onecycle | 3/3 |" in proc.stdout
    assert is_convergence(sweep) and is_ablation(sweep)  # the convergence report is looked for first
    for variant in ("baseline", "baseline+onecycle"):
        summaries = [json.loads((sweep / variant / f"s{s}" / "summary.json").read_text()) for s in range(3)]
        assert all(s["stopped_early"].startswith("reached the targets") for s in summaries)
        assert all(s["samples_to_target"] % 64 == 0 for s in summaries)  # dated on the evaluation grid
    seeds = {v: cv.read_seeds(sorted((sweep / v).glob("s*"))) for v in ("baseline", "baseline+onecycle")}
    expected = cv.samples_to_target(seeds["baseline+onecycle"], seeds["baseline"])
    rows = {r["configuration"]: r for r in read_csv(sweep / "report.csv")}
    assert float(rows["baseline+onecycle"]["samples_ratio"]) == pytest.approx(expected.estimate, rel=1e-5)
    assert rows["baseline+onecycle"]["throughput_ratio"] == "1" and rows["baseline"]["reached"] == "3"
    md = (sweep / "report.md").read_text()
    assert "| baseline | 3/3 |" in md and f"{expected.estimate:.2f} [0–∞]" in md  # 3 seeds: no bounded interval
    assert "Too few seeds for a verdict" in md
    (sweep / "report.md").unlink()
    rows_of = lambda text: [line for line in text.splitlines() if line.startswith("| baseline")]  # noqa: E731
    assert report_main([str(sweep)]) == 0 and rows_of((sweep / "report.md").read_text()) == rows_of(md)
