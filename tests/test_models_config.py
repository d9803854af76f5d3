"""Models from config: constructor arguments from the command line, checked against the signature, and
fine-tuning from torchvision's weights cache, offline.

The weights tests write a real resnet18 state dict where torchvision looks for it, a temporary
``$TORCH_HOME/hub/checkpoints/resnet18-f37072fd.pth`` (the file name of the weights' URL), and check that
the model starts from exactly those tensors with a fresh 2-class head. Nothing is downloaded: any
attempt fails the test.
"""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import pytest
import torch
import torchvision
from hydra.errors import ConfigCompositionException
from torch import nn

from conftest import compose_cfg, run_here
from runner import models
from runner.engine.train import train
from runner.errors import ConfigError

EXAMPLE = torch.randn(3, 16, 16)  # one input item of TINY's synthetic data


def build(*overrides: str, num_classes: int = 10, example: torch.Tensor | None = EXAMPLE) -> nn.Module:
    return models.build(
        compose_cfg(*overrides).model,
        {"num_classes": num_classes},
        3 if example is None else example.shape[0],
        example=example,
    )


# ------------------------------------------------------------------------------ constructor arguments


def test_any_constructor_argument_without_plus():
    model = build("model=mlp", "model.hidden=24", "model.depth=3", "model.dropout=0.25")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(768, 24), (24, 24), (24, 24), (24, 10)]
    assert model.blocks[0][2].p == 0.25


