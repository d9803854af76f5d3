"""runner/techniques/ is the one place a technique is named: the ablation's variants, the speed tuner's
candidates, the doctor's suggestions, the task's image-only skips and the README's switch table are checked
against it here (or read from it), so a technique renamed or switched differently in one place fails."""

from __future__ import annotations

import copy
import functools
import re
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_GPT, compose_cfg
from runner import REPO_ROOT
from runner.techniques import TECHNIQUES, WHERE, by_variant, variants

VARIANTS = sorted(
    {p.stem for p in (REPO_ROOT / "conf" / "ablation" / "variant").glob("*.yaml")} | set(variants.generate())
)
#: Variants that are not one technique: recipe changes (4x the batch, the LR scaled linearly or by the square root)
#: and the fast preset's whole data loading (on-device data, or workers and pinned memory, whichever the hardware gets)
NOT_ONE_TECHNIQUE = {"big_batch", "big_batch_sqrt", "data_loading"}


#: the variants of the techniques that act on token ids only: composed on the GPT (their keys are a language model's)
TOKENS = {t.variant for t in TECHNIQUES.values() if t.where == "tokens" and t.variant}


def variant_cfg(name: str, gpt: bool = False):
    # trainer.device=cuda: the hardware-aware presets resolve their CUDA branch without a GPU
    experiment = "+experiment=[shakespeare_char,ablation]" if gpt else "+experiment=ablation"
    return compose_cfg(experiment, f"ablation/variant={name}", "trainer.device=cuda", tiny=False)


def test_every_entry_is_well_formed():
    for name, t in TECHNIQUES.items():
        assert t.name == name and t.where in WHERE and t.on and t.source, name
        assert all(o.count("=") == 1 for o in t.overrides), (name, t.overrides)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("baseline", "fast")])
def test_every_ablation_variant_switches_its_technique_as_the_table_says(variant):
    """A leave-one-in variant has its technique on where the baseline has it off; a leave-one-out variant has it off
    where the fast preset has it on. The variant names its technique by the table's ``variant`` name."""
    gpt = variant.split("+")[-1] in TOKENS
    cfg = variant_cfg(variant, gpt)
    named = cfg.ablation.technique
    if named in NOT_ONE_TECHNIQUE:
        return
    technique = by_variant(named)
    assert technique is not None, f"{variant}: ablation.technique={named} is not a technique of runner/techniques/"
    if cfg.ablation.kind == "leave-one-in":
        assert technique.is_on(cfg) and not technique.is_on(variant_cfg("baseline", gpt)), variant
    else:
        assert not technique.is_on(cfg) and technique.is_on(variant_cfg("fast", gpt)), variant


def test_the_speed_tuners_candidates_are_the_tables():
    """Every built-in candidate is a technique of the table, switched as the table says, or one of the few
    candidates that are not one technique (``TUNER_ONLY``)."""
    from runner.tune.switches import TUNER_ONLY, switches

    cfg = compose_cfg("precision=fp32", "compile=off", "optimizer=adamw", "trainer.log_every=1", "dataloader=default")
    OmegaConf.set_struct(cfg, False)
    offered, notes = switches(cfg, torch.device("cpu"), allow="recipe")
    named = {s.name for s in offered} | {n.split(":")[0] for n in notes}
    assert named - set(TECHNIQUES) <= set(TUNER_ONLY), named - set(TECHNIQUES)
    assert {t.name for t in TECHNIQUES.values() if t.tuner} <= named  # none of the table's candidates is lost
    for s in offered:
        if s.name in TECHNIQUES:
            t = TECHNIQUES[s.name]
            assert s.changes == t.changes() and s.arithmetic == t.arithmetic and s.group == t.group, s.name


def test_a_language_model_skips_exactly_the_image_techniques():
    from runner import task as task_mod

    cfg = compose_cfg(
        "task=language_model",
        "model=gpt",
        "data=text",
        "channels_last=true",
        "cudnn_benchmark=true",
        "model.drop_bias_before_bn=true",
        "data.normalize=true",
        "data.augment=true",
        tiny=False,
    )
    OmegaConf.set_struct(cfg, False)
    for t in TECHNIQUES.values():  # every image technique switched on, wherever its key lives in this config
        if t.where.startswith("image"):
            for key, value in t.changes().items():
                OmegaConf.update(cfg, key, value, force_add=True)
    skipped = task_mod.build(cfg.task).skipped(cfg)
    expected = {(t.statuses or (t.name,))[0] for t in TECHNIQUES.values() if t.where.startswith("image")}
    assert set(skipped) == expected and all(v.startswith("skipped: ") for v in skipped.values())


