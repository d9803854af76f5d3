"""Dataset functions for ``data=custom`` tests, written the way a user would (importable: tests/ is on sys.path).

Good ones return ``(train_dataset, eval_dataset)`` (``regression``: float targets, for ``task=regression``); the
``bad_*`` ones each break one rule that ``runner.data.custom_datasets`` must turn into a ConfigError.
``FixedContextLM`` is a user's own language model (``model._target_=user_data.FixedContextLM``); ``ScatterNet`` an
image model whose step runs an operation with no deterministic kernel; ``OwnRegression`` a user's own task
(``task._target_=user_data.OwnRegression``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from runner.task import evaluation_sums


def tabular(n_features: int = 8, n_classes: int = 3, n_train: int = 256, n_eval: int = 64, seed: int = 0):
    """Gaussian clusters: ``n_features`` floats -> one of ``n_classes``, as two TensorDatasets."""
    g = torch.Generator().manual_seed(seed)
    centers = 3 * torch.randn(n_classes, n_features, generator=g)
    y = torch.arange(n_train + n_eval) % n_classes
    x = centers[y] + torch.randn(n_train + n_eval, n_features, generator=g)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def tabular_noting_environment(note: str, variable: str, **kwargs):
    """``tabular``, having written environment variable ``variable`` (empty when unset) to the file ``note``:
    what the process that builds the data sees (tests/test_interleave.py)."""
    import os
    from pathlib import Path

    Path(note).write_text(os.environ.get(variable, ""))
    return tabular(**kwargs)


def regression(
    n_features: int = 8, n_targets: int = 0, n_train: int = 256, n_eval: int = 64, noise: float = 0.1, seed: int = 0
):
    """A regression problem: ``n_features`` floats -> float targets, shape (N,) (``n_targets=0``: one value per
    item) or (N, n_targets): a random linear map of the inputs (each value of variance about 1) plus Gaussian noise
    of std ``noise``, so the best reachable MSE is ``noise**2`` (0.01) and predicting the mean scores about 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_eval, n_features, generator=g)
    w = torch.randn(n_features, max(n_targets, 1), generator=g) / n_features**0.5
    y = x @ w + noise * torch.randn(n_train + n_eval, max(n_targets, 1), generator=g)
    y = y[:, 0] if n_targets == 0 else y
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


class Rows(Dataset):
    """A map-style dataset that is not tensors: rows computed in ``__getitem__`` (numpy inputs, int targets)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, classes: list[str] | None = None):
        self.x, self.y = x.numpy(), y.tolist()
        if classes is not None:
            self.classes = classes

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i].astype(np.float32), self.y[i]


def regression_with_a_bad_target(which: str = "evaluation", value: float = float("nan")):
    """``regression``'s data with one target of the ``which`` set set to ``value`` (NaN or infinity)."""
    train, evaluation = regression()
    (train if which == "training" else evaluation).tensors[1][5] = value
    return train, evaluation


def rows(n_features: int = 8, n_classes: int = 3, classes: list[str] | None = None):
    """``tabular`` served row by row (not materializable as tensors); ``classes`` sets that attribute."""
    (x, y), (xe, ye) = (ds.tensors for ds in tabular(n_features, n_classes))
    return Rows(x, y, classes), Rows(xe, ye, classes)


def split(n_features: int = 8):
    """Subsets of one TensorDataset (what ``random_split`` returns)."""
    train, evaluation = tabular(n_features)
    full = TensorDataset(
        torch.cat([train.tensors[0], evaluation.tensors[0]]), torch.cat([train.tensors[1], evaluation.tensors[1]])
    )
    n = len(train)
    return Subset(full, range(n)), Subset(full, range(n, len(full)))


def labelled_subsets(n_features: int = 8):
    """Subsets of a row dataset that keeps its labels in a ``targets`` attribute (torchvision's convention)."""
    (x, y), (xe, ye) = (ds.tensors for ds in tabular(n_features))
    full = Rows(torch.cat([x, xe]), torch.cat([y, ye]))
    full.targets = full.y
    return Subset(full, range(len(y))), Subset(full, range(len(y), len(full)))


def with_kwargs(**kwargs):
    """Accepts any keyword: runner cannot check names against its signature."""
    return tabular(**kwargs)


def takes_num_classes(num_classes: int = 3, n_features: int = 8):
    """Has a ``num_classes`` parameter: runner passes ``data.num_classes`` to it when set."""
    return tabular(n_features, num_classes)


# ------------------------------------------------------------------------------ bad ones

NOT_CALLABLE = 42


def bad_raises(n_features: int = 8):
    raise FileNotFoundError(f"no such table: features_{n_features}.csv")


def bad_one_dataset():
    return tabular()[0]


def bad_iterable():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(8), 0

    return Stream(), Stream()


def bad_empty():
    train, _ = tabular()
    return train, TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))


def bad_triples():
    x = torch.randn(16, 8)
    return (
        TensorDataset(x, torch.zeros(16, dtype=torch.long), x),
        TensorDataset(x, torch.zeros(16, dtype=torch.long), x),
    )


def bad_float_targets():
    x = torch.randn(16, 8)
    return TensorDataset(x, torch.rand(16)), TensorDataset(x, torch.rand(16))


def bad_int32_targets():
    x = torch.randn(16, 8)
    y = torch.zeros(16, dtype=torch.int32)
    return TensorDataset(x, y), TensorDataset(x, y)


