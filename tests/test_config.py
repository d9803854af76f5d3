"""Config groups: every option of every group composes against its schema and its components build.

Typos and wrong types, on the command line or inside a YAML option, fail at compose time with Hydra's
own message (the dataclass schemas in ``runner/config/``); cross-key rules fail in ``validate``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import TINY_GPT, compose_cfg, make_tiny_cifar, make_tiny_imagefolder, make_tiny_text, run_cli
from runner import REPO_ROOT, data as data_mod, distributed, models
from runner.config import CHOICES, GROUP_SCHEMAS
from runner.data import tokens
from runner.engine.train import train, validate
from runner.errors import ConfigError
from runner.measure import hardware
from runner.techniques import precision, prepare, variants

CONF = REPO_ROOT / "conf"
# every option file of every group, nested groups too (ablation/variant); hydra/ holds Hydra's own groups
OPTIONS = sorted(
    (p.parent.relative_to(CONF).as_posix(), p.stem)
    for p in CONF.rglob("*.yaml")
    if p.parent != CONF and p.relative_to(CONF).parts[0] != "hydra"
)
#: and the ablation's variants generated from the technique table (tests/test_ablation.py composes each)
GENERATED = sorted(("ablation/variant", name) for name in variants.generate())
GROUPS = sorted({g for g, _ in OPTIONS})
# presets that set several groups at once; not in config.yaml's defaults list, so they are added with "+"
PRESETS = ("experiment", "ablation/variant")


def override(group: str, option: str) -> str:
    return f"+{group}={option}" if group in PRESETS else f"{group}={option}"


def test_every_group_is_found():
    assert set(GROUP_SCHEMAS) <= set(GROUPS), "a schema group has no option in conf/"
    assert {
        "model",
        "data",
        "optimizer",
        "scheduler",
        "precision",
        "dataloader",
        "distributed",
        "memory",
        "logger",
    } <= {g for g, _ in OPTIONS}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_against_its_schema(group, option):
    cfg = compose_cfg(override(group, option), tiny=False)
    assert OmegaConf.missing_keys(cfg) == set()
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group in GROUP_SCHEMAS:
        # the option extends base_<group>: typed, so a typo or a wrong type cannot slip through
        assert issubclass(OmegaConf.get_type(cfg[group]), GROUP_SCHEMAS[group]), OmegaConf.get_type(cfg[group])


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    """Tiny CIFAR-format and ImageFolder sets, and a copy of the embedded MNIST archives."""
    base = tmp_path_factory.mktemp("data")
    raw = base / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    return {
        "cifar10": make_tiny_cifar(base / "cifar"),
        "imagefolder": make_tiny_imagefolder(base / "images"),
        "mnist": base / "mnist",
        "text": make_tiny_text(base / "text.txt"),
    }


DATA_OVERRIDES = {
    "cifar10": lambda r: [f"data.root={r['cifar10']}"],
    "imagefolder": lambda r: [f"data.root={r['imagefolder']}", "data.image_size=16"],
    "mnist": lambda r: [f"data.root={r['mnist']}"],
    # tests/user_data.py, importable like a user's module (compose_cfg leaves TINY's synthetic-only keys out)
    "custom": lambda r: ["data._target_=user_data.tabular", "model=mlp"],
}
# options that only work together (a language model needs token data and a model of tokens), and the model-parallel
# layouts (they split a model by its plan: runner's GPT has one, the default MnistCNN none): a tiny GPT
LANGUAGE_MODEL = {
    ("task", "language_model"),
    ("model", "gpt"),
    ("data", "text"),
    ("distributed", "tp"),
    ("distributed", "pp"),
}
# Built by a one-step job below, except: compile (torch.compile would compile for minutes on a CPU;
# the wrapper is built instead), the loggers but none (runs of their own in test_wandb.py and test_loggers.py, which
# read each back), the presets (combinations of the options built here, trained by their own tests) and the recipe
# searches (hparams_search: a sweeper's settings on the global package, run by tests/test_search.py).
NOT_BUILT = ("compile", "logger", "hparams_search", *PRESETS)
BUILD = [(g, o) for g, o in OPTIONS if g not in NOT_BUILT and (g, o) != ("memory", "budget")] + [("logger", "none")]


@pytest.mark.parametrize("group,option", BUILD, ids=[f"{g}={o}" for g, o in BUILD])
@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_option_builds_and_trains_one_step(group, option, roots, tmp_path):
    extra = DATA_OVERRIDES.get(option, lambda r: [])(roots) if group == "data" else []
    if (group, option) in LANGUAGE_MODEL:
        extra = [*TINY_GPT, f"data.path={roots['text']}"]
    if (group, option) == ("data", "tokens"):  # the tiny GPT on token files written from the same text
        bins = tokens.prepare(roots["text"], tmp_path / "bins")
        extra = [
            *(o for o in TINY_GPT if o != "data=text"),
            f"data.train_path={bins['train_path']}",
            f"data.val_path={bins['val_path']}",
            f"data.vocab_size={bins['vocab_size']}",
        ]
    if (group, option) == ("task", "regression"):  # float targets: tests/user_data.py's regression, runner's MLP
        extra = ["data=custom", "data._target_=user_data.regression", "model=mlp"]
    if (group, option) == ("model", "hf_causal_lm"):  # TINY_GPT's sizes are GPT2Config's names too
        pytest.importorskip("transformers")
        extra = [*(o for o in TINY_GPT if o != "model=gpt"), f"data.path={roots['text']}"]
    steps = 12 if group == "scheduler" else 1  # cosine's warm-up (10 steps) must fit in the run
    cfg = compose_cfg(
        override(group, option),
        *extra,
        f"trainer.max_steps={steps}",
        "trainer.warmup_steps=0",
        "trainer.log_every=1",
        "trainer.eval_max_batches=1",
    )
    summary = train(cfg, job_dir=tmp_path)
    assert summary["steps"] == steps and summary["train_loss"] == summary["train_loss"]  # not NaN
    assert all(v == "applied" or v.startswith("skipped: ") for v in summary["techniques"].values())
    if group == "ema":  # options on the global package (trainer.ema_*): the EMA is there, or not
        assert summary["techniques"].get("ema") == ("applied" if option == "on" else None), summary["techniques"]
        assert summary["config"]["trainer"]["target_weights"] == ("ema" if option == "on" else "model")
    else:
        assert summary["config"][group] == OmegaConf.to_container(cfg[group], resolve=True)


@pytest.mark.parametrize("option", [p.stem for p in sorted((CONF / "compile").glob("*.yaml"))])
def test_compile_option_builds(option):
    cfg = compose_cfg(f"compile={option}")
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    amp = precision.build(cfg.precision, env.device)
    model, techniques, _ = prepare.prepare(models.build(cfg.model, {"num_classes": 10}, 3), cfg, env, amp)
    assert all(v == "applied" or v.startswith("skipped: ") for v in techniques.values())
    assert (cfg.compile.mode is None) == ("compile" not in techniques)


def test_memory_budget_option_builds_with_compile():
    """memory=budget acts in torch.compile's partitioner: built here with compile=default (training it would compile,
    as the compile options above are not trained); the process-wide budget is put back after."""
    cfg = compose_cfg("memory=budget", "compile=default")
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    amp = precision.build(cfg.precision, env.device)
    try:
        _, techniques, _ = prepare.prepare(models.build(cfg.model, {"num_classes": 10}, 3), cfg, env, amp)
        assert techniques["activation_memory_budget"] == "applied" and techniques["compile"] == "applied"
    finally:
        prepare.apply_memory_budget(None, "default")


def test_amp_and_pinned_run_here_with_cuda_parts_skipped(tmp_path):
    """Done-when: ``precision=amp dataloader=pinned`` runs on a CPU; CUDA-only parts say why they were skipped."""
    summary = train(compose_cfg("precision=amp", "dataloader=pinned", "dataloader.num_workers=1"), job_dir=tmp_path)
    t = summary["techniques"]
    assert summary["steps"] == 4
    assert t["pin_memory"].startswith("skipped: ") and t["non_blocking"].startswith("skipped: ")
    if hardware.cpu_has_native_bf16():  # amp on a CPU is bf16 autocast, only where the CPU computes bf16 natively
        assert t["amp"] == "applied"
    else:
        assert t["amp"].startswith("skipped: ") and "native bf16" in t["amp"], t["amp"]


def test_overrides_may_follow_config_dir_as_the_tuners_printed_line_has_them(tmp_path):
    """``python -m runner '+experiment=tuned' --config-dir DIR trainer.log_every=3``: Hydra's argparse took overrides
    only before or after all its options and stopped on "unrecognized arguments"; runner puts the options first."""
    from conftest import run_here

    (tmp_path / "preset" / "experiment").mkdir(parents=True)
    (tmp_path / "preset" / "experiment" / "tuned.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\n")
    proc = run_here(
        "+experiment=tuned",
        "--config-dir",
        str(tmp_path / "preset"),
        "trainer.log_every=3",
        "--cfg",
        "job",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max_steps: 7" in proc.stdout and "log_every: 3" in proc.stdout


def test_help_lists_every_option_and_no_schema(tmp_path):
    """``--help`` lists each group with exactly its YAML options: the ``base_*`` schemas that the options
    extend (ConfigStore entries) are not choices and are left out."""
    proc = run_cli("--help", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split("== Config groups ==")[1].split("== Config ==")[0]
    assert "base_" not in listed
    groups = dict(line.split(": ", 1) for line in listed.splitlines() if ": " in line)
    assert groups == {g: ", ".join(sorted(o for gg, o in OPTIONS + GENERATED if gg == g)) for g in GROUPS}
    assert "model:\n  _target_: runner.models.MnistCNN" in proc.stdout  # the composed config follows


# -------------------------------------------------------------------------------- compose-time errors


@pytest.mark.parametrize(
    "bad,message",
    [
        ("trainer.max_step=3", "Could not override 'trainer.max_step'"),
        ("optimizer.lrr=0.1", "Could not override 'optimizer.lrr'"),
        ("dataloader.batch_size=abc", "Error merging override dataloader.batch_size=abc"),
        ("trainer.target_accuracy=high", "Error merging override trainer.target_accuracy=high"),
        ("model=foo", "Could not find 'model/foo'"),
    ],
)
def test_bad_override_fails_at_compose(bad, message):
    with pytest.raises(ConfigCompositionException, match=message) as info:
        compose_cfg(bad)
    if "Error merging" in message:  # the cause names the key and the expected type
        assert "could not be converted" in str(info.value.__cause__)


@pytest.fixture
def conf_copy(tmp_path) -> Path:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    return conf


@pytest.mark.parametrize(
    "body,message",
    [
        ("lrr: 0.1\n", "Key 'lrr' not in 'SGDConfig'"),
        ("lr: fast\n", "Value 'fast' of type 'str' could not be converted to Float"),
    ],
)
def test_bad_yaml_option_fails_at_compose(conf_copy, body, message):
    (conf_copy / "optimizer" / "typo.yaml").write_text("defaults: [base_sgd, _self_]\n" + body)
    with initialize_config_dir(config_dir=str(conf_copy), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as info:
            compose(config_name="config", overrides=["optimizer=typo"])
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    assert message in "\n".join(chain)


@pytest.mark.parametrize(
    "bad",
    [
        "dataloader.batch_size=0",
        "memory.accumulate_steps=0",
        "trainer.max_epochs=0",
        "trainer.max_steps=0",
        "trainer.warmup_steps=-1",
        "trainer.log_every=0",
        "trainer.eval_every=0",
        "trainer.target_accuracy=0",
        "trainer.target_accuracy=1.5",
        "trainer.progress=fancy",
        "optimizer.clip_grad_norm=0",
    ],
)
def test_validate_names_the_key(bad):
    key, value = bad.split("=")
    with pytest.raises(ConfigError, match=f"^{key}={value}"):
        validate(compose_cfg(bad))


def test_a_compiled_optimizer_step_with_foreach_kernels_is_refused_before_anything_runs():
    """torch's foreach kernels refuse the compiled step's tensor LR ("lr as a Tensor is not supported for
    capturable=False and foreach=True", raised inside dynamo at the first step); the default and fused take it."""
    with pytest.raises(ConfigError, match="^optimizer.impl=foreach cannot run with compile.optimizer=true"):
        validate(compose_cfg("compile.optimizer=true", "optimizer.impl=foreach"))
    for impl in ("null", "fused"):
        validate(compose_cfg("compile.optimizer=true", f"optimizer.impl={impl}"))


def test_validate_accepts_the_defaults():
    validate(compose_cfg(tiny=False))


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_option_list_is_checked_once_before_anything_is_built(key):
    cfg = compose_cfg()
    OmegaConf.update(cfg, key, "nonsense", force_add=False)
    allowed = ", ".join(c for c in CHOICES[key] if c is not None)
    with pytest.raises(ConfigError, match=f"^{key}=nonsense is not one of {allowed}"):
        validate(cfg)


def test_the_data_option_list_is_what_the_builder_knows():
    assert set(CHOICES["data.name"]) == {*data_mod.IMAGE_DATASETS, "text", "tokens", "custom"}


def _schema_of(option: dict):
    """The schema an option file extends (its ``base_<name>`` default), from runner.config's registry."""
    from runner.config import OPTION_SCHEMAS

    for entry in option.get("defaults", []):
        name = entry.removeprefix("base_") if isinstance(entry, str) and entry.startswith("base_") else None
        if name in GROUP_SCHEMAS:
            return GROUP_SCHEMAS[name]
        for named in OPTION_SCHEMAS.values():
            if name in named:
                return named[name]
    return None


def test_yaml_options_set_only_what_differs_from_their_schema():
    """A group option (conf/<group>/<option>.yaml) and conf/config.yaml hold only values that differ from the
    schema's defaults in runner/config/: a default lives in one place, so changing it cannot leave a stale
    copy behind."""
    import yaml

    from runner.config import RunnerConfig

    def same(values: dict, defaults: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in values.items():
            if key == "defaults" or key not in defaults:
                continue
            if isinstance(value, dict) and isinstance(defaults[key], dict):
                out += same(value, defaults[key], f"{prefix}{key}.")
            elif value == defaults[key]:
                out.append(f"{prefix}{key}={value!r}")
        return out

    found = {}
    for group in GROUP_SCHEMAS:
        if group == "logger":  # its options fill the nodes logger.<name> (@package), typed by LoggerConfig's fields
            continue
        for path in sorted((REPO_ROOT / "conf" / group).glob("*.yaml")):
            option = yaml.safe_load(path.read_text()) or {}
            schema = _schema_of(option)
            assert schema is not None, f"{path} extends no base_<schema>"
            found[f"{group}/{path.name}"] = same(option, OmegaConf.to_container(OmegaConf.structured(schema)))
    root = yaml.safe_load((REPO_ROOT / "conf" / "config.yaml").read_text())
    found["config.yaml"] = same(root, OmegaConf.to_container(OmegaConf.structured(RunnerConfig)))
    assert not {k: v for k, v in found.items() if v}, "drop these keys (the schema already says so)"
    assert len(found) > 30  # every group's options were read


def test_the_schemas_are_stored_once_and_again_when_the_store_lost_them():
    """``variants.register`` (called by every ``variants.compose``) leaves the stored schemas alone while the
    ConfigStore holds them, and stores them again where an entry was dropped: compose still validates against them."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    variants.register()
    schema, variant = store.repo["config_schema.yaml"], store.repo["ablation"]["variant"]["baseline+amp.yaml"]
    variants.compose([])  # not conftest's compose_cfg: it keeps what it composed
    assert store.repo["config_schema.yaml"] is schema  # nothing built again
    assert store.repo["ablation"]["variant"]["baseline+amp.yaml"] is variant
    del store.repo["config_schema.yaml"]
    cfg = variants.compose(["dataloader.batch_size=8"])
    assert store.repo["config_schema.yaml"] is not schema and cfg.dataloader.batch_size == 8
    with pytest.raises(ConfigCompositionException):  # the schema is back: a misspelt key fails
        variants.compose(["trainer.max_stepz=3"])


def test_a_copy_of_hydra_s_config_repository_shares_the_config_store():
    """Hydra 1.3 deep-copies its config repository for every compose and every group listing (``--help``: 215); the
    ConfigStore in it, runner's schemas and variants, is shared rather than copied (``variants._share_the_store``).
    A config stored after the copy is found through it, and listing the groups is one repository's work."""
    import copy

    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    variants.register()
    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        repository = copy.deepcopy(GlobalHydra.instance().config_loader().repository)  # as each compose copies it
        store.store(group="model", name="stored_after_the_copy", node={"_target_": "runner.models.MLP"})
        try:
            assert "stored_after_the_copy" in repository.get_group_options("model", ObjectType.CONFIG)
        finally:
            del store.repo["model"]["stored_after_the_copy.yaml"]