def test_the_doctor_suggests_a_technique_as_the_table_switches_it():
    from runner.doctor import diagnose

    summary = {
        "data_wait_fraction": 0.5,
        "device": "cuda",
        "steps": 10,
        "samples_per_sec": 100.0,
        "machine_load": {"cpu_cores": 8},
    }
    config = {
        "data": {"name": "synthetic"},
        "dataloader": {"num_workers": 0, "pin_memory": False, "on_device": False},
        "compile": {"mode": None},
    }
    findings = diagnose(summary, config, [])
    suggested = [s.overrides for f in findings for s in f.suggestions]
    assert TECHNIQUES["pinned_memory"].overrides in suggested and TECHNIQUES["on_device_data"].overrides in suggested
    config["dataloader"] |= {"pin_memory": True, "non_blocking": True}
    assert TECHNIQUES["pinned_memory"].overrides not in [
        s.overrides for f in diagnose(summary, config, []) for s in f.suggestions
    ]


def test_the_readme_switch_table_has_a_row_for_each_technique_that_says_how_to_switch_it():
    rows = {}
    for line in (Path(REPO_ROOT) / "README.md").read_text().splitlines():
        m = re.match(r"\| (\w+) \| (.+?) \| ", line)
        if m:
            rows[m[1]] = m[2]
    for t in TECHNIQUES.values():
        if t.readme is None:
            continue
        assert t.readme in rows, f"{t.name}: README switch-table row {t.readme} is missing"
        cell = rows[t.readme]
        first = t.overrides[0]
        key, value = first.split("=")
        assert key.split(".")[-1] in cell or key.split("/")[-1] in cell, (t.name, first, cell)
        assert value in ("true", "false") or value in cell or value.isdigit(), (t.name, first, cell)


def test_the_table_decides_where_a_technique_acts_for_the_loader_the_tuner_and_the_ablation(tmp_path):
    """``Technique.why_not`` is the one decision: on a CPU job the loader records pinned memory as skipped, the
    speed tuner leaves cuDNN autotuning out and the ablation does not run its variant, each with the table's words."""
    from conftest import run_tiny
    from runner.sweeps.ablation import not_run
    from runner.techniques import Job
    from runner.tune.switches import switches

    cpu, gpu = Job(compose_cfg()), Job(compose_cfg(), cuda=True, capability=(9, 0), native_bf16=True)
    pinned, cudnn = TECHNIQUES["pinned_memory"].why_not(cpu), TECHNIQUES["cudnn_benchmark"].why_not(cpu)
    assert pinned and cudnn and TECHNIQUES["cudnn_benchmark"].why_not(gpu) is None
    assert (
        TECHNIQUES["channels_last"].why_not(Job(compose_cfg("+experiment=shakespeare_char", tiny=False)))
        == "an image technique; the inputs are token ids"
    )
    summary = run_tiny(tmp_path / "job", "dataloader.pin_memory=true")
    assert summary["techniques"]["pin_memory"] == f"skipped: {pinned}"
    _, notes = switches(compose_cfg(), torch.device("cpu"))
    assert f"cudnn_benchmark: not a candidate ({cudnn})" in notes
    reason = not_run(compose_cfg("+experiment=ablation", "ablation/variant=baseline+cudnn_benchmark"), tmp_path)
    assert reason.startswith(f"needs CUDA ({cudnn})")


@functools.cache
def _job_of_kind(kind: str):
    """A tiny job on the CPU with image or token inputs: its composed config and its overrides."""
    text = Path(tempfile.mkdtemp()) / "input.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    job = [
        *([] if kind == "image" else [*TINY_GPT, f"data.path={text}"]),
        "trainer.device=cpu",
        "trainer.max_steps=12",
    ]  # 12: a schedule's warm-up fits
    return compose_cfg(*job), job