def bad_shapes():
    train, evaluation = tabular()
    return train, TensorDataset(torch.randn(len(evaluation), 9), evaluation.tensors[1])


def bad_no_classes():
    """Row datasets without classes/num_classes and without readable targets."""
    (x, y), (xe, ye) = (ds.tensors for ds in tabular())
    return Rows(x, y), Rows(xe, ye)


def unpicklable(n_features: int = 8):
    """``tabular``'s data behind a dataset holding a lambda: DataLoader workers can only get it by fork."""
    train, evaluation = tabular(n_features)
    rows = Rows(*train.tensors)
    rows.transform = lambda v: v  # a lambda does not pickle
    return rows, evaluation


class FixedContextLM(nn.Module):
    """A user's language model with a fixed context it does not declare (no ``block_size`` attribute, no
    Hugging Face config): learned positions for ``context`` tokens, so a longer input raises IndexError.
    Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``, T <= context."""

    def __init__(self, vocab_size: int, context: int = 16, width: int = 16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, width), nn.Embedding(context, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))


def _put_with_a_repeated_index(device: torch.device) -> None:
    index = torch.zeros(2, dtype=torch.long, device=device)
    torch.zeros(1, device=device).put_(index, torch.ones(2, device=device))


class _PutInBackward(torch.autograd.Function):
    """The identity, whose backward runs ``_put_with_a_repeated_index``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _put_with_a_repeated_index(grad.device)
        return grad


class ScatterNet(nn.Module):
    """A linear classifier of ``(B, 3, 16, 16)`` images -> logits ``(B, num_classes)`` whose forward or backward
    (``where``) also runs ``Tensor.put_`` with a repeated index: an operation with no deterministic kernel on a
    CPU, as a CNN's adaptive average pooling backward has none on CUDA (``trainer.deterministic=true`` must name
    it)."""

    def __init__(self, num_classes: int = 10, in_features: int = 3 * 16 * 16, where: str = "backward"):
        super().__init__()
        self.fc, self.where = nn.Linear(in_features, num_classes), where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            _put_with_a_repeated_index(x.device)
        logits = self.fc(x.flatten(1))
        return _PutInBackward.apply(logits) if self.where == "backward" else logits


class OwnRegression:
    """A user's own task (``task._target_=user_data.OwnRegression``): a copy of ``runner.task.Regression`` written
    outside runner, to show that the members of ``runner.protocols.Task`` are all a task needs. Float targets
    ``(B,)`` or ``(B, k)``; MSE loss; ``eval_loss`` (MSE) and ``eval_rmse``."""

    metrics = ("eval_loss", "eval_rmse")

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float().reshape(y.shape), y.float())

    def evaluate(self, model, batches, autocast, max_batches, env):
        def sums(out, y):
            return torch.stack(
                [
                    (out.reshape(y.shape) - y.float()).square().sum().double(),
                    torch.tensor(y.numel(), device=y.device, dtype=torch.float64),
                ]
            )

        squared_sum, count = evaluation_sums(model, batches, autocast, max_batches, env, 2, sums)
        if count == 0:
            return dict.fromkeys(self.metrics)
        return {"eval_loss": squared_sum / count, "eval_rmse": math.sqrt(squared_sum / count)}

    def check_target(self, target):
        ok = isinstance(target, torch.Tensor) and target.is_floating_point() and target.dim() <= 1
        return None if ok else "OwnRegression takes float targets of shape () or (k,)"

    def model_kwargs(self, data):
        return {"num_outputs": data.target.numel()}

    def check(self, model, data):
        pass

    def tokens_per_sample(self, data):
        return None

    def skipped(self, cfg):
        return {}

    def finish(self, model, data, job_dir, env, seed):
        pass


#: A task written before ``check_target`` joined the contract: ``OwnRegression`` without it (``task.build`` must
#: refuse it, naming the member).
NoTargetCheck = type(
    "NoTargetCheck",
    (),
    {k: v for k, v in vars(OwnRegression).items() if k != "check_target" and not k.startswith("__")},
)


class NanRow(Dataset):
    """``regression``'s evaluation set as a map-style dataset (not cheaply scanned before training) whose item 3 has
    a NaN target."""

    def __init__(self, rows: TensorDataset):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        x, y = self.rows[i]
        return x, torch.tensor(float("nan")) if i == 3 else y


def regression_with_a_nan_evaluation_row():
    train, evaluation = regression()
    return train, NanRow(evaluation)


class WeightedRegression(OwnRegression):
    """``OwnRegression`` with a constructor argument (``+task.weight=2``: the loss times ``weight``) and a metric of
    its own, ``eval_mae`` (the mean absolute error), which the console shows beside ``eval_loss``."""

    metrics = ("eval_loss", "eval_rmse", "eval_mae")

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def loss(self, model, batch):
        return self.weight * super().loss(model, batch)

    def evaluate(self, model, batches, autocast, max_batches, env):
        batches = list(batches)
        figures = super().evaluate(model, batches, autocast, max_batches, env)
        absolute, count = evaluation_sums(
            model,
            batches,
            autocast,
            max_batches,
            env,
            2,
            lambda out, y: torch.stack(
                [
                    (out.reshape(y.shape) - y.float()).abs().sum().double(),
                    torch.tensor(y.numel(), device=y.device, dtype=torch.float64),
                ]
            ),
        )
        return figures | {"eval_mae": absolute / count if count else None}
