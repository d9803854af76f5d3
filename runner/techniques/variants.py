"""The ablation's variants, generated from the technique table and the two presets (``ablation/variant``).

For each technique with a ``variant``: ``baseline+<variant>`` (leave-one-in) is conf/experiment/baseline.yaml with
the technique set as conf/experiment/fast.yaml sets it (else as its ``command``), and ``fast-<variant>``
(leave-one-out) is fast.yaml with the technique set as baseline.yaml sets it, for the techniques fast.yaml has on.
A technique is set through the keys of its ``on`` that the presets write, else through its config group. The
variants that are no technique of the table (``baseline``, ``fast``, the bigger batch, ``fast-data_loading``) stay
files in conf/ablation/variant/.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner import CONF_DIR
from runner.config import register_configs
from runner.techniques import TECHNIQUES, Technique

#: fast.yaml's data loading leaves as one (conf/ablation/variant/fast-data_loading.yaml): with the data on the
#: device the loader's workers have nothing to do, so taking off either alone would measure fast.yaml again
JOINT_LEAVE_OUT = ("pinned_workers", "on_device_data")


def _preset(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A preset's group choices (its ``override /group: option`` lines) and its values as dotted keys (raw: the
    resolvers stay for the job to resolve)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml"), resolve=False)
    groups = {k.removeprefix("override /"): v for d in raw.pop("defaults") if isinstance(d, dict) for k, v in d.items()}
    values: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else values.__setitem__(f"{prefix}{k}", v)

    walk(raw, "")
    return groups, values


def _settings(t: Technique, base: tuple[dict, dict], fast: tuple[dict, dict]) -> tuple[dict, dict | None]:
    """The technique on (as fast.yaml sets it) and off (as baseline.yaml sets it; None when fast.yaml leaves it
    off), each ``{"groups": {...}, "values": {...}}``."""
    keys = [k for k in t.keys() if k in fast[1]]
    if keys:
        on, off = {k: fast[1][k] for k in keys}, {k: base[1][k] for k in keys}
        return {"groups": {}, "values": on}, ({"groups": {}, "values": off} if on != off else None)
    if t.command and len(t.command) == 1 and "=" in t.command[0] and "." not in t.command[0].split("=")[0]:
        group, option = t.command[0].split("=", 1)  # a config group's option, e.g. memory=selective
        chosen = fast[0].get(group)
        if chosen == option or chosen in t.equivalent:
            return {"groups": {group: chosen}, "values": {}}, {"groups": {group: base[0][group]}, "values": {}}
        return {"groups": {group: option}, "values": {}}, None
    return {"groups": {}, "values": t.changes()}, None


def _node(preset: str, kind: str, name: str, t: Technique, setting: dict) -> Any:
    node = OmegaConf.create(
        {
            "defaults": [
                f"/experiment/{preset}",
                *({f"override /{g}": o} for g, o in setting["groups"].items()),
                "_self_",
            ],
            "ablation": {"variant": name, "kind": kind, "technique": t.variant},
        }
    )
    for key, value in setting["values"].items():
        OmegaConf.update(node, key, value, force_add=True)
    return node


def generate() -> dict[str, Any]:
    """Variant name -> its config node (``# @package _global_``), for every technique of the table with a variant."""
    base, fast = _preset("baseline"), _preset("fast")
    out = {}
    for t in TECHNIQUES.values():
        if t.variant is None:
            continue
        on, off = _settings(t, base, fast)
        out[f"baseline+{t.variant}"] = _node("baseline", "leave-one-in", f"baseline+{t.variant}", t, on)
        if off is not None and t.variant not in JOINT_LEAVE_OUT:
            out[f"fast-{t.variant}"] = _node("fast", "leave-one-out", f"fast-{t.variant}", t, off)
    return out


#: The schema node ``register`` stored last: while the ConfigStore still holds it, nothing is stored again
_STORED: list = []


def register() -> None:
    """The configs Hydra composes: the schemas (``runner.config.register_configs``) and the generated variants.
    Stored once per process, and again where the ConfigStore no longer holds the schema stored last (a fresh
    instance, the entry dropped or replaced): storing them built every structured config anew, a third of each
    ``compose``'s time."""
    _share_the_store()
    store = ConfigStore.instance()
    if _STORED and store.repo.get("config_schema.yaml") is _STORED[0]:
        return
    register_configs()
    for name, node in generate().items():
        store.store(group="ablation/variant", name=name, node=node, package="_global_")
    _STORED[:] = [store.repo["config_schema.yaml"]]


def compose(overrides: list[str], searchpath: list[str] | tuple[str, ...] = ()) -> Any:
    """runner's config for the command-line ``overrides``, as ``python -m runner`` composes it (the one way runner's
    tools compose outside their own Hydra app): conf/ with the schemas and variants registered (``register``) and a
    job's own config folders (``searchpath``, its ``hydra.searchpath``). Inside a running Hydra app it composes in
    that app's context (its config folder and search path). Raises Hydra's errors as they come (callers word them).
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    extra = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=[*extra, *overrides])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[*extra, *overrides])


def _share_the_store() -> None:
    """A copy of Hydra's config repository shares the ConfigStore instead of copying it. Hydra 1.3 deep-copies the
    repository for every composition and every group listing (``CachingConfigRepository``), and with it the store its
    structured source holds: with runner's schemas and variants stored, ~40 ms a copy, a fifth of each compose and
    ~6 s of ``python -m runner --help`` (215 listings). The store is a process-wide singleton; Hydra's structured
    source looks it up on each use from facebookresearch/hydra#2928 on, which this does for the Hydra 1.3 releases."""
    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