@pytest.mark.parametrize("name", sorted(TECHNIQUES))
def test_every_technique_acts_where_the_table_says_and_is_skipped_where_it_says_why_not(name, tmp_path):
    """Each technique switched on in a tiny image job and a tiny language-model job on the CPU, built: where
    ``why_not`` of the job is None its builder records it applied (or nothing: a recipe or loop setting); else no
    builder applies it (it records why, or refuses the combination with a ConfigError). So a builder, the tuner, the
    ablation and the doctor cannot disagree about where it acts."""
    from runner import distributed
    from runner.engine.build import build_parts
    from runner.errors import ConfigError
    from runner.techniques import Job

    t = TECHNIQUES[name]
    model_level = {("int8", "image")}  # what only the model tells: the tiny CNN's one Linear layer is its head
    for kind in ("image", "tokens"):
        base, job = _job_of_kind(kind)
        why = t.why_not(Job.of(base, "cpu"))
        if t.command:  # a group option: composed
            cfg = compose_cfg(*job, *t.overrides)
        else:  # its keys set on the job, as the speed tuner does
            cfg = copy.deepcopy(base)
            for key, value in t.changes().items():
                OmegaConf.update(cfg, key, value, merge=False)
        try:
            parts, _ = build_parts(cfg, distributed.setup(cfg.distributed, "cpu"), tmp_path / kind)
        except ConfigError as e:
            assert why is not None, (kind, str(e))
            continue
        status = {k: parts.techniques.get(k) for k in t.statuses or (t.name,)}
        if why is None:
            first = status[(t.statuses or (t.name,))[0]]
            assert first in ("applied", None) or (name, kind) in model_level, (kind, status)
        else:
            assert "applied" not in status.values(), (kind, why, status)


#: Where a module outside the table would be deciding where a technique acts: the device features it probes
#: and the data sets kept in memory (runner/techniques/__init__.py's needs read them)
PROBES = re.compile(
    r"get_device_capability|is_bf16_supported|cpu_has_native_bf16|IN_MEMORY_DATA|\.where\b|"
    r"device\.type\s*[!=]=|\bcuda\s+and\b|\bnot\s+cuda\b"
)


def test_no_tool_decides_where_a_technique_acts_but_the_table():
    """The speed tuner's candidates, the doctor's suggestions and the ablation's variants ask ``why_not``: none of
    their modules probes the device or the data for a technique itself (the doctor's own measurements, GPU idle time
    and the memory of the device, are not a technique's: its ``cuda`` flag is read only through the ``Job``)."""
    root = REPO_ROOT / "runner"
    found = []
    deciders = [
        "tune/switches.py",
        "tune/dataloader.py",
        "doctor/diagnosis.py",
        "doctor/verify.py",
        "sweeps/ablation.py",
    ]
    for path in (root / name for name in deciders):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if PROBES.search(code) and "job.cuda" not in code:
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_language_models_tips_are_the_tuners_candidates_on_the_gpt_and_noted_elsewhere():
    """The chunked loss acts on token inputs (``where="tokens"``) of a model whose forward takes the targets (runner's
    GPT); the compiled optimizer step on any job. Selective checkpointing recomputes to save memory: a speed
    candidate only where the micro-batch may grow."""
    from runner.tune.switches import switches

    def names(*overrides, allow="speed"):
        cfg = compose_cfg(*overrides, tiny=False)
        OmegaConf.set_struct(cfg, False)
        offered, notes = switches(cfg, torch.device("cpu"), allow)
        return {s.name for s in offered}, {n.split(":")[0]: n for n in notes}

    gpt, notes = names("+experiment=shakespeare_char")
    assert {"chunked_loss", "compiled_optimizer_step"} <= gpt and "selective_checkpointing" not in gpt
    assert "tune.allow=recipe" in notes["selective_checkpointing"]
    gpt, _ = names("+experiment=shakespeare_char", allow="recipe")
    assert {"selective_checkpointing", "chunked_loss", "compiled_optimizer_step", "batch_x2"} <= gpt
    image, notes = names()
    assert "compiled_optimizer_step" in image and not {"selective_checkpointing", "chunked_loss"} & image
    assert "a language-model technique; the inputs are not token ids" in notes["chunked_loss"]


def test_the_ablation_runs_the_language_models_tips_where_they_act(tmp_path):
    """On the GPT, baseline+selective and baseline+chunked_loss run; on a causal LM whose forward takes no targets
    the chunked loss is recorded as not run with the table's reason; the compiled optimizer step runs on images."""
    from runner.sweeps.ablation import not_run

    def why(*overrides):
        cfg = compose_cfg(*overrides, tiny=False)
        return not_run(cfg, tmp_path)

    gpt = "+experiment=[shakespeare_char,ablation]"
    assert why(gpt, "ablation/variant=baseline+selective") is None
    assert why(gpt, "ablation/variant=baseline+chunked_loss") is None
    assert why("+experiment=ablation", "ablation/variant=baseline+compiled_optimizer") is None
    reason = why(gpt, "ablation/variant=baseline+chunked_loss", "model=hf_causal_lm")
    assert (
        reason == "does not act on this job (the model's forward takes no targets to chunk the loss over "
        "(runner's GPT does))"
    )
    assert (tmp_path / "not_run.json").is_file()
