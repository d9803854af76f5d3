"""Bad data found mid-training, said in one line: which item of the training set, what is wrong, the fix.

A label out of range deep in the set, an item of another shape, an unreadable file or a model that returns a
tuple surface as an exception from inside PyTorch (``IndexError: Target 7 is out of bounds``, ``stack expects
each tensor to be equal size``, ``cannot identify image file``, ``must be Tensor, not tuple``). The loop pays
nothing for this on the happy path: ``runner.engine.train.fit`` catches the exception around the step and calls
``diagnose``, which only then looks at the data -- the training set's items read one by one, from the start,
within ``BUDGET_S`` seconds -- and returns the ``ConfigError`` to raise, or None when it finds nothing to blame
(the original exception is then raised as it was).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runner.errors import ConfigError

#: seconds the diagnosis may spend reading training items to find the bad one
BUDGET_S = 60.0
#: what running out of memory makes PyTorch say (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError)
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory")
#: what a model output that is not logits makes PyTorch say
_NOT_LOGITS = ("not tuple", "not list", "not dict", "'tuple' object", "'list' object", "'dict' object")


def dataset_of(loader: Any):
    """The map-style dataset behind a training loader (``DeviceIterable`` -> ``DataLoader`` -> dataset), or None
    (on-device loaders hold tensors, not a dataset)."""
    for obj in (loader, getattr(loader, "batches", None)):
        ds = getattr(obj, "dataset", None)
        if ds is not None and hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
            return ds
    return None


def _file_of(ds, i: int) -> str:
    """`` (file <path>)`` for an ImageFolder-style dataset (``samples``/``imgs``, through a ``Subset``), else ``""``."""
    while hasattr(ds, "indices") and hasattr(ds, "dataset"):  # torch.utils.data.Subset
        ds, i = ds.dataset, ds.indices[i]
    samples = getattr(ds, "samples", None) or getattr(ds, "imgs", None)
    try:
        return f" (file {samples[i][0]})"
    except (TypeError, IndexError, KeyError):
        return ""


def find_bad_item(ds, shape: tuple[int, ...] | None, num_classes: int | None, budget_s: float = BUDGET_S) -> str | None:
    """Read ``ds[0]``, ``ds[1]``, ... for at most ``budget_s`` seconds; describe the first item that cannot be
    loaded, whose input shape is not ``shape``, or whose class index is outside ``0 .. num_classes - 1``."""
    deadline = time.monotonic() + budget_s
    for i in range(len(ds)):
        if time.monotonic() > deadline:
            return None
        try:
            item = ds[i]
        except Exception as e:  # noqa: BLE001 - whatever the dataset raises is what is wrong with the item
            return (
                f"training item {i}{_file_of(ds, i)} cannot be loaded ({type(e).__name__}: {e}); fix or remove "
                f"it from the dataset"
            )
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            continue
        x, y = item
        if shape is not None and isinstance(x, torch.Tensor) and tuple(x.shape) != tuple(shape):
            return (
                f"training item {i}{_file_of(ds, i)} has shape {tuple(x.shape)} where the others have "
                f"{tuple(shape)}; every item must have one shape (resize or crop it in the dataset or its "
                f"transform)"
            )
        label = y.item() if isinstance(y, torch.Tensor) and y.numel() == 1 else y
        if num_classes is not None and isinstance(label, int) and not 0 <= label < num_classes:
            return (
                f"training item {i}{_file_of(ds, i)} has class index {label}, outside 0 .. {num_classes - 1} "
                f"({num_classes} classes); fix its label, or set data.num_classes to the real class count"
            )
    return None


def diagnose(
    exc: BaseException,
    step: int,
    batch: int,
    epoch: int,
    loader,
    item: torch.Tensor | None,
    num_classes: int | None,
    budget_s: float = BUDGET_S,
) -> ConfigError | None:
    """The ``ConfigError`` for an exception raised by optimizer step ``step`` (``batch`` of ``epoch``), or None.

    Running out of memory is not the data's fault: None at once. A model output that is not logits is named first;
    else the training set is searched (``find_bad_item``) for the item to blame. Neither found: None (the caller
    re-raises ``exc``)."""
    if isinstance(exc, torch.OutOfMemoryError) or any(s in str(exc) for s in _OUT_OF_MEMORY):
        return None  # not the data's fault (and the batch-size tuner probes it: no time spent here)
    where = f"at step {step} (batch {batch} of epoch {epoch})"
    said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    if any(s in str(exc) for s in _NOT_LOGITS):
        return ConfigError(
            f"the model's output {where} is not a logits tensor ({said}); a model must return its "
            f"logits, or an object holding them as .logits: return the logits alone (not a tuple "
            f"such as (logits, loss)), or wrap the model so it does"
        )
    ds = dataset_of(loader)
    labels = getattr(getattr(loader, "batches", None), "labels", None)  # an on-device loader's label tensor
    if ds is None and isinstance(labels, torch.Tensor) and num_classes is not None:
        bad = ((labels < 0) | (labels >= num_classes)).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            return ConfigError(
                f"bad data {where}: training item {i} has class index {int(labels[i])}, outside 0 .. "
                f"{num_classes - 1} ({num_classes} classes; {len(bad)} such items); fix its label, or "
                f"set data.num_classes to the real class count ({said})"
            )
    if ds is None:
        return None
    shape = tuple(item.shape) if isinstance(item, torch.Tensor) else None
    found = find_bad_item(ds, shape, num_classes, budget_s)
    return None if found is None else ConfigError(f"bad data {where}: {found} ({said})")
