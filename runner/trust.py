"""A job folder from someone else is data, never code: what a config read back from a folder may name and resolve.

Every config that ``runner.evaluate``, ``runner.export`` and ``runner.doctor --verify`` read back passes the
``check_*`` functions before anything it names is imported or called; why: docs/checkpointing.md, "What is safe to
load". Sources: https://hydra.cc/docs/advanced/instantiate_objects/overview/,
https://omegaconf.readthedocs.io/en/2.3_branch/custom_resolvers.html, https://docs.python.org/3/reference/import.html.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from runner.errors import ConfigError

#: Module namespaces whose classes and functions a config read back may name without being allowed: what
#: runner's configs and schemas use (models, tasks, optimizers) and the model zoos runner builds from.
NAMESPACES = (
    "runner.models",
    "runner.task",
    "torchvision.models",
    "torch.nn",
    "torch.optim",
    "timm.optim",
    "transformers",
)
#: runner's own ``_target_`` paths that moved when the package took its layer folders (2026-11-28): a job folder or a
#: checkpoint written before names the old path of the same object, and reading it back renames it (``moved``)
MOVED = {
    "runner.gpt.": "runner.models.gpt.",
    "runner.hf.": "runner.models.hf.",
    "runner.ablation.": "runner.sweeps.ablation.",
    "runner.jobdir.": "runner.engine.jobdir.",
}
#: The environment variable with more allowed module prefixes, comma-separated (as ``--allow-target``).
ALLOW_ENV = "RUNNER_ALLOW_TARGETS"
#: OmegaConf's resolvers that compute from the config alone; with runner's own (``runner_*``) and ``oc.env`` of
#: ``ENV_PREFIX`` variables, the only ones a config read back may use.
RESOLVERS = ("oc.select", "oc.dict.keys", "oc.dict.values", "oc.create", "oc.decode")
ENV_PREFIX = "RUNNER_"
#: A dotted Python name: ``package.module.attribute``.
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: A resolver's use in an interpolation: ``${name:``, with its first argument (``oc.env``'s variable).
_RESOLVER_USE = re.compile(r"\$\{\s*([A-Za-z_][\w.\-]*)\s*:\s*([^,}]*)")


def within(name: str, prefixes: Iterable[str]) -> bool:
    """``name`` is one of ``prefixes`` or inside one (``torch.nn.Linear`` is within ``torch.nn``; ``torch`` is not)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Policy:
    """What the user allowed a config read back from ``folder`` to name: everything (``trust``), module prefixes
    (``allowed``), or exact targets given as command-line overrides (``named``)."""

    trust: bool = False
    allowed: tuple[str, ...] = ()
    named: frozenset[str] = frozenset()
    folder: Path | None = None

    @classmethod
    def make(
        cls,
        trust: bool = False,
        allow: Iterable[str] = (),
        folder: Path | None = None,
        environ: dict[str, str] | None = None,
    ) -> Policy:
        """The policy of a command line: ``--trust``, ``--allow-target`` prefixes and ``RUNNER_ALLOW_TARGETS``.

        Raises:
            ConfigError: a prefix that is not a dotted Python name.
        """
        environ = os.environ if environ is None else environ
        from_env = [p.strip() for p in environ.get(ALLOW_ENV, "").split(",") if p.strip()]
        for source, prefixes in ((ALLOW_ENV, from_env), ("--allow-target", list(allow))):
            for p in prefixes:
                if not _DOTTED.fullmatch(p):
                    raise ConfigError(
                        f"{source} {p!r} is not a dotted module or target name; give a prefix such as "
                        f"my_data (every target in my_data.py) or my_data.tabular (that one)"
                    )
        return cls(trust=trust, allowed=tuple(from_env) + tuple(allow), folder=None if folder is None else Path(folder))

    def naming(self, targets: Iterable[str]) -> Policy:
        """This policy with ``targets`` (given on the command line) allowed exactly."""
        return replace(self, named=self.named | frozenset(targets))


def add_arguments(parser) -> None:
    """``--trust`` and ``--allow-target PREFIX`` on an ``argparse`` parser (evaluate, export, doctor)."""
    parser.add_argument(
        "--allow-target",
        action="append",
        default=[],
        metavar="PREFIX",
        help="allow the job's config to name targets under this module prefix (repeatable; also "
        f"{ALLOW_ENV}=a,b): e.g. my_data for data._target_=my_data.tabular",
    )
    parser.add_argument(
        "--trust",
        action="store_true",
        help="the job folder is yours: call every _target_ its config names and resolve every "
        "interpolation, as python -m runner does (default: runner's own targets only)",
    )


def _how(target: str) -> str:
    return (
        f"if you trust this folder, allow it with --allow-target {target} (or {ALLOW_ENV}={target}), or pass "
        f"--trust to allow everything it names"
    )


# ------------------------------------------------------------------------------------------------ targets