def test_torchvision_factory_arguments_reach_the_class():
    """resnet18(**kwargs) forwards to ResNet: its arguments are accepted and applied."""
    model = build("model=resnet18", "model.zero_init_residual=true")
    assert all(not b.bn2.weight.any() for b in model.modules() if type(b).__name__ == "BasicBlock")
    # an accepted name with a value the class refuses: the constructor's own message, as a ConfigError
    with pytest.raises(
        ConfigError,
        match=r"model._target_='torchvision.models.resnet18' raised ValueError: "
        r"BasicBlock only supports groups=1 and base_width=64",
    ):
        build("model=resnet18", "model.width_per_group=32")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=mlp", "model.hiden=64"],
            r"model\.hiden=64: runner\.models\.MLP has no parameter 'hiden' \(did you mean "
            r"model\.hidden\?\)\. Its parameters: in_features, num_classes, hidden, depth, "
            r"dropout, num_outputs; runner's own model keys: cifar_stem, "
            r"drop_bias_before_bn, weights, freeze_backbone",
        ),
        (
            ["model=resnet18", "model.zero_init_residul=true"],
            r"resnet18 has no parameter 'zero_init_residul' "
            r"\(did you mean model\.zero_init_residual\?\)\. Its "
            r"parameters: progress, num_classes, zero_init_residual, "
            r"groups",
        ),
        (
            ["model=mlp", "model.num_classes=3"],
            r"model\.num_classes=3 cannot be set: the model's class count follows the "
            r"data \(10\); set data\.num_classes instead",
        ),
        (
            ["model._target_=torch.nn.Linearr"],
            r"torch\.nn has no attribute 'Linearr' \(did you mean torch\.nn\.Linear\?\)",
        ),
        (
            ["model._target_=nowhere_pkg.Net"],
            r"model\._target_='nowhere_pkg\.Net' cannot be imported: no module named "
            r"'nowhere_pkg'",
        ),
        (["model._target_=torch.pi"], r"is a float, not a class or function"),
        (["model._target_=builtins.dict"], r"model\._target_='builtins\.dict' returned a dict, not a torch nn\.Module"),
        (["model=mlp", "model.depth=-1"], r"raised ValueError: MLP needs .* depth >= 0"),
        # values checked against the annotations of the signature (the factory's class for torchvision)
        (
            ["model=resnet18", "model.zero_init_residual=abc"],
            r"^model\.zero_init_residual='abc' does not fit "
            r".*annotation zero_init_residual: bool; give true or false",
        ),
        (["model=resnet18", "model.zero_init_residual=1"], r"model\.zero_init_residual=1 does not fit .*: bool"),
        (["model=resnet18", "model.groups=1.5"], r"model\.groups=1\.5 does not fit .*groups: int; give a whole number"),
        (
            ["model=mlp", "model.hidden=abc"],
            r"model\.hidden='abc' does not fit runner\.models\.MLP's annotation "
            r"hidden: int",
        ),
        (["model=mlp", "model.depth=true"], r"model\.depth=True does not fit .*depth: int"),
        (["model=mlp", "model.dropout=x"], r"model\.dropout='x' does not fit .*dropout: float; give a number"),
    ],
)
def test_bad_model_arguments_name_the_key_and_the_valid_names(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(*overrides)


def test_runner_keys_stay_typed_and_other_groups_closed():
    with pytest.raises(ConfigCompositionException, match="Error merging override model.cifar_stem=abc"):
        compose_cfg("model.cifar_stem=abc")
    with pytest.raises(ConfigCompositionException, match="Could not override 'optimizer.lrr'"):
        compose_cfg("model.width=3", "optimizer.lrr=0.1")
    assert compose_cfg("model.width=64").model.width == 64  # no `+`


def test_annotated_values_that_fit_are_passed_as_given():
    assert build("model=mlp", "model.dropout=0").blocks[0][2].p == 0  # an int where a float is annotated
    model = build("model=resnet18", "model.zero_init_residual=false")
    assert all(b.bn2.weight.all() for b in model.modules() if type(b).__name__ == "BasicBlock")


def test_cli_value_that_does_not_fit_the_annotation_is_one_error_line(tmp_path):
    proc = run_here(
        "model=resnet18",
        "model.zero_init_residual=abc",
        "data=synthetic",
        "trainer.device=cpu",
        "logger=none",
        cwd=tmp_path,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "model.zero_init_residual='abc'" in line and "true or false" in line
    assert list((tmp_path / "outputs").rglob("summary.json")) == []


def test_schemas_are_not_offered_as_models_and_typing_one_is_one_error(tmp_path):
    """``base_model`` (the schema every model option extends) is no choice: the option lists leave it out,
    and ``model=base_model`` typed anyway stops with one error line, not a MissingMandatoryValue traceback."""
    listing = run_here("model=nope", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "0"})
    assert listing.returncode == 2 and "error: model=nope: no such option in group model" in listing.stderr
    assert "mlp, mnist_cnn" in listing.stderr and "base_" not in listing.stderr, listing.stderr
    assert "base_" not in run_here("--help", cwd=tmp_path).stdout.split("== Config ==")[0]
    proc = run_here(
        "model=base_model",
        "data=synthetic",
        "trainer.device=cpu",
        "logger=none",
        cwd=tmp_path,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "model=base_model is the schema" in line and "mlp, mnist_cnn, resnet18" in line
    assert list((tmp_path / "outputs").rglob("summary.json")) == []


def test_cli_typo_in_a_constructor_argument_stops_before_training(tmp_path):
    proc = run_here(
        "model=mlp",
        "model.widht=64",
        "data=synthetic",
        "trainer.device=cpu",
        "logger=none",
        cwd=tmp_path,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "model.widht=64: runner.models.MLP has no parameter 'widht'" in line and "hidden" in line
    assert list((tmp_path / "outputs").rglob("summary.json")) == []


# ------------------------------------------------------------------------------ pretrained weights

WEIGHTS = torchvision.models.ResNet18_Weights.IMAGENET1K_V1


@pytest.fixture
def no_download(monkeypatch):
    """Any download attempt fails the test (torch.hub downloads through urllib.request.urlopen)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def torch_home(tmp_path, monkeypatch, no_download) -> Path:
    """An empty ``TORCH_HOME``; ``torch.hub.get_dir()`` reads the variable on every call."""
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def cache_file(home: Path, weights=WEIGHTS) -> Path:
    """Where torchvision expects ``weights``: the file name of its URL under ``hub/checkpoints``."""
    return home / "hub" / "checkpoints" / Path(weights.url).name


@pytest.fixture
def resnet18_file(torch_home) -> dict[str, torch.Tensor]:
    """A resnet18 ImageNet state dict (random values) saved where torchvision looks; returns it."""
    torch.manual_seed(123)
    state = torchvision.models.resnet18().state_dict()  # 1000 classes, like the published file
    path = cache_file(torch_home)
    assert path.name == "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return state


@pytest.mark.parametrize("name", ["IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1", "DEFAULT"])
def test_weights_load_from_the_cache_and_the_head_is_replaced(resnet18_file, name, caplog):
    caplog.set_level(logging.WARNING, logger="runner.models")
    model = build("model=resnet18", f"model.weights={name}", num_classes=2)
    state = model.state_dict()
    backbone = [k for k in resnet18_file if not k.startswith("fc.")]
    assert len(backbone) == len(resnet18_file) - 2
    for k in backbone:
        torch.testing.assert_close(state[k], resnet18_file[k], rtol=0, atol=0)
    assert isinstance(model.fc, nn.Linear) and (model.fc.in_features, model.fc.out_features) == (512, 2)
    assert all(p.requires_grad for p in model.parameters())
    # the test's file is not the published one: its SHA-256 cannot start with f37072fd, and runner says so
    assert "does not start with f37072fd, the hash in its name" in caplog.text


@pytest.mark.cli
def test_pretrained_run_on_two_classes(resnet18_file, spy, tmp_path):
    """Done-when: fine-tuning from a cached weights file works offline, with the head replaced."""
    summary = train(
        compose_cfg("model=resnet18", "model.weights=IMAGENET1K_V1", "data.num_classes=2", "trainer.max_steps=2"),
        job_dir=tmp_path,
    )
    assert summary["steps"] == 2 and summary["eval_accuracy"] is not None
    start = spy.initial_params  # taken when the optimizer was built: the model as training starts
    for k, v in start.items():
        if not k.startswith("fc."):
            torch.testing.assert_close(v, resnet18_file[k], rtol=0, atol=0)
    assert start["fc.weight"].shape == (2, 512)


@pytest.mark.cli
def test_freeze_backbone_trains_only_the_new_head(resnet18_file, spy, tmp_path, capsys):
    capsys.readouterr()
    summary = train(
        compose_cfg(
            "model=resnet18",
            "model.weights=IMAGENET1K_V1",
            "model.freeze_backbone=true",
            "data.num_classes=2",
            "trainer.max_steps=2",
            "optimizer.lr=0.1",
            "trainer.progress=lines",
        ),
        job_dir=tmp_path,
    )
    assert summary["model_details"]["trainable_parameters"] == 1026
    model, optimizer = spy.model, spy.optimizer
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias"}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(model.fc.weight), id(model.fc.bias)}
    after = dict(model.named_parameters())
    changed = {n for n, v in spy.initial_params.items() if not torch.equal(v, after[n].detach())}
    assert changed == {"fc.weight", "fc.bias"}
    assert len(spy.steps) == 2
    # the console says what was loaded, what is frozen and what trains: one line at build
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model: ")]
    assert lines == [
        "model: resnet18, IMAGENET1K_V1 weights loaded; backbone frozen; 1,026 of 11.2 M parameters trainable"
    ]
    details = models.model_report(
        model, compose_cfg("model=resnet18", "model.weights=IMAGENET1K_V1", "model.freeze_backbone=true").model
    )[1]
    assert details == {
        "name": "resnet18",
        "target": "torchvision.models.resnet18",
        "weights": "IMAGENET1K_V1",
        "backbone_frozen": True,
        "parameters": 11177538,
        "trainable_parameters": 1026,
    }


def test_pretrained_first_conv_adapted_to_one_channel(resnet18_file):
    model = build("model=resnet18", "model.weights=IMAGENET1K_V1", num_classes=10, example=torch.randn(1, 28, 28))
    torch.testing.assert_close(model.conv1.weight, resnet18_file["conv1.weight"].sum(1, keepdim=True))


def test_missing_weights_file_says_where_to_put_it(torch_home):
    path = cache_file(torch_home)
    with pytest.raises(ConfigError) as info:
        build("model=resnet18", "model.weights=IMAGENET1K_V1", num_classes=2)
    msg = str(info.value)
    assert f"the weights file {path} does not exist" in msg
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in msg and f"put it at {path}" in msg


def test_missing_weights_file_through_the_cli(tmp_path):
    home = tmp_path / "home"
    proc = run_here(
        "model=resnet18",
        "model.weights=IMAGENET1K_V1",
        "data=synthetic",
        "data.num_classes=2",
        "trainer.device=cpu",
        "logger=none",
        cwd=tmp_path,
        env={"HYDRA_FULL_ERROR": "0", "TORCH_HOME": str(home)},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert str(cache_file(home)) in line and WEIGHTS.url in line
    assert not cache_file(home).exists()  # nothing was downloaded


def test_weights_of_another_architecture_by_name(torch_home):
    with pytest.raises(
        ConfigError,
        match=r"model\.weights='ResNet50_Weights\.IMAGENET1K_V1' are weights for another "
        r"architecture: torchvision\.models\.resnet18 takes ResNet18_Weights "
        r"\(IMAGENET1K_V1, DEFAULT\), not ResNet50_Weights",
    ):
        build("model=resnet18", "model.weights=ResNet50_Weights.IMAGENET1K_V1")


def test_weights_file_of_another_architecture(torch_home):
    """A resnet50 file saved under resnet18's name: the message says what differs, and where to get the right file."""
    path = cache_file(torch_home)
    path.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet50().state_dict(), path)
    with pytest.raises(ConfigError) as info:
        build("model=resnet18", "model.weights=IMAGENET1K_V1", num_classes=2)
    msg = str(info.value)
    assert f"{path} does not hold weights for torchvision.models.resnet18" in msg
    assert "unexpected (e.g. layer1.0.conv3.weight)" in msg
    assert "of another shape (e.g. layer1.0.conv1.weight: file (64, 64, 1, 1), model (64, 64, 3, 3))" in msg
    assert "another architecture's file" in msg and WEIGHTS.url in msg


@pytest.mark.parametrize(
    "content,message",
    [
        (
            b"<html>404 Not Found</html>",
            r"cannot read .*resnet18-f37072fd\.pth as PyTorch weights .*Delete it and fetch "
            r"it again from https://download\.pytorch\.org/models/resnet18-f37072fd\.pth",
        ),
        ("module", r"cannot read .* as PyTorch weights \(UnpicklingError"),  # weights_only=True runs no pickled code
        ("list", r"holds a list, not a state dict of tensors"),
    ],
)
def test_unreadable_weights_file(torch_home, content, message):
    path = cache_file(torch_home)
    path.parent.mkdir(parents=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "module":
        torch.save(torchvision.models.resnet18(), path)  # a whole pickled module, not its state dict
    else:
        torch.save([torch.zeros(3)], path)
    with pytest.raises(ConfigError, match=message):
        build("model=resnet18", "model.weights=IMAGENET1K_V1")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=resnet18", "model.weights=IMAGENET_V9"],
            r"'IMAGENET_V9' is not one of torchvision\.models\.resnet18's "
            r"weights: ResNet18_Weights has IMAGENET1K_V1, DEFAULT",
        ),
        (["model=mlp", "model.weights=IMAGENET1K_V1"], r"needs a torchvision model builder with a weights argument"),
        (
            ["model=resnet18", "model.freeze_backbone=true"],
            r"model\.freeze_backbone=true trains only a pretrained model's "
            r"new head; set model\.weights",
        ),
    ],
)
def test_bad_weights_settings(torch_home, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(*overrides)


# ------------------------------------------------------------------------------ trained weights


def test_weights_trained_without_the_biases_before_bn_load_into_the_plain_model(tmp_path):
    """+experiment=fast drops the conv biases that feed a BatchNorm: model.safetensors lacks them, so the plain
    load_state_dict refuses the file; runner.models.load_weights loads it with those biases at zero."""
    from safetensors.torch import load_file

    summary = train(compose_cfg("model.drop_bias_before_bn=true"), job_dir=tmp_path)
    assert summary["techniques"]["drop_bias_before_bn"] == "applied"
    saved = load_file(str(tmp_path / "model.safetensors"))
    plain = models.MnistCNN(num_classes=10, in_channels=3)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"features\.0\.0\.bias\""):
        plain.load_state_dict(saved)
    loaded = models.load_weights(plain, tmp_path / "model.safetensors")
    assert loaded is plain and not plain.features[0][0].bias.any() and not plain.features[1][0].bias.any()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(RuntimeError, match="size mismatch"):  # anything but a dropped bias is still checked
        models.load_weights(models.MnistCNN(num_classes=7, in_channels=3), tmp_path / "model.safetensors")
