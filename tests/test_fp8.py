"""precision=fp8 (runner/techniques/precision.py): skipped with the reason where it cannot run (here: no CUDA GPU), the
layer filter that decides which Linear layers torchao converts (first and last layers stay bf16), the conversion itself
and compile turned on for it. Nothing here needs a GPU; the filter's thresholds are torchao's own, tested where
torchao is installed (the ``fp8`` and ``dev`` extras)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from conftest import compose_cfg, run_tiny
from runner import distributed, models
from runner.measure import hardware
from runner.models.gpt import GPT
from runner.techniques import precision, prepare

CPU = torch.device("cpu")


def linear_sizes(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def converted(model: nn.Module, recipe: str) -> set[str]:
    """The Linear layers of ``model`` that fp8 would convert with torchao's filter for ``recipe``."""
    keep = precision.fp8_module_filter(model, recipe)
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, name)}


def meta_gpt(n_embd: int, n_layer: int = 2, vocab: int = 50304) -> GPT:
    """A GPT on the meta device: shapes only, no memory (the filter reads weight shapes)."""
    with torch.device("meta"):
        return GPT(vocab, block_size=64, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd)


def block_layers(n_layer: int, *names: str) -> set[str]:
    return {f"transformer.h.{i}.{n}" for i in range(n_layer) for n in names}


# ------------------------------------------------------------------------------- where it cannot run


