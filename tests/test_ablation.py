"""The presets, the ablation sweep and its report.

- The variants (generated from the technique table, and conf/ablation/variant/ for the rest) are checked by composing
  them: each leave-one-in variant changes
  exactly the keys its leave-one-out twin changes back, and every difference between the baseline and
  the fast preset belongs to a technique of the ablation.
- The report's rule (the paired intervals of an interleaved record, verdicts from them, ranking, skipped and
  not-run rows) is unit-tested on synthetic summaries and a synthetic ``interleave.json``.
- An end-to-end sweep runs through the real CLI on a tiny model: the variant mix with a failing job (slow).
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
from runner import REPO_ROOT
from runner.measure import hardware
from runner.report import CSV_COLUMNS, JOB_COLUMNS, NO_INTERVAL, Job, ReportError, build_rows, load_jobs, write_report
from runner.techniques import TECHNIQUES, variants

VARIANTS = REPO_ROOT / "conf" / "ablation" / "variant"
FILES = sorted(p.stem for p in VARIANTS.glob("*.yaml"))  # the variants that are no technique of the table
NAMES = sorted([*FILES, *variants.generate()])  # and those generated from it (runner/techniques/variants.py)
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
    return flat(
        compose_cfg("+experiment=ablation", f"ablation/variant={name}", "trainer.device=cuda", *overrides, tiny=False)
    )


def diff(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


# ------------------------------------------------------------------------------------------- configs
def test_the_sweep_lists_every_variant_once_and_is_interleaved():
    """One multirun job per configuration (the launcher adds its processes), each capped only by time: the
    conductor stops the jobs when interleave.max_minutes is spent. Every variant is swept by the speed ablation or,
    the recipes that buy steps (schedules, optimizer, EMA), by the convergence ablation."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=ablation"], return_hydra_config=True)
        gpt = compose("config", overrides=["+experiment=[shakespeare_char,ablation]"], return_hydra_config=True)
        convergence = compose("config", overrides=["+experiment=convergence"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params

    def listed(c) -> list[str]:
        return [v.strip() for v in c.hydra.sweeper.params["ablation/variant"].split(",") if v.strip()]

    swept = listed(cfg)
    # the language model's own techniques are swept on a language model only (${runner_for_tokens:...})
    assert set(listed(gpt)) - set(swept) == {"baseline+selective", "baseline+chunked_loss"}
    assert set(swept) < set(listed(gpt))
    swept = listed(gpt)
    # the variants only the convergence ablation sweeps: recipes that buy steps, not speed
    recipes = {v.strip() for v in convergence.hydra.sweeper.params["ablation/variant"].split(",")} - set(swept)
    assert recipes and sorted([*swept, *recipes]) == NAMES and len(swept) == len(set(swept))
    assert list(params) == ["ablation/variant"]
    overrides = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    assert len(BasicSweeper.split_arguments(overrides, None)[0]) == len(listed(cfg))
    assert cfg.hydra.launcher._target_.endswith("InterleavedLauncher") and cfg.trainer.max_steps >= 100_000


@pytest.mark.parametrize("key", ["ablation.design=rounds", "ablation.repeats=3"])
def test_the_retired_rounds_design_is_an_unknown_key(key):
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException):
            compose("config", overrides=["+experiment=ablation", key])


def test_no_variant_file_is_one_the_table_generates():
    """Each technique of the table with a ``variant`` gets its leave-one-in variant, and its leave-one-out one when
    the fast preset has it on, from the table: a file of the same name would be a second, hand-kept copy."""
    generated = variants.generate()
    assert not set(FILES) & set(generated)
    assert {f"baseline+{t.variant}" for t in TECHNIQUES.values() if t.variant} <= set(generated)
    assert {"fast-amp", "fast-compile", "fast-channels_last"} <= set(generated)  # fast.yaml has them on
    assert "fast-muon" not in generated and "fast-pinned_workers" not in generated  # off in fast.yaml; joint


@pytest.mark.parametrize("name", NAMES)
def test_variant_composes_and_names_itself(name):
    tokens = name in ("baseline+selective", "baseline+chunked_loss")  # a language model's keys: on the GPT
    experiment = "+experiment=[shakespeare_char,ablation]" if tokens else "+experiment=ablation"
    cfg = compose_cfg(experiment, f"ablation/variant={name}", tiny=False)
    OmegaConf.to_container(cfg, resolve=True)
    a = cfg.ablation
    assert a.variant == name
    if name in ("baseline", "fast"):
        assert a.kind == name and a.technique is None
    else:
        prefix, tech = ("baseline+", "leave-one-in") if name.startswith("baseline+") else ("fast-", "leave-one-out")
        assert a.kind == tech and name == prefix + a.technique


LEAVE_OUT = [n[len("fast-") :] for n in NAMES if n.startswith("fast-")]
LEAVE_IN = [n[len("baseline+") :] for n in NAMES if n.startswith("baseline+")]


@pytest.mark.parametrize("tech", sorted(set(LEAVE_OUT) & set(LEAVE_IN)))
def test_leave_one_in_and_out_are_mirror_images(tech):
    """baseline+X sets X's keys to fast's values; fast-X sets the same keys back to the baseline's."""
    base, fast = variant("baseline"), variant("fast")
    on, off = variant(f"baseline+{tech}"), variant(f"fast-{tech}")
    keys = diff(base, on)
    assert keys, f"baseline+{tech} changes nothing"
    assert keys == diff(fast, off)
    assert {k: on[k] for k in keys} == {k: fast[k] for k in keys}
    assert {k: off[k] for k in keys} == {k: base[k] for k in keys}


def test_every_difference_between_the_presets_is_a_technique_of_the_ablation():
    base, fast = variant("baseline"), variant("fast")
    explained = set().union(*(diff(fast, variant(f"fast-{t}")) for t in LEAVE_OUT))
    assert diff(base, fast) - explained == set()
    # the data-loading leave-one-out undoes exactly what the two data-loading leave-one-ins switch on
    loading = diff(fast, variant("fast-data_loading"))
    assert loading <= diff(base, variant("baseline+pinned_workers")) | diff(base, variant("baseline+on_device_data"))


def test_the_keys_of_each_skippable_technique_are_the_keys_its_variant_switches():
    from runner.sweeps.ablation import TECHNIQUE_KEYS

    base = variant("baseline")
    for tech, keys in TECHNIQUE_KEYS.items():
        assert diff(base, variant(f"baseline+{tech}")) == set(keys), tech


@pytest.mark.parametrize(
    "name,no_op",
    [
        ("baseline+channels_last", True),
        ("fast-normalize", True),
        ("fast-drop_bias", True),
        ("fast-compile", False),
        ("baseline", False),
    ],
)
def test_a_technique_the_language_model_skips_is_not_measured(tmp_path, name, no_op):
    """On the GPT an image technique changes nothing: its variant is its reference again, so it is recorded as
    not run (saving a quarter of the GPT ablation's minutes) instead of being measured as a copy."""
    from runner.sweeps.ablation import not_run

    cfg = compose_cfg("+experiment=[shakespeare_char,ablation]", f"ablation/variant={name}", tiny=False)
    why = not_run(cfg, tmp_path)
    if not no_op:
        assert why is None and not (tmp_path / "not_run.json").exists()
        return
    reason = json.loads((tmp_path / "not_run.json").read_text())["reason"]
    assert why == reason
    assert reason.startswith("does nothing on this job (") and "image technique" in reason
    assert reason.endswith("the same configuration as its reference")


def test_an_image_technique_is_measured_on_an_image_model(tmp_path):
    from runner.sweeps.ablation import not_run

    assert not_run(compose_cfg("+experiment=ablation", "ablation/variant=fast-channels_last"), tmp_path) is None
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
    assert (
        cfg.precision.name,
        cfg.scheduler.name,
        cfg.dataloader.num_workers,
        cfg.dataloader.pin_memory,
        cfg.compile.mode,
        cfg.channels_last,
        cfg.cudnn_benchmark,
        cfg.optimizer.set_to_none,
        cfg.trainer.log_every,
    ) == ("fp32", "constant", 0, False, None, False, False, False, 1)


# ------------------------------------------------------------------------------------------- the rule
def summary(variant: str, repeat: int, sps: float, techniques: dict | None = None, **extra) -> dict:
    kind = (
        "baseline"
        if variant == "baseline"
        else "fast"
        if variant == "fast"
        else ("leave-one-in" if variant.startswith("baseline+") else "leave-one-out")
    )
    tech = None if kind in ("baseline", "fast") else variant.split("+" if "+" in variant else "-", 1)[1]
    return {
        "samples_per_sec": sps,
        "step_time_ms_median": 1000 * 64 / sps,
        "data_wait_fraction": 0.1,
        "peak_memory_mb": extra.pop("peak", 1000.0),
        "train_loss": 2.0,
        "eval_loss": 2.1,
        "warmup_steps": 3,
        "measured_steps": 8,
        "global_batch_size": 64,
        "device": "cpu",
        "device_name": "x86_64",
        "techniques": techniques or {},
        "config": {
            "ablation": {"variant": variant, "repeat": repeat, "kind": kind, "technique": tech},
            "model": {"_target_": "tiny"},
            "data": {"name": "synthetic"},
            "logger": {"name": "none"},
            "optimizer": {"_target_": "torch.optim.SGD"},
        },
        **extra,
    }


SYNTHETIC = {  # configuration -> (its true samples/s, techniques)
    "baseline": (100.0, {}),
    "baseline+amp": (200.0, {"amp": "applied"}),
    "baseline+set_to_none": (100.0, {}),  # no effect: only the slices' noise
    "baseline+checkpointing": (71.0, {"activation_checkpointing": "applied"}),
    "baseline+cudnn_benchmark": (150.0, {"cudnn_benchmark": "skipped: CUDA only"}),
    "fast": (300.0, {"amp": "applied", "compile": "applied"}),
    "fast-amp": (150.0, {"compile": "applied"}),
    "fast-compile": (300.0, {"amp": "applied"}),
}
#: the baseline's copy (A'): the launcher names it after the configuration's last process
AA = "baseline/r1"


def reference_of(name: str, configs) -> str | None:
    return (
        None if name == "baseline" else "fast/r0" if name.startswith("fast-") and "fast" in configs else "baseline/r0"
    )


def paired_record(configs=SYNTHETIC, passes: int = 10, noise: float = 0.02, seed: int = 1) -> dict:
    """The ``interleave.json`` an interleaved ablation of ``configs`` would leave: one process per configuration
    (``<name>/r0``) and the baseline's copy ``AA``, every one slicing once per pass at its true samples/s x the
    machine's drift (±20 % over the passes) x 2 % noise, each paired with its reference's slice of the pass.
    Every comparison of a pass shares that reference slice, so their errors move together; with seed 0 the
    baseline's slices read 1.5 % low on average and set_to_none's x1.013 [1.003-1.024] was called (the 5 % a
    test at its level allows), so the default is a seed whose noise calls nothing."""
    rng = np.random.default_rng(seed)
    jobs = {
        f"{name}/r0": {
            "config": f"{name}/r0",
            "reference": reference_of(name, configs),
            "status": "measured",
            "group": None if name == "baseline" else 1,
            "design": "interleaved",
        }
        for name in configs
    }
    jobs[AA] = {"config": AA, "reference": "baseline/r0", "status": "measured", "group": 1, "design": "interleaved"}
    speed = {f"{name}/r0": sps for name, (sps, _) in configs.items()} | {AA: configs["baseline"][0]}
    order = sorted(jobs, key=lambda n: (jobs[n]["reference"] is not None, n != "fast/r0", n))  # references first
    slices = []
    for p in range(passes):
        drift = 1 + 0.2 * np.sin(p)
        position = {name: i for i, name in enumerate(order)}
        for name in order:
            ref = jobs[name]["reference"]
            slices.append(
                {
                    "group": 1,
                    "pass": p,
                    "position": position[name],
                    "job": name,
                    "pairs_with": None if ref is None else position[ref],
                    "steps": 10,
                    "seconds": 1.0,
                    "samples_per_sec": speed[name] * drift * float(np.exp(rng.normal(0, noise))),
                    "resume_steps": 3,
                    "time": 1000.0 + p,
                }
            )
    return {
        "design": "interleaved",
        "reference": "baseline/r0",
        "aa": AA,
        "slice_steps": 10,
        "settings": {"confidence": 0.95, "processes": 1, "order": "rmit"},
        "jobs": jobs,
        "slices": slices,
        "stopped": [f"group 1: interleave.max_passes={passes} reached"],
        "started": 1000.0,
        "finished": 1100.0,
    }


def synthetic_jobs(configs=SYNTHETIC) -> list[Job]:
    """The report's jobs of ``configs``: one process each, and the baseline's copy."""
    names = [(name, 0) for name in configs] + ([("baseline", 1)] if "baseline" in configs else [])
    return [
        Job(
            name,
            i,
            Path(f"{name}/r{i}"),
            summary(name, i, configs[name][0])["config"]["ablation"]["kind"],
            summary(name, i, configs[name][0])["config"]["ablation"]["technique"],
            summary(name, i, configs[name][0], configs[name][1]),
        )
        for name, i in names
    ]


def synthetic_rows(configs=SYNTHETIC, **record) -> list:
    from runner.report import paired

    rows = build_rows(synthetic_jobs(configs))
    paired.apply_to_rows(rows, paired_record(configs, **record))
    return rows


def test_rows_are_ranked_by_speedup_and_noise_is_not_a_win():
    rows = synthetic_rows()
    by = {r.configuration: r for r in rows}
    speedups = [r.speedup for r in rows]
    assert speedups == sorted(speedups, reverse=True)
    # every figure is a paired interval from the slices, however much the machine drifted
    amp = by["baseline+amp"]
    assert amp.speedup == pytest.approx(2.0, rel=0.03) and amp.verdict == "helps" and amp.design == "interleaved"
    assert 1.9 < amp.speedup_ci.low < amp.speedup < amp.speedup_ci.high < 2.1 and amp.effect_ci == amp.speedup_ci
    noise = by["baseline+set_to_none"]
    assert noise.verdict.startswith("no effect larger than ±") and noise.rank is None
    assert noise.speedup_ci.low < 1 < noise.speedup_ci.high
    assert by["baseline+checkpointing"].verdict == "hurts" and by["baseline+checkpointing"].rank is None
    # faster than the baseline, but its only technique was skipped: not a finding, not ranked
    assert by["baseline+cudnn_benchmark"].verdict == "skipped here" and by["baseline+cudnn_benchmark"].rank is None
    # leave-one-out: the effect is fast / this configuration, measured against fast pass by pass; its speed-up
    # against the baseline is the chain through fast
    assert by["fast-amp"].verdict == "helps" and by["fast-amp"].effect == pytest.approx(2.0, rel=0.03)
    assert by["fast-amp"].speedup == pytest.approx(1.5, rel=0.03)
    assert by["fast-amp"].status == "amp: applied"  # what fast had and this configuration lacks
    assert by["fast-compile"].verdict.startswith("no effect larger than ±")
    assert {r.configuration for r in rows if r.rank} == {"fast", "fast-compile", "baseline+amp", "fast-amp"}
    assert [r.rank for r in rows if r.rank] == [1, 2, 3, 4]
    assert by["baseline"].verdict == "reference" and by["baseline"].rank is None
    assert by["fast"].verdict == "faster"
    # the baseline's interval is its copy's: the noise band, around 1
    assert by["baseline"].speedup_ci.low < 1 < by["baseline"].speedup_ci.high


def test_without_an_interleaved_record_a_row_has_no_interval_no_verdict_and_no_rank():
    rows = build_rows(synthetic_jobs())
    by = {r.configuration: r for r in rows}
    assert by["baseline+amp"].speedup == pytest.approx(2.0) and by["baseline+amp"].speedup_ci is None
    assert by["baseline+amp"].verdict == NO_INTERVAL and by["fast-amp"].verdict == NO_INTERVAL
    assert by["fast-amp"].effect == pytest.approx(2.0)  # fast ÷ this, a ratio of medians
    assert all(r.rank is None for r in rows)
    speedups = [r.speedup for r in rows]
    assert speedups == sorted(speedups, reverse=True)  # still sorted by speed-up


def test_missing_baseline_is_one_clear_error():
    jobs = [j for j in synthetic_jobs() if j.variant != "baseline"]
    with pytest.raises(ReportError, match="no baseline"):
        build_rows(jobs)


def write_sweep(root: Path, configs=SYNTHETIC, interleaved: bool = True) -> Path:
    """A sweep folder as an interleaved ablation of ``configs`` leaves it: a summary per process (its samples/s
    the mean of its slices), ``ablation.json`` and, with ``interleaved``, ``interleave.json``."""
    record = paired_record(configs) if "baseline" in configs else None
    for i, job in enumerate(synthetic_jobs(configs)):
        d = root / job.folder
        d.mkdir(parents=True)
        sps = (
            [x["samples_per_sec"] for x in record["slices"] if x["job"] == str(job.folder)]
            if record
            else [configs[job.variant][0]]
        )
        s = summary(job.variant, job.repeat, sum(sps) / len(sps), configs[job.variant][1], peak=1000.0 + 10 * i % 2)
        (d / "summary.json").write_text(json.dumps(s))
    (root / "ablation.json").write_text(
        json.dumps(
            {
                "command": "python -m runner -m +experiment=ablation model=tiny",
                "machine": {"cpu": "Test CPU", "cpu_cores": 2, "gpus": []},
            }
        )
    )
    if interleaved and record:
        (root / "interleave.json").write_text(json.dumps(record))
    return root


def test_report_files_from_synthetic_summaries(tmp_path):
    sweep = write_sweep(tmp_path / "sweep")
    nr = sweep / "fast-cudnn_benchmark" / "r0"
    nr.mkdir(parents=True)
    (nr / "not_run.json").write_text(
        json.dumps({"variant": "fast-cudnn_benchmark", "repeat": 0, "reason": "needs CUDA"})
    )
    doc = tmp_path / "docs" / "ablation-test.md"
    written = write_report(sweep, doc=doc)
    assert {p.name for p in written} == {
        "report.md",
        "report.csv",
        "speedup.png",
        "jobs.csv",
        "ablation-test.md",
        "ablation-test.png",
    }
    rows = read_csv(sweep / "report.csv")
    assert list(rows[0]) == CSV_COLUMNS
    assert rows[0]["configuration"] in ("fast", "fast-compile") and rows[0]["rank"] == "1"
    by = {r["configuration"]: r for r in rows}
    assert (
        by["baseline+set_to_none"]["verdict"].startswith("no effect larger than")
        and by["baseline+set_to_none"]["rank"] == ""
    )
    assert by["fast-cudnn_benchmark"]["verdict"] == "not run: needs CUDA"
    assert by["baseline+amp"]["design"] == "interleaved"
    md = (sweep / "report.md").read_text()
    amp = next(line for line in md.splitlines() if line.startswith("| 3 | baseline+amp | 2.0"))
    assert "| **helps** |" in amp, amp
    assert "## How this sweep was measured: interleaved" in md and "**Noise (A/A):**" in md
    low, high = float(by["baseline+amp"]["speedup_ci_low"]), float(by["baseline+amp"]["speedup_ci_high"])
    assert 1.9 < low < high < 2.1
    assert by["baseline"]["effect_ci_low"] == "" and by["fast-cudnn_benchmark"]["speedup_ci_low"] == ""
    assert (sweep / "speedup.png").read_bytes()[:8] == PNG_MAGIC
    jobs = read_csv(sweep / "jobs.csv")
    assert list(jobs[0]) == JOB_COLUMNS and len(jobs) == len(SYNTHETIC) + 2  # the copy, the not-run job
    text = doc.read_text()
    assert "## Reading" in text and "- **Helped:** amp (on alone, ×2.0" in text and "](ablation-test.png)" in text


def test_a_sweep_without_an_interleaved_record_says_it_has_no_intervals(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")}, interleaved=False)
    write_report(sweep)
    md = (sweep / "report.md").read_text()
    assert "not interleaved (no interleave.json)" in md
    assert {r["verdict"] for r in read_csv(sweep / "report.csv")} == {"reference", NO_INTERVAL}


def test_the_reading_lists_an_equivalence_margin_as_no_measurable_effect():
    from runner.compare.stats import Interval
    from runner.report.load import Row
    from runner.report.markdown import reading

    rows = [
        Row(
            "baseline+set_to_none",
            "leave-one-in",
            "set_to_none",
            effect=1.02,
            verdict="no effect larger than ±9.5%",
            effect_ci=Interval(1.02, 0.93, 1.11, 0.6, 8, 0.04, 0.95),
        ),
        Row(
            "baseline+checkpointing",
            "leave-one-in",
            "checkpointing",
            effect=0.76,
            verdict="hurts",
            effect_ci=Interval(0.76, 0.70, 0.84, 0.001, 8, 0.04, 0.95),
        ),
    ]
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
    assert setups == [pytest.approx(3.5 + i, abs=0.01) for i in range(3)]
    assert all(float(j["teardown_s"]) == pytest.approx(2.0, abs=0.01) for j in jobs)
    rows = {r["configuration"]: r for r in read_csv(sweep / "report.csv")}
    assert float(rows["baseline+amp"]["setup_s_median"]) > 0
    md = (sweep / "report.md").read_text()
    assert "Sweep wall time: 100.0 s" in md and "(12% of it in measured steps)" in md
    assert "| measured steps | 12.0 s | 12% |" in md and "| evaluation | 3.0 s | 3% |" in md
    assert "Fixed cost per job (setup before the first step): median 4.5 s, 3.5–5.5 s over 3 jobs." in md


def test_report_cli_bad_input_exits_nonzero_with_one_message(tmp_path):
    def report(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "runner.report", str(folder)], capture_output=True, text=True, timeout=120
        )

    empty = tmp_path / "empty"
    empty.mkdir()
    no_base = write_sweep(tmp_path / "nobase", {k: v for k, v in SYNTHETIC.items() if k != "baseline"})
    for folder, message in (
        (tmp_path / "absent", "is not a folder"),
        (empty, "holds no job folder"),
        (no_base, "no baseline"),
    ):
        proc = report(folder)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_duplicate_jobs_from_two_sweeps_are_refused(tmp_path):
    write_sweep(tmp_path / "a")
    write_sweep(tmp_path / "b")
    with pytest.raises(ReportError, match="appears twice"):
        load_jobs(tmp_path)


@pytest.mark.cli
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
E2E_VARIANTS = [
    "baseline",
    "baseline+amp",
    "baseline+channels_last",
    "baseline+cudnn_benchmark",
    "baseline+big_batch",
    "fast",
    "fast-channels_last",
]


@pytest.mark.slow
@pytest.mark.longest
@pytest.mark.waits  # interleaved slices: half its wall time waits
def test_ablation_sweep_and_report_through_the_cli(tmp_path):
    # the presets set the batch and log_every themselves: keep TINY's out of their way
    tiny = [
        o
        for o in TINY
        if not o.startswith(
            (
                "trainer.log_every",
                "trainer.max_steps",
                "trainer.warmup_steps",
                "dataloader.batch_size",
                "data.train_size",
            )
        )
    ]
    proc = run_cli(
        "-m",
        "+experiment=ablation",
        *tiny,
        "trainer.warmup_steps=2",
        "compile=off",  # compile: minutes
        "interleave.processes=1",
        "interleave.slice_steps=2",
        "interleave.min_passes=2",
        "interleave.max_passes=3",
        # batch 16; baseline+big_batch's 4 x 16 exceeds the 48 training samples and fails: the sweep goes on
        "optimizer.base_batch_size=16",
        "data.train_size=48",
        "ablation/variant=" + ",".join(E2E_VARIANTS),
        cwd=tmp_path,
        timeout=600,
    )
    # baseline+big_batch failed: the sweep goes on, reports, and says so in its exit status
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 job(s) failed (baseline+big_batch/r0)" in proc.stderr
    sweeps = list((tmp_path / "outputs" / "ablation").glob("*/*"))
    assert len(sweeps) == 1
    sweep = sweeps[0]
    for name in ("report.md", "report.csv", "speedup.png", "ablation.json", "interleave.json"):
        assert (sweep / name).is_file(), name
    assert (sweep / "speedup.png").read_bytes()[:8] == PNG_MAGIC

    # amp is bf16 autocast on a CPU with native bf16; on other CPUs the table says it cannot act, so it is not run
    native = hardware.cpu_has_native_bf16()
    not_run = {"baseline+cudnn_benchmark", "baseline+big_batch"} | (set() if native else {"baseline+amp"})
    measured = sorted(p.parent.relative_to(sweep).as_posix() for p in sweep.rglob("summary.json"))
    assert measured == sorted([*(f"{v}/r0" for v in E2E_VARIANTS if v not in not_run), "baseline/r1"])
    s = json.loads((sweep / "baseline+channels_last" / "r0" / "summary.json").read_text())
    assert s["config"]["ablation"]["variant"] == "baseline+channels_last" and s["config"]["ablation"]["repeat"] == 0
    assert s["warmup_steps"] == 2 and s["global_batch_size"] == 16
    assert (sweep / "baseline+big_batch" / "r0" / "failed.json").is_file()
    # a speed measurement keeps no weights: 110 resnet18 jobs with a checkpoint each once filled a disk
    assert not list(sweep.rglob("model.safetensors")) and not list(sweep.rglob("checkpoints"))

    rows = read_csv(sweep / "report.csv")
    by = {r["configuration"]: r for r in rows}
    assert set(by) == set(E2E_VARIANTS)
    speedups = [float(r["speedup"]) for r in rows if r["speedup"]]
    assert speedups == sorted(speedups, reverse=True) and len(speedups) == (5 if native else 4)
    assert by["baseline"]["verdict"] == "reference" and float(by["baseline"]["speedup"]) == 1.0
    assert by["baseline+cudnn_benchmark"]["verdict"].startswith("not run: needs CUDA")
    assert by["baseline+big_batch"]["verdict"].startswith("failed (exit status 2)")
    assert by["baseline+channels_last"]["techniques"] == "channels_last: applied"
    assert by["fast-channels_last"]["techniques"] == "channels_last: applied"
    amp = by["baseline+amp"]
    assert amp["techniques"] == "amp: applied" if native else amp["verdict"].startswith("not run: "), amp
    # every measured row has its paired interval and a verdict from it
    for r in rows:
        if r["speedup"] and r["kind"] != "baseline" and r["verdict"] != "skipped here":
            assert r["design"] == "interleaved" and float(r["speedup_ci_low"]) <= float(r["speedup"]), r
            assert r["verdict"] in ("helps", "hurts", "faster", "slower") or r["verdict"].startswith(
                "no effect larger than"
            ), r
    md = (sweep / "report.md").read_text()
    record = json.loads((sweep / "ablation.json").read_text())
    assert record["command"].startswith("python -m runner -m ") and "+experiment=ablation" in record["command"]
    assert record["command"] in md and record["machine"]["cpu"] in md and record["job_server_start_s"] > 0
    assert "## How this sweep was measured: interleaved" in md and "**Noise (A/A):**" in md

    again = subprocess.run(
        [sys.executable, "-m", "runner.report", str(sweep)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert read_csv(sweep / "report.csv") == rows


def test_report_warns_when_the_machine_was_busy(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {k: SYNTHETIC[k] for k in ("baseline", "baseline+amp")})
    write_report(sweep)
    assert "machine was busy" not in (sweep / "report.md").read_text()
    (sweep / "ablation.json").write_text(
        json.dumps({"command": "c", "machine": {"cpu": "Test CPU", "cpu_cores": 2, "load_average_1min": 3.2}})
    )
    write_report(sweep)
    assert "machine was busy when the sweep started (load average 3.2 on 2 cores)" in (sweep / "report.md").read_text()
    # a job whose own summary recorded a busy machine (runner.measure.machine_load.load_warnings) is counted and quoted
    path = sweep / "baseline+amp" / "r0" / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"warnings": ["runner's threads waited 40 %"]}))
    write_report(sweep)
    assert (
        "1 of 3 measured jobs recorded a busy machine while they measured (summary.json `warnings`; e.g. "
        "baseline+amp r0: runner's threads waited 40 %)"
    ) in (sweep / "report.md").read_text()


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
    assert (
        disagree == []
        and "| cudnn |" not in text
        and text.endswith("for the same reason (the ranking above says why): cudnn.")
    )


