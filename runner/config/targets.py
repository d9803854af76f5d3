"""A user's ``_target_``: import it, check the config's arguments against its signature, call it.

Shared by ``model._target_`` (a module class or factory) and ``data._target_`` (a dataset function), so both fail
the same way, before training, with one ``ConfigError`` naming the key and the fix. Why a module in the folder
``python -m runner`` runs from imports without ``PYTHONPATH``: docs/data-and-models.md, "Your own dataset".
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import types
import typing
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

#: Optional packages runner knows how to install: top-level module -> the command that installs it.
OPTIONAL_PACKAGES = {"transformers": 'pip install -e ".[hf]" (or pip install "transformers>=4.40")'}


def hydra_key(name: str) -> bool:
    """Hydra's own instantiate keys (``_target_``, ``_partial_``, ``_args_``, ``_convert_``, ...)."""
    return name.startswith("_") and name.endswith("_")


def locate(key: str, path: Any) -> Callable:
    """Import ``path`` (``package.module.attribute``) for the config key ``key`` (e.g. ``data._target_``).

    Raises:
        ConfigError: ``path`` is unset, cannot be imported (the message names the module Python could not
            find, the run folder and ``PYTHONPATH``), or is not callable.
    """
    if not path or not isinstance(path, str):
        raise ConfigError(
            f"{key} is not set: give it as {key}=<module>.<callable>, e.g. {key}=my_data.tabular "
            f"for a function tabular in my_data.py in the folder you run from"
        )
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}={path!r} names no module: write it as <module>.<callable>, e.g. my_data.{path}")
    parts = path.split(".")
    obj, error = None, None
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:i]).startswith(e.name):
                raise ConfigError(
                    f"{key}={path!r}: importing {'.'.join(parts[:i])} failed because it imports "
                    f"{e.name!r}, which is not installed ({e}); install it or fix that import"
                ) from e
            error = e
            continue
        except Exception as e:  # noqa: BLE001 - the user's module raised while being imported
            raise ConfigError(
                f"{key}={path!r}: importing module {'.'.join(parts[:i])} raised "
                f"{type(e).__name__}: {e}; fix that module"
            ) from e
        for j, name in enumerate(parts[i:], start=i):
            if not hasattr(obj, name):
                owner = ".".join(parts[:j])
                have = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
                close = difflib.get_close_matches(name, have, n=1)
                hint = f" (did you mean {owner}.{close[0]}?)" if close else ""
                raise ConfigError(
                    f"{key}={path!r}: {owner} has no attribute {name!r}{hint}; its callables: "
                    f"{', '.join(have[:20]) or 'none'}"
                )
            obj = getattr(obj, name)
        break
    else:
        if parts[0] in OPTIONAL_PACKAGES:
            raise ConfigError(
                f"{key}={path!r} needs the {parts[0]} package, which is not installed: {OPTIONAL_PACKAGES[parts[0]]}"
            ) from error
        searched = [p for p in sys.path[:3] if p]
        raise ConfigError(
            f"{key}={path!r} cannot be imported: no module named {parts[0]!r} ({error}). Put "
            f"{parts[0]}.py in the folder you run from ({os.getcwd()}) or add its folder to "
            f"PYTHONPATH (searched first: {', '.join(searched)})"
        ) from error
    if not callable(obj):
        raise ConfigError(f"{key}={path!r} is a {type(obj).__name__}, not a class or function; name a callable")
    return obj


def _return_class(fn: Callable) -> type | None:
    """The class a factory function is annotated to return (torchvision: ``resnet18(...) -> ResNet``)."""
    if not inspect.isfunction(fn):
        return None
    try:
        ret = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: no look-through
        return None
    return ret if isinstance(ret, type) and ret.__init__ is not object.__init__ else None


