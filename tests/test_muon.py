"""``optimizer=muon``: Muon for the hidden matrices, AdamW for the rest, in one ``timm.optim.Muon`` (techniques.optim).

The split on runner's real models (GPT with its tied head, the CNN, the MLP, ResNet-18), one update against
``torch.optim.Muon`` and ``torch.optim.AdamW`` on the same tensors, the orthogonalized update, a run through the engine
that lowers the loss, the clear errors, and exact resume (one process here; FSDP2 in tests/test_resume.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from conftest import TINY_GPT, compose_cfg
from runner import models
from runner.errors import ConfigError
from runner.models.gpt import GPT
from runner.techniques import optim


def muon_cfg(*overrides: str):
    return compose_cfg("optimizer=muon", *overrides).optimizer


def names(pairs) -> list[str]:
    return [n for n, _ in pairs]


# ------------------------------------------------------------------------------------------- the split


def test_gpt_split_hidden_matrices_take_muon_embeddings_tied_head_and_norms_take_adamw():
    model = GPT(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
    matrices, rest = optim.muon_split(model)
    hidden = [
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert names(matrices) == hidden
    assert all(p.dim() == 2 for _, p in matrices)
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(names(rest))
    assert any(p is model.lm_head.weight for _, p in rest)  # the head, tied to the token table: AdamW, once
    assert all(p is not model.lm_head.weight for _, p in matrices)
    one_d = [n for n, p in model.named_parameters() if p.dim() == 1]  # every bias and LayerNorm gain/bias
    assert set(one_d) <= set(names(rest)) and len(one_d) == 2 * (4 + 4) + 2  # per block: 4 Linear biases, 2 LNs
    assert len(matrices) + len(rest) == len(list(model.parameters()))  # every trainable tensor, once


@pytest.mark.parametrize("name, muon_count", [("mnist_cnn", 2), ("mlp", 2), ("resnet18", 20)])
def test_vision_models_split_convs_and_hidden_linears_to_muon_head_and_norms_to_adamw(name, muon_count):
    model = models.build(compose_cfg(f"model={name}").model, {"num_classes": 10}, 3, example=torch.zeros(3, 16, 16))
    matrices, rest = optim.muon_split(model)
    assert len(matrices) == muon_count
    head = model.fc if name == "resnet18" else model.head
    assert head.weight.dim() == 2 and any(p is head.weight for _, p in rest)
    convs_and_linears = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(convs_and_linears) == muon_count + 1  # every conv filter and hidden Linear, but the head
    assert all(p.dim() < 2 or p is head.weight for _, p in rest)


def test_a_class_token_and_a_position_table_held_as_bare_parameters_are_vectors_for_adamw():
    model = nn.Module()
    model.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
    model.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
    model.body = nn.Linear(8, 8)
    model.head = nn.Linear(8, 3)
    matrices, rest = optim.muon_split(model)
    assert names(matrices) == ["body.weight"]
    assert names(rest) == ["cls_token", "pos_embed", "body.bias", "head.weight", "head.bias"]


def test_the_optimizer_groups_say_which_rule_each_tensor_takes():
    model = GPT(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
    matrices, rest = optim.muon_split(model)
    opt, _ = optim.build(muon_cfg(), model, 64, torch.device("cpu"))
    assert [len(g["params"]) for g in opt.param_groups] == [len(matrices), len(rest)]
    muon, adamw = opt.param_groups
    assert muon["use_muon"] and not adamw["use_muon"] and not adamw["nesterov"]  # plain AdamW, not NAdamW
    assert muon["lr"] == adamw["lr"] == 0.02 and adamw["lr"] * adamw["fallback_lr_scale"] == pytest.approx(3e-4)
    opt, _ = optim.build(muon_cfg("optimizer.decay_all=false"), model, 64, torch.device("cpu"))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.01, 0.0]
    assert [p.dim() >= 2 for p in opt.param_groups[2]["params"]] == [False] * 18


# ------------------------------------------------------------------------------------------- the update


class Hidden(nn.Module):
    """An embedding, one hidden matrix (48 x 32), a head: the smallest model with both parts."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.hidden = nn.Linear(32, 48)
        self.head = nn.Linear(48, 5)


