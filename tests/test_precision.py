"""Technique 4 (mixed precision, GradScaler) and 14 (gradient clipping with GradScaler), in the real engine.

The engine's autocast is observed by a forward hook (``technique_helpers.Spy``); the scaler paths run
with a real, enabled ``torch.amp.GradScaler`` on the CPU (GradScaler supports "cpu" since torch 2.3).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from conftest import ONE_THREAD, compose_cfg, cuda_only, run_tiny
from runner.errors import ConfigError
from runner.measure import hardware
from runner.techniques import precision


def run_precision(job_dir, *overrides):
    """A tiny job with ``optimizer.set_to_none=false``, so ``techniques`` lists precision's only."""
    return run_tiny(job_dir, "optimizer.set_to_none=false", *overrides)


def changed(spy) -> list[str]:
    after = dict(spy.model.named_parameters())
    return [n for n in after if not torch.equal(spy.initial_params[n], after[n])]


# ---------------------------------------------------------------------------------- autocast


def test_amp_on_a_cpu_with_native_bf16_runs_the_forward_in_bf16(tmp_path, spy, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    summary = run_precision(tmp_path, "precision=amp")
    assert summary["techniques"] == {"amp": "applied", **ONE_THREAD}
    assert summary["technique_details"]["precision"].startswith("precision=amp on a CPU: bf16 autocast")
    assert spy.train_calls() and spy.eval_calls()
    assert all(c.out_dtype == torch.bfloat16 and c.x_dtype == torch.float32 for c in spy.calls)
    assert math.isfinite(summary["train_loss"])
    assert not spy.scaler_used.is_enabled()  # bf16 needs no loss scaling
    assert all(p.dtype == torch.float32 for p in spy.model.parameters())  # master weights stay fp32


def test_amp_on_a_cpu_without_native_bf16_is_skipped(tmp_path, spy, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    summary = run_precision(tmp_path, "precision=amp")
    assert summary["techniques"]["amp"].startswith("skipped: this CPU has no native bf16")
    assert all(c.out_dtype == torch.float32 for c in spy.calls)


def test_bf16_autocast(tmp_path, spy, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    summary = run_precision(tmp_path, "precision=bf16")
    assert summary["techniques"] == {"bf16": "applied", **ONE_THREAD}
    assert spy.calls and all(c.out_dtype == torch.bfloat16 for c in spy.calls)


def test_bf16_on_an_emulating_cpu_warns_but_applies(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="emulated"):
        prec = precision.build(compose_cfg("precision=bf16").precision, torch.device("cpu"))
    assert prec.techniques == {"bf16": "applied"} and prec.compute_dtype == torch.bfloat16
    with prec.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name, techniques",
    [
        ("fp32", {}),
        (
            "tf32",
            {"tf32": "skipped: TF32 needs an NVIDIA GPU of compute capability 8.0 or newer; this job runs on the CPU"},
        ),
    ],
)
def test_fp32_and_tf32_on_cpu_run_in_fp32(tmp_path, spy, name, techniques):
    summary = run_precision(tmp_path, f"precision={name}")
    assert summary["techniques"] == {**techniques, **ONE_THREAD}
    assert spy.calls and all(c.out_dtype == torch.float32 for c in spy.calls)


def test_bad_scaler_options_are_config_errors():
    cfg = compose_cfg("precision=amp", "precision.init_scale=0").precision
    with pytest.raises(ConfigError, match="precision.init_scale"):
        precision.build(cfg, torch.device("cpu"))
    cfg = compose_cfg("precision=amp", "precision.growth_interval=0").precision
    with pytest.raises(ConfigError, match="precision.growth_interval"):
        precision.build(cfg, torch.device("cpu"))


# ---------------------------------------------------------------------------------- GradScaler


class CpuGradScaler(torch.amp.GradScaler):
    """A GradScaler that records the device it was asked for and runs on the CPU."""

    def __init__(self, device: str = "cuda", **kwargs):
        super().__init__("cpu", **kwargs)
        self.requested_device = device


def test_init_scale_and_growth_interval_reach_the_cuda_scaler(monkeypatch):
    monkeypatch.setattr(precision, "GradScaler", CpuGradScaler)
    cfg = compose_cfg("precision=amp", "precision.init_scale=1024", "precision.growth_interval=7").precision
    prec = precision.build(cfg, torch.device("cuda"))  # builds only; nothing runs on the device
    assert prec.techniques == {"amp": "applied"} and prec.compute_dtype == torch.float16
    assert prec.scaler.requested_device == "cuda" and prec.scaler.is_enabled()
    assert prec.scaler.get_scale() == 1024.0 and prec.scaler.get_growth_interval() == 7


def fp16_on_cpu(spy, init_scale: float) -> None:
    """The CUDA amp recipe (fp16 autocast + GradScaler) on the CPU, where both exist since torch 2.3."""
    spy.autocast = functools.partial(torch.autocast, "cpu", dtype=torch.float16)
    spy.scaler = lambda: torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2000)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")  # a skipped first step
def test_the_scaler_skips_the_step_with_inf_gradients(tmp_path, spy):
    fp16_on_cpu(spy, 2.0**24)  # fp16 backward overflows (max 65504) with a loss scale of 2**24
    summary = run_precision(tmp_path, "trainer.max_steps=1", "trainer.warmup_steps=0")
    assert summary["steps"] == 1 and math.isfinite(summary["train_loss"])
    assert spy.steps == []  # optimizer.step never ran
    assert changed(spy) == []  # weights untouched (no inf/NaN written into them)
    assert spy.scaler_used.get_scale() == 2.0**23  # backoff_factor 0.5


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_the_scaler_backs_off_until_steps_go_through(tmp_path, spy):
    fp16_on_cpu(spy, 2.0**24)
    run_precision(tmp_path, "trainer.max_steps=16")
    skipped = 16 - len(spy.steps)
    assert 1 <= skipped < 16  # some steps skipped, then the scale got small enough
    assert spy.scaler_used.get_scale() == 2.0 ** (24 - skipped)  # halved once per skipped step
    assert changed(spy) and all(math.isfinite(s.grad_norm) for s in spy.steps)


def test_the_scaler_lets_finite_steps_through(tmp_path, spy):
    spy.scaler = lambda: torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    run_precision(tmp_path, "trainer.max_steps=4")
    assert len(spy.steps) == 4 and changed(spy)
    assert spy.scaler_used.get_scale() == 4096.0  # doubled after every 2 clean steps
    assert all(math.isfinite(s.grad_norm) and s.grad_norm < 100 for s in spy.steps)  # unscaled before step


# ---------------------------------------------------------------------------- 14: grad clipping


def test_clip_grad_norm_clips_the_global_norm(tmp_path, spy):
    summary = run_precision(tmp_path, "optimizer.clip_grad_norm=0.001")
    assert summary["techniques"]["clip_grad_norm"] == "applied"
    assert len(spy.steps) == 4
    assert [s.grad_norm for s in spy.steps] == pytest.approx([0.001] * 4, rel=1e-3)


def test_clip_grad_norm_unscales_first_with_the_scaler(tmp_path, spy):
    # Without unscale_ before clipping, the optimizer would see 0.001 / 1024.
    spy.scaler = lambda: torch.amp.GradScaler("cpu", init_scale=1024.0)
    run_precision(tmp_path, "optimizer.clip_grad_norm=0.001")
    assert [s.grad_norm for s in spy.steps] == pytest.approx([0.001] * 4, rel=1e-3)


def test_gradients_are_not_clipped_by_default(tmp_path, spy):
    summary = run_precision(tmp_path)
    assert "clip_grad_norm" not in summary["techniques"]
    assert all(s.grad_norm > 0.01 for s in spy.steps)  # so the 0.001 above is the clip, not the model


def test_non_positive_clip_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.clip_grad_norm"):
        run_precision(tmp_path, "optimizer.clip_grad_norm=0")


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@cuda_only
def test_amp_on_cuda_is_fp16_with_a_grad_scaler(tmp_path, spy):
    summary = run_precision(
        tmp_path, "precision=amp", "trainer.device=cuda", "precision.init_scale=1024", "precision.growth_interval=3"
    )
    assert summary["techniques"]["amp"] == "applied"
    assert spy.calls and all(c.out_dtype == torch.float16 for c in spy.calls)
    scaler = spy.scaler_used
    assert scaler.is_enabled() and scaler.get_growth_interval() == 3
    assert scaler.get_scale() >= 1024.0 and len(spy.steps) >= 1 and changed(spy)


@pytest.mark.gpu
@cuda_only
@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")  # a skipped first step
def test_the_cuda_scaler_skips_the_step_with_inf_gradients(tmp_path, spy):
    # fp16 gradients overflow (max 65504) with a loss scale of 2**24: GradScaler.step must not call optimizer.step
    summary = run_precision(
        tmp_path,
        "precision=amp",
        "trainer.device=cuda",
        f"precision.init_scale={2.0**24}",
        "trainer.max_steps=1",
        "trainer.warmup_steps=0",
    )
    assert summary["techniques"]["amp"] == "applied" and summary["steps"] == 1
    assert spy.steps == [] and changed(spy) == []  # the weights got no inf/NaN
    assert spy.scaler_used.get_scale() == 2.0**23  # backoff_factor 0.5


@pytest.mark.gpu
@cuda_only
def test_tf32_on_cuda(tmp_path):
    summary = run_precision(tmp_path, "precision=tf32", "trainer.device=cuda")
    expected = "applied" if torch.cuda.get_device_capability()[0] >= 8 else None
    if expected:
        assert summary["techniques"]["tf32"] == "applied"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    run_precision(tmp_path / "fp32", "precision=fp32", "trainer.device=cuda")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


# ------------------------------------------------------------------- auto: what +experiment=fast picks


def test_fast_uses_auto():
    assert compose_cfg("+experiment=fast", tiny=False).precision.name == "auto"


def fake_gpu(monkeypatch, name: str, bf16: bool) -> torch.device:
    """``torch.cuda`` answering as the GPU ``name`` would (nothing runs on it: ``precision.build`` only builds)."""
    monkeypatch.setattr(precision, "GradScaler", CpuGradScaler)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda")


def test_auto_on_a_gpu_with_bf16_is_bf16_without_a_scaler(monkeypatch):
    cuda = fake_gpu(monkeypatch, "NVIDIA H200", bf16=True)
    prec = precision.build(compose_cfg("+experiment=fast").precision, cuda)
    assert prec.compute_dtype == torch.bfloat16 and not prec.scaler.is_enabled()
    assert prec.techniques == {"amp": "applied"} and "NVIDIA H200 supports bf16" in prec.note
    assert prec.autocast.args == ("cuda",) and prec.autocast.keywords == {"dtype": torch.bfloat16}  # not opened here


def test_auto_on_a_gpu_without_bf16_is_fp16_with_the_scaler(monkeypatch):
    cuda = fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", bf16=False)
    prec = precision.build(compose_cfg("precision=auto", "precision.init_scale=1024").precision, cuda)
    assert prec.compute_dtype == torch.float16 and prec.scaler.is_enabled() and prec.scaler.get_scale() == 1024.0
    assert prec.scaler.requested_device == "cuda" and prec.techniques == {"amp": "applied"}
    assert prec.note == "auto: fp16 autocast + GradScaler (this GPU has no bf16)"


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_a_cpu_is_exactly_amp(monkeypatch, native):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    auto, amp = (precision.build(compose_cfg(f"precision={n}").precision, cpu) for n in ("auto", "amp"))
    assert (auto.techniques, auto.compute_dtype) == (amp.techniques, amp.compute_dtype)
    said = "on a CPU: bf16 autocast, no loss scaling" if native else None  # the note names the dtype amp means here
    assert [n and n.split(" (")[0] for n in (auto.note, amp.note)] == (
        [f"precision=auto {said}", f"precision=amp {said}"] if native else [None, None]
    )
    assert auto.scaler.is_enabled() is amp.scaler.is_enabled() is False
