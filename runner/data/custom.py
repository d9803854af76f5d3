"""``data=custom``: the user's own dataset function, checked (``custom_datasets``), and its class count
(``class_count``); ``custom_source`` hands the checked datasets to the loader assembly as a ``Source`` of layout
``tensors``. The items, the arguments and the class-count rule: docs/data-and-models.md, "Your own dataset".
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset, default_collate

from runner.config import targets
from runner.data.source import Source
from runner.errors import ConfigError

#: ``data=custom`` keys that are runner's; every other key under ``data.`` is an argument of the function
#: (``num_classes`` is passed too, when set and the function has a parameter of that name).
CUSTOM_KEYS = ("name", "_target_", "num_classes", "normalize", "augment")


def as_batched(target: Any) -> Any:
    """One item's ``target`` as a batch holds it: ``default_collate([target])`` row 0 (a Python int -> a 0-d int64
    tensor, a float -> a 0-d float64 one, a numpy array -> a tensor of its dtype and shape), or ``target`` itself
    when that gives no tensor (a string, a dict, None)."""
    try:
        batched = default_collate([target])
    except Exception:  # noqa: BLE001 - default_collate raises TypeError and others for what it cannot batch
        return target
    return batched[0] if isinstance(batched, torch.Tensor) else target


def _described(y: Any) -> str:
    """What a target is, for a message: ``a torch.int32 tensor of shape ()``, ``a float``, ``a ndarray (float32,
    shape (3,))``."""
    if isinstance(y, torch.Tensor):
        return f"a {y.dtype} tensor of shape {tuple(y.shape)}"
    if isinstance(y, np.ndarray):
        return f"a ndarray ({y.dtype}, shape {tuple(y.shape)})"
    return f"a {type(y).__name__}" + (f" ({y.dtype})" if isinstance(y, np.generic) else "")


def _check_item(path: str, which: str, ds, check_target: Callable[[Any], str | None]) -> tuple[torch.Tensor, Any]:
    """Item 0 of ``ds`` as ``(input tensor, target as a batch holds it)``, its target checked by the task.

    Raises:
        ConfigError: reading it raises, it is not an ``(input, target)`` pair, the input is not a tensor
            or numpy array with at least one dimension, or the task's ``check_target`` refuses the target (the
            message says what the target is, then what the task says it must be).
    """
    try:
        item = ds[0]
    except Exception as e:  # noqa: BLE001 - the user's __getitem__ can raise anything
        raise ConfigError(
            f"data._target_={path}: reading item 0 of the {which} set raised {type(e).__name__}: {e}"
        ) from e
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        what = f"a {type(item).__name__}" + (f" of {len(item)} elements" if isinstance(item, (tuple, list)) else "")
        raise ConfigError(
            f"data._target_={path}: items must be (input, target) pairs, but item 0 of the {which} set "
            f"is {what}; return `x, y` from __getitem__ (a TensorDataset(inputs, targets) does)"
        )
    x, y = item
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        what = "a 0-d tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ConfigError(
            f"data._target_={path}: the input of item 0 of the {which} set is {what}; it must be a "
            f"tensor (or numpy array) with at least one dimension, e.g. shape (n_features,)"
        )
    target = as_batched(y)
    rule = check_target(target)
    if rule is not None:
        raise ConfigError(f"data._target_={path}: the target of item 0 of the {which} set is {_described(y)}; {rule}")
    return x, target


def _tensor_pair(ds) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``ds`` as ``(inputs, targets)`` tensors, for ``dataloader.on_device``, or the reason it cannot be.

    A ``TensorDataset`` of two tensors gives its own (no copy); a ``Subset`` of one gives the selected rows.
    """
    if isinstance(ds, TensorDataset):
        return (
            tuple(ds.tensors) if len(ds.tensors) == 2 else f"its TensorDataset holds {len(ds.tensors)} tensors, not 2"
        )
    if isinstance(ds, Subset):
        inner = _tensor_pair(ds.dataset)
        if isinstance(inner, str):
            return inner
        idx = torch.as_tensor(list(ds.indices), dtype=torch.long)
        return inner[0][idx], inner[1][idx]
    return (
        f"a {type(ds).__name__} cannot be held as whole tensors (only a TensorDataset or a Subset of one: its "
        f"__getitem__ may transform each item); batches come from the DataLoader instead"
    )


