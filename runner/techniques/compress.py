"""Compression during training, the ``compress`` group (docs/configuration.md, "Compression during training"): applied
by ``runner.techniques.prepare`` before activation checkpointing and compile, each returning a ``summary.json``
``techniques`` status.

- ``qat``: torchao quantization-aware training (``QATConfig``,
  https://docs.pytorch.org/ao/stable/generated/torchao.quantization.qat.QATConfig.html): every Linear layer trains
  fake-quantized as ``int8_config()`` will compute; ``to_int8`` is its convert step (``python -m runner.export --format
  int8``). The weights stay fp32 under their own names, so ``model.safetensors`` and checkpoints are unchanged.
- ``sparse24``: torchao's 2:4 semi-structured sparse training (``torchao.sparsity.training``,
  https://github.com/pytorch/ao/tree/main/torchao/sparsity/training) of the large Linear layers, on CUDA GPUs of
  compute capability 8.0+; skipped elsewhere.
"""

from __future__ import annotations

import functools

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from runner.config import check_choice
from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, Job
from runner.techniques.precision import edge_layers

#: What ``compress=qat`` simulates and ``to_int8`` computes (torchao's ``Int8DynamicActivationInt8WeightConfig``)
QAT_SCHEME = "int8 activations per token (asymmetric, scaled at run time) x int8 weights per output channel (symmetric)"

#: Precisions that replace the Linear layers themselves: no second technique can wrap them
_OWN_LINEARS = ("fp8", "int8")


def linear_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s Linear layers that torchao's ``quantize_`` acts on (``nn.Linear``, except the
    ``NonDynamicallyQuantizableLinear`` inside ``nn.MultiheadAttention``, whose forward never calls it)."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear)
    ]


def apply(model: nn.Module, cfg: DictConfig, device: torch.device) -> tuple[dict[str, str], dict[str, object]]:
    """``compress.name`` applied to ``model`` in place (``cfg``: the whole config).

    Returns:
        ``({}, {})`` for ``none``; else ``({name: "applied" | "skipped: <why>"}, {name: details})``.

    Raises:
        ConfigError: an unknown ``compress.name``; ``precision=fp8`` or ``int8`` with a compression (both replace
            the Linear layers); a model without a Linear layer; ``compress.min_features`` < 1.
    """
    name = cfg.compress.name
    check_choice("compress.name", name)
    if name == "none":
        return {}, {}
    if cfg.precision.name in _OWN_LINEARS:
        raise ConfigError(
            f"compress={name} cannot run with precision={cfg.precision.name}: both replace the model's "
            f"Linear layers; pick one (precision=bf16 or auto with compress={name})"
        )
    layers = linear_layers(model)
    if not layers:
        raise ConfigError(
            f"compress={name} acts on Linear layers and the model {cfg.model._target_} has none; "
            f"train it with compress=none"
        )
    if name == "qat":
        status, details = apply_qat(model, layers)
    else:
        status, details = apply_sparse24(model, cfg.compress.min_features, device)
    return {name: status}, {name: details}


def _fake_quantize_configs():
    """The (activation, weight) ``IntxFakeQuantizeConfig`` of ``QAT_SCHEME``: the numerics of ``int8_config()``
    (checked in tests/test_compress.py: the converted model matches the fake-quantized one within 1e-6)."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    return (
        IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
        IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True),
    )


def int8_config():
    """torchao's post-training config of the int8 model (``Int8DynamicActivationInt8WeightConfig``, activations
    asymmetric): ``int8`` weights with fp32 scales, int8 matmuls (``torch._int_mm``) on CPUs and CUDA."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig
    from torchao.quantization.quant_primitives import MappingType

    return Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC)


def apply_qat(model: nn.Module, layers: list[str]) -> tuple[str, dict[str, object]]:
    """``compress=qat``: QATConfig's prepare step on the Linear layers ``layers``, in place: each becomes torchao's
    ``FakeQuantizedLinear`` (same shapes ``(out, in)``, same parameter names), whose forward rounds its input and
    weight to ``QAT_SCHEME``'s int8 grid and back; the rounding passes gradients straight through.

    Returns:
        ``("applied", {"scheme": QAT_SCHEME, "layers": layers})``.
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    activations, weights = _fake_quantize_configs()
    chosen = set(layers)
    quantize_(
        model,
        QATConfig(activation_config=activations, weight_config=weights, step="prepare"),
        filter_fn=lambda m, fqn: fqn in chosen,
    )
    return "applied", {"scheme": QAT_SCHEME, "layers": layers}


def to_int8(model: nn.Module) -> str:
    """Convert ``model``'s Linear layers to int8 in place (the weights become torchao ``Int8Tensor``s: int8 values
    ``(out, in)``, one fp32 scale per output channel): QATConfig's convert step with ``int8_config()`` for a model
    ``apply_qat`` prepared, else torchao post-training quantization with the same config.

    Returns:
        ``"qat"`` (converted the fake-quantized layers) or ``"post-training"``.

    Raises:
        ConfigError: the model has no Linear layer.
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    if any(isinstance(m, FakeQuantizedLinear) for m in model.modules()):
        quantize_(model, QATConfig(int8_config(), step="convert"))
        return "qat"
    chosen = set(linear_layers(model))
    if not chosen:
        raise ConfigError(f"--format int8 quantizes Linear layers and the model {type(model).__name__} has none")
    quantize_(model, int8_config(), filter_fn=lambda m, fqn: fqn in chosen)
    return "post-training"


