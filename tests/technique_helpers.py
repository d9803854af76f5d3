"""Helpers for the technique tests: tiny models and a spy that sees inside the real engine.

``Spy`` wraps the engine's own builders (``models.build``, ``optim.build``, ``precision.build``,
``data.build``) with monkeypatch, so a test runs the real ``train()`` and then inspects what was built
and what happened during the steps: every forward call of the model (mode, dtypes, memory format,
autograd state) and every optimizer step that really ran (LR, gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

from runner import data as data_mod, models
from runner.techniques import optim, precision


class TinyMLP(nn.Module):
    """Flatten -> Linear(in_features, 32) -> ReLU -> Linear(32, num_classes); no BatchNorm, no dropout,
    so a batch of 16 and two accumulated batches of 8 give the same gradients."""

    def __init__(self, num_classes: int = 10, in_features: int = 3 * 16 * 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Untraceable(nn.Module):
    """Conv -> BN with data-dependent control flow: torch.fx.symbolic_trace cannot trace it."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a Proxy cannot be turned into a bool
            x = -x
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


class SharedConv(nn.Module):
    """One conv called twice: once into a BatchNorm, once not; its bias must stay."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.conv(x)


@dataclass
class Call:
    """One forward call of the top-level model inside the engine."""

    training: bool
    inference_mode: bool
    grad_enabled: bool
    anomaly: bool
    x_dtype: torch.dtype
    x_channels_last: bool
    out_dtype: torch.dtype
    out_requires_grad: bool
    out_has_grad_fn: bool
    weights_channels_last: bool  # every 4-D parameter is channels_last-contiguous


@dataclass
class Step:
    """One optimizer step that really ran (GradScaler skips ``optimizer.step`` on inf/NaN gradients)."""

    lr: float
    grad_norm: float  # global L2 norm of the gradients the optimizer sees
    grads: dict[str, torch.Tensor] | None


class Spy:
    """Wrap the engine's builders; ``keep_grads`` stores each step's gradients; ``scaler`` (a callable
    returning a GradScaler) replaces the precision's scaler, e.g. an enabled CPU GradScaler, and
    ``autocast`` (a callable returning a context manager) its autocast context."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.precisions: list[precision.Precision] = []
        self.datas: list[data_mod.Data] = []
        self.calls: list[Call] = []
        self.steps: list[Step] = []
        self.initial_params: dict[str, torch.Tensor] = {}
        self.keep_grads = False
        self.scaler: Callable[[], torch.amp.GradScaler] | None = None
        self.autocast: Callable | None = None
        self.hook = True
        orig_model, orig_optim, orig_prec, orig_data = models.build, optim.build, precision.build, data_mod.build

        def model_build(*a, **k):
            model = orig_model(*a, **k)
            self.models.append(model)
            if self.hook:
                model.register_forward_hook(self._on_forward)
            return model

        def optim_build(cfg, model, *a, **k):
            opt, status = orig_optim(cfg, model, *a, **k)
            self.optimizers.append(opt)
            self.named = {id(p): n for n, p in model.named_parameters()}
            self.initial_params = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.register_step_pre_hook(self._on_step)
            return opt, status

        def precision_build(*a, **k):
            prec = orig_prec(*a, **k)
            if self.scaler is not None:
                prec.scaler = self.scaler()
            if self.autocast is not None:
                prec.autocast = self.autocast
            self.precisions.append(prec)
            return prec

        def data_build(*a, **k):
            data = orig_data(*a, **k)
            self.datas.append(data)
            return data

        monkeypatch.setattr(models, "build", model_build)
        monkeypatch.setattr(optim, "build", optim_build)
        monkeypatch.setattr(precision, "build", precision_build)
        monkeypatch.setattr(data_mod, "build", data_build)

    @property
    def model(self) -> nn.Module:
        return self.models[-1]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[-1]

    @property
    def scaler_used(self) -> torch.amp.GradScaler:
        return self.precisions[-1].scaler

    def train_calls(self) -> list[Call]:
        return [c for c in self.calls if c.training]

    def eval_calls(self) -> list[Call]:
        return [c for c in self.calls if not c.training]

    def _on_forward(self, module, args, out) -> None:
        if not self.models or module is not self.models[-1]:  # e.g. the FLOP counter's deep copy
            return
        x = args[0]
        out = getattr(out, "logits", out)  # a Hugging Face model returns a ModelOutput
        self.calls.append(
            Call(
                training=module.training,
                inference_mode=torch.is_inference_mode_enabled(),
                grad_enabled=torch.is_grad_enabled(),
                anomaly=torch.is_anomaly_enabled(),
                x_dtype=x.dtype,
                x_channels_last=x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last),
                out_dtype=out.dtype,
                out_requires_grad=out.requires_grad,
                out_has_grad_fn=out.grad_fn is not None,
                weights_channels_last=all(
                    p.is_contiguous(memory_format=torch.channels_last) for p in module.parameters() if p.dim() == 4
                ),
            )
        )

    def _on_step(self, opt, args, kwargs) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
        kept = None
        if self.keep_grads:
            kept = {
                self.named[id(p)]: p.grad.detach().clone()
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        self.steps.append(Step(lr=opt.param_groups[0]["lr"], grad_norm=norm, grads=kept))
