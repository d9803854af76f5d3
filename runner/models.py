"""Models: torchvision (or runner's own) modules instantiated from ``_target_`` and fitted to the data."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner.errors import ConfigError

#: Model-group keys that are runner switches, not constructor arguments.
RUNNER_KEYS = ("cifar_stem", "drop_bias_before_bn")


class ConvBlock(nn.Sequential):
    """Conv3x3 (with bias, as most tutorials write it) -> BatchNorm -> ReLU -> MaxPool2d(2).

    Input ``(B, C_in, H, W)`` -> output ``(B, C_out, H // 2, W // 2)``. The conv bias is redundant before
    BatchNorm (its mean subtraction cancels it); ``model.drop_bias_before_bn=true`` removes it.
    """

    def __init__(self, c_in: int, c_out: int):
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2))


class MnistCNN(nn.Module):
    """Two ConvBlocks (32, 64 channels) and a linear head: ~99% MNIST test accuracy after one epoch.

    Input ``(B, in_channels, H, W)`` float, H, W >= 4; output logits ``(B, num_classes)``.
    ~7.7 MFLOPs per 28x28 sample forward.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(ConvBlock(in_channels, 32), ConvBlock(32, 64))
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.head = nn.Linear(64 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def _first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d] | None:
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.Conv2d):
                return module, child_name, child
    return None


def build(cfg: DictConfig, data_kwargs: dict[str, int], in_channels: int | None = None) -> nn.Module:
    """Instantiate ``cfg._target_(**data_kwargs)`` and fit its stem to the data.

    ``data_kwargs`` are the sizes the data dictates (``Data.model_kwargs``: ``num_classes`` for images,
    ``vocab_size`` for text, e.g. ``runner.gpt.GPT``). For image data (``in_channels`` given) the first
    ``Conv2d`` is rebuilt when the data has another channel count (e.g. ResNet on MNIST), and
    ``cifar_stem`` turns a ResNet's 7x7/2 stem + max-pool into a 3x3/1 stem without pooling, the usual
    change for 32x32 inputs (He et al. 2016, section 4.2).

    Raises:
        ConfigError: ``_target_`` cannot be imported or called, or ``cifar_stem`` on a non-ResNet.
    """
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in RUNNER_KEYS}
    try:
        model = instantiate(kwargs, **data_kwargs)
    except Exception as e:  # hydra wraps import and call errors in InstantiationException
        raise ConfigError(f"model._target_={cfg._target_!r} could not be built: {e}") from e
    if cfg.cifar_stem:
        if not (hasattr(model, "conv1") and hasattr(model, "maxpool")):
            raise ConfigError(f"model.cifar_stem=true needs a torchvision ResNet; {cfg._target_} has no conv1/maxpool")
        model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    found = _first_conv(model) if in_channels is not None else None
    if found is not None:
        parent, name, conv = found
        if conv.in_channels != in_channels:
            setattr(parent, name, nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                                            conv.padding, bias=conv.bias is not None))
    return model