def _cheap_targets(ds) -> torch.Tensor | None:
    """Every target of ``ds`` as an integer tensor when readable without loading inputs, else None: a
    TensorDataset's second tensor, a ``targets`` attribute, a Subset of either (its indices applied)."""
    if isinstance(ds, TensorDataset):
        return ds.tensors[1] if len(ds.tensors) == 2 else None
    if isinstance(ds, Subset):
        inner = _cheap_targets(ds.dataset)
        return None if inner is None else inner[torch.as_tensor(list(ds.indices), dtype=torch.long)]
    t = getattr(ds, "targets", None)
    if t is None:
        return None
    try:
        t = torch.as_tensor(t)
    except Exception:  # noqa: BLE001 - not a list of numbers
        return None
    return t if t.dim() == 1 and len(t) == len(ds) and not t.is_floating_point() else None


def _declared_classes(ds) -> tuple[int, str] | None:
    """``(count, where from)`` from a ``num_classes`` or ``classes`` attribute of ``ds`` (or of a Subset's dataset)."""
    for obj in (ds, getattr(ds, "dataset", None)):
        n = getattr(obj, "num_classes", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n, f"the dataset's num_classes attribute ({n})"
        classes = getattr(obj, "classes", None)
        if classes is not None and hasattr(classes, "__len__") and not isinstance(classes, str):
            return len(classes), f"the dataset's classes attribute ({len(classes)} names)"
    return None


def class_count(path: str, configured: int | None, train_ds, eval_ds) -> int:
    """The class count of the user's datasets (docs/data-and-models.md, "Class count").

    Raises:
        ConfigError: ``data.num_classes`` < 1, a negative target, a target >= the count (names where the
            count came from), or no way to know the count (asks for ``data.num_classes``).
    """
    if configured is not None and configured < 1:
        raise ConfigError(f"data.num_classes={configured} must be >= 1 (or null: inferred from the data)")
    seen = [t for t in (_cheap_targets(train_ds), _cheap_targets(eval_ds)) if t is not None and len(t)]
    if configured is not None:
        count, source = configured, f"data.num_classes={configured}"
    elif (declared := _declared_classes(train_ds)) is not None:
        count, source = declared
    elif seen:
        count = int(max(int(t.max()) for t in seen)) + 1
        source = f"max(target) + 1 = {count}"
    else:
        raise ConfigError(
            f"data._target_={path}: cannot tell how many classes the data has: set data.num_classes=<C> "
            f"(or give the dataset a num_classes or classes attribute, or targets runner can read "
            f"without loading inputs: a TensorDataset or a `targets` attribute)"
        )
    if seen:
        lo, hi = min(int(t.min()) for t in seen), max(int(t.max()) for t in seen)
        if lo < 0:
            raise ConfigError(f"data._target_={path}: a target is {lo}; class indices run from 0 to num_classes - 1")
        if hi >= count:
            raise ConfigError(
                f"data._target_={path}: a target is {hi} but the class count is {count} (from {source}); "
                f"class indices run from 0 to num_classes - 1: set data.num_classes={hi + 1} or more"
            )
    return count


def custom_datasets(
    cfg: DictConfig, check_target: Callable[[Any], str | None]
) -> tuple[Dataset, Dataset, int | None, torch.Tensor, torch.Tensor]:
    """Call ``data._target_`` and check what it returns: ``(train_dataset, eval_dataset, num_classes,
    first training input, first training target as a batch holds it)``; ``num_classes`` is None for float
    targets (they are no class indices).

    Keyword arguments: every key under ``data.`` but ``CUSTOM_KEYS``, plus ``num_classes`` when set and the function
    has that parameter. ``check_target``: the task's (``runner.protocols.Task.check_target``).

    Raises:
        ConfigError: ``_target_`` unset, not importable or not callable; an argument its signature lacks
            (lists the valid names); the call raises; it does not return a pair of map-style datasets; an
            empty dataset; items that are not ``(input, target)`` pairs, or whose target the task refuses;
            inputs or targets of different shapes in the two sets; no class count (``class_count``),
            ``data.num_classes`` set for float targets, or NaN/infinite float targets (where readable cheaply).
    """
    path = cfg._target_
    fn = targets.locate("data._target_", path)
    kwargs = {k: v for k, v in targets.plain(cfg).items() if k not in CUSTOM_KEYS}
    targets.check_arguments("data", fn, kwargs, CUSTOM_KEYS)
    if cfg.num_classes is not None and "num_classes" in targets.parameters(fn)[0]:
        kwargs["num_classes"] = cfg.num_classes
    out = targets.call("data._target_", path, kwargs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        what = type(out).__name__ + (f" of {len(out)} elements" if isinstance(out, (tuple, list)) else "")
        raise ConfigError(
            f"data._target_={path} returned a {what}; it must return a pair (train_dataset, "
            f"eval_dataset), e.g. `return TensorDataset(x_train, y_train), "
            f"TensorDataset(x_eval, y_eval)`"
        )
    for which, ds in zip(("training", "evaluation"), out):
        if isinstance(ds, IterableDataset) or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(
                f"data._target_={path}: its {which} set is a {type(ds).__name__}, not a map-style "
                f"Dataset (with __len__ and __getitem__, e.g. a TensorDataset)"
            )
        if len(ds) == 0:
            raise ConfigError(
                f"data._target_={path}: its {which} set is empty (0 items); check the function's "
                f"arguments ({', '.join(f'data.{k}={v!r}' for k, v in kwargs.items()) or 'none'})"
            )
    train_ds, eval_ds = out
    x0, y0 = _check_item(path, "training", train_ds, check_target)
    xe, ye = _check_item(path, "evaluation", eval_ds, check_target)
    for what, train, evaluation in (("inputs", x0, xe), ("targets", y0, ye)):
        if isinstance(train, torch.Tensor) and isinstance(evaluation, torch.Tensor) and train.shape != evaluation.shape:
            raise ConfigError(
                f"data._target_={path}: training {what} have shape {tuple(train.shape)} but evaluation "
                f"{what} {tuple(evaluation.shape)}; both sets must hold {what} of one shape"
            )
    if isinstance(y0, torch.Tensor) and y0.is_floating_point():  # values, not class indices: no class count
        if cfg.num_classes is not None:
            raise ConfigError(
                f"data.num_classes={cfg.num_classes} counts classes, but the targets are floats "
                f"({_described(y0)}), not class indices; drop data.num_classes"
            )
        for which, ds in (("training", train_ds), ("evaluation", eval_ds)):  # where readable without the inputs
            t = _cheap_targets(ds)
            if t is not None and t.is_floating_point() and not (finite := torch.isfinite(t)).all():
                rows = (~finite).reshape(len(t), -1).any(1).nonzero().flatten()
                raise ConfigError(
                    f"data._target_={path}: {len(rows)} target(s) of the {which} set are NaN or "
                    f"infinite (item {rows[0].item()} first): no model fits them and the loss would be "
                    f"NaN; drop or fix those items"
                )
        return train_ds, eval_ds, None, x0, y0
    return train_ds, eval_ds, class_count(path, cfg.num_classes, train_ds, eval_ds), x0, y0


def custom_source(cfg: DictConfig, check_target: Callable[[Any], str | None]) -> Source:
    """``data=custom``: the user's datasets (``custom_datasets``, their targets checked by the task's
    ``check_target``) as a ``Source`` of layout ``tensors``. ``data.normalize`` and ``data.augment`` are recorded as
    skipped here, ``on_device`` for data that is not whole tensors by the loader assembly (``in_memory`` says why; a
    Subset's rows are copied only when ``on_device`` asks).

    Raises:
        ConfigError: bad custom data (``custom_datasets``).
    """
    train_ds, eval_ds, num_classes, x0, y0 = custom_datasets(cfg, check_target)
    techniques: dict[str, str] = {}
    why = "data=custom: your dataset function returns the inputs as the model sees them"
    if cfg.normalize:
        techniques["normalize"] = (
            f"skipped: {why}; normalize them there (data.normalize knows only the built-in image sets' statistics)"
        )
    if cfg.augment:
        techniques["augment"] = (
            f"skipped: {why}; augment in its __getitem__ (data.augment is the built-in image sets' crop + flip)"
        )

    def in_memory() -> tuple | str:
        pair = _tensor_pair(train_ds), _tensor_pair(eval_ds)
        return next((p for p in pair if isinstance(p, str)), pair)

    return Source(
        name="custom",
        train=train_ds,
        eval=eval_ds,
        sample_shape=tuple(x0.shape),
        layout="tensors",
        in_memory=in_memory,
        num_classes=num_classes,
        item=x0,
        techniques=techniques,
        target=y0 if isinstance(y0, torch.Tensor) else None,
    )
