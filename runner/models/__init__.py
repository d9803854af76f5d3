"""Models: any module class or factory named by ``model._target_``, with its constructor arguments from the
config, fitted to the data (``build``), optionally starting from torchvision's pretrained weights; runner's own
``MnistCNN`` and ``MLP``. docs/data-and-models.md: "Your own model", "Fine-tuning pretrained torchvision weights".
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import CONF_DIR
from runner.config import targets
from runner.errors import ConfigError, deterministic_refusal
from runner.models import hf

log = logging.getLogger(__name__)

#: Model-group keys that are runner switches, not constructor arguments.
RUNNER_KEYS = ("cifar_stem", "drop_bias_before_bn", "weights", "freeze_backbone")


class ConvBlock(nn.Sequential):
    """Conv3x3 (with bias, as most tutorials write it) -> BatchNorm -> ReLU -> MaxPool2d(2).

    Input ``(B, C_in, H, W)`` -> output ``(B, C_out, H // 2, W // 2)``. The conv bias is redundant before
    BatchNorm (its mean subtraction cancels it); ``model.drop_bias_before_bn=true`` removes it.
    """

    def __init__(self, c_in: int, c_out: int):
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True), nn.MaxPool2d(2)
        )


class MnistCNN(nn.Module):
    """Two ConvBlocks (32, 64 channels) and a linear head: ~99% MNIST test accuracy after one epoch.

    Input ``(B, in_channels, H, W)`` float, H, W >= 4; output logits ``(B, num_classes)``; ~7.7 MFLOPs per 28x28 sample.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(ConvBlock(in_channels, 32), ConvBlock(32, 64))
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.head = nn.Linear(64 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class MLPBlock(nn.Sequential):
    """Linear(c_in, c_out) -> ReLU -> Dropout(p): ``(B, c_in)`` -> ``(B, c_out)``."""

    def __init__(self, c_in: int, c_out: int, dropout: float = 0.0):
        super().__init__(nn.Linear(c_in, c_out), nn.ReLU(inplace=True), nn.Dropout(dropout))


class MLP(nn.Module):
    """A multi-layer perceptron for vectors: ``depth`` MLPBlocks of ``hidden`` units and a linear head.

    Input ``(B, *shape)`` float with ``prod(shape) == in_features`` (flattened first, so images work too);
    output logits ``(B, num_classes)``, or ``(B, num_outputs)`` values when ``num_outputs`` is given (it wins).
    ``depth=0`` is a linear model; runner fills ``in_features`` and the output size from the data. About
    ``2 * (in_features * hidden + (depth - 1) * hidden**2 + hidden * outputs)`` FLOPs per sample forward.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int = 10,
        hidden: int = 128,
        depth: int = 2,
        dropout: float = 0.0,
        num_outputs: int | None = None,
    ):
        super().__init__()
        outputs = num_classes if num_outputs is None else num_outputs
        if in_features < 1 or outputs < 1 or hidden < 1 or depth < 0 or not 0 <= dropout < 1:
            raise ValueError(
                f"MLP needs in_features, outputs, hidden >= 1, depth >= 0 and 0 <= dropout < 1; got "
                f"{in_features=}, {outputs=}, {hidden=}, {depth=}, {dropout=}"
            )
        widths = [in_features] + [hidden] * depth
        self.blocks = nn.Sequential(*(MLPBlock(a, b, dropout) for a, b in zip(widths, widths[1:])))
        self.head = nn.Linear(widths[-1], outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.flatten(x, 1)))


def _first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d] | None:
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.Conv2d):
                return module, child_name, child
    return None


# ------------------------------------------------------------------------------ pretrained weights


def resolve_weights(builder, target: str, name: str):
    """The torchvision ``WeightsEnum`` member ``model.weights=name`` means for the builder ``target``.

    ``name``: a member of the builder's enum (``DEFAULT``) or a full name (``ResNet18_Weights.IMAGENET1K_V1``);
    sources: ``torchvision.models.get_model_weights``, ``get_weight``.

    Raises:
        ConfigError: the builder takes no torchvision weights, the name is unknown (lists the builder's
            weights), or the weights belong to another architecture (names both).
    """
    from torchvision.models import get_model_weights, get_weight

    try:
        enum = get_model_weights(builder)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"model.weights={name!r} needs a torchvision model builder with a weights argument (e.g. "
            f"model._target_=torchvision.models.resnet18); model._target_={target} has none ({e}). "
            f"Load your own weights in your model's constructor instead."
        ) from e
    available = ", ".join(m for m in enum.__members__)
    if "." in name:
        try:
            weights = get_weight(name)
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"model.weights={name!r} is not a torchvision weights name ({e!r}); "
                f"{target} takes {enum.__name__}: {available}"
            ) from e
        if not isinstance(weights, enum):
            raise ConfigError(
                f"model.weights={name!r} are weights for another architecture: {target} takes "
                f"{enum.__name__} ({available}), not {type(weights).__name__}. Pick "
                f"model.weights={enum.__name__}.<one of those>, or the model those weights are for."
            )
        return weights
    if name not in enum.__members__:
        raise ConfigError(f"model.weights={name!r} is not one of {target}'s weights: {enum.__name__} has {available}")
    return enum[name]


def cached_weights_file(weights) -> Path:
    """Where torchvision keeps ``weights``: ``$TORCH_HOME/hub/checkpoints/<URL's file name>`` (``torch.hub.get_dir``;
    ``$TORCH_HOME`` defaults to ``~/.cache/torch``), e.g. ``resnet18-f37072fd.pth`` (SHA-256 prefix after the dash)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def _first_line(e: Exception) -> str:
    """The telling line of an exception's message (torch.load's weights-only refusal: the unpickler's error)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _check_weights_file(weights, path: Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path``, read with ``torch.load(weights_only=True)``; warns when its SHA-256 does not start
    with the hash prefix in its name (torch.hub checks that only while downloading).

    Raises:
        ConfigError: the file is missing (gives the path and the URL to fetch it from), unreadable, or
            holds no state dict.
    """
    url = weights.url
    if not path.is_file():
        raise ConfigError(
            f"model.weights={weights!r}: the weights file {path} does not exist and runner does not "
            f"download. On a machine with network fetch {url} (e.g. `curl -L -o {path.name} {url}`) "
            f"and put it at {path} (the folder is $TORCH_HOME/hub/checkpoints; TORCH_HOME defaults "
            f"to ~/.cache/torch)."
        )
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file can raise almost anything
        raise ConfigError(
            f"model.weights={weights!r}: cannot read {path} as PyTorch weights ({type(e).__name__}: "
            f"{_first_line(e)}). Delete it and fetch it again from {url}."
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"model.weights={weights!r}: {path} holds a {type(state).__name__}, not a state dict of "
            f"tensors. Replace it with the file from {url}."
        )
    match = torch.hub.HASH_REGEX.search(path.name)
    if match:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if not digest.startswith(match.group(1)):
            log.warning(
                "%s: its SHA-256 %s... does not start with %s, the hash in its name: it is not the file "
                "torchvision publishes at %s (loaded anyway, as torch.hub does for cached files)",
                path,
                digest[:12],
                match.group(1),
                url,
            )
    return state


def _mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str:
    """What differs between a model's state dict and a file's: missing, unexpected, other shapes."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and own[k].shape != state[k].shape]
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's {len(own)} tensors missing (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
    if shapes:
        k = shapes[0]
        parts.append(
            f"{len(shapes)} of another shape (e.g. {k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
        )
    return "; ".join(parts) or "no difference in names or shapes"


def _load_pretrained(builder, target: str, kwargs: dict, weights) -> nn.Module:
    """``builder(weights=..., **kwargs)``, torchvision's own API, on the cached file (checked first: never downloads).

    Raises:
        ConfigError: the file is missing/unreadable (``_check_weights_file``), or it holds weights of
            another architecture (names the file, the model and what differs).
    """
    path = cached_weights_file(weights)
    state = _check_weights_file(weights, path)
    try:
        # the member's name, which the builder's WeightsEnum.verify accepts (an Enum cannot pass through instantiate)
        return targets.call("model._target_", target, {**kwargs, "weights": weights.name})
    except ConfigError as e:
        cause = e.__cause__
        if not (isinstance(cause, RuntimeError) and "state_dict" in str(cause)):
            raise
        try:  # the same architecture without weights, only to say what differs
            bare = targets.call("model._target_", target, {**kwargs, "num_classes": len(weights.meta["categories"])})
            diff = _mismatch(bare, state)
        except ConfigError:
            diff = str(cause).splitlines()[0]
        raise ConfigError(
            f"model.weights={weights!r}: {path} does not hold weights for {target}: {diff}. It "
            f"looks like another architecture's file; replace it with {weights.url}"
        ) from cause


def _replace_head(model: nn.Module, weights_classes: int, num_classes: int) -> nn.Module:
    """Replace the last Linear (or 1x1 Conv2d) with ``weights_classes`` outputs by a fresh ``num_classes`` one; returns
    it. Source: https://pytorch.org/tutorials/beginner/finetuning_torchvision_models_tutorial.html

    Raises:
        ConfigError: no such layer (the model is not a classifier with the weights' class count).
    """
    found = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == weights_classes:
            found = name, module
        elif isinstance(module, nn.Conv2d) and module.out_channels == weights_classes and module.kernel_size == (1, 1):
            found = name, module
    if found is None:
        raise ConfigError(
            f"model.weights: no Linear layer with {weights_classes} outputs (the weights' class count) "
            f"to replace by a {num_classes}-class head; this model is not a classifier runner can "
            f"fine-tune"
        )
    name, old = found
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, 1, bias=old.bias is not None)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return new


def _adapted_conv(conv: nn.Conv2d, in_channels: int, pretrained: bool) -> nn.Conv2d:
    """``conv`` rebuilt for ``in_channels`` inputs. Pretrained kernels are adapted, not discarded (timm's
    ``adapt_input_conv``): summed over RGB for 1 channel, else tiled and scaled by 3 / in_channels."""
    new = nn.Conv2d(
        in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, bias=conv.bias is not None
    )
    if pretrained:
        with torch.no_grad():
            w = conv.weight
            if in_channels == 1:
                new.weight.copy_(w.sum(1, keepdim=True))
            else:
                reps = math.ceil(in_channels / w.shape[1])
                new.weight.copy_(w.repeat(1, reps, 1, 1)[:, :in_channels] * (w.shape[1] / in_channels))
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
    return new


# ------------------------------------------------------------------------------ the input check


def _first_layer(model: nn.Module) -> str:
    """The first layer that fixes the input's size, described with what it expects."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            return f"its first layer {name} = Linear(in_features={m.in_features}) expects (B, ..., {m.in_features})"
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            dims = {nn.Conv1d: "L", nn.Conv2d: "H, W", nn.Conv3d: "D, H, W"}[type(m)]
            return (
                f"its first layer {name} = {type(m).__name__}(in_channels={m.in_channels}) expects "
                f"(B, {m.in_channels}, {dims})"
            )
        if isinstance(m, nn.Embedding):
            return (
                f"its first layer {name} = Embedding({m.num_embeddings}) expects integer indices < {m.num_embeddings}"
            )
    return "its layers give no expected shape"


def check_forward(model: nn.Module, example: torch.Tensor, size: int, classes: bool = True) -> None:
    """Run the model (eval, ``torch.inference_mode``) once on 2 copies of ``example`` (shape ``S``) and check the
    output is ``(2, size)`` (``(2,)`` also for one regression value, ``classes=False``); non-tensor outputs pass.

    Raises:
        ConfigError: the forward fails (names the data's input shape and what the first layer expects) or
            the output has another shape.
    """
    batch = example.unsqueeze(0).expand(2, *example.shape).clone()
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            out = model(batch)
    except Exception as e:  # noqa: BLE001 - whatever the model raises, the cause is the input
        if (refusal := deterministic_refusal(e)) is not None:  # ... unless it is trainer.deterministic's
            raise refusal from e
        raise ConfigError(
            f"the model does not take the data's inputs: items of shape {tuple(example.shape)} "
            f"({example.dtype}; a batch is {tuple(batch.shape)}), but {_first_layer(model)}. The "
            f"first forward failed with {type(e).__name__}: {_first_line(e)}. "
            f"Fix the model's arguments (model.<name>=...) or the data's shape."
        ) from e
    finally:
        model.train(was_training)
    fits = {(2, size)} | ({(2,)} if size == 1 and not classes else set())
    if isinstance(out, torch.Tensor) and tuple(out.shape) not in fits:
        what, name = (
            (f"logits for the data's {size} classes", "num_classes")
            if classes
            else (f"predictions for the targets' {size} values", "num_outputs")
        )
        raise ConfigError(
            f"the model returns {tuple(out.shape)} for a batch of 2, not (2, {size}) {what}: give the "
            f"model a {name} parameter (runner fills it in) or set its output size to {size}"
        )


# ------------------------------------------------------------------------------ what was built


def _count(n: int) -> str:
    """A parameter count for the console: ``5,130``, ``11.2 M``, ``1.3 B``."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def model_report(model: nn.Module, cfg: DictConfig) -> tuple[str, dict[str, object]]:
    """The console line for the built model (``model: resnet18, ...; 5,130 of 11.2 M parameters trainable``) and
    ``summary.json``'s ``model_details``; ``cfg``: the ``model`` node it was built from."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    name = str(cfg._target_).rpartition(".")[2]
    start = f"{cfg.weights} weights loaded" if cfg.weights else "randomly initialized"
    frozen = "; backbone frozen" if cfg.freeze_backbone else ""
    counted = (
        f"{_count(total)} parameters, all trainable"
        if trainable == total
        else f"{trainable:,} of {_count(total)} parameters trainable"
    )
    details = {
        "name": name,
        "target": str(cfg._target_),
        "weights": cfg.weights,
        "backbone_frozen": bool(cfg.freeze_backbone),
        "parameters": total,
        "trainable_parameters": trainable,
    }
    return f"model: {name}, {start}{frozen}; {counted}", details


# ------------------------------------------------------------------------------ trained weights


def load_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a job's ``model.safetensors`` into ``model`` (the plain class) in place and return it; a conv/linear bias
    the file lacks (``drop_bias_before_bn``) is zero. Sources: ``safetensors.torch.load_file``; Ioffe & Szegedy 2015.

    Raises:
        FileNotFoundError: no file at ``path``.
        RuntimeError: a key other than a dropped bias is missing or unexpected, or a shape differs (as
            ``load_state_dict`` reports it).
    """
    from safetensors.torch import load_file

    state = load_file(str(path))
    own = model.state_dict()
    for name in own.keys() - state.keys():
        layer_name, _, leaf = name.rpartition(".")
        layer = model.get_submodule(layer_name) if layer_name else model
        if leaf == "bias" and isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
            state[name] = torch.zeros_like(own[name])  # removed before training: the trained model's is zero
    model.load_state_dict(state)
    return model


# ------------------------------------------------------------------------------ build


def build(
    cfg: DictConfig, data_kwargs: dict[str, int], in_channels: int | None = None, example: torch.Tensor | None = None
) -> nn.Module:
    """Instantiate ``cfg._target_`` with the config's constructor arguments and fit it to the data.

    Args:
        cfg: the ``model`` node; keys other than ``_target_`` and ``RUNNER_KEYS`` are constructor arguments.
        data_kwargs: the task's ``model_kwargs`` (``num_classes``, ``vocab_size``, ``num_outputs``), passed when taken.
        in_channels: image channels of the input items (None for data that is not images).
        example: one input item (shape ``S``): ``in_features=prod(S)`` when taken and unset, and ``check_forward``.

    Steps: docs/data-and-models.md, "Fine-tuning".

    Raises:
        ConfigError: ``_target_`` unset (``model=base_model``), cannot be imported or called, an argument its signature
            lacks, the constructor raises, ``model.num_classes``/``model.vocab_size`` set (they follow the data), bad
            ``weights`` (unknown, another architecture's, file missing or unreadable), ``cifar_stem`` on a
            non-ResNet, ``freeze_backbone`` without ``weights``, or a model that does not take the data's inputs.
    """
    if OmegaConf.is_missing(cfg, "_target_"):  # model=base_model: the schema the options extend, not a model
        options = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise ConfigError(
            f"model._target_ is not set (model=base_model is the schema every model option extends, "
            f"not a model): pick model=<one of {options}>, or name your class with "
            f"model._target_=<module>.<class>"
        )
    if cfg.freeze_backbone and not cfg.weights:
        raise ConfigError(
            "model.freeze_backbone=true trains only a pretrained model's new head; set "
            "model.weights=<torchvision weights name> too (or leave freeze_backbone=false)"
        )
    builder = targets.locate("model._target_", cfg._target_)
    kwargs, names, any_name = _constructor_kwargs(cfg, builder, data_kwargs, example)
    num_classes = data_kwargs.get("num_classes")
    fresh: list[nn.Module] = []  # layers runner creates with random weights: never frozen
    if cfg.weights:
        if num_classes is None:
            raise ConfigError(
                "model.weights replaces a pretrained classifier's head for the data's classes; this "
                "task has none (token data, float targets). Load such weights in the model's constructor"
            )
        weights = resolve_weights(builder, cfg._target_, cfg.weights)
        model = _load_pretrained(builder, cfg._target_, kwargs, weights)
        fresh.append(_replace_head(model, len(weights.meta["categories"]), num_classes))
    else:
        kwargs |= {k: v for k, v in data_kwargs.items() if k in names or any_name}
        model = targets.call("model._target_", cfg._target_, kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"model._target_={cfg._target_!r} returned a {type(model).__name__}, not a torch nn.Module"
            )
    fresh += _fit_to_images(model, cfg, in_channels, example)
    if cfg.freeze_backbone:
        model.requires_grad_(False)
        for module in fresh:
            module.requires_grad_(True)
    if example is not None and (size := data_kwargs.get("num_classes", data_kwargs.get("num_outputs"))) is not None:
        check_forward(model, example, size, classes="num_classes" in data_kwargs)
    return model


def _constructor_kwargs(
    cfg: DictConfig, builder, data_kwargs: dict[str, int], example: torch.Tensor | None
) -> tuple[dict, set, bool]:
    """The constructor's keyword arguments (checked against its signature), its parameter names, and whether it
    takes any keyword.

    Raises:
        ConfigError: ``model.num_classes``/``model.vocab_size`` set (they follow the data), an argument the
            signature lacks.
    """
    kwargs = {k: v for k, v in targets.plain(cfg).items() if k not in RUNNER_KEYS and k != "_target_"}
    for key, value in data_kwargs.items():
        if key in kwargs:
            what, where = {
                "num_classes": ("the model's class count", "set data.num_classes instead"),
                "num_outputs": ("the model's output size", "it is the size of one target"),
            }.get(key, ("the model's vocabulary size", "it is the text's character count"))
            raise ConfigError(f"model.{key}={kwargs[key]} cannot be set: {what} follows the data ({value}); {where}")
    targets.check_arguments("model", builder, kwargs, RUNNER_KEYS)
    names, any_name = targets.parameters(builder)
    hf.fill_nested_config(kwargs, data_kwargs, names, any_name)
    if example is not None and "in_features" in names and "in_features" not in kwargs:
        kwargs["in_features"] = math.prod(example.shape)
    return kwargs, names, any_name


def _fit_to_images(
    model: nn.Module, cfg: DictConfig, in_channels: int | None, example: torch.Tensor | None
) -> list[nn.Module]:
    """``cifar_stem`` (a 3x3/1 stem without pooling, He et al. 2016 section 4.2) and the first ``Conv2d`` rebuilt
    for ``in_channels`` when the items are images; returns the layers built fresh (never frozen).

    Raises:
        ConfigError: ``cifar_stem`` on a model without ``conv1``/``maxpool`` or on data that are not images.
    """
    fresh: list[nn.Module] = []
    if cfg.cifar_stem:
        if not (hasattr(model, "conv1") and hasattr(model, "maxpool")) or in_channels is None:
            raise ConfigError(
                f"model.cifar_stem=true needs a torchvision ResNet on images; {cfg._target_} has no "
                f"conv1/maxpool or the data are not images"
            )
        model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
        fresh.append(model.conv1)
    image_items = in_channels is not None and (example is None or example.dim() == 3)  # items (C, H, W)
    found = _first_conv(model) if image_items else None
    if found is not None:
        parent, name, conv = found
        if conv.in_channels != in_channels:
            new = _adapted_conv(conv, in_channels, pretrained=bool(cfg.weights))
            setattr(parent, name, new)
            if not cfg.weights:
                fresh.append(new)
    return fresh
