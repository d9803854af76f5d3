"""The presets, the ablation sweep and its report.

- The variants (conf/ablation/variant/) are checked by composing them: each leave-one-in variant changes
  exactly the keys its leave-one-out twin changes back, and every difference between the baseline and
  the fast preset belongs to a technique of the ablation.
- The report's rule (bootstrap intervals of the speed-ups, verdicts from them, ranking, skipped and
  not-run rows) and ``ablation.repeats=auto``'s rounds are unit-tested on synthetic summaries.
- End-to-end sweeps run through the real CLI on a tiny model: ``repeats=auto`` with a real extra round
  (not slow), and the full variant mix with a failing job (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import TINY, compose_cfg, read_csv, run_cli
from runner import REPO_ROOT, ablation_first_round
from runner.ablation import auto_repeat, round_command
from runner.report import (
    CSV_COLUMNS,
    JOB_COLUMNS,
    NO_INTERVAL,
    Job,
    ReportError,
    build_rows,
    load_jobs,
    pending,
    write_report,
)

VARIANTS = REPO_ROOT / "conf" / "ablation" / "variant"
NAMES = sorted(p.stem for p in VARIANTS.glob("*.yaml"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def flat(cfg) -> dict[str, object]:
    """The resolved config as ``{"a.b.c": value}`` (the ablation's own bookkeeping left out)."""
    out: dict[str, object] = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("ablation", None)
    walk(container, "")
    return out


def variant(name: str, *overrides: str) -> dict[str, object]:
    # trainer.device=cuda resolves the hardware-aware values to their CUDA branch without a GPU
    return flat(compose_cfg("+experiment=ablation", f"ablation/variant={name}", "trainer.device=cuda", *overrides,
                            tiny=False))


def diff(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


# ------------------------------------------------------------------------------------------- configs
def test_sweep_lists_every_variant_and_repeat_is_the_outer_loop():
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=ablation", "ablation.design=rounds", "ablation.repeats=2"],
                      return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert list(params)[0] == "ablation.repeat"
    swept = [v.strip() for v in params["ablation/variant"].split(",")]
    assert sorted(swept) == NAMES and len(swept) == len(set(swept))
    overrides = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    jobs = BasicSweeper.split_arguments(overrides, None)[0]
    assert len(jobs) == 2 * len(NAMES)
    assert [j[0] for j in jobs] == ["ablation.repeat=0"] * len(NAMES) + ["ablation.repeat=1"] * len(NAMES)
    assert cfg.ablation.repeats == 2 and cfg.trainer.warmup_steps < cfg.trainer.max_steps


@pytest.mark.parametrize("overrides,first", [([], 3), (["ablation.repeats=5"], 5), (["ablation.repeats=auto"], 3),
                                             (["ablation.repeats=auto", "ablation.max_repeats=2"], 2)])
def test_the_first_round_of_repeats(overrides, first):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=ablation", "ablation.design=rounds", *overrides],
                      return_hydra_config=True)
    assert cfg.hydra.sweeper.params["ablation.repeat"] == f"range(0,{first})"
    assert cfg.trainer.max_steps == 11  # every job measures the same few steps


def test_the_ablation_is_interleaved_by_default():
    """One multirun job per configuration (the launcher adds its processes), each capped only by time: the
    conductor stops the jobs when interleave.max_minutes is spent."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=ablation"], return_hydra_config=True)
    assert cfg.ablation.design == "interleaved" and cfg.hydra.sweeper.params["ablation.repeat"] == "range(0,1)"
    assert cfg.hydra.launcher._target_.endswith("InterleavedLauncher") and cfg.trainer.max_steps >= 100_000


@pytest.mark.parametrize("repeats,max_repeats", [("often", 10), (0, 10), (True, 10), ("auto", 1)])
def test_bad_repeats_are_refused(repeats, max_repeats):
    with pytest.raises(ValueError, match="ablation.(max_)?repeats"):
        ablation_first_round(repeats, max_repeats)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_variant_composes_and_names_itself(name):
    cfg = compose_cfg("+experiment=ablation", f"ablation/variant={name}", tiny=False)
    OmegaConf.to_container(cfg, resolve=True)
    a = cfg.ablation
    assert a.variant == name
    if name in ("baseline", "fast"):
        assert a.kind == name and a.technique is None
    else:
        prefix, tech = ("baseline+", "leave-one-in") if name.startswith("baseline+") else ("fast-", "leave-one-out")
        assert a.kind == tech and name == prefix + a.technique


LEAVE_OUT = [n[len("fast-"):] for n in NAMES if n.startswith("fast-")]
LEAVE_IN = [n[len("baseline+"):] for n in NAMES if n.startswith("baseline+")]


@pytest.mark.parametrize("tech", sorted(set(LEAVE_OUT) & set(LEAVE_IN)))
@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_leave_one_in_and_out_are_mirror_images(tech):
    """baseline+X sets X's keys to fast's values; fast-X sets the same keys back to the baseline's."""
    base, fast = variant("baseline"), variant("fast")
    on, off = variant(f"baseline+{tech}"), variant(f"fast-{tech}")
    keys = diff(base, on)
    assert keys, f"baseline+{tech} changes nothing"
    assert keys == diff(fast, off)
    assert {k: on[k] for k in keys} == {k: fast[k] for k in keys}
    assert {k: off[k] for k in keys} == {k: base[k] for k in keys}


@pytest.mark.slow
def test_every_difference_between_the_presets_is_a_technique_of_the_ablation():
    base, fast = variant("baseline"), variant("fast")
    explained = set().union(*(diff(fast, variant(f"fast-{t}")) for t in LEAVE_OUT))
    assert diff(base, fast) - explained == set()
    # the data-loading leave-one-out undoes exactly what the two data-loading leave-one-ins switch on
    loading = diff(fast, variant("fast-data_loading"))
    assert loading <= diff(base, variant("baseline+pinned_workers")) | diff(base, variant("baseline+on_device_data"))


def test_the_keys_of_each_skippable_technique_are_the_keys_its_variant_switches():
    from runner.ablation import TECHNIQUE_KEYS

    base = variant("baseline")
    for tech, keys in TECHNIQUE_KEYS.items():
        assert diff(base, variant(f"baseline+{tech}")) == set(keys), tech


@pytest.mark.parametrize("name,no_op", [("baseline+channels_last", True), ("fast-normalize", True),
                                        ("fast-drop_bias", True), ("fast-compile", False), ("baseline", False)])
def test_a_technique_the_language_model_skips_is_not_measured(tmp_path, name, no_op):
    """On the GPT an image technique changes nothing: its variant is its reference again, so it is recorded as
    not run (saving a quarter of the GPT ablation's minutes) instead of being measured as a copy."""
    from runner.ablation import run_job

    cfg = compose_cfg("+experiment=[shakespeare_char,ablation]", f"ablation/variant={name}", tiny=False)
    figures = run_job(cfg, job_dir=tmp_path)
    if not no_op:
        assert figures is None and not (tmp_path / "not_run.json").exists()
        return
    assert figures == {"samples_per_sec": None}
    reason = json.loads((tmp_path / "not_run.json").read_text())["reason"]
    assert reason.startswith("does nothing on this job (") and "image technique" in reason
    assert reason.endswith("the same configuration as its reference")


def test_an_image_technique_is_measured_on_an_image_model(tmp_path):
    from runner.ablation import run_job

    assert run_job(compose_cfg("+experiment=ablation", "ablation/variant=fast-channels_last"), job_dir=tmp_path) is None
    assert not (tmp_path / "not_run.json").exists()


@pytest.mark.parametrize("device,batch,scaling", [("cuda", 256, "linear"), ("cpu", 64, "none")])
def test_fast_preset_picks_the_batch_for_the_hardware(device, batch, scaling):
    cfg = compose_cfg("+experiment=fast", f"trainer.device={device}", tiny=False)
    assert cfg.dataloader.batch_size == batch and cfg.optimizer.lr_scaling == scaling
    assert compose_cfg("+experiment=baseline", f"trainer.device={device}", tiny=False).dataloader.batch_size == 64


def test_fast_preset_keeps_image_files_off_the_device():
    assert compose_cfg("+experiment=fast", "data=synthetic", tiny=False).dataloader.on_device is True
    assert compose_cfg("+experiment=fast", "data=imagefolder", "data.root=x", tiny=False).dataloader.on_device is False


def test_baseline_preset_is_the_naive_job():
    cfg = compose_cfg("+experiment=baseline", "precision=amp", tiny=False)  # the command line still wins
    assert cfg.precision.name == "amp"
    cfg = compose_cfg("+experiment=baseline", tiny=False)
    assert (cfg.precision.name, cfg.scheduler.name, cfg.dataloader.num_workers, cfg.dataloader.pin_memory,
            cfg.compile.mode, cfg.channels_last, cfg.cudnn_benchmark, cfg.optimizer.set_to_none,
            cfg.trainer.log_every) == ("fp32", "constant", 0, False, None, False, False, False, 1)


# ------------------------------------------------------------------------------------------- the rule
def summary(variant: str, repeat: int, sps: float, techniques: dict | None = None, **extra) -> dict:
    kind = "baseline" if variant == "baseline" else "fast" if variant == "fast" else (
        "leave-one-in" if variant.startswith("baseline+") else "leave-one-out")
    tech = None if kind in ("baseline", "fast") else variant.split("+" if "+" in variant else "-", 1)[1]
    return {"samples_per_sec": sps, "step_time_ms_median": 1000 * 64 / sps, "data_wait_fraction": 0.1,
            "peak_memory_mb": extra.pop("peak", 1000.0), "train_loss": 2.0, "eval_loss": 2.1,
            "warmup_steps": 3, "measured_steps": 8, "global_batch_size": 64, "device": "cpu",
            "device_name": "x86_64", "techniques": techniques or {},
            "config": {"ablation": {"variant": variant, "repeat": repeat, "kind": kind, "technique": tech},
                       "model": {"_target_": "tiny"}, "data": {"name": "synthetic"}, "logger": {"name": "none"},
                       "optimizer": {"_target_": "torch.optim.SGD"}}, **extra}


SYNTHETIC = {  # configuration -> (samples/s of 3 repeats, techniques)
    "baseline": ([95.0, 100.0, 105.0], {}),
    "baseline+amp": ([190.0, 200.0, 210.0], {"amp": "applied"}),
    "baseline+set_to_none": ([101.0, 103.0, 99.0], {}),  # inside the baseline's spread
    "baseline+checkpointing": ([70.0, 72.0, 71.0], {"activation_checkpointing": "applied"}),
    "baseline+cudnn_benchmark": ([150.0, 150.0, 150.0], {"cudnn_benchmark": "skipped: CUDA only"}),
    "fast": ([290.0, 300.0, 310.0], {"amp": "applied", "compile": "applied"}),
    "fast-amp": ([140.0, 150.0, 160.0], {"compile": "applied"}),
    "fast-compile": ([296.0, 300.0, 305.0], {"amp": "applied"}),
}


def synthetic_jobs(configs=SYNTHETIC) -> list[Job]:
    return [Job(name, i, Path(f"/sweep/{name}/r{i}"), summary(name, i, sps)["config"]["ablation"]["kind"],
                summary(name, i, sps)["config"]["ablation"]["technique"], summary(name, i, sps, techniques))
            for name, (runs, techniques) in configs.items() for i, sps in enumerate(runs)]


def test_rows_are_ranked_by_speedup_and_noise_is_not_a_win():
    rows = build_rows(synthetic_jobs())
    by = {r.configuration: r for r in rows}
    speedups = [r.speedup for r in rows]
    assert speedups == sorted(speedups, reverse=True)
    # 3 repeats each: the bootstrap interval is [min / max of the reference, max / min of the reference]
    amp = by["baseline+amp"]
    assert amp.speedup == pytest.approx(2.0) and amp.verdict == "helps"
    assert (amp.speedup_ci.low, amp.speedup_ci.high) == (pytest.approx(190 / 105), pytest.approx(210 / 95))
    assert amp.effect_ci == amp.speedup_ci
    assert by["baseline+set_to_none"].verdict == "no measurable effect" and by["baseline+set_to_none"].rank is None
    assert by["baseline+set_to_none"].speedup_ci.low < 1 < by["baseline+set_to_none"].speedup_ci.high
    assert by["baseline+checkpointing"].verdict == "hurts" and by["baseline+checkpointing"].rank is None
    # faster than the baseline, but its only technique was skipped: not a finding, not ranked
    assert by["baseline+cudnn_benchmark"].verdict == "skipped here" and by["baseline+cudnn_benchmark"].rank is None
    # leave-one-out: the effect is fast / this configuration, its interval against fast's repeats
    assert by["fast-amp"].verdict == "helps" and by["fast-amp"].effect == pytest.approx(2.0)
    assert (by["fast-amp"].effect_ci.low, by["fast-amp"].effect_ci.high) == (pytest.approx(290 / 160),
                                                                            pytest.approx(310 / 140))
    assert by["fast-amp"].status == "amp: applied"  # what fast had and this configuration lacks
    assert by["fast-compile"].verdict == "no measurable effect"
    ranked = [r.configuration for r in rows if r.rank]
    assert ranked == ["fast", "fast-compile", "baseline+amp", "fast-amp"]
    assert [r.rank for r in rows if r.rank] == [1, 2, 3, 4]
    assert by["baseline"].verdict == "reference" and by["baseline"].rank is None
    assert by["fast"].verdict == "faster"
    # the baseline against itself: the noise band, around 1
    assert by["baseline"].speedup_ci.low < 1 < by["baseline"].speedup_ci.high


def test_identical_configurations_have_no_measurable_effect_and_a_true_one_helps():
    rng = __import__("numpy").random.default_rng(0)
    configs = {"baseline": (list(100 * (1 + 0.03 * rng.standard_normal(6))), {}),
               "baseline+set_to_none": (list(100 * (1 + 0.03 * rng.standard_normal(6))), {}),
               "baseline+amp": (list(200 * (1 + 0.03 * rng.standard_normal(6))), {"amp": "applied"})}
    by = {r.configuration: r for r in build_rows(synthetic_jobs(configs))}
    assert by["baseline+set_to_none"].verdict == "no measurable effect"
    assert by["baseline+amp"].verdict == "helps" and 1.85 < by["baseline+amp"].effect_ci.low
    assert by["baseline+amp"].effect_ci.high < 2.15 and by["baseline+amp"].rank == 1


def test_intervals_are_simultaneous_over_the_sweep_s_verdicts():
    """With many techniques judged at once, each interval is computed at 1 - 0.05/m (Bonferroni): a small
    effect whose per-comparison 95 % interval just excludes 1 gets no verdict in a sweep of 20 findings,
    while the same data judged alone (m = 1) does."""
    from runner.report import stats

    rng = np.random.default_rng(3)
    base = list(100 * (1 + 0.03 * rng.standard_normal(8)))
    small = [1.07 * v for v in base[::-1]]  # +7 %: the 95 % interval excludes 1, the 99.75 % one does not
    alone = {"baseline": (base, {}), "baseline+set_to_none": (small, {})}
    by = {r.configuration: r for r in build_rows(synthetic_jobs(alone))}
    assert by["baseline+set_to_none"].effect_ci.confidence == pytest.approx(0.95)
    assert by["baseline+set_to_none"].verdict == "helps"
    many = {**alone, **{f"baseline+t{i}": (base, {}) for i in range(19)}}  # 20 findings in all
    by = {r.configuration: r for r in build_rows(synthetic_jobs(many))}
    assert by["baseline+set_to_none"].effect_ci.confidence == pytest.approx(1 - 0.05 / 20)
    assert by["baseline+set_to_none"].verdict == "no measurable effect"
    assert by["baseline"].speedup_ci.confidence == pytest.approx(1 - 0.05 / 20)  # the noise row too
    assert stats.simultaneous_confidence(0) == stats.simultaneous_confidence(1) == 0.95
    with pytest.raises(ValueError, match="family"):
        stats.simultaneous_confidence(3, family=1.0)


def test_one_repeat_has_no_interval_no_verdict_and_no_rank():
    configs = {k: ([v[0][0]], v[1]) for k, v in SYNTHETIC.items()}
    rows = build_rows(synthetic_jobs(configs))
    by = {r.configuration: r for r in rows}
    assert by["baseline+amp"].speedup == pytest.approx(2.0) and by["baseline+amp"].speedup_ci is None
    assert by["baseline+amp"].verdict == NO_INTERVAL and by["fast-amp"].verdict == NO_INTERVAL
    assert all(r.rank is None for r in rows)
    speedups = [r.speedup for r in rows]
    assert speedups == sorted(speedups, reverse=True)  # still sorted by speed-up


def test_the_report_is_reproducible_with_its_seed():
    a = [(r.configuration, r.speedup_ci, r.effect_ci) for r in build_rows(synthetic_jobs())]
    assert a == [(r.configuration, r.speedup_ci, r.effect_ci) for r in build_rows(synthetic_jobs())]
    rng = __import__("numpy").random.default_rng(0)  # 10 repeats: enough distinct medians for the seed to show
    noisy = {k: (list(v[0][0] * (1 + 0.05 * rng.standard_normal(10))), v[1]) for k, v in SYNTHETIC.items()}
    first = [r.effect_ci for r in build_rows(synthetic_jobs(noisy), seed=1)]
    assert first == [r.effect_ci for r in build_rows(synthetic_jobs(noisy), seed=1)]
    assert first != [r.effect_ci for r in build_rows(synthetic_jobs(noisy), seed=2)]


def test_pending_lists_the_configurations_whose_interval_is_too_wide():
    rows = build_rows(synthetic_jobs())
    half = {r.configuration: r.effect_ci.half_width for r in rows if r.effect_ci}
    # every measured configuration but the baseline; the skipped one is not a finding
    assert set(pending(rows, 1.0)) == set()
    assert set(pending(rows, 1e-9)) == set(SYNTHETIC) - {"baseline", "baseline+cudnn_benchmark"}
    cut = sorted(half.values())[2]
    assert set(pending(rows, cut)) == {k for k, w in half.items() if w >= cut and k != "baseline+cudnn_benchmark"}


def test_missing_baseline_is_one_clear_error():
    jobs = [j for j in synthetic_jobs() if j.variant != "baseline"]
    with pytest.raises(ReportError, match="no baseline"):
        build_rows(jobs)


def write_sweep(root: Path, configs=SYNTHETIC) -> Path:
    for name, (runs, techniques) in configs.items():
        for i, sps in enumerate(runs):
            d = root / name / f"r{i}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps(summary(name, i, sps, techniques, peak=1000.0 + 10 * i)))
    (root / "ablation.json").write_text(json.dumps({"command": "python -m runner -m +experiment=ablation model=tiny",
                                                    "machine": {"cpu": "Test CPU", "cpu_cores": 2, "gpus": []}}))
    return root


def test_report_files_from_synthetic_summaries(tmp_path):
    sweep = write_sweep(tmp_path / "sweep")
    nr = sweep / "fast-cudnn_benchmark" / "r0"
    nr.mkdir(parents=True)
    (nr / "not_run.json").write_text(json.dumps({"variant": "fast-cudnn_benchmark", "repeat": 0, "reason": "needs CUDA"}))
    doc = tmp_path / "docs" / "ablation-test.md"
    written = write_report(sweep, doc=doc)
    assert {p.name for p in written} == {"report.md", "report.csv", "speedup.png", "jobs.csv", "ablation-test.md",
                                         "ablation-test.png"}
    rows = read_csv(sweep / "report.csv")
    assert list(rows[0]) == CSV_COLUMNS
    assert rows[0]["configuration"] == "fast" and rows[0]["rank"] == "1"
    by = {r["configuration"]: r for r in rows}
    assert by["baseline+set_to_none"]["verdict"] == "no measurable effect" and by["baseline+set_to_none"]["rank"] == ""
    assert by["fast-cudnn_benchmark"]["verdict"] == "not run: needs CUDA"
    assert float(by["baseline+amp"]["peak_memory_change_pct"]) == pytest.approx(0.0)
    md = (sweep / "report.md").read_text()
    assert "python -m runner -m +experiment=ablation model=tiny" in md and "Test CPU, 2 cores" in md
    assert "3 warm-up + 8 measured steps" in md and "3 repeat(s)" in md
    assert "| – | baseline+set_to_none |" in md and "no measurable effect" in md
    assert "| 3 | baseline+amp | 2.00 | 1.81–2.21 | 2.00 | 1.81–2.21 | **helps** |" in md
    assert "bootstrap percentile interval (Efron & Tibshirani 1993" in md and "10,000 times (seed 0)" in md
    assert float(by["baseline+amp"]["speedup_ci_low"]) == pytest.approx(190 / 105, rel=1e-5)
    assert float(by["fast-amp"]["effect_ci_high"]) == pytest.approx(310 / 140, rel=1e-5)
    assert by["baseline"]["effect_ci_low"] == "" and by["fast-cudnn_benchmark"]["speedup_ci_low"] == ""
    assert (sweep / "speedup.png").read_bytes()[:8] == PNG_MAGIC
    jobs = read_csv(sweep / "jobs.csv")
    assert list(jobs[0]) == JOB_COLUMNS and len(jobs) == 3 * len(SYNTHETIC) + 1
    text = doc.read_text()
    assert "## Reading" in text and "amp (on alone, ×2.00 [1.81–2.21])" in text and "](ablation-test.png)" in text


def test_the_reading_lists_an_equivalence_margin_as_no_measurable_effect():
    from runner.report.load import Row
    from runner.report.markdown import reading
    from runner.report.stats import Interval

    rows = [Row("baseline+set_to_none", "leave-one-in", "set_to_none", effect=1.02, verdict="no effect larger than ±9.5%",
                effect_ci=Interval(1.02, 0.93, 1.11, 0.95, 2, 2)),
            Row("baseline+checkpointing", "leave-one-in", "checkpointing", effect=0.76, verdict="hurts",
                effect_ci=Interval(0.76, 0.70, 0.84, 0.95, 2, 2))]
    text = reading(rows)  # the interleaved design's wording of "no measurable effect"
    assert "- **No measurable effect:** set_to_none (on alone, ×1.02 [0.93–1.11])" in text, text
    assert "- **Hurt:** checkpointing (on alone, ×0.76 [0.70–0.84])" in text


def test_report_shows_each_jobs_fixed_cost_and_the_sweeps_time(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")})
    now = time.time()
    for i, path in enumerate(sorted(sweep.rglob("summary.json"))):
        s = json.loads(path.read_text())
        s |= {"train_time_s": 5.0, "eval_time_s": 1.0, "measured_time_s": 4.0}
        path.write_text(json.dumps(s))
        os.utime(path, (now - 2, now - 2))  # the summary was written 2 s before the child exited
        (path.parent / "job.json").write_text(json.dumps({"started": now - 2 - 6 - 3.5 - i, "finished": now}))
    record = json.loads((sweep / "ablation.json").read_text())
    (sweep / "ablation.json").write_text(json.dumps(record | {"started_s": now - 100, "finished_s": now}))
    write_report(sweep)
    jobs = read_csv(sweep / "jobs.csv")
    setups = sorted(float(j["setup_s"]) for j in jobs)
    assert setups == [pytest.approx(3.5 + i, abs=0.01) for i in range(6)]
    assert all(float(j["teardown_s"]) == pytest.approx(2.0, abs=0.01) for j in jobs)
    rows = {r["configuration"]: r for r in read_csv(sweep / "report.csv")}
    assert float(rows["baseline+amp"]["setup_s_median"]) > 0
    md = (sweep / "report.md").read_text()
    assert "Sweep wall time: 100.0 s" in md and "(24% of it in measured steps)" in md
    assert "| measured steps | 24.0 s | 24% |" in md and "| evaluation | 6.0 s | 6% |" in md
    assert "Fixed cost per job (setup before the first step): median 6.0 s, 3.5–8.5 s over 6 jobs." in md


def test_report_cli_bad_input_exits_nonzero_with_one_message(tmp_path):
    def report(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runner.report", str(folder)], capture_output=True, text=True,
                              timeout=120)

    empty = tmp_path / "empty"
    empty.mkdir()
    no_base = write_sweep(tmp_path / "nobase", {k: v for k, v in SYNTHETIC.items() if k != "baseline"})
    for folder, message in ((tmp_path / "absent", "is not a folder"), (empty, "holds no job folder"),
                            (no_base, "no baseline")):
        proc = report(folder)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_duplicate_jobs_from_two_sweeps_are_refused(tmp_path):
    write_sweep(tmp_path / "a")
    write_sweep(tmp_path / "b")
    with pytest.raises(ReportError, match="appears twice"):
        load_jobs(tmp_path)


def test_wandb_table_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    configs = {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")}
    sweep = write_sweep(tmp_path / "sweep", configs)
    for p in sweep.rglob("summary.json"):  # jobs that logged to W&B
        s = json.loads(p.read_text())
        s["config"]["logger"] = {"name": "wandb", "project": "runner-test"}
        p.write_text(json.dumps(s))
    written = write_report(sweep)
    runs = list((sweep / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    assert len(written) == 5
    assert write_report(sweep, use_wandb=False) == written[:4]
    # a rebuilt report logs to the same run (its id kept in the sweep folder): W&B updates it, no second run
    run_id = json.loads((sweep / "wandb_report.json").read_text())["run_id"]
    assert runs[0].name.endswith(f"-{run_id}")
    write_report(sweep)
    assert {p.name.rsplit("-", 1)[1] for p in (sweep / "wandb").glob("offline-run-*")} == {run_id}


# ------------------------------------------------------------------------------------------- end to end
E2E_VARIANTS = ["baseline", "baseline+amp", "baseline+channels_last", "baseline+cudnn_benchmark",
                "baseline+big_batch", "fast", "fast-channels_last"]


@pytest.mark.slow
def test_ablation_sweep_and_report_through_the_cli(tmp_path):
    # the presets set the batch and log_every themselves: keep TINY's out of their way
    tiny = [o for o in TINY if not o.startswith(("trainer.log_every", "trainer.max_steps", "trainer.warmup_steps",
                                                 "dataloader.batch_size", "data.train_size"))]
    proc = run_cli("-m", "+experiment=ablation", "ablation.design=rounds", *tiny, "trainer.max_steps=5",
                   "trainer.warmup_steps=2",
                   "ablation.repeats=1", "compile=off",  # torch.compile would take minutes on a CPU
                   # batch 16; baseline+big_batch's 4 x 16 exceeds the 48 training samples and fails: the sweep goes on
                   "optimizer.base_batch_size=16", "data.train_size=48",
                   "ablation/variant=" + ",".join(E2E_VARIANTS), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "ablation").glob("*/*"))
    assert len(sweeps) == 1
    sweep = sweeps[0]
    for name in ("report.md", "report.csv", "speedup.png", "ablation.json"):
        assert (sweep / name).is_file(), name
    assert (sweep / "speedup.png").read_bytes()[:8] == PNG_MAGIC

    measured = sorted(p.parent.relative_to(sweep).as_posix() for p in sweep.rglob("summary.json"))
    assert measured == sorted(f"{v}/r0" for v in E2E_VARIANTS if v not in ("baseline+cudnn_benchmark",
                                                                           "baseline+big_batch"))
    s = json.loads((sweep / "baseline+amp" / "r0" / "summary.json").read_text())
    assert s["config"]["ablation"]["variant"] == "baseline+amp" and s["config"]["ablation"]["repeat"] == 0
    assert s["warmup_steps"] == 2 and s["measured_steps"] == 3 and s["global_batch_size"] == 16
    assert (sweep / "baseline+big_batch" / "r0" / "failed.json").is_file()
    # a speed measurement keeps no weights: 110 resnet18 jobs with a checkpoint each once filled a disk
    assert not list(sweep.rglob("model.safetensors")) and not list(sweep.rglob("checkpoints"))

    rows = read_csv(sweep / "report.csv")
    by = {r["configuration"]: r for r in rows}
    assert set(by) == set(E2E_VARIANTS)
    speedups = [float(r["speedup"]) for r in rows if r["speedup"]]
    assert speedups == sorted(speedups, reverse=True) and len(speedups) == 5
    assert by["baseline"]["verdict"] == "reference" and float(by["baseline"]["speedup"]) == 1.0
    assert by["baseline+cudnn_benchmark"]["verdict"].startswith("not run: needs CUDA")
    assert by["baseline+big_batch"]["verdict"].startswith("failed (exit status 2)")
    assert by["baseline+channels_last"]["techniques"] == "channels_last: applied"
    assert by["fast-channels_last"]["techniques"] == "channels_last: applied"
    # amp is bf16 on a CPU with native bf16 and skipped on other CPUs: either way the row says which
    amp = by["baseline+amp"]
    assert amp["techniques"] == "amp: applied" or (amp["techniques"].startswith("amp: skipped")
                                                   and amp["verdict"] == "skipped here")
    # one repeat: no interval, so no verdict and no rank
    assert all(r["rank"] == "" for r in rows)
    assert {r["verdict"] for r in rows if r["speedup"] and r["kind"] != "baseline"} <= {NO_INTERVAL, "skipped here"}
    md = (sweep / "report.md").read_text()
    record = json.loads((sweep / "ablation.json").read_text())
    assert record["command"].startswith("python -m runner -m ") and "+experiment=ablation" in record["command"]
    assert record["command"] in md and record["machine"]["cpu"] in md
    assert "2 warm-up + 3 measured steps" in md and "a configuration ran once" in md

    again = subprocess.run([sys.executable, "-m", "runner.report", str(sweep)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert read_csv(sweep / "report.csv") == rows


def test_report_warns_when_the_machine_was_busy(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")})
    write_report(sweep)
    assert "machine was busy" not in (sweep / "report.md").read_text()
    (sweep / "ablation.json").write_text(json.dumps({"command": "c", "machine": {"cpu": "Test CPU", "cpu_cores": 2,
                                                                                "load_average_1min": 3.2}}))
    write_report(sweep)
    assert "machine was busy when the sweep started (load average 3.2 on 2 cores)" in (sweep / "report.md").read_text()
    # a job whose own summary recorded a busy machine (runner.machine_load.load_warnings) is counted and quoted
    path = sweep / "baseline+amp" / "r1" / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"warnings": ["runner's threads waited 40 %"]}))
    write_report(sweep)
    assert ("1 of 6 measured jobs recorded a busy machine while they measured (summary.json `warnings`; e.g. "
            "baseline+amp r1: runner's threads waited 40 %)") in (sweep / "report.md").read_text()


# ------------------------------------------------------------------------------------------- repeats=auto
def fake_round(sweep: Path, samples: dict[str, list[float]], calls: list):
    """A ``launch`` for ``auto_repeat`` that 'runs' repeat n of each variant: the next value of its list."""
    def launch(repeat: int, variants: list[str]) -> int:
        calls.append((repeat, variants))
        for name in variants:
            d = sweep / name / f"r{repeat}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps(summary(name, repeat, samples[name][repeat], {})))
        return 0
    return launch


def test_auto_repeat_stops_at_once_when_every_interval_is_tight_enough(tmp_path):
    sweep = write_sweep(tmp_path / "s", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")})
    calls = []
    stopped, rounds = auto_repeat(sweep, 0.5, 10, 3, fake_round(sweep, {}, calls))
    assert calls == [] and rounds == [] and "within ±50.0% after 3 repeat(s)" in stopped


def test_auto_repeat_adds_rounds_until_the_criterion_holds(tmp_path):
    """amp runs at exactly 200; the baseline has one slow... fast repeat (130) among 100s. Its median
    resamples reach 130 with probability 6 % at 6 repeats (> 2.5 %), 1 % at 7: the interval of amp's
    speed-up closes to [2, 2] at the 7th repeat."""
    configs = {"baseline": ([100.0, 100.0, 130.0], {}), "baseline+amp": ([200.0, 200.0, 200.0], {"amp": "applied"}),
               "baseline+set_to_none": ([100.0, 100.0, 100.0], {})}
    sweep = write_sweep(tmp_path / "s", configs)
    calls = []
    samples = {"baseline": [100.0] * 10, "baseline+amp": [200.0] * 10, "baseline+set_to_none": [100.0] * 10}
    stopped, rounds = auto_repeat(sweep, 0.05, 10, 3, fake_round(sweep, samples, calls))
    assert [r for r, _ in calls] == [3, 4, 5, 6]
    assert all(sorted(v) == ["baseline", "baseline+amp", "baseline+set_to_none"] for _, v in calls)
    assert "within ±5.0% after 7 repeat(s)" in stopped and [r["repeat"] for r in rounds] == [3, 4, 5, 6]
    assert rounds[0]["pending"]["baseline+amp"] > 0.05 and rounds[0]["returncode"] == 0
    by = {r.configuration: r for r in build_rows(load_jobs(sweep))}
    assert by["baseline+amp"].effect_ci.half_width == 0 and by["baseline+amp"].verdict == "helps"
    assert len(by["baseline"].runs) == 7


def test_auto_repeat_runs_only_what_is_pending_and_its_references(tmp_path):
    configs = {"baseline": ([100.0, 100.0, 100.0], {}), "baseline+amp": ([200.0, 200.0, 200.0], {"amp": "applied"}),
               "fast": ([300.0, 300.0, 300.0], {"amp": "applied"}), "fast-amp": ([150.0, 100.0, 190.0], {})}
    sweep = write_sweep(tmp_path / "s", configs)
    calls = []
    samples = {"baseline": [100.0] * 5, "fast": [300.0] * 5, "fast-amp": [150.0, 100.0, 190.0, 120.0, 170.0]}
    stopped, rounds = auto_repeat(sweep, 0.05, 5, 3, fake_round(sweep, samples, calls))
    assert calls == [(3, ["fast", "fast-amp", "baseline"]), (4, ["fast", "fast-amp", "baseline"])]
    assert stopped.startswith("ablation.max_repeats=5 reached; still wider than ±5.0%: fast-amp (±")


def test_auto_repeat_stops_when_a_round_fails(tmp_path):
    sweep = write_sweep(tmp_path / "s", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")})
    stopped, rounds = auto_repeat(sweep, 0.01, 10, 3, lambda repeat, variants: 1)
    assert "round of repeat 3 failed (exit status 1)" in stopped and rounds[0]["returncode"] == 1


def test_round_command_keeps_the_sweep_and_replaces_the_repeats():
    hydra = OmegaConf.create({"overrides": {
        "hydra": ["hydra.mode=MULTIRUN", "hydra.sweep.dir=x", "hydra/launcher=basic"],
        "task": ["+experiment=ablation", "model=resnet18", "ablation.repeats=auto", "ablation/variant=baseline,fast",
                 "ablation.max_repeats=6"]}})
    cmd = round_command(hydra, Path("/tmp/sweep"), 4, ["baseline", "baseline+amp"])
    assert cmd[:4] == [sys.executable, "-m", "runner", "-m"]
    assert cmd[4:] == ["hydra/launcher=basic", "+experiment=ablation", "model=resnet18", "ablation.max_repeats=6",
                       "ablation.repeats=5", "ablation.repeat=4", "ablation/variant=baseline,baseline+amp",
                       "hydra.sweep.dir='/tmp/sweep'"]


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_each_job_of_the_sweep_is_one_console_line_with_its_figure(tmp_path):
    """The ablation's jobs train with trainer.progress=off (conf/experiment/ablation.yaml): no per-step lines,
    summary tables or doctor per job (a 12-job sweep printed 533 lines), but one line each with its figures."""
    tiny = [o for o in TINY if not o.startswith("trainer.progress")]  # the preset's own setting
    proc = run_cli("-m", "+experiment=ablation", "ablation.design=rounds", *tiny, "compile=off", "ablation.repeats=1",
                   "ablation/variant=baseline,baseline+set_to_none", cwd=tmp_path, timeout=300,
                   env={"PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for job in ("baseline/r0", "baseline+set_to_none/r0"):
        (done,) = [x for x in lines if x.startswith(f"ablation: {job} done in ")]
        assert " samples/s, eval_loss " in done, done
    assert not [x for x in lines if x.startswith(("step ", "summary (", "model: ", "speed doctor"))], lines
    assert len(lines) <= 2 * 3 + 2, lines  # per job: Hydra's launch line and the done line; then the report


@pytest.mark.slow
def test_repeats_auto_through_the_cli_adds_a_round_and_stops_at_max_repeats(tmp_path):
    """Two cheap variants, TINY jobs, an unreachable target: 3 repeats, one more round (repeat 3), stop."""
    proc = run_cli("-m", "+experiment=ablation", "ablation.design=rounds", *TINY, "compile=off",
                   "ablation.repeats=auto",
                   "ablation.max_repeats=4", "ablation.target_ci=1e-9", "ablation/variant=baseline,baseline+set_to_none",
                   cwd=tmp_path, timeout=600, env={"PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "ablation").glob("*/*"))
    assert len(sweeps) == 1
    sweep = sweeps[0]
    measured = sorted(p.parent.relative_to(sweep).as_posix() for p in sweep.rglob("summary.json"))
    assert measured == sorted(f"{v}/r{i}" for v in ("baseline", "baseline+set_to_none") for i in range(4))
    record = json.loads((sweep / "ablation.json").read_text())
    assert record["job_process"] == "forkserver" and record["job_server_start_s"] > 0
    auto = record["auto"]
    assert (auto["first_round"], auto["max_repeats"], auto["target_ci"]) == (3, 4, 1e-9)
    assert [r["repeat"] for r in auto["rounds"]] == [3] and auto["rounds"][0]["returncode"] == 0
    assert sorted(auto["rounds"][0]["variants"]) == ["baseline", "baseline+set_to_none"]
    assert auto["stopped"].startswith("ablation.max_repeats=4 reached")
    assert len(record["multiruns"]) == 1 and "ablation.repeat=3" in record["multiruns"][0]["command"]
    job = json.loads((sweep / "baseline" / "r3" / "job.json").read_text())
    assert job["process"] == "forkserver" and job["returncode"] == 0 and job["wall_s"] > 0
    rows = {r["configuration"]: r for r in read_csv(sweep / "report.csv")}
    assert rows["baseline+set_to_none"]["repeats"] == "4" and rows["baseline+set_to_none"]["effect_ci_low"]
    assert float(rows["baseline"]["setup_s_median"]) > 0
    md = (sweep / "report.md").read_text()
    assert "ablation.repeats=auto: first round 3 repeat(s)" in md and "stopped: ablation.max_repeats=4 reached" in md
    assert "forked from a job server" in md and "## Where the sweep's time went" in md
    assert all(j["setup_s"] for j in read_csv(sweep / "jobs.csv"))


@pytest.mark.parametrize("bad,message", [("ablation.repeats=often", "ablation.repeats='often'"),
                                         ("ablation.target_ci=0", "ablation.target_ci=0.0")])
@pytest.mark.slow
def test_bad_repeats_on_the_command_line_stop_before_any_job(tmp_path, bad, message):
    extra = ["ablation.repeats=auto"] if "target_ci" in bad else []
    proc = run_cli("-m", "+experiment=ablation", "ablation.design=rounds", *TINY, *extra, bad, cwd=tmp_path,
                   env={"PYTHONPATH": str(REPO_ROOT)},
                   timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}") and "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("summary.json"))


def test_a_replication_must_reproduce_every_firm_verdict():
    """``python -m runner.report A --doc D --replication B``: a configuration A calls helps/hurts/faster/slower
    must get the same verdict in B; one A calls "no measurable effect" may go either way in B (its interval
    contains 1) and is shown but not counted."""
    from runner.report import Row, agreement

    def rows(**verdicts):
        out = [Row("baseline", "baseline", None, verdict="reference", effect=1.0)]
        return out + [Row(name, "leave-one-in", name, verdict=v, effect=1.5) for name, v in verdicts.items()]

    a = rows(amp="helps", compile="no measurable effect", ckpt="hurts")
    text, disagree = agreement(a, rows(amp="helps", compile="helps", ckpt="hurts"))
    assert disagree == [] and "agrees on all 2 configurations" in text
    assert text.count("| yes |") == 2 and text.count("| — |") == 1  # compile: shown, not counted
    text, disagree = agreement(a, rows(amp="no measurable effect", compile="hurts"))  # ckpt not run there
    assert disagree == ["amp", "ckpt"] and "disagrees on 2 of the 2" in text and "not run" in text
    cuda = Row("cudnn", "leave-one-in", "cudnn", verdict="not run: needs CUDA", effect=None)
    text, disagree = agreement([*a, cuda], [*rows(amp="helps", compile="helps", ckpt="hurts"), cuda])
    assert disagree == [] and "| cudnn |" not in text and text.endswith("for the same reason (the ranking above "
                                                                         "says why): cudnn.")


def test_a_forked_job_starts_its_loader_workers_as_python_m_runner_would(tmp_path):
    """An ablation job forked from the job server starts its DataLoader workers with the parent's start method
    (fork on Linux), not the server's forkserver: on CIFAR-10 with workers this once failed every
    baseline+pinned_workers job (the dataset did not pickle); the dataset now pickles too (spawn, forkserver)."""
    import pickle

    from conftest import TINY_LOOP, make_tiny_cifar
    from runner.ablation import fork_train
    from runner.data.images import cifar10_class

    root = tmp_path / "data"
    make_tiny_cifar(root)
    cfg = compose_cfg("data=cifar10", f"data.root={root}", *TINY_LOOP, "dataloader.num_workers=1",
                      "ablation.isolate=false")
    (tmp_path / "job").mkdir()
    assert fork_train(cfg, tmp_path / "job", {}, "test job") == 0
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["steps"] == 4
    assert pickle.loads(pickle.dumps(cifar10_class()(str(root), train=False))).data.shape == (40, 32, 32, 3)
    # a dataset that cannot pickle at all: its workers start only by the parent's fork, not the server's forkserver
    cfg = compose_cfg("data=custom", "data._target_=user_data.unpicklable", "model=mlp", *TINY_LOOP,
                      "dataloader.num_workers=1", "ablation.isolate=false")
    (tmp_path / "job2").mkdir()
    assert fork_train(cfg, tmp_path / "job2", {}, "test job 2") == 0
