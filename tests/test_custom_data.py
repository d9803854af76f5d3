"""``data=custom``: the user's own dataset function, from the README's example to every bad input.

The README's tabular example runs through the real CLI with its ``my_data.py`` written outside the package
(into ``tmp_path``, the folder the command runs from; only the checkout on PYTHONPATH). The rest runs ``train()`` or
``data.build`` in-process on the functions of ``tests/user_data.py``.
"""

from __future__ import annotations

import re
import shlex
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import TINY, compose_cfg, job_dirs, read_summary, run_cli
from runner import REPO_ROOT, data as data_mod
from runner.data import OnDeviceLoader
from runner.distributed import setup
from runner.engine.train import train
from runner.errors import ConfigError

#: TINY without its synthetic-data keys: on data=custom they would be arguments of the user's function
LOOP = [o for o in TINY if not o.startswith(("data=", "data."))]


def custom(*overrides: str, target: str = "user_data.tabular"):
    """A tiny CPU job on ``data=custom data._target_=<target>`` with runner's MLP."""
    return compose_cfg(
        *LOOP, "data=custom", f"data._target_={target}", "model=mlp", "model.hidden=16", *overrides, tiny=False
    )


def build(*overrides: str, target: str = "user_data.tabular", env=None):
    cfg = custom(*overrides, target=target)
    return data_mod.build(cfg.data, cfg.dataloader, env or setup(cfg.distributed, "cpu"), seed=0)


# ------------------------------------------------------------------------------ the README example


