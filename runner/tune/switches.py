"""The speed tuner's candidates (runner/tune/speed.py): the switches that apply to a job on its hardware, the
user's own (``tune.switches``), a config with switches applied, and ``+experiment=fast`` under the user's command
(what the verification compares the pick with)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, Job

#: Candidates that are not one technique of runner/techniques/: recipe changes (a larger micro-batch with the LR
#: scaled, ``tune.allow=recipe``)
TUNER_ONLY = ("batch_x2", "batch_x4")

#: The order the candidates are offered in (the table's tuner candidates; one not named here comes last)
ORDER = (
    "compile",
    "compile_max_autotune",
    "compile_regional",
    "compile_reduce_overhead",
    "fused_optimizer",
    "foreach_optimizer",
    "on_device_data",
    "loader_workers",
    "pinned_memory",
    "bf16",
    "bf16_upcast_attention",
    "amp",
    "tf32",
    "int8",
    "sparse24",
    "channels_last",
    "cudnn_benchmark",
    "chunked_loss",
    "compiled_optimizer_step",
    "set_to_none",
    "fewer_syncs",
    "half_threads",
    "selective_checkpointing",
)


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
    switch left out and why (for the report): the technique table decides (``Technique.why_not``).

    Args:
        cfg: the composed run config (the user's job).
        device: ``torch.device`` the job runs on.
        allow: ``speed`` (the recipe stays: same batch, LR, schedule) or ``recipe`` (also the micro-batch).
    """
    job, out, notes = Job.of(cfg, device), [], []
    rank = {name: i for i, name in enumerate(ORDER)}
    for t in sorted((t for t in TECHNIQUES.values() if t.tuner), key=lambda t: rank.get(t.name, len(ORDER))):
        switch = Switch.of(t.name)
        why_not = t.why_not(job, candidate=True)
        # selective checkpointing recomputes to save memory: it pays for speed only through the larger micro-batch
        if why_not is None and t.name == "selective_checkpointing" and allow != "recipe":
            why_not = "it recomputes to save memory for a larger micro-batch: tune.allow=recipe"
        if all(OmegaConf.select(cfg, k) == v for k, v in switch.changes.items()):
            notes.append(f"{switch.name}: already on in your configuration")
        elif why_not:
            notes.append(f"{switch.name}: not a candidate ({why_not})")
        else:
            out.append(switch)
    if allow == "recipe":
        b = int(cfg.dataloader.batch_size)
        scaling = cfg.optimizer.lr_scaling if cfg.optimizer.lr_scaling != "none" else "linear"
        out += [
            Switch(
                f"batch_x{k}", {"dataloader.batch_size": k * b, "optimizer.lr_scaling": scaling}, "batch", recipe=True
            )
            for k in (2, 4)
        ]
    else:
        notes.append("recipe changes (a larger micro-batch with the LR scaled) not tried: tune.allow=speed")
    return out, notes


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
            raise ConfigError(
                f"tune.only={list(t.only)}: no switch named {', '.join(unknown)}; the switches of this "
                f"job: {', '.join(sorted(known))}"
            )
        builtin = [s for s in builtin if s.name in t.only]
    own = []
    for name, changes in (t.switches or {}).items():
        if name in known:
            raise ConfigError(f"tune.switches.{name}: a built-in switch has that name; name yours differently")
        if not OmegaConf.is_dict(changes) or not changes:
            raise ConfigError(f"tune.switches.{name} must map config keys to values, e.g. {{optimizer.impl: fused}}")
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
