"""Optimizers: ``_target_`` from the config, the LR scaled to the global batch, the kernel chosen.

Techniques recorded here (their switches live in the ``optimizer`` group; docs/configuration.md):

- 3, LR scaling: ``optimizer.lr_scaling`` (``scaled_lr``).
- 5, the optimizer and its kernel: ``optimizer=sgd|adamw|lamb|lars|muon``, ``optimizer.impl``.
- 11, ``optimizer.set_to_none``: the engine's ``optimizer.zero_grad(set_to_none=cfg.set_to_none)`` frees the
  ``.grad`` tensors instead of writing zeros into them (PyTorch Performance Tuning Guide,
  https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#use-parameter-grad-none-instead-of-model-zero-grad-or-optimizer-zero-grad).
- 14, gradient clipping: ``optimizer.clip_grad_norm`` (``gradient_clipping``; Pascanu et al. 2013,
  https://arxiv.org/abs/1211.5063).
"""

from __future__ import annotations

import inspect
import math

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from runner.config import check_choice
from runner.errors import ConfigError

#: Optimizer-group keys that are runner switches, not constructor arguments.
RUNNER_KEYS = ("lr_scaling", "base_batch_size", "impl", "set_to_none", "clip_grad_norm", "decay_all")
#: ``optimizer=muon``'s keys that runner turns into the AdamW part's parameter groups (``muon_groups``).
MUON_KEYS = ("adamw_lr", "adamw_eps")
#: The class behind ``optimizer=muon``: one optimizer holding both update rules (see ``muon_groups``).
MUON_TARGET = "timm.optim.Muon"
#: ``optimizer.impl`` -> constructor arguments. ``loop`` = the single-tensor for-loop implementation.
_IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def scaled_lr(cfg: DictConfig, global_batch_size: int) -> float:
    """Technique 3: scale the LR with the global batch (Goyal et al. 2017, https://arxiv.org/abs/1706.02677).

    ``linear``: lr x B / B0 (the paper's rule for SGD); ``sqrt``: lr x sqrt(B / B0) (Krizhevsky 2014,
    https://arxiv.org/abs/1404.5997, common for Adam-type optimizers); ``none``: lr unchanged.
    B = ``global_batch_size`` (micro-batch x accumulate_steps x world size, in samples),
    B0 = ``optimizer.base_batch_size`` (the batch ``optimizer.lr`` was tuned for).

    Raises:
        ConfigError: an unknown ``lr_scaling`` or a non-positive ``base_batch_size``.
    """
    if cfg.base_batch_size <= 0:
        raise ConfigError(f"optimizer.base_batch_size={cfg.base_batch_size} must be > 0 (samples)")
    ratio = global_batch_size / cfg.base_batch_size
    rules = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}
    check_choice("optimizer.lr_scaling", cfg.lr_scaling)
    return cfg.lr * rules[cfg.lr_scaling]