@pytest.mark.cli
@pytest.mark.waits  # it waits on the job server and the forked job's warm-up: ~1 s of CPU in 15 s
def test_a_forked_job_starts_its_loader_workers_as_python_m_runner_would(tmp_path):
    """An ablation job forked from the job server starts its DataLoader workers with the parent's start method
    (fork on Linux), not the server's forkserver: on CIFAR-10 with workers this once failed every
    baseline+pinned_workers job (the dataset did not pickle); the dataset now pickles too (spawn, forkserver)."""
    import pickle

    from conftest import TINY_LOOP, make_tiny_cifar
    from runner.compare import Job
    from runner.data.images import cifar10_class

    def forked(cfg, folder: Path) -> dict:
        OmegaConf.resolve(cfg)
        job = Job(folder.name, cfg, folder, None)
        folder.mkdir()
        assert job.start(), job.status  # forked from the job server, its warm-up trained (the workers started)
        job.finish()
        assert job.status == "measured", job.status
        return json.loads((folder / "summary.json").read_text())

    root = tmp_path / "data"
    make_tiny_cifar(root)
    cfg = compose_cfg("data=cifar10", f"data.root={root}", *TINY_LOOP, "dataloader.num_workers=1")
    assert forked(cfg, tmp_path / "job")["steps"] >= 1
    assert pickle.loads(pickle.dumps(cifar10_class()(str(root), train=False))).data.shape == (40, 32, 32, 3)
    # a dataset that cannot pickle at all: its workers start only by the parent's fork, not the server's forkserver
    cfg = compose_cfg(
        "data=custom", "data._target_=user_data.unpicklable", "model=mlp", *TINY_LOOP, "dataloader.num_workers=1"
    )
    assert forked(cfg, tmp_path / "job2")["steps"] >= 1


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda r: r.update(jobs=[]), "jobs is []"),
        (lambda r: r.pop("settings"), "settings is None"),
        (lambda r: r.update(started="x"), "started is 'x'"),
        (lambda r: r["slices"].__setitem__(0, None), "slices[0] is NoneType, not an object"),
        (lambda r: r["slices"][0].update(samples_per_sec=-1.0), "slices[0].samples_per_sec is -1.0"),
        (lambda r: r["slices"][0].update(samples_per_sec=float("inf")), "slices[0].samples_per_sec is inf"),
        (lambda r: r["slices"][0].update(job="ghost"), "slices[0].job 'ghost' is not in jobs"),
        (lambda r: r["jobs"]["baseline/r0"].update(group="x"), "jobs.baseline/r0.group is 'x'"),
        (lambda r: r["settings"].update(confidence=2), "settings.confidence is 2"),
    ],
)
def test_a_damaged_interleave_record_is_one_line_naming_the_key(tmp_path, capsys, damage, named):
    """``interleave.json`` is read by every report; one not written by the conductor (edited, or another tool's)
    is refused before any reader indexes it: one ``error:`` line naming the file and the key, status 2."""
    from runner.report.__main__ import main

    sweep = write_sweep(tmp_path / "sweep")
    record = json.loads((sweep / "interleave.json").read_text())
    damage(record)
    (sweep / "interleave.json").write_text(json.dumps(record))
    assert main([str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: {sweep / 'interleave.json'} is not a record runner's conductor wrote: {named}; run the sweep again"
    ), err
