"""Compression during training (runner/techniques/compress.py) and int8 training (precision=int8), with torchao:
``compress=qat`` trains torchao's fake-quantized Linear layers, saves and resumes as any job, and ``python -m
runner.export --format int8`` converts it to a model whose weights are int8, printing both accuracies;
``compress=sparse24`` is skipped on a CPU with the reason; ``precision=int8`` acts on a CPU (torch._int_mm) and says
why it does nothing on a model with no Linear layer between its first and last. Tiny CPU jobs, one thread."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch import nn

from conftest import TINY, compose_cfg, job_dirs, read_summary, run_here, run_tiny
from runner.errors import ConfigError
from runner.measure import hardware
from runner.models import MLP, MnistCNN, load_weights
from runner.techniques import compress, precision

pytest.importorskip("torchao", reason="torchao (the fp8 extra) is not installed")
from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingLinear  # noqa: E402
from torchao.quantization import Int8Tensor  # noqa: E402
from torchao.quantization.granularity import PerAxis, PerToken  # noqa: E402
from torchao.quantization.qat import FakeQuantizedLinear  # noqa: E402

CPU = torch.device("cpu")
QAT_JOB = [*TINY, "compress=qat", "trainer.doctor=false"]


@pytest.fixture(scope="module")
def qat_job(tmp_path_factory) -> Path:
    """A finished tiny ``compress=qat`` job (MnistCNN on synthetic 3x16x16 images, 4 steps), trained once."""
    root = tmp_path_factory.mktemp("qat")
    proc = run_here(*QAT_JOB, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [folder] = job_dirs(root)
    return folder


def fake_quantized_cnn(folder: Path) -> nn.Module:
    """The job's trained model as it trained: MnistCNN with its weights, its head fake-quantized."""
    model = load_weights(MnistCNN(num_classes=10, in_channels=3), folder / "model.safetensors").eval()
    compress.apply_qat(model, compress.linear_layers(model))
    return model


# ------------------------------------------------------------------------------- compress=qat


def test_qat_trains_torchaos_fake_quantized_linear_layers(tmp_path, spy):
    summary = run_tiny(tmp_path, "compress=qat")
    assert summary["techniques"]["qat"] == "applied" and math.isfinite(summary["train_loss"])
    assert summary["technique_details"]["qat"] == {"scheme": compress.QAT_SCHEME, "layers": ["head"]}
    head = spy.model.head
    assert isinstance(head, FakeQuantizedLinear)  # every Linear layer (MnistCNN has one), swapped in place
    assert not any(type(m) is nn.Linear for m in spy.model.modules())
    weights, activations = head.weight_fake_quantizer.config, head.activation_fake_quantizer.config
    assert weights.dtype == activations.dtype == torch.int8
    assert weights.granularity == PerAxis(0) and isinstance(activations.granularity, PerToken)
    assert spy.train_calls() and spy.steps  # it trained through them
    # the weights keep their names: model.safetensors loads into the plain model
    plain = MnistCNN(num_classes=10, in_channels=3)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(plain.state_dict())
    load_weights(plain, tmp_path / "model.safetensors")


def test_qat_resumes_from_its_checkpoint_as_a_straight_run_ends(tmp_path):
    """4 steps, then the same job resumed from their checkpoint to 6, ends with the weights of 6 straight steps."""
    straight = tmp_path / "straight"
    run_tiny(straight, "compress=qat", "trainer.max_steps=6")
    first = tmp_path / "first"
    run_tiny(first, "compress=qat", "trainer.max_steps=4")
    [checkpoint] = [p for p in (first / "checkpoints").iterdir() if p.is_dir()]
    resumed = tmp_path / "resumed"
    summary = run_tiny(resumed, "compress=qat", "trainer.max_steps=6", f"checkpoint.resume={checkpoint}")
    assert summary["steps"] == 6 and summary["techniques"]["qat"] == "applied"
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_the_int8_conversion_computes_what_fake_quantization_trained_for():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10, bias=False))
    compress.apply_qat(model, compress.linear_layers(model))
    x = torch.randn(32, 64)
    with torch.no_grad():
        trained = model(x)
        assert compress.to_int8(model) == "qat"
        converted = model(x)
    torch.testing.assert_close(converted, trained, rtol=0, atol=1e-6)
    for layer in (model[0], model[2]):
        assert type(layer) is nn.Linear and isinstance(layer.weight, Int8Tensor)
        assert layer.weight.qdata.dtype == torch.int8 and layer.weight.scale.numel() == layer.out_features
    plain = nn.Sequential(nn.Linear(64, 10))
    assert compress.to_int8(plain) == "post-training" and isinstance(plain[0].weight, Int8Tensor)


def test_the_int8_export_holds_int8_weights_and_prints_both_accuracies(qat_job):
    proc = run_here(str(qat_job), "--format", "int8", cwd=qat_job, module="runner.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert (
        "int8 (qat conversion of 1 Linear layers" in out
        and "check: torch.export.load(...).module() matches the int8 model" in out
    )
    fake = next(line for line in out.splitlines() if line.startswith("  fake-quantized (compress=qat): "))
    int8 = next(line for line in out.splitlines() if line.startswith("  int8: "))
    assert "eval_accuracy" in fake and "eval_accuracy" in int8
    program = torch.export.load(str(qat_job / "model.int8.pt2"))
    weight = program.state_dict["head.weight"]
    assert isinstance(weight, Int8Tensor) and weight.qdata.dtype == torch.int8 and weight.qdata.shape == (10, 3136)
    x = torch.randn(5, 3, 16, 16)  # another batch size than the example's: the batch dimension is dynamic
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), fake_quantized_cnn(qat_job)(x), rtol=1e-4, atol=1e-5)