def parameters(fn: Callable) -> tuple[list[str], bool]:
    """The names ``fn`` accepts as keyword arguments, and whether it accepts any other name too.

    A factory whose ``**kwargs`` are forwarded to the class it returns (torchvision's ``resnet18(*,
    weights, progress, **kwargs) -> ResNet``) is looked through: the returned class's parameters that have
    a default count as accepted (the required ones, ``block`` and ``layers``, are the factory's to give).
    ``(names, True)`` means the signature cannot rule out any name (``**kwargs`` we cannot see through).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: cannot check
        return [], True
    names = [p.name for p in sig.parameters.values() if p.kind in _KEYWORD]
    any_name = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    cls = _return_class(fn) if any_name else None
    if cls is not None:
        try:
            inner = inspect.signature(cls).parameters.values()
        except (TypeError, ValueError):
            return names, True
        names += [p.name for p in inner if p.kind in _KEYWORD and p.default is not p.empty and p.name not in names]
        any_name = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inner)
    return names, any_name


#: Annotations whose values are checked before the call: the Python types a config value of each may have,
#: what to write, and an example.
_SCALARS = {
    bool: ((bool,), "true or false", "true"),
    int: ((int,), "a whole number", "2"),
    float: ((int, float), "a number", "0.5"),
}


def _hints(fn: Callable) -> tuple[dict[str, Any], dict[str, Any]]:
    """The resolved annotations and defaults of ``fn``'s parameters, and of the class a factory returns
    (looked through as in ``parameters``); ``({}, {})`` where they cannot be read."""
    hints: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for part in (_return_class(fn), fn):  # the factory's own annotations win
        if part is None:
            continue
        target = part.__init__ if isinstance(part, type) else part
        try:
            sig = inspect.signature(part)
            resolved = typing.get_type_hints(target)
        except Exception:  # noqa: BLE001 - builtins, unresolvable string annotations: nothing to check
            continue
        for p in sig.parameters.values():
            if p.name in resolved:
                hints[p.name], defaults[p.name] = resolved[p.name], p.default
    return hints, defaults


def _scalar(annotation: Any) -> tuple[type | None, bool]:
    """The bool/int/float an annotation names and whether it admits ``None`` (``Optional[int]``,
    ``int | None``); ``(None, False)`` for any other annotation (not checked)."""
    if annotation in _SCALARS:
        return annotation, False
    args = typing.get_args(annotation)
    if type(None) in args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS:
            return rest[0], True
    return None, False


def check_types(group: str, fn: Callable, kwargs: dict[str, Any]) -> None:
    """Fail when a value in ``kwargs`` does not fit its parameter's ``bool``, ``int`` or ``float`` annotation
    in ``fn``'s signature (or the signature of the class a factory returns): ``model.zero_init_residual=abc``
    would otherwise reach the constructor as the string ``'abc'``, which Python treats as true. A bool takes
    only true/false, an int only a whole number (not a bool), a float a number; ``null`` only where the
    annotation is Optional or the default is None. Other annotations are not checked.

    Raises:
        ConfigError: naming the key, its value, the annotation and the values it takes.
    """
    hints, defaults = _hints(fn)
    for key, value in kwargs.items():
        kind, optional = _scalar(hints.get(key))
        if kind is None or hydra_key(key):
            continue
        if value is None and (optional or defaults.get(key) is None):
            continue
        fits, takes, example = _SCALARS[kind]
        if isinstance(value, fits) and (kind is bool or not isinstance(value, bool)):
            continue
        shown = kind.__name__ + (" | None" if optional else "")
        raise ConfigError(
            f"{group}.{key}={value!r} does not fit {describe(fn)}'s annotation {key}: {shown}; "
            f"give {takes}, e.g. {group}.{key}={example}"
        )


def describe(fn: Callable) -> str:
    """``module.qualname`` of ``fn`` for messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_arguments(group: str, fn: Callable, kwargs: dict[str, Any], own_keys: Iterable[str] = ()) -> None:
    """Fail when ``kwargs`` holds a name ``fn`` does not accept (checked with ``inspect.signature``).

    ``group`` prefixes the key in the message (``model`` -> ``model.widht=64``); ``own_keys`` are runner's
    keys of that group, listed as the other valid names. Nothing is checked when ``fn`` takes ``**kwargs``
    it does not forward visibly (``parameters``): then a wrong name fails in the call, also as a ConfigError.

    Raises:
        ConfigError: naming the unknown key and its value, the closest valid name, and every valid name.
    """
    own_keys = tuple(own_keys)
    check_types(group, fn, kwargs)
    names, any_name = parameters(fn)
    if any_name:
        return
    unknown = [k for k in kwargs if k not in names and not hydra_key(k)]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, [*names, *own_keys], n=1)
    hint = f" (did you mean {group}.{close[0]}?)" if close else ""
    own = f"; runner's own {group} keys: {', '.join(own_keys)}" if own_keys else ""
    listed = [n for n in names if n not in own_keys]  # e.g. a builder's own `weights`: runner's key wins
    raise ConfigError(
        f"{group}.{key}={kwargs[key]!r}: {describe(fn)} has no parameter {key!r}{hint}. Its "
        f"parameters: {', '.join(listed) or 'none'}{own}"
    )


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The node as plain Python (dicts, lists), interpolations resolved."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def call(key: str, path: str, kwargs: dict[str, Any]) -> Any:
    """Call ``path(**kwargs)`` through Hydra's ``instantiate`` (nested ``_target_`` values are built too;
    lists and dicts arrive as plain Python: ``_convert_="all"``).

    Raises:
        ConfigError: the call raised; names ``key`` (``data._target_``) and the callable's own exception.
            A ConfigError raised by the callable passes through unchanged.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate({"_target_": path, "_convert_": "all", **kwargs})
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):
            raise cause
        said = " ".join(str(cause).split())  # one line (Hydra's import errors take three)
        raise ConfigError(
            f"{key}={path!r} raised {type(cause).__name__}: {said} (called with "
            f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items() if not hydra_key(k)) or 'no arguments'})"
        ) from cause