def readme_example() -> tuple[str, list[str]]:
    """The README's ``my_data.py`` (the python block starting ``# my_data.py``) and the overrides of the
    command in the next bash block."""
    text = (REPO_ROOT / "README.md").read_text()
    found = re.search(r"```python\n(# my_data\.py.*?)```", text, re.S)
    block = re.search(r"```bash\n(.*?)```", text[found.end() :], re.S).group(1)
    (command,) = [line for line in block.splitlines() if line.startswith("python -m runner data=custom")]
    return found.group(1), shlex.split(command, comments=True)[3:]


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_readme_tabular_example_through_the_cli(tmp_path):
    """Done-when: a dataset module outside the package trains through the CLI, with an MLP whose width
    comes from the command line; accuracy far above chance (1 / n_classes)."""
    module, overrides = readme_example()
    (tmp_path / "my_data.py").write_text(module)
    assert "data.n_classes=4" in overrides and "model.hidden=128" in overrides
    # PYTHONPATH holds only the checkout (run_cli): my_data is found because the command runs from tmp_path
    proc = run_cli(*overrides, "logger=none", "trainer.progress=off", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    summary = read_summary(job)
    chance = 1 / 4
    assert summary["eval_accuracy"] > 0.7 > 2 * chance, summary["eval_accuracy"]
    assert summary["config"]["data"]["n_features"] == 20 and summary["config"]["model"]["hidden"] == 128
    assert summary["steps"] == 2 * (8000 // 64)
    assert summary["flops_per_sample"] > 0  # counted on the real input shape (20,)


@pytest.mark.cli
def test_module_in_the_run_folder_not_found_elsewhere(tmp_path):
    """The module is found only where the user runs from; elsewhere one error line names that folder."""
    module, overrides = readme_example()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "my_data.py").write_text(module)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(
        *LOOP, *[o for o in overrides if o.startswith(("data", "model"))], cwd=elsewhere, env={"HYDRA_FULL_ERROR": "0"}
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "data._target_='my_data.tabular' cannot be imported" in line
    assert str(elsewhere) in line and "PYTHONPATH" in line
    assert list((elsewhere / "outputs").rglob("summary.json")) == []


# ------------------------------------------------------------------------------ what runner does with it


def test_tensor_dataset_trains_and_goes_on_device(spy, tmp_path):
    summary = train(
        custom("dataloader=device", "trainer.max_steps=16", "optimizer=adamw", "optimizer.lr=0.01"), job_dir=tmp_path
    )
    data = spy.datas[-1]
    assert summary["techniques"]["on_device_data"] == "applied"
    assert isinstance(data.train.batches, OnDeviceLoader)
    assert (data.num_classes, data.sample_shape, data.in_channels, data.train_samples) == (3, (8,), 8, 256)
    x, y = next(iter(data.train))
    assert x.dtype == torch.float32 and x.shape == (16, 8) and y.dtype == torch.int64  # stored as they are
    assert spy.model.blocks[0][0].in_features == 8 and spy.model.head.out_features == 3  # in_features filled in
    assert summary["eval_accuracy"] > 0.9  # well-separated clusters


def test_rows_dataset_skips_on_device_and_uses_the_dataloader(spy, tmp_path):
    summary = train(
        custom("dataloader=device", "data.n_features=6", "data.classes=[a,b,c,d]", target="user_data.rows"),
        job_dir=tmp_path,
    )
    t = summary["techniques"]
    assert t["on_device_data"].startswith("skipped: a Rows cannot be held as whole tensors")
    data = spy.datas[-1]
    assert isinstance(data.train.batches, torch.utils.data.DataLoader)
    assert data.num_classes == 4  # the classes attribute (4 names), not max(target) + 1 = 3
    x, y = next(iter(data.train))
    assert x.shape == (16, 6) and y.dtype == torch.int64  # numpy rows and int targets, collated


def test_image_only_switches_are_skipped_with_the_reason(tmp_path):
    summary = train(custom("data.normalize=true", "data.augment=true", "channels_last=true"), job_dir=tmp_path)
    t = summary["techniques"]
    assert t["normalize"].startswith("skipped: data=custom") and t["augment"].startswith("skipped: data=custom")
    assert t["channels_last"].startswith("skipped: ")
    assert summary["steps"] == 4


def test_loader_techniques_apply_to_custom_data():
    data = build("dataloader=pinned", "dataloader.num_workers=1")
    assert data.techniques["num_workers"] == "applied"
    assert data.techniques["pin_memory"].startswith("skipped: ")  # no CUDA here
    assert data.train.batches.num_workers == 1 and len(list(data.train)) == 256 // 16
    # two ranks: each gets a DistributedSampler over half of the set
    env = SimpleNamespace(device=torch.device("cpu"), rank=1, world_size=2)
    two = build(env=env)
    sampler = two.train.batches.sampler.sampler  # inside the SkippableSampler that lets a resumed run skip ahead
    assert isinstance(sampler, DistributedSampler) and sampler.rank == 1
    assert len(two.train) == 256 // 2 // 16


def test_subset_of_a_tensor_dataset_goes_on_device():
    data = build("dataloader=device", target="user_data.split")
    assert data.techniques["on_device_data"] == "applied" and data.train_samples == 256


@pytest.mark.parametrize(
    "overrides,target,expected",
    [
        ([], "user_data.tabular", 3),  # max(target) + 1 over TensorDataset targets
        (["data.num_classes=5"], "user_data.tabular", 5),  # explicit wins (more classes than seen is allowed)
        ([], "user_data.labelled_subsets", 3),  # Subsets of a dataset with a `targets` attribute
        (["data.classes=[x,y,z,w,v]"], "user_data.rows", 5),  # a classes attribute
        (["data.num_classes=4"], "user_data.takes_num_classes", 4),  # passed to the function, which makes 4
        (["data.n_classes=2", "data.anything=1"], "user_data.with_kwargs", None),  # **kwargs: names not checked
    ],
)
def test_class_count_rule(overrides, target, expected):
    if target == "user_data.with_kwargs":
        with pytest.raises(
            ConfigError, match="raised TypeError: tabular.. got an unexpected keyword argument 'anything'"
        ):
            build(*overrides, target=target)
        assert build("data.n_classes=2", target=target).num_classes == 2
        return
    assert build(*overrides, target=target).num_classes == expected


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "target,overrides,message",
    [
        ("null", [], r"data\._target_ is not set: give it as data\._target_=<module>\.<callable>"),
        ("tabular", [], r"names no module: write it as <module>\.<callable>"),
        ("no_such_module_xyz.make", [], r"cannot be imported: no module named 'no_such_module_xyz'.*PYTHONPATH"),
        ("user_data.tabulr", [], r"user_data has no attribute 'tabulr' \(did you mean user_data\.tabular\?\)"),
        ("user_data.NOT_CALLABLE", [], r"is a int, not a class or function"),
        (
            "user_data.tabular",
            ["data.n_featurs=4"],
            r"data\.n_featurs=4: user_data\.tabular has no parameter 'n_featurs' \(did you mean data\.n_features\?\)\. "
            r"Its parameters: n_features, n_classes, n_train, n_eval, seed",
        ),
        (
            "user_data.bad_raises",
            [],
            r"raised FileNotFoundError: no such table: features_8\.csv \(called with n_features"
            r"|raised FileNotFoundError: no such table: features_8\.csv",
        ),
        (
            "user_data.bad_one_dataset",
            [],
            r"returned a TensorDataset; it must return a pair \(train_dataset, "
            r"eval_dataset\)",
        ),
        ("user_data.bad_iterable", [], r"its training set is a Stream, not a map-style Dataset"),
        ("user_data.bad_empty", [], r"its evaluation set is empty \(0 items\)"),
        (
            "user_data.bad_triples",
            [],
            r"items must be \(input, target\) pairs, but item 0 of the training set is a tuple "
            r"of 3 elements",
        ),
        ("user_data.bad_float_targets", [], r"the target of item 0 of the training set is a torch\.float32 tensor"),
        ("user_data.bad_int32_targets", [], r"torch\.int32 tensor of shape \(\).*0-d int64 tensor"),
        ("user_data.bad_shapes", [], r"training inputs have shape \(8,\) but evaluation inputs \(9,\)"),
        ("user_data.bad_no_classes", [], r"cannot tell how many classes the data has: set data\.num_classes=<C>"),
        (
            "user_data.tabular",
            ["data.num_classes=2"],
            r"a target is 2 but the class count is 2 \(from "
            r"data\.num_classes=2\)",
        ),
        ("user_data.tabular", ["data.num_classes=0"], r"data\.num_classes=0 must be >= 1"),
    ],
)
def test_bad_custom_data_stops_before_training(target, overrides, message, tmp_path):
    cfg = custom(*overrides, target=target)
    with pytest.raises(ConfigError, match=message):
        train(cfg, job_dir=tmp_path)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_inputs_the_model_cannot_take_name_both_shapes(tmp_path):
    cfg = custom("model.in_features=5")  # the data has 8 features
    with pytest.raises(ConfigError) as info:
        train(cfg, job_dir=tmp_path)
    msg = str(info.value)
    assert "items of shape (8,)" in msg and "a batch is (2, 8)" in msg
    assert "Linear(in_features=5) expects (B, ..., 5)" in msg
    # a conv net on vectors: the same message, with the conv's expectation (its first conv is fitted to the
    # channels of image items only)
    cfg = compose_cfg(*LOOP, "data=custom", "data._target_=user_data.tabular", "model=mnist_cnn", tiny=False)
    with pytest.raises(ConfigError, match=r"items of shape \(8,\).*Conv2d\(in_channels=1\) expects \(B, 1, H, W\)"):
        train(cfg, job_dir=tmp_path)


def test_a_key_left_from_another_model_is_caught(tmp_path):
    """Hydra applies key overrides after group choices: model.hidden meant for model=mlp reaches mnist_cnn."""
    with pytest.raises(
        ConfigError,
        match=r"model\.hidden=16: runner\.models\.MnistCNN has no parameter 'hidden'\. "
        r"Its parameters: num_classes, in_channels",
    ):
        train(custom("model=mnist_cnn"), job_dir=tmp_path)


def test_custom_keys_do_not_leak_into_built_in_sets():
    """data=custom's node is open; the built-in sets' nodes stay closed: a typo fails at compose time."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="Could not override 'data.augmnet'"):
        compose_cfg("data.augmnet=true")
    with pytest.raises(ConfigCompositionException, match="Could not override 'data._target_'"):
        compose_cfg("data=mnist", "data._target_=my_data.tabular")
    assert custom("data.n_features=3").data.n_features == 3  # no `+` needed on data=custom


def test_built_in_num_classes_must_agree(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.num_classes=5 but data=mnist has 10 classes"):
        data_mod.build(
            compose_cfg("data=mnist", "data.num_classes=5").data,
            compose_cfg().dataloader,
            setup(compose_cfg().distributed, "cpu"),
        )
    assert build().num_classes == 3