def sparse24_unavailable(device: torch.device) -> str | None:
    """Why 2:4 sparse training cannot run on ``device``, or None: its matmuls need cuSPARSELt on a CUDA GPU of compute
    capability >= 8.0 (the technique table's ``sparse24`` entry)."""
    if why := TECHNIQUES["sparse24"].why_not(Job.of(None, device)):
        return why
    if not torch.backends.cusparselt.is_available():
        return "this torch build has no cuSPARSELt (torch.backends.cusparselt.is_available() is False)"
    return None


def sparse_layers(model: nn.Module, min_features: int) -> list[str]:
    """The Linear layers ``compress=sparse24`` swaps: not the first or last (``edge_layers``), in_features and
    out_features both >= ``min_features`` and multiples of 64 (the 2:4 kernels' tiles)."""
    edges = set(edge_layers(model))
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and name not in edges
        and min(m.in_features, m.out_features) >= min_features
        and m.in_features % 64 == m.out_features % 64 == 0
    ]


def apply_sparse24(model: nn.Module, min_features: int, device: torch.device) -> tuple[str, dict[str, object]]:
    """``compress=sparse24``: ``sparse_layers`` swapped in place (``swap_linear_with_semi_sparse_linear``) for
    torchao's ``SemiSparseLinear`` with 16-bit operands (``_semi_sparse_linear``).

    Returns:
        ``(status, {"layers": [...], "min_features": n})``: skipped off CUDA >= 8.0 or with no layer large enough.

    Raises:
        ConfigError: ``min_features`` < 1.
    """
    if min_features < 1:
        raise ConfigError(f"compress.min_features={min_features} must be >= 1")
    layers = sparse_layers(model, min_features)
    details: dict[str, object] = {"layers": layers, "min_features": min_features}
    why = sparse24_unavailable(device)
    if why is None and not layers:
        why = (
            f"no Linear layer between the first and last has in_features and out_features >= "
            f"compress.min_features={min_features} and multiples of 64"
        )
    if why is not None:
        return f"skipped: {why}; the plain model trains", details
    from torchao.sparsity.training import swap_linear_with_semi_sparse_linear

    swap_linear_with_semi_sparse_linear(model, dict.fromkeys(layers, _semi_sparse_linear()))
    return "applied", details


@functools.cache
def _semi_sparse_linear() -> type[nn.Linear]:
    """torchao's ``SemiSparseLinear`` with its operands in 16 bits: cuSPARSELt multiplies fp16/bf16 only, and
    runner keeps fp32 weights under autocast. The weight is cast to autocast's dtype (bf16 without autocast), pruned
    to 2:4 by magnitude (``semi_structured_sparsify``; its gradient passes straight through to the fp32 weight) and
    multiplied with the input cast alike; without autocast the output is cast back to the input's dtype."""
    from torchao.sparsity.training import SemiSparseLinear
    from torchao.sparsity.training.autograd import semi_structured_sparsify

    class SemiSparseLinear16(SemiSparseLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            autocast = torch.is_autocast_enabled(x.device.type)
            dtype = torch.get_autocast_dtype(x.device.type) if autocast else torch.bfloat16
            weight = semi_structured_sparsify(self.weight.to(dtype), backend="cusparselt")
            out = F.linear(x.to(dtype), weight, None if self.bias is None else self.bias.to(dtype))
            return out if autocast else out.to(x.dtype)

    return SemiSparseLinear16


def for_evaluation(model: nn.Module, cfg: DictConfig) -> None:
    """A finished job's plain model made to compute as it trained (``runner.evaluate.rebuild``): ``compress=qat``'s
    fake-quantized layers; sparse24 is not re-applied (its weights are dense, evaluated as such)."""
    if cfg.get("compress", {}).get("name") == "qat":
        layers = linear_layers(model)
        if layers:
            apply_qat(model, layers)