def moved(node: Any) -> Any:
    """``node`` (a plain dict or list, or a DictConfig) with each ``_target_`` that names a ``MOVED`` path renamed to
    the new one, in place; returns it."""
    listed = isinstance(node, list) or type(node).__name__ == "ListConfig"
    items = node.items() if hasattr(node, "items") else enumerate(node) if listed else ()
    for key, value in list(items):
        if key == "_target_" and isinstance(value, str):
            old = next((o for o in MOVED if value.startswith(o)), None)
            if old is not None:
                node[key] = MOVED[old] + value[len(old) :]
        else:
            moved(value)
    return node


def targets_in(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(key, value)`` of a ``_target_`` in a plain tree of dicts and lists, its key dotted
    (``model.config._target_``, ``callbacks.0._target_``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if k == "_target_":
                yield key, v
            else:
                yield from targets_in(v, key + ".")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from targets_in(v, f"{prefix}{i}.")


def _plain(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg


def check_config(cfg: Any, policy: Policy, source: Path | str) -> None:
    """Refuse a config read from ``source`` whose ``_target_``s (anywhere in the tree) the policy does not allow,
    before any of them is imported or called. Interpolations are not resolved here.

    Raises:
        ConfigError: naming the key, the target, ``source``, why it is refused and how to allow it.
    """
    if policy.trust:
        return
    for key, target in targets_in(_plain(cfg)):
        check_target(key, target, policy, source)


def check_target(key: str, target: Any, policy: Policy, source: Path | str) -> None:
    """One ``_target_`` (see ``check_config``).

    Raises:
        ConfigError: the target is not a dotted name, lies outside ``NAMESPACES`` and the user's prefixes, or
            resolves through an object defined elsewhere, or (built-in namespaces) to something other than a class
            or module-level function, or to a module inside the job folder.
    """
    if policy.trust or target in policy.named:
        return
    if not isinstance(target, str) or not _DOTTED.fullmatch(target):
        raise ConfigError(
            f"{key}={target!r} in {source} is not the dotted name of a class or function; a config "
            f"read back from a job folder names its targets plainly; {_how(str(target))}"
        )
    user = within(target, policy.allowed)
    if not user and not within(target, NAMESPACES):
        raise ConfigError(
            f"{key}={target!r} in {source} is not one of runner's own targets (under "
            f"{', '.join(NAMESPACES)}): reading a job folder calls nothing it names that you have not "
            f"allowed; {_how(target)}"
        )
    _resolve_within(key, target, policy, source, user)


def _resolve_within(key: str, target: str, policy: Policy, source: Path | str, user: bool) -> None:
    """Import ``target``'s module (inside the allowed prefixes only) and check each attribute on the way is defined
    inside them; an unimportable target is left to its builder to report."""
    prefixes = NAMESPACES + policy.allowed
    parts = target.split(".")
    obj = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, as runner.config.targets.locate finds it
        name = ".".join(parts[:i])
        if not within(name, prefixes):
            return  # e.g. `torch` for torch.nn.X: never imported on a config's word; the builder reports it
        try:
            if not user:
                _not_from_folder(key, target, name, policy, source)
            obj = importlib.import_module(name)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - not a module (an attribute), or it fails to import: see below
            continue
        break
    else:
        return
    for attr in parts[i:]:
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
            return  # runner.config.targets.locate names the missing attribute and the close ones
        where = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        if not isinstance(where, str) or not within(where, prefixes):
            raise ConfigError(
                f"{key}={target!r} in {source} reaches {attr!r}, which is defined in "
                f"{where or 'no module'}, outside the allowed {', '.join(prefixes)}: a target is refused "
                f"unless every step of its path is; {_how(target)}"
            )
    if not user:
        kind = _kind(target, obj)
        if kind is not None:
            raise ConfigError(
                f"{key}={target!r} in {source} is {kind}: a config read back builds models, tasks and "
                f"optimizers only; {_how(target)}"
            )


#: Built-in namespaces whose module-level functions may be targets (model factories: torchvision's resnet18,
#: runner.models.hf.causal_lm); elsewhere only classes are.
FUNCTIONS = ("runner.models", "runner.task", "torchvision.models")


def _kind(target: str, obj: Any) -> str | None:
    """Why ``obj`` (a built-in namespace's ``target``) may not be named, or None: a class, a ``FUNCTIONS`` function,
    or under ``transformers`` a model or config class."""
    if within(target, ("transformers",)):
        import transformers

        if inspect.isclass(obj) and issubclass(obj, (transformers.PreTrainedModel, transformers.PretrainedConfig)):
            return None
        return "not a transformers model or config class"
    if inspect.isclass(obj):
        return None
    if inspect.isfunction(obj) and "." not in obj.__qualname__ and within(target, FUNCTIONS):
        return None
    return f"a {type(obj).__name__}, not a class" + (" or a module-level function" if within(target, FUNCTIONS) else "")


_MISSING = object()


def _not_from_folder(key: str, target: str, module: str, policy: Policy, source: Path | str) -> None:
    """Refuse ``module`` (and its parent packages) when Python would import it from inside the job folder: checked
    with ``importlib.util.find_spec``, which runs no code of the module itself (parents are checked first)."""
    if policy.folder is None:
        return
    folder = policy.folder.resolve()
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(name)
        except Exception:  # noqa: BLE001 - a parent that fails to import: import_module reports it
            return
        if spec is None:
            return
        places = [spec.origin] if spec.origin and spec.has_location else []
        places += list(spec.submodule_search_locations or [])
        for place in places:
            if Path(place).resolve().is_relative_to(folder):
                raise ConfigError(
                    f"{key}={target!r} in {source}: the module {name} would be imported from inside the "
                    f"job folder ({place}), not from the installed package; a job folder holds no code "
                    f"runner runs; {_how(target)}"
                )


def check_package(folder: Path, policy: Policy) -> None:
    """Refuse a job folder that is a Python package (``__init__.py``), which could shadow an installed package.

    Raises:
        ConfigError: naming the file and the fix.
    """
    init = Path(folder) / "__init__.py"
    if not policy.trust and init.exists():
        raise ConfigError(
            f"{init} makes the job folder a Python package, which could be imported in place of an "
            f"installed one (runner never writes it); delete it, or pass --trust if the folder is yours"
        )


# ------------------------------------------------------------------------------------------------ resolvers


def _strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{prefix}{k}.")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _strings(v, f"{prefix}{i}.")
    elif isinstance(node, str):
        yield prefix.rstrip("."), node


def refused_resolver(value: str) -> str | None:
    """The first resolver use in ``value`` a config read back may not make (``oc.env:HOME``), or None."""
    for name, arg in _RESOLVER_USE.findall(value):
        if name.startswith("runner_") or name in RESOLVERS:
            continue
        variable = arg.strip().strip("'\"")
        if name == "oc.env" and variable.startswith(ENV_PREFIX) and "$" not in variable:
            continue
        return f"{name}:{variable}" if variable else name
    return None


_ALLOWED_RESOLVERS = (
    f"runner_*, {', '.join(RESOLVERS)}, and oc.env of {ENV_PREFIX}* variables; nothing from your "
    f"environment is read into a job someone else wrote"
)


def check_interpolations(cfg: Any, policy: Policy, source: Path | str) -> None:
    """Refuse, before it is resolved, a config read from ``source`` that uses a resolver other than runner's own
    and OmegaConf's pure ones (``refused_resolver``).

    Raises:
        ConfigError: naming the key, its value, the resolver, ``source`` and the fix.
    """
    if policy.trust:
        return
    for key, value in _strings(_plain(cfg)):
        used = refused_resolver(value)
        if used is not None:
            raise ConfigError(
                f"{key}={value!r} in {source} uses the resolver {used}; a config read back from a job "
                f"folder resolves only {_ALLOWED_RESOLVERS}. If the folder is yours, pass --trust (or "
                f"write the value into {source})"
            )


def check_searchpath(entries: Iterable[str], policy: Policy, source: Path | str) -> None:
    """Refuse a recorded config search path entry that is not a folder (``pkg://`` imports its package) or that
    lies inside the job folder.

    Raises:
        ConfigError: naming the entry, ``source`` and the fix.
    """
    if policy.trust:
        return
    for entry in entries:
        scheme, _, where = str(entry).partition("://")
        inside = (
            scheme == "file"
            and policy.folder is not None
            and Path(where).resolve().is_relative_to(policy.folder.resolve())
        )
        if scheme != "file" or inside:
            why = "inside the job folder" if inside else "not a folder (Hydra imports a pkg:// entry's package)"
            raise ConfigError(
                f"hydra.searchpath entry {entry!r} in {source} is {why}; a job folder's config search "
                f"path may name your config folders only. If the folder is yours, pass --trust"
            )


def check_overrides(overrides: Iterable[str], policy: Policy, source: Path | str) -> None:
    """Refuse recorded overrides (the doctor's ``overrides.yaml``) that set Hydra's own settings or use a resolver
    a config read back may not use.

    Raises:
        ConfigError: naming the override, ``source`` and the fix.
    """
    if policy.trust:
        return
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            raise ConfigError(
                f"the override {o!r} in {source} sets Hydra's own settings (search path, launcher, "
                f"callbacks), which a job's task overrides never hold; if the folder is yours, pass "
                f"--trust"
            )
        used = refused_resolver(str(o))
        if used is not None:
            raise ConfigError(
                f"the override {o!r} in {source} uses the resolver {used}; a config read back from a "
                f"job folder resolves only {_ALLOWED_RESOLVERS}. If the folder is yours, pass --trust"
            )