def build(cfg: DictConfig, model: torch.nn.Module, global_batch_size: int, device: torch.device):
    """Return ``(optimizer, techniques)`` for the model's trainable parameters.

    ``_target_`` is any optimizer class: ``torch.optim.SGD``/``AdamW`` (Loshchilov & Hutter 2019,
    https://arxiv.org/abs/1711.05101), and LAMB (You et al. 2019, https://arxiv.org/abs/1904.00962) and
    LARS (You et al. 2017, https://arxiv.org/abs/1708.03888) from ``timm.optim``
    (https://huggingface.co/docs/timm/reference/optimizers). Note timm's ``Lamb`` clips the global grad
    norm to ``max_grad_norm=1.0`` by default.

    ``impl`` picks the kernel (https://pytorch.org/docs/stable/optim.html#algorithms): ``fused``, ``foreach``
    or ``loop`` (``_IMPLS``); null keeps torch's default. An optimizer class without that argument (timm's
    LAMB/LARS have no ``fused``) records the switch as skipped with the reason.

    ``decay_all=false`` puts the tensors with fewer than 2 dimensions (biases, LayerNorm/BatchNorm gains)
    in a second parameter group without weight decay, as nanoGPT's ``configure_optimizers`` and GPT-2 do.

    ``optimizer=muon`` (``timm.optim.Muon``; Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/): one
    optimizer whose parameter groups say which rule each tensor takes (``muon_groups``); ``impl`` is skipped.

    Raises:
        ConfigError: an unknown ``impl`` or ``_target_``, or an optimizer torch refuses to build (e.g. a
            fused kernel the device lacks); for ``optimizer=muon`` the checks of ``muon_groups``.
    """
    techniques: dict[str, str] = {}
    muon = cfg._target_ == MUON_TARGET
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items()
              if k not in RUNNER_KEYS + (MUON_KEYS if muon else ())}
    kwargs["lr"] = scaled_lr(cfg, global_batch_size)
    if cfg.lr_scaling != "none":
        techniques["lr_scaling"] = "applied"
    if cfg.impl is not None:
        check_choice("optimizer.impl", cfg.impl)
        target = cfg._target_
        try:
            cls = get_class(target)
        except Exception as e:  # noqa: BLE001 - hydra raises ImportError or ValueError
            raise ConfigError(f"optimizer._target_={target!r} cannot be imported: {e}") from e
        accepted = inspect.signature(cls.__init__).parameters
        if all(k in accepted for k in _IMPLS[cfg.impl]):
            kwargs.update(_IMPLS[cfg.impl])
            techniques[f"optimizer_{cfg.impl}"] = "applied"
        else:
            missing = [k for k in _IMPLS[cfg.impl] if k not in accepted]
            techniques[f"optimizer_{cfg.impl}"] = (f"skipped: {target} has no {cfg.impl} implementation "
                                                   f"(no {'/'.join(missing)} argument)")
    if cfg.set_to_none:
        techniques["zero_grad_set_to_none"] = "applied"
    if cfg.clip_grad_norm is not None:
        if cfg.clip_grad_norm <= 0:
            raise ConfigError(f"optimizer.clip_grad_norm={cfg.clip_grad_norm} must be > 0 or null (off)")
        techniques["clip_grad_norm"] = "applied"
    params = [p for p in model.parameters() if p.requires_grad]
    if muon:
        params = muon_groups(cfg, model)
        kwargs["fallback_lr_scale"] = cfg.adamw_lr / cfg.lr
    elif not cfg.decay_all:  # nanoGPT / GPT-2: decay matrices and embeddings; biases and norm gains keep their scale
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        # _convert_="all": plain lists in the param groups (timm keeps betas as given; a ListConfig in the saved
        # state is not plain data, so resuming refused the checkpoint of optimizer=lamb|muon)
        optimizer = instantiate(kwargs, params, _convert_="all")
    except Exception as e:
        raise ConfigError(f"optimizer {cfg._target_} could not be built with {kwargs}: {e}") from e
    return optimizer, techniques


def tensor_lr(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter group's LR as a 0-d CPU tensor (``compile_step``)."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))


def compile_step(optimizer: torch.optim.Optimizer) -> str:
    """``compile.optimizer``: ``torch.compile`` the optimizer's step, the update of every parameter traced into fused
    kernels (PyTorch recipe "Compiling the optimizer", https://pytorch.org/tutorials/recipes/compiling_optimizer.html).
    Its LRs must be tensors (``tensor_lr``, before the scheduler is built), which the LR schedulers fill in place, so a
    schedule changes a value, not the graph (the recipe's "with an LR scheduler"); call it after the scheduler is
    built (it wraps the step)."""
    optimizer.step = torch.compile(optimizer.step, fullgraph=False)  # type: ignore[method-assign]
    return "applied"


Named = list[tuple[str, torch.nn.Parameter]]


def muon_split(model: torch.nn.Module) -> tuple[Named, Named]:
    """``(matrices, rest)``: the trainable parameters that take Muon and those that take AdamW, as ``(name, tensor)``
    in ``named_parameters`` order (a tied weight once, under its first name).

    The matrices are the tensors of >= 2 dimensions except every ``nn.Embedding``'s weights, the output head's (the
    last ``Linear``/``Conv`` module in registration order) and a tensor whose ``(shape[0], rest)`` view has a side
    of 1; conv filters take Muon on their ``(out, in*kh*kw)`` view (timm's ``conv_mode="flatten"``). Why these:
    docs/configuration.md, "Muon" (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/).
    """
    modules = list(model.modules())
    embeddings = {id(p) for m in modules if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}
    layers = [m for m in modules if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))]
    head = {id(p) for p in layers[-1].parameters(recurse=False)} if layers else set()

    def matrix(p: torch.Tensor) -> bool:
        return p.dim() >= 2 and id(p) not in embeddings | head and p.shape[0] > 1 and math.prod(p.shape[1:]) > 1

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if matrix(p)], [(n, p) for n, p in named if not matrix(p)]


