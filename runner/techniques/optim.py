"""Optimizers: ``_target_`` from the config, the LR scaled to the global batch, the kernel chosen.

Techniques recorded here (their switches live in the ``optimizer`` group; docs/configuration.md):

- 3, LR scaling: ``optimizer.lr_scaling`` (``scaled_lr``).
- 5, the optimizer and its kernel: ``optimizer=sgd|adamw|lamb|lars|muon``, ``optimizer.impl``.
- 11, ``optimizer.set_to_none``: ``zero_grad(set_to_none=...)``
  (https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).
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
from runner.techniques import TECHNIQUES, Job, compile_cache

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

    ``linear``: lr x B / B0; ``sqrt``: lr x sqrt(B / B0) (Krizhevsky 2014, https://arxiv.org/abs/1404.5997); ``none``.
    B = ``global_batch_size`` (samples), B0 = ``optimizer.base_batch_size`` (the batch ``optimizer.lr`` was tuned for).

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

    ``_target_``: any optimizer class: SGD, AdamW (https://arxiv.org/abs/1711.05101), timm's LAMB
    (https://arxiv.org/abs/1904.00962; clips the grad norm to 1.0 by default) and LARS
    (https://arxiv.org/abs/1708.03888), Muon (``muon_groups``). ``impl``: the kernel (``_IMPLS``;
    https://pytorch.org/docs/stable/optim.html#algorithms), skipped where the class lacks it. ``decay_all=false``:
    no weight decay on tensors of < 2 dimensions, as nanoGPT's ``configure_optimizers``.

    Raises:
        ConfigError: an unknown ``impl`` or ``_target_``, or an optimizer torch refuses to build (e.g. a
            fused kernel the device lacks); for ``optimizer=muon`` the checks of ``muon_groups``.
    """
    techniques: dict[str, str] = {}
    muon = cfg._target_ == MUON_TARGET
    kwargs = {
        k: v
        for k, v in OmegaConf.to_container(cfg, resolve=True).items()
        if k not in RUNNER_KEYS + (MUON_KEYS if muon else ())
    }
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
        # fused and foreach: where the table says they act (the class takes the argument); loop: foreach=False
        technique = TECHNIQUES.get(f"{cfg.impl}_optimizer")
        if technique is not None:
            why = technique.why_not(Job({"optimizer": {"_target_": target}}))
        else:
            why = (
                None
                if "foreach" in inspect.signature(cls.__init__).parameters
                else f"{target} has no loop implementation (no foreach argument)"
            )
        if why is None:
            kwargs.update(_IMPLS[cfg.impl])
            techniques[f"optimizer_{cfg.impl}"] = "applied"
        else:
            techniques[f"optimizer_{cfg.impl}"] = f"skipped: {why}"
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
        params = [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
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
    """``compile.optimizer``: ``torch.compile`` the optimizer's step; its LRs must be tensors (``tensor_lr``, before
    the scheduler); call it after the scheduler is built. https://pytorch.org/tutorials/recipes/compiling_optimizer.html
    """
    compile_cache.isolate()  # this process's own Inductor cache folder, never the global one
    optimizer.step = torch.compile(optimizer.step, fullgraph=False)  # type: ignore[method-assign]
    return "applied"


Named = list[tuple[str, torch.nn.Parameter]]


def muon_split(model: torch.nn.Module) -> tuple[Named, Named]:
    """``(matrices, rest)``: the trainable parameters that take Muon and those that take AdamW, as ``(name, tensor)``
    in ``named_parameters`` order (a tied weight once, under its first name).

    Matrices: tensors of >= 2 dimensions but embeddings, the output head and ``(shape[0], rest)`` views with a side
    of 1 (conv filters as ``(out, in*kh*kw)``). Why: docs/configuration.md, "Muon".
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
    """``optimizer=muon``'s parameter groups for one ``timm.optim.Muon`` (Jordan et al. 2024,
    https://kellerjordan.github.io/posts/muon/): ``muon_split``'s matrices with ``use_muon=True``, the rest AdamW at
    ``lr x fallback_lr_scale`` (``adamw_lr / lr``). Why: docs/configuration.md, "Muon".

    Raises:
        ConfigError: ``lr`` or ``adamw_lr`` not > 0, ``ns_steps`` < 1, ``momentum`` outside [0, 1), or a model with no
            hidden matrix (Muon would update nothing).
    """
    for ok, key, value, rule in (
        (cfg.lr > 0, "lr", cfg.lr, "must be > 0 (the AdamW part's LR is adamw_lr / lr of it)"),
        (cfg.adamw_lr > 0, "adamw_lr", cfg.adamw_lr, "must be > 0 (the AdamW part's LR; Jordan et al.: 3e-4)"),
        (cfg.ns_steps >= 1, "ns_steps", cfg.ns_steps, "must be >= 1 (Newton-Schulz iterations; 5 is usual)"),
        (0 <= cfg.momentum < 1, "momentum", cfg.momentum, "must be in [0, 1) (0.95 is usual)"),
    ):
        if not ok:
            raise ConfigError(f"optimizer.{key}={value} {rule}")
    matrices, rest = muon_split(model)
    if not matrices:  # every tensor would take the AdamW fallback: optimizer=muon would be AdamW under another name
        raise ConfigError(
            f"optimizer=muon: {type(model).__name__} has no hidden matrix for Muon (its {len(rest)} "
            f"trainable tensors are embeddings, the output head, biases or gains, which take AdamW); "
            f"use optimizer=adamw"
        )
    adamw = {"use_muon": False, "nesterov": False, "eps": cfg.adamw_eps}
    groups = [{"params": [p for _, p in matrices], "use_muon": True}]
    if cfg.decay_all:
        groups.append({"params": [p for _, p in rest], **adamw})
    else:
        groups += [
            {"params": [p for _, p in rest if p.dim() >= 2], **adamw},
            {"params": [p for _, p in rest if p.dim() < 2], **adamw, "weight_decay": 0.0},
        ]
    return [g for g in groups if g["params"]]


def gradient_clipping(max_norm: float | None, model: torch.nn.Module, scaler: torch.amp.GradScaler):
    """Technique 14: clip the gradients' global L2 norm to ``max_norm`` (None: no clipping) after ``scaler.unscale_``
    (https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-clipping). ``clip(optimizer, norm=False)``
    returns the norm before clipping as a 0-dim device tensor when ``norm``, else None."""
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