def test_evaluate_reproduces_a_qat_jobs_evaluation(qat_job):
    """runner.evaluate rebuilds a compress=qat job fake-quantized, as it trained: the summary's figures again."""
    proc = run_here(str(qat_job), "trainer.eval_max_batches=2", cwd=qat_job, module="runner.evaluate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    record = json.loads((qat_job / "eval-final.json").read_text())
    for key in ("eval_accuracy", "eval_loss"):
        assert record["metrics"][key] == pytest.approx(read_summary(qat_job)[key], rel=1e-6, abs=1e-7), key


class ConvOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


@pytest.mark.parametrize("name", ["qat", "sparse24"])
def test_impossible_combinations_are_one_line_refusals(name, tmp_path):
    cfg = compose_cfg(f"compress={name}")
    cfg.model._target_ = "my_models.ConvOnly"
    with pytest.raises(
        ConfigError,
        match=f"^compress={name} acts on Linear layers and the model my_models.ConvOnly "
        f"has none; train it with compress=none$",
    ):
        compress.apply(ConvOnly(), cfg, CPU)
    proc = run_here(*TINY, f"compress={name}", "precision=int8", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: compress={name} cannot run with precision=int8: both replace the model's Linear layers; pick one "
        f"(precision=bf16 or auto with compress={name})"
    ]
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("summary.json"))


def test_compress_none_changes_nothing():
    model = MnistCNN(num_classes=10, in_channels=3)
    assert compress.apply(model, compose_cfg(), CPU) == ({}, {}) and type(model.head) is nn.Linear


# ------------------------------------------------------------------------------- compress=sparse24


def test_sparse24_on_a_cpu_is_skipped_and_the_plain_model_trains(tmp_path, spy):
    summary = run_tiny(tmp_path, "compress=sparse24")
    status = summary["techniques"]["sparse24"]
    assert status == (
        "skipped: 2:4 sparse matmuls (cuSPARSELt) need a CUDA GPU of compute capability 8.0 or newer "
        "(Ampere, Hopper, Blackwell); the plain model trains"
    )
    assert type(spy.model.head) is nn.Linear and spy.steps and math.isfinite(summary["train_loss"])


def test_sparse24_needs_ampere_and_swaps_only_the_large_inner_layers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert compress.sparse24_unavailable(torch.device("cuda")) == (
        "2:4 sparse matmuls (cuSPARSELt) need compute capability 8.0 or newer; this GPU has 7.5"
    )
    model = nn.Sequential(
        nn.Linear(64, 1024), nn.Linear(1024, 4096), nn.Linear(4096, 1000), nn.Linear(1000, 1024), nn.Linear(1024, 10)
    )
    # first and last stay dense; 4096 -> 1000: 1000 is no multiple of 64
    assert compress.sparse_layers(model, 1024) == ["1"]
    assert compress.sparse_layers(model, 2048) == []
    monkeypatch.setattr(compress, "sparse24_unavailable", lambda device: None)  # an A100 or newer
    status, details = compress.apply_sparse24(model, 1024, torch.device("cuda"))
    from torchao.sparsity.training import SemiSparseLinear

    assert status == "applied" and details["layers"] == ["1"]
    assert isinstance(model[1], SemiSparseLinear) and not isinstance(model[2], SemiSparseLinear)
    status, _ = compress.apply_sparse24(nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 10)), 1024, CPU)
    assert status.startswith("skipped: no Linear layer between the first and last has in_features")


# ------------------------------------------------------------------------------- precision=int8


def test_int8_training_acts_on_a_cpu_and_keeps_the_first_and_last_layers(tmp_path, spy):
    summary = run_tiny(tmp_path, "precision=int8", "model=mlp", "model.depth=2")
    assert summary["techniques"]["int8"] == "applied" and math.isfinite(summary["train_loss"])
    assert summary["technique_details"]["int8"] == {"converted": 1, "kept": 2, "converted_layers": ["blocks.1.0"]}
    model = spy.model
    assert isinstance(model.blocks[1][0], Int8MixedPrecisionTrainingLinear)
    assert not isinstance(model.blocks[0][0], Int8MixedPrecisionTrainingLinear)
    assert not isinstance(model.head, Int8MixedPrecisionTrainingLinear)
    plain = MLP(in_features=3 * 16 * 16, num_classes=10, depth=2)  # the weights keep their names
    load_weights(plain, tmp_path / "model.safetensors")


def test_int8_training_says_why_it_does_nothing_on_a_model_with_only_a_head(tmp_path):
    summary = run_tiny(tmp_path, "precision=int8")
    assert summary["techniques"]["int8"].startswith(
        "skipped: none of the model's 1 Linear layers lies between its first and last layers (those stay as they are)"
    )


@pytest.mark.parametrize("native", [True, False])
def test_int8_trains_the_rest_in_bf16_where_the_cpu_has_it_else_fp32(native, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    prec = precision.build(compose_cfg("precision=int8").precision, CPU)
    assert prec.int8 and prec.techniques == {}
    assert prec.compute_dtype == (torch.bfloat16 if native else torch.float32)


def test_int8_without_torchao_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(precision, "_torchao_missing", lambda: "torchao is not installed")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    prec = precision.build(compose_cfg("precision=int8").precision, CPU)
    assert not prec.int8 and prec.techniques["int8"] == (
        "skipped: torchao is not installed; trained in fp32 (this device has no native bf16)"
    )


def test_the_compress_group_composes_with_its_schema():
    cfg = compose_cfg("compress=sparse24", "compress.min_features=768")
    assert OmegaConf.to_container(cfg.compress) == {"name": "sparse24", "min_features": 768}
    assert compose_cfg().compress.name == "none"