def test_one_step_equals_torch_muon_on_the_matrix_and_torch_adamw_on_the_rest():
    """timm's Muon as runner configures it computes, on the hidden matrix, the update ``torch.optim.Muon`` computes
    (Jordan's coefficients, Nesterov, ``adjust_lr_fn=original``), and on the rest what ``torch.optim.AdamW`` does at
    ``adamw_lr``; and the update is orthogonalized: its singular values lie close together where the gradient's
    spread over two orders of magnitude."""
    torch.manual_seed(0)
    model = Hidden()
    u, _ = torch.linalg.qr(torch.randn(48, 32))
    v, _ = torch.linalg.qr(torch.randn(32, 32))
    spectrum = torch.logspace(0, -2, 32)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    grads["hidden.weight"] = u @ torch.diag(spectrum) @ v.T
    theirs = copy.deepcopy(model)
    opt, _ = optim.build(muon_cfg(), model, 64, torch.device("cpu"))
    ref_muon = torch.optim.Muon(
        [theirs.hidden.weight],
        lr=0.02,
        weight_decay=0.01,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr_fn="original",
    )
    others = [p for n, p in theirs.named_parameters() if n != "hidden.weight"]
    ref_adamw = torch.optim.AdamW(others, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)
    before = model.hidden.weight.detach().clone()
    for _ in range(3):
        for m in (model, theirs):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, dict(theirs.named_parameters())[n], rtol=1e-6, atol=1e-7, msg=n)
    one = torch.optim.Muon([nn.Parameter(before.clone())], lr=1.0, weight_decay=0.0, momentum=0.95)
    one.param_groups[0]["params"][0].grad = grads["hidden.weight"]
    one.step()  # first step from zero momentum: the update is -NS(gradient)
    update = (before - one.param_groups[0]["params"][0].detach()) / (48 / 32) ** 0.5  # adjust_lr_fn=original's scale
    s = torch.linalg.svdvals(update)
    assert spectrum.max() / spectrum.min() > 99
    assert s.min() > 0.5 and s.max() < 1.5 and s.max() / s.min() < 2, s  # Jordan: U S' V^T, S' ~ U(0.5, 1.5)


# ------------------------------------------------------------------------------------------- the engine


@pytest.mark.slow  # ~15 s on 2 busy cores; test_techniques trains muon 2 steps in the quick suite
def test_training_with_muon_through_the_engine_lowers_the_loss(tmp_path, tiny_text):
    from runner.engine.train import train

    cfg = compose_cfg(
        *TINY_GPT,
        f"data.path={tiny_text}",
        "optimizer=muon",
        "optimizer.impl=foreach",
        "optimizer.clip_grad_norm=1.0",
        "optimizer.decay_all=false",
        "trainer.max_steps=30",
        "trainer.log_every=1",
    )
    summary = train(cfg, job_dir=tmp_path)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.2, losses  # 3.53 -> 3.16 here
    techniques = summary["techniques"]
    assert techniques["optimizer_foreach"].startswith("skipped: timm.optim.Muon has no foreach implementation")
    assert techniques["clip_grad_norm"] == "applied"
    assert summary["config"]["optimizer"]["adamw_lr"] == 3e-4


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.adamw_lr=0", "optimizer.adamw_lr=0.0 must be > 0"),
        ("optimizer.lr=0", "optimizer.lr=0.0 must be > 0 (the AdamW part's LR is adamw_lr / lr of it)"),
        ("optimizer.ns_steps=0", "optimizer.ns_steps=0 must be >= 1"),
        ("optimizer.momentum=1", "optimizer.momentum=1.0 must be in [0, 1)"),
    ],
)
def test_bad_muon_settings_stop_with_one_clear_error_before_anything_is_written(tmp_path, override, message):
    from runner.engine.train import train

    with pytest.raises(ConfigError) as caught:
        train(compose_cfg("optimizer=muon", "model=mlp", override), job_dir=tmp_path)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()


# ------------------------------------------------------------------------------------------- exact resume


@pytest.mark.slow
def test_killed_muon_run_resumes_exactly(tmp_path):
    """Killed at a random step and started again, a Muon run ends where the straight run ends: equal weights, equal
    optimizer state (momentum buffers, the AdamW moments, each tensor's ``use_muon``), the same loss rows. The CNN:
    conv filters on Muon; a schedule that sets one LR for all groups."""
    from test_resume import JOB, assert_exact_resume

    assert_exact_resume(tmp_path, [*JOB, "optimizer=muon", "optimizer.decay_all=false", "scheduler=onecycle"])


def test_muon_on_a_model_with_no_hidden_matrix_is_refused_naming_it(tmp_path):
    """A model whose every tensor is an embedding, the head, a bias or a gain would train with AdamW alone under
    optimizer=muon, silently: one error line says so and names the fix."""
    with pytest.raises(ConfigError, match=r"optimizer=muon: Linear has no hidden matrix for Muon .*optimizer=adamw"):
        optim.muon_groups(compose_cfg("optimizer=muon").optimizer, torch.nn.Linear(8, 3))
    assert (
        optim.muon_groups(
            compose_cfg("optimizer=muon").optimizer, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        )[0]["use_muon"]
        is True
    )