def muon_groups(cfg: DictConfig, model: torch.nn.Module) -> list[dict]:
    """``optimizer=muon``'s parameter groups for one ``timm.optim.Muon``: the matrices (``muon_split``) with
    ``use_muon=True``, the rest with ``use_muon=False`` (timm's AdamW fallback, with ``nesterov=False`` so it is AdamW,
    not NAdamW, and ``eps=adamw_eps``); ``decay_all=false`` moves the AdamW part's 1-D tensors to a group without
    weight decay. Every group has the same ``lr`` (OneCycleLR and CyclicLR set one LR for all groups): the AdamW part
    runs at ``lr x fallback_lr_scale``, the scale ``adamw_lr / lr``. Why, and why timm's Muon: docs/configuration.md,
    "Muon".

    Raises:
        ConfigError: ``lr`` or ``adamw_lr`` not > 0, ``ns_steps`` < 1, ``momentum`` outside [0, 1), or a model with no
            hidden matrix (Muon would update nothing).
    """
    for ok, key, value, rule in (
            (cfg.lr > 0, "lr", cfg.lr, "must be > 0 (the AdamW part's LR is adamw_lr / lr of it)"),
            (cfg.adamw_lr > 0, "adamw_lr", cfg.adamw_lr, "must be > 0 (the AdamW part's LR; Jordan et al.: 3e-4)"),
            (cfg.ns_steps >= 1, "ns_steps", cfg.ns_steps, "must be >= 1 (Newton-Schulz iterations; 5 is usual)"),
            (0 <= cfg.momentum < 1, "momentum", cfg.momentum, "must be in [0, 1) (0.95 is usual)")):
        if not ok:
            raise ConfigError(f"optimizer.{key}={value} {rule}")
    matrices, rest = muon_split(model)
    if not matrices:  # every tensor would take the AdamW fallback: optimizer=muon would be AdamW under another name
        raise ConfigError(f"optimizer=muon: {type(model).__name__} has no hidden matrix for Muon (its {len(rest)} "
                          f"trainable tensors are embeddings, the output head, biases or gains, which take AdamW); "
                          f"use optimizer=adamw")
    adamw = {"use_muon": False, "nesterov": False, "eps": cfg.adamw_eps}
    groups = [{"params": [p for _, p in matrices], "use_muon": True}]
    if cfg.decay_all:
        groups.append({"params": [p for _, p in rest], **adamw})
    else:
        groups += [{"params": [p for _, p in rest if p.dim() >= 2], **adamw},
                   {"params": [p for _, p in rest if p.dim() < 2], **adamw, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]



def gradient_clipping(max_norm: float | None, model: torch.nn.Module, scaler: torch.amp.GradScaler):
    """Technique 14 as the callable the loop runs before each optimizer step: clip the global L2 norm of
    the gradients to ``max_norm`` after ``scaler.unscale_`` (so the true gradients are clipped, not the
    loss-scaled ones; PyTorch AMP examples, https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-clipping).

    ``clip(optimizer, norm=False)`` returns the global L2 norm before clipping as a 0-dim tensor on the device (no
    host sync) when ``norm`` is true (the loop asks at log steps: the row's ``grad_norm``), and None otherwise.
    ``max_norm`` None: nothing is clipped. Under FSDP the norm covers every shard."""
    params = [p for p in model.parameters() if p.requires_grad]

    def full(norm: torch.Tensor) -> torch.Tensor:
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip(optimizer: torch.optim.Optimizer, norm: bool = False) -> torch.Tensor | None:
        if max_norm is None and not norm:
            return None
        scaler.unscale_(optimizer)
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return full(total) if norm else None  # full_tensor is a collective under FSDP: only when asked for
        grads = [p.grad for p in params if p.grad is not None]
        return full(torch.nn.utils.get_total_norm(grads)) if grads else None

    return clip
