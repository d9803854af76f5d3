"""The speed tuner's candidates (runner/tune/speed.py): the switches that apply to a job on its hardware, the
user's own (``tune.switches``), a config with switches applied, and ``+experiment=fast`` under the user's command
(what the verification compares the pick with)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, applies, applies_to_job

#: Candidates that are not one technique of runner/techniques/: a combination (bf16 with the attention in fp32),
#: a setting of the machine (half the threads), recipe changes (a larger micro-batch with the LR scaled)
TUNER_ONLY = ("bf16_upcast_attention", "half_threads", "batch_x2", "batch_x4")

#: optimizers that have a fused kernel (torch.optim; others record ``optimizer_fused`` as skipped)
FUSED = ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD", "torch.optim.Adagrad")


@dataclass(frozen=True)
class Switch:
    """One candidate: ``name`` (the table's), ``changes`` (dotted key -> value, applied to the run config),
    ``group`` (switches of one group exclude each other: one compile mode, one optimizer kernel, one
    precision), ``recipe`` (True: it changes the recipe, only with ``tune.allow=recipe``) and ``arithmetic``
    (False for the switches that move data or syncs and compute the same thing on the same batches: on-device
    data, loader workers, pinning, fewer syncs, ``set_to_none``; the guard skips them)."""

    name: str
    changes: dict[str, Any]
    group: str | None = None
    recipe: bool = False
    arithmetic: bool = True  # False: it only moves data or work (same batches, same operations): not guarded

    @classmethod
    def of(cls, name: str) -> "Switch":
        """The technique ``name`` of runner/techniques/ as a candidate: its changes (this machine's values), group
        and whether it changes the arithmetic."""
        t = TECHNIQUES[name]
        return cls(t.name, t.changes(), t.group, arithmetic=t.arithmetic)

    @property
    def overrides(self) -> list[str]:
        """The command-line form: ``["compile.mode=default", ...]``."""
        return [f"{k}={_value(v)}" for k, v in self.changes.items()]


def _value(v: Any) -> str:
    return "true" if v is True else "false" if v is False else "null" if v is None else str(v)


def switches(cfg: DictConfig, device, allow: str = "speed") -> tuple[list[Switch], list[str]]:
    """The built-in switches that apply to ``cfg`` on ``device`` and are not already on, and one note per
    switch left out and why (for the report).

    Args:
        cfg: the composed run config (the user's job).
        device: ``torch.device`` the job runs on.
        allow: ``speed`` (the recipe stays: same batch, LR, schedule) or ``recipe`` (also the micro-batch).
    """
    offers = _Offers(cfg)
    cuda = device.type == "cuda"
    _compile_and_optimizer(offers, cfg, cuda)
    _data(offers, cfg, cuda)
    _precision(offers, cfg, device)
    _the_rest(offers, cfg, cuda)
    # selective checkpointing recomputes to save memory: it pays for speed only through the larger micro-batch
    recipe_only = "it recomputes to save memory for a larger micro-batch: tune.allow=recipe"
    why_not = applies_to_job("selective_checkpointing", cfg, cuda=cuda) or (allow != "recipe" and recipe_only)
    offers(Switch.of("selective_checkpointing"), not why_not, why_not or "")
    if allow == "recipe":
        b = int(cfg.dataloader.batch_size)
        scaling = cfg.optimizer.lr_scaling if cfg.optimizer.lr_scaling != "none" else "linear"
        for k in (2, 4):
            offers(Switch(f"batch_x{k}", {"dataloader.batch_size": k * b, "optimizer.lr_scaling": scaling},
                          "batch", recipe=True), True, "")
    else:
        offers.notes.append("recipe changes (a larger micro-batch with the LR scaled) not tried: tune.allow=speed")
    return offers.out, offers.notes


class _Offers:
    """The candidates offered so far (``out``) and the notes on those left out (``notes``)."""

    def __init__(self, cfg: DictConfig):
        self.cfg, self.out, self.notes = cfg, [], []

    def __call__(self, switch: Switch, applies: bool, why_not: str) -> None:
        """Offer ``switch`` where it ``applies`` and is not already on; else note ``why_not``."""
        if all(OmegaConf.select(self.cfg, k) == v for k, v in switch.changes.items()):
            self.notes.append(f"{switch.name}: already on in your configuration")
        elif not applies:
            self.notes.append(f"{switch.name}: not a candidate ({why_not})")
        else:
            self.out.append(switch)


def _compile_and_optimizer(offer: _Offers, cfg: DictConfig, cuda: bool) -> None:
    mode = cfg.compile.mode
    offer(Switch.of("compile"), mode is None or cuda, "")
    # max-autotune also picks among inductor's GEMM/conv templates on a CPU (the GPT recipe, interleaved: x1.137
    # on top of bf16, the default mode x1.121); reduce-overhead adds CUDA graphs, on a CPU it is the default mode
    offer(Switch.of("compile_max_autotune"), True, "")
    # each repeated block compiled once: a shorter cold compile, which a short job or a fresh node pays (a model
    # without repeated blocks compiles whole, and the guard drops the candidate: it would be compile again)
    offer(Switch.of("compile_regional"), mode is None or cuda or not cfg.compile.regional, "")
    offer(Switch.of("compile_reduce_overhead"), cuda,
          "its CUDA graphs need a GPU; on a CPU it is the default mode")
    target = cfg.optimizer._target_
    offer(Switch.of("fused_optimizer"), target in FUSED,
          f"{target} has no fused kernel")
    offer(Switch.of("foreach_optimizer"),
          target.startswith("torch.optim."), f"{target} is not a torch.optim optimizer")


def _data(offer: _Offers, cfg: DictConfig, cuda: bool) -> None:
    from runner import IN_MEMORY_DATA

    dl = cfg.dataloader
    offer(Switch.of("on_device_data"),
          cfg.data.name in IN_MEMORY_DATA, f"data={cfg.data.name} has no in-memory form")
    if not dl.on_device:
        offer(Switch.of("loader_workers"), dl.num_workers == 0, "")
        why_not = applies("pinned_memory", cuda=cuda)
        offer(Switch.of("pinned_memory"), why_not is None, why_not or "")


def _precision(offer: _Offers, cfg: DictConfig, device) -> None:
    import torch

    from runner.measure import hardware

    cuda = device.type == "cuda"
    precision = cfg.precision.name
    bf16 = (cuda and torch.cuda.is_bf16_supported()) or (not cuda and hardware.cpu_has_native_bf16())
    fp32 = precision in ("fp32", "tf32")
    no_bf16 = "your precision is already reduced" if not fp32 else "this device has no native bf16"
    offer(Switch.of("bf16"), fp32 and bf16, no_bf16)
    # bf16 with the attention kept in fp32 (runner.models.gpt.GPT's upcast_attention): on a CPU, torch's bf16
    # flash-attention backward is several times slower than fp32's at small shapes, enough to make bf16 lose
    upcast = OmegaConf.select(cfg, "model.upcast_attention")
    offer(Switch("bf16_upcast_attention", {"precision.name": "bf16", "model.upcast_attention": True}, "precision"),
          fp32 and bf16 and upcast is not None and not cuda,
          no_bf16 if not (fp32 and bf16) else "the model has no upcast_attention switch (runner.models.gpt.GPT has)"
          if upcast is None else "on CUDA, flash attention runs in bf16 itself; fp32 would leave it")
    offer(Switch.of("amp"), fp32 and cuda,
          "fp16 with a GradScaler acts on CUDA only (on a CPU amp is bf16, the bf16 candidate)")
    capability = torch.cuda.get_device_capability(device) if cuda else None
    ampere = capability is not None and capability[0] >= 8
    no_tf32 = (f"precision={precision} is not fp32: TF32 changes only fp32 matmuls and convolutions"
               if precision != "fp32" else "TF32 needs an NVIDIA GPU of compute capability 8.0 or newer; this job runs "
               "on the CPU" if not cuda else f"TF32 needs compute capability 8.0 or newer; this GPU has "
               f"{capability[0]}.{capability[1]}")
    offer(Switch.of("tf32"), precision == "fp32" and ampere, no_tf32)
    # int8 matmuls pay on GPUs with INT8 tensor cores; on a CPU they ran slower than bf16 (docs/configuration.md)
    offer(Switch.of("int8"), fp32 and cuda and ampere, "its int8 matmuls pay on a GPU with INT8 tensor cores (8.0+)"
          if fp32 else no_bf16)
    offer(Switch.of("sparse24"), cfg.compress.name == "none" and ampere and fp32,
          "2:4 sparse matmuls need a CUDA GPU of compute capability 8.0 or newer" if not ampere else
          "another compression, or a precision that replaces the Linear layers, is on")


def _the_rest(offer: _Offers, cfg: DictConfig, cuda: bool) -> None:
    import torch

    from runner.measure import hardware

    for name in ("channels_last", "cudnn_benchmark"):
        why_not = applies_to_job(name, cfg, cuda=cuda)
        offer(Switch.of(name), why_not is None, why_not or "")
    why_not = applies_to_job("chunked_loss", cfg, cuda=cuda)
    offer(Switch.of("chunked_loss"), why_not is None, why_not or "")
    offer(Switch.of("compiled_optimizer_step"), True, "")
    offer(Switch.of("set_to_none"), True, "")
    offer(Switch.of("fewer_syncs"), cfg.trainer.log_every < 50,
          f"trainer.log_every={cfg.trainer.log_every} already syncs at most every 50 steps")
    threads = max(1, hardware.cpu_cores() // 2)
    offer(Switch("half_threads", {"trainer.num_threads": threads}),
          not cuda and threads != torch.get_num_threads(), "CPU threads matter on a CPU job only"
          if cuda else "one core: no fewer threads to try")


def chosen(cfg: DictConfig, t: DictConfig, device) -> tuple[list[Switch], list[str]]:
    """The candidates of this search: the built-in ``switches`` (narrowed by ``tune.only``) and
    ``tune.switches``.

    Raises:
        ConfigError: ``tune.only`` names a switch that does not exist; ``tune.switches`` holds a change whose
            key is not in the run config, or a name of a built-in switch.
    """
    builtin, notes = switches(cfg, device, t.allow)
    known = {s.name for s in builtin} | {n.split(":")[0] for n in notes}
    if t.only is not None:
        unknown = [n for n in t.only if n not in known]
        if unknown:
            raise ConfigError(f"tune.only={list(t.only)}: no switch named {', '.join(unknown)}; the switches of this "
                              f"job: {', '.join(sorted(known))}")
        builtin = [s for s in builtin if s.name in t.only]
    own = []
    for name, changes in (t.switches or {}).items():
        if name in known:
            raise ConfigError(f"tune.switches.{name}: a built-in switch has that name; name yours differently")
        if not OmegaConf.is_dict(changes) or not changes:
            raise ConfigError(f"tune.switches.{name} must map config keys to values, e.g. "
                              f"{{optimizer.impl: fused}}")
        for key in changes:
            if OmegaConf.select(cfg, str(key), default="<missing>") == "<missing>":
                raise ConfigError(f"tune.switches.{name}: {key} is not a key of the run config")
        own.append(Switch(str(name), {str(k): OmegaConf.to_container(changes)[k] for k in changes}))
    return builtin + own, notes


def applied(cfg: DictConfig, chosen_switches: list[Switch]) -> DictConfig:
    """A copy of ``cfg`` with every switch's changes."""
    out = copy.deepcopy(cfg)
    for s in chosen_switches:
        for key, value in s.changes.items():
            OmegaConf.update(out, key, value, merge=False)
    return out


def fast_config() -> tuple[DictConfig | None, str]:
    """The user's command with ``+experiment=fast`` layered under it (``+experiment=[fast,<theirs>]``: their
    preset's keys win, as in scripts/bench_gpt.py), composed by Hydra; ``(None, why)`` outside a Hydra app or
    when it does not compose."""
    from hydra.core.hydra_config import HydraConfig

    from runner.techniques.variants import compose

    if not HydraConfig.initialized():
        return None, "the fast preset is composed from the command line (python -m runner.tune speed ...)"
    overrides = list(HydraConfig.get().overrides.task)
    mine = [o for o in overrides if o.lstrip("+").startswith("experiment=")]
    rest = [o for o in overrides if o not in mine]
    if mine:
        theirs = mine[0].split("=", 1)[1].strip("[]")
        if "fast" in [x.strip() for x in theirs.split(",")]:
            return None, "your command already uses +experiment=fast"
        experiment = f"+experiment=[fast,{theirs}]"
    else:
        experiment = "+experiment=fast"
    try:
        return compose([*rest, experiment]), experiment
    except Exception as e:  # noqa: BLE001 - any composition error only drops the comparison
        return None, f"{experiment} does not compose with your overrides ({e})"
