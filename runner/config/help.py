"""The config groups ``python -m runner --help`` lists (conf/hydra/help/runner.yaml): runner's and a
``--config-dir``'s, without Hydra's own groups or the schemas runner stores as ``base_*``."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore


def config_groups_help() -> str:
    """The config groups ``python -m runner --help`` lists (conf/hydra/help/runner.yaml), one line each.

    Hydra's own list (``$APP_CONFIG_GROUPS``) would also show the ``base_*`` schemas stored above as if
    they were options; they are what YAML options extend, never a choice, so this lists every group and
    option of the search path (runner's and those a ``--config-dir`` adds) except Hydra's own groups and
    the ConfigStore's ``base_*`` entries.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():  # resolved outside a Hydra app (e.g. --cfg hydra --resolve)
        return "(see python -m runner --help)"
    loader, store = GlobalHydra.instance().config_loader(), ConfigStore.instance()

    def groups(parent: str) -> list[str]:
        found = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if group != "hydra":
                found += [group, *groups(group)]
        return found

    def schemas(group: str) -> set[str]:
        try:
            return {n.removesuffix(".yaml") for n in store.list(group) if n.startswith("base_")}
        except OSError:  # no ConfigStore entry in this group
            return set()

    lines = []
    for group in sorted(groups("")):
        options = sorted(set(loader.get_group_options(group, ObjectType.CONFIG)) - schemas(group))
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)