def test_fp8_on_a_cpu_is_skipped_and_trains_bf16(tmp_path, spy, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    summary = run_tiny(tmp_path, "precision=fp8", "optimizer.set_to_none=false")
    status = summary["techniques"]["fp8"]
    assert status.startswith("skipped: fp8 matmuls need a CUDA GPU of compute capability 8.9"), status
    assert status.endswith("trained with bf16 autocast")
    assert spy.calls and all(c.out_dtype == torch.bfloat16 for c in spy.calls)
    assert not any("Float8" in type(m).__name__ for m in spy.model.modules())
    assert "fp8" not in summary["technique_details"] and math.isfinite(summary["train_loss"])


def test_fp8_on_a_cpu_without_native_bf16_trains_fp32(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    prec = precision.build(compose_cfg("precision=fp8").precision, CPU)
    assert prec.techniques["fp8"].endswith("trained in fp32 (this device has no native bf16)")
    assert prec.compute_dtype == torch.float32 and prec.fp8_recipe is None


def test_the_skip_reason_names_what_is_missing(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real_find_spec(name, *a)
    )
    assert "torchao is not installed" in precision.fp8_unavailable(CPU)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = precision.fp8_unavailable(torch.device("cuda"))
    assert why.startswith("NVIDIA A100-SXM4-80GB has compute capability 8.0; fp8 matmuls need 8.9") and "torchao" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100, torchao present:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert precision.fp8_unavailable(torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    prec = precision.build(compose_cfg("precision=fp8", "precision.fp8_recipe=rowwise").precision, torch.device("cuda"))
    assert prec.fp8_recipe == "rowwise" and prec.techniques == {} and prec.compute_dtype == torch.bfloat16


def test_an_unknown_recipe_is_refused():
    from runner.errors import ConfigError

    cfg = compose_cfg("precision=fp8").precision
    cfg.fp8_recipe = "blockwise"
    with pytest.raises(ConfigError, match="^precision.fp8_recipe=blockwise is not one of tensorwise, rowwise"):
        precision.build(cfg, CPU)


# ------------------------------------------------------------------------------- which layers convert


def test_the_first_and_last_layers_are_the_embedding_and_the_head_or_the_stem_and_the_classifier():
    assert precision.edge_layers(meta_gpt(128)) == ["lm_head", "transformer.wte"]
    resnet = models.build(compose_cfg("model=resnet18").model, {"num_classes": 10}, 3)
    assert precision.edge_layers(resnet) == ["conv1", "fc"]
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    assert precision.edge_layers(mlp) == ["0", "3"]
    assert precision.edge_layers(nn.ReLU()) == []


def test_the_filter_keeps_the_first_and_last_layers_whatever_the_base_filter_says():
    gpt = meta_gpt(128)
    keep = precision.fp8_module_filter(gpt, "tensorwise", base=lambda m, fqn: isinstance(m, nn.Linear))
    chosen = {name for name, m in gpt.named_modules() if keep(m, name)}
    assert chosen == linear_sizes(gpt) - {"lm_head"}  # every block's Linear, not the head (the embedding is no Linear)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    keep = precision.fp8_module_filter(mlp, "rowwise", base=lambda m, fqn: True)
    assert [keep(m, name) for name, m in mlp.named_children()] == [False, True, False]
    keep = precision.fp8_module_filter(mlp, "rowwise", base=lambda m, fqn: False)
    assert not any(keep(m, name) for name, m in mlp.named_children())


def test_torchao_s_filter_converts_only_layers_large_enough_to_gain():
    pytest.importorskip("torchao.float8", reason="torchao (the fp8 extra) is not installed")
    # the Shakespeare GPU GPT (6 x 384) and GPT-2 124M (768): tensorwise converts c_attn (3d x d) and c_fc (4d x d)
    # only, rowwise nothing; the head stays bf16 either way
    for width in (384, 768):
        gpt = meta_gpt(width)
        assert converted(gpt, "tensorwise") == block_layers(2, "attn.c_attn", "mlp.c_fc"), width
        assert converted(gpt, "rowwise") == set(), width
    # a GPT of width 2048: tensorwise converts every projection, rowwise the two widest
    wide = meta_gpt(2048)
    assert converted(wide, "tensorwise") == block_layers(2, "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert converted(wide, "rowwise") == block_layers(2, "attn.c_attn", "mlp.c_fc")
    assert "lm_head" not in converted(meta_gpt(4096, n_layer=1), "tensorwise")  # large, but the last layer
    odd = nn.Sequential(nn.Linear(16, 16), nn.Linear(2050, 5000), nn.Linear(16, 16))
    assert converted(odd, "tensorwise") == set()  # 2050 is not a multiple of 16 (fp8 GEMMs need it)


def test_convert_fp8_swaps_the_chosen_layers_and_measures_mfu_against_the_fp8_peak():
    pytest.importorskip("torchao.float8", reason="torchao (the fp8 extra) is not installed")
    gpt = GPT(64, block_size=16, n_layer=2, n_head=6, n_embd=384)
    amp = precision.Precision(lambda: None, None, torch.bfloat16, {}, fp8_recipe="tensorwise")
    status, details = precision.convert_fp8(gpt, amp)
    assert status == "applied" and amp.mfu_dtype == torch.float8_e4m3fn
    assert set(details["converted_layers"]) == block_layers(2, "attn.c_attn", "mlp.c_fc")
    assert details["converted"] == 4 and details["kept_bf16"] == 5  # 2 x (2 projections) + the head
    assert {name for name, m in gpt.named_modules() if type(m).__name__ == "Float8Linear"} == block_layers(
        2, "attn.c_attn", "mlp.c_fc"
    )
    small = GPT(64, block_size=16, n_layer=1, n_head=2, n_embd=64)
    amp = precision.Precision(lambda: None, None, torch.bfloat16, {}, fp8_recipe="rowwise")
    status, details = precision.convert_fp8(small, amp)
    assert status.startswith("skipped: none of the model's 5 Linear layers is large enough")
    assert details["converted"] == 0
    assert amp.mfu_dtype == torch.bfloat16  # nothing converted: MFU stays against the bf16 peak


def test_fp8_turns_compile_on_when_it_applies(monkeypatch):
    cfg = compose_cfg("model._target_=technique_helpers.TinyMLP")
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    amp = precision.Precision(lambda: None, None, torch.bfloat16, {}, fp8_recipe="tensorwise")
    monkeypatch.setattr(precision, "convert_fp8", lambda model, amp: ("applied", {"recipe": amp.fp8_recipe}))
    model, techniques, details = prepare.prepare(models.build(cfg.model, {"num_classes": 10}, 3), cfg, env, amp)
    assert techniques["fp8"] == "applied" and techniques["compile"] == "applied"
    assert details["fp8"]["compile"].startswith("turned on by precision=fp8") and model._compiled_call_impl is not None
    monkeypatch.setattr(precision, "convert_fp8", lambda model, amp: ("skipped: nothing large enough", {}))
    model, techniques, _ = prepare.prepare(models.build(cfg.model, {"num_classes": 10}, 3), cfg, env, amp)
    assert "compile" not in techniques and model._compiled_call_impl is None  # bf16 only: compile stays as given
