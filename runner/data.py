"""Datasets and loaders: torchvision datasets or the user's own behind a DataLoader, or the whole dataset
on the device.

``build`` returns train/eval iterables that yield ``(x, y)`` already on the run's device: for the built-in
sets ``x`` is a float32 batch of shape ``(B, C, H, W)`` (normalized when ``data.normalize``); for
``data=custom`` it is the batch of whatever the user's items hold, ``(B, *S)``; ``y`` is an int64 ``(B,)``.
The host->device copy happens inside the iterable, so the engine's data-wait figure includes it.

``data=custom data._target_=<module>.<function>`` (``custom_datasets``) calls the user's function with
every other key under ``data.`` as a keyword argument; it returns ``(train_dataset, eval_dataset)``, two
map-style ``torch.utils.data.Dataset``s whose items are ``(input, target)``: ``input`` a tensor (or numpy
array) of one shape ``S`` for every item, ``target`` a class index (a Python int or a 0-d int64 tensor).
The class count follows this rule (``class_count``): ``data.num_classes`` when set; else the training
dataset's ``num_classes`` attribute, else ``len`` of its ``classes`` attribute (a ``Subset``'s underlying
dataset is asked too); else max(target) + 1 over the training and evaluation targets when they can be
read without loading the inputs (a ``TensorDataset``'s second tensor, a ``targets`` attribute, Subsets of
these); else the run stops asking for ``data.num_classes``.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset, TensorDataset

from runner import targets, text
from runner.config import check_choice
from runner.errors import ConfigError

# Per-channel statistics of the training sets (the values torchvision's references use).
STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # imagefolder default
    "synthetic": ((0.5,), (0.2898,)),  # uniform bytes 0..255 / 255: mean 0.5, std sqrt((256**2-1)/12)/255
}


@dataclass
class Data:
    """What the engine needs from the data: two iterables plus what the model must fit.

    ``example`` is one batch of 2 samples on the device (inputs, targets), the shape and dtype of real
    batches, for counting FLOPs. ``vocab`` (token data only) maps token id -> text.
    """

    train: "DeviceIterable"
    eval: "DeviceIterable"
    num_classes: int | None  # images: classes; token data: None (see vocab)
    in_channels: int | None  # images: C; token data: None
    sample_shape: tuple[int, ...]  # images: (C, H, W); token data: (block_size,)
    train_samples: int  # samples in the training set (token data: windows per epoch)
    techniques: dict[str, str]
    example: tuple[torch.Tensor, torch.Tensor]
    vocab: list[str] | None = None
    item: torch.Tensor | None = None  # the first training input as the dataset returns it (CPU); None for tokens

    @property
    def model_kwargs(self) -> dict[str, int]:
        """The constructor arguments the data dictates: ``vocab_size`` for token data, else ``num_classes``."""
        return {"vocab_size": len(self.vocab)} if self.vocab is not None else {"num_classes": self.num_classes}


class DeviceIterable:
    """Wrap a batch iterable so it yields tensors on ``device`` in ``memory_format``.

    ``non_blocking`` copies return before the copy finishes (only truly asynchronous from pinned host
    memory; PyTorch "pin_memory" tutorial: https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html).
    """

    def __init__(self, batches, device: torch.device, non_blocking: bool, memory_format: torch.memory_format):
        self.batches = batches
        self.device = device
        self.non_blocking = non_blocking
        self.memory_format = memory_format
        self._skip = 0
        # the random generators that order an epoch (the DataLoader's, its sampler's, an on-device loader's),
        # with their first seeds: ``set_epoch`` reseeds them from these, so epoch e is the same sequence
        # however the run got there (straight through, or resumed from a checkpoint)
        self._generators = [(g, g.initial_seed()) for g in _generators_of(batches)]

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Prepare ``epoch``: reshuffle (``DistributedSampler.set_epoch`` / the on-device permutation), reseed its
        generators from (their first seed, ``epoch``), and start the next iteration after its first ``skip``
        batches -- a run resumed mid-epoch continues with exactly the batches it had left. Batches are skipped
        by index where the loader allows (samplers, on-device loaders: nothing is loaded), else by drawing
        them."""
        sampler = getattr(self.batches, "sampler", None)
        target = sampler if hasattr(sampler, "set_epoch") else self.batches
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)
        for g, first_seed in self._generators:
            g.manual_seed(first_seed + 1_000_003 * epoch)
        self._skip = skip

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        skip, self._skip = self._skip, 0
        batches = self.batches
        if skip and isinstance(batches, DataLoader) and isinstance(batches.sampler, SkippableSampler):
            batches.sampler.skip_next(skip * batches.batch_size)
            skip = 0
        elif skip and hasattr(batches, "skip_next"):
            batches.skip_next(skip)
            skip = 0
        for i, (x, y) in enumerate(batches):
            if i < skip:
                continue  # a loader that cannot skip by index: draw and drop
            x = x.to(self.device, non_blocking=self.non_blocking, memory_format=self.memory_format)
            yield x, y.to(self.device, non_blocking=self.non_blocking)


def _generators_of(batches) -> list[torch.Generator]:
    found = []
    for obj in (batches, getattr(batches, "sampler", None), getattr(getattr(batches, "sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


class SkippableSampler(torch.utils.data.Sampler):
    """Wraps a sampler so that its next pass starts ``n`` indices in (``skip_next``); ``set_epoch`` and the
    ``generator`` of the wrapped sampler stay reachable. What a resumed run's DataLoader uses to continue
    mid-epoch without loading the batches it already trained on."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._skip = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def skip_next(self, n: int) -> None:
        self._skip = n

    def __iter__(self):
        skip, self._skip = self._skip, 0
        for i, index in enumerate(self.sampler):
            if i >= skip:
                yield index


class OnDeviceLoader:
    """Technique 2b (airbench, hlb-CIFAR10): the dataset lives on the device as a uint8 tensor.

    Each epoch draws one permutation (same seed on every rank, then this rank's strided share, like
    DistributedSampler), and each batch is gathered, converted to float, augmented with a random crop
    (zero padding 4) and horizontal flip, and normalized, all on the device. With ``as_images=False``
    (``data=custom``) batches are gathered and yielded as they are stored.

    Args:
        images: uint8 ``(N, C, H, W)``, on the device (``as_images=False``: any ``(N, *S)`` tensor).
        labels: int64 ``(N,)``.
        mean, std: per-channel statistics in [0, 1] units, or None for no normalization.
    """

    def __init__(self, images, labels, batch_size, *, shuffle, augment, mean, std, drop_last, seed, rank, world_size,
                 as_images: bool = True):
        self.images, self.labels, self.as_images = images, labels, as_images
        self.batch_size, self.shuffle, self.augment, self.drop_last = batch_size, shuffle, augment, drop_last
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        dev = images.device
        self.mean = None if mean is None else torch.tensor(mean, device=dev).view(1, -1, 1, 1) * 255
        self.std = None if std is None else torch.tensor(std, device=dev).view(1, -1, 1, 1) * 255
        self.per_rank = len(labels) // world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        """Start the next pass at batch ``batches`` of the epoch's order (a resumed run)."""
        self._skip = batches

    def __len__(self) -> int:
        n = self.per_rank / self.batch_size
        return math.floor(n) if self.drop_last else math.ceil(n)

    def __iter__(self):
        n = len(self.labels)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        order = order[self.rank : self.per_rank * self.world_size : self.world_size].to(self.images.device)
        skip, self._skip = getattr(self, "_skip", 0), 0
        for i in range(skip, len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            if not self.as_images:
                yield self.images[idx], self.labels[idx]
                continue
            x = self.images[idx].float()
            if self.augment:
                x = random_crop_flip(x, padding=4)
            if self.mean is not None:
                x = (x - self.mean) / self.std
            else:
                x = x / 255.0
            yield x, self.labels[idx]


def random_crop_flip(x: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Batched RandomCrop(padding, fill 0) + RandomHorizontalFlip on ``x`` of shape ``(B, C, H, W)``.

    One gather for the crop (per-sample offsets) and one ``where`` for the flip; no Python loop over
    samples, so it runs at device speed (the airbench recipe).
    """
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    dx = torch.randint(0, 2 * padding + 1, (b, 1), device=x.device)
    rows = (dy + torch.arange(h, device=x.device)).view(b, 1, h, 1)
    cols = (dx + torch.arange(w, device=x.device)).view(b, 1, 1, w)
    bi = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    ci = torch.arange(c, device=x.device).view(1, c, 1, 1)
    out = padded[bi, ci, rows, cols]
    flip = torch.rand(b, device=x.device) < 0.5
    return torch.where(flip.view(b, 1, 1, 1), out.flip(3), out)


class UInt8ImageDataset(Dataset):
    """``(N, C, H, W)`` uint8 images + labels, served one sample at a time (the synthetic data)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std):
        self.images, self.labels = images, labels
        self.mean = None if mean is None else torch.tensor(mean).view(-1, 1, 1)
        self.std = None if std is None else torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].float() / 255.0
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x, self.labels[i]


# --------------------------------------------------------------------------------------------------
# Datasets: each returns (train_dataset, eval_dataset, in_memory) where in_memory is a callable giving
# ((train_images, train_labels), (eval_images, eval_labels)) as uint8 NCHW / int64 tensors that share
# memory with the dataset's arrays (technique 12: torch.from_numpy / as_tensor, no copies).


def images_as_tensor(array) -> torch.Tensor:
    """View a uint8 image array as an ``(N, C, H, W)`` tensor without copying (technique 12).

    ``array``: numpy ``(N, H, W, C)`` (CIFAR), numpy/tensor ``(N, H, W)`` (MNIST) or tensor NCHW.
    ``torch.from_numpy`` shares the buffer (https://pytorch.org/docs/stable/generated/torch.from_numpy.html);
    the NHWC->NCHW ``permute`` is a view too, so no byte is copied.
    """
    t = torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.as_tensor(array)
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.shape[-1] in (1, 3) and t.shape[1] not in (1, 3):
        return t.permute(0, 3, 1, 2)
    return t


def _transforms(name: str, data_cfg: DictConfig, train: bool, mean, std):
    from torchvision import transforms as T

    steps = []
    if name == "imagefolder":
        size = data_cfg.image_size
        steps += [T.RandomResizedCrop(size), T.RandomHorizontalFlip()] if train and data_cfg.augment else [
            T.Resize(int(size * 256 / 224)),
            T.CenterCrop(size),
        ]
    elif train and data_cfg.augment:
        steps += [T.RandomCrop(32 if name == "cifar10" else 28, padding=4), T.RandomHorizontalFlip()]
    steps.append(T.ToTensor())
    if mean is not None:
        steps.append(T.Normalize(mean, std))
    return T.Compose(steps)


def _mnist(cfg: DictConfig, mean, std):
    """MNIST from ``<root>/MNIST/raw``: each ``.gz`` is md5-checked and extracted next to itself, once.

    The copy a regular install put inside the package (``data.root`` defaults to it there) is only read:
    site-packages may be read-only, and files written there would outlive ``pip uninstall``. Its archives
    are extracted into ``runner.cache_dir()`` (``~/.cache/runner/MNIST/raw``) instead. Each file is
    written under a temporary name and renamed, so jobs extracting at once (DDP ranks) never read half a file.

    Raises:
        ConfigError: a ``.gz`` is missing (names it, ``data.root`` and ``data.download=true``), corrupt
            (md5 mismatch), cannot be extracted, the download failed, or an extracted file is unreadable.
    """
    from torchvision.datasets import MNIST
    from torchvision.datasets.utils import check_integrity

    from runner import PACKAGE_DIR, cache_dir

    raw = Path(cfg.root) / "MNIST" / "raw"
    root = cache_dir() if raw.resolve().is_relative_to(PACKAGE_DIR) else Path(cfg.root)  # where MNIST() reads
    out = root / "MNIST" / "raw"
    downloading = False
    for url_name, md5 in MNIST.resources:
        gz = raw / url_name
        extracted = out / url_name.removesuffix(".gz")
        if extracted.exists():
            continue
        if not gz.exists():
            if cfg.download:
                downloading = True
                break  # torchvision fetches and extracts everything below
            raise ConfigError(
                f"MNIST not found: {gz} does not exist. Set data.root to a folder holding MNIST/raw/*.gz "
                f"(or the environment variable RUNNER_DATA_ROOT), or pass data.download=true to fetch it."
            )
        if not check_integrity(str(gz), md5):
            raise ConfigError(f"corrupt dataset file {gz}: its md5 is not {md5}. Delete it and restore it "
                              f"(copy it again, or data.download=true).")
        try:
            out.mkdir(parents=True, exist_ok=True)
            partial = extracted.with_name(f"{extracted.name}.{os.getpid()}.partial")
            with gzip.open(gz) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, extracted)
        except OSError as e:
            raise ConfigError(f"cannot extract {gz} into {out} ({e}); make {out} writable or copy the data elsewhere "
                              f"and set data.root") from e
    try:
        mk = lambda train: MNIST(root, train=train, download=cfg.download,  # noqa: E731
                                 transform=_transforms("mnist", cfg, train, mean, std))
        train_ds, eval_ds = mk(True), mk(False)
    except (RuntimeError, AssertionError, ValueError) as e:
        if downloading:
            raise ConfigError(f"MNIST not found under {raw} and downloading it failed ({e}). Set data.root to a "
                              f"folder holding MNIST/raw/*.gz (or RUNNER_DATA_ROOT), or retry data.download=true "
                              f"with network access.") from e
        raise ConfigError(f"cannot read MNIST under {out} ({e}); delete the extracted *-ubyte files there and "
                          f"run again") from e
    return train_ds, eval_ds, lambda: ((images_as_tensor(train_ds.data), train_ds.targets),
                                       (images_as_tensor(eval_ds.data), eval_ds.targets))


def _cifar_batch_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable CIFAR-10 batch (a pickled dict with ``data`` (N, 3072) uint8 and
    ``labels``/``label_names``), or None when it is."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is corrupt
        return f"cannot unpickle it ({e!r})"
    if not isinstance(entry, dict):
        return f"it holds a {type(entry).__name__}, not a dict"
    if "label_names" in entry:
        return None
    if "data" not in entry or "labels" not in entry:
        return f"it has no 'data'/'labels' entries (keys: {sorted(entry)[:5]})"
    if np.asarray(entry["data"]).size % 3072:
        return "its 'data' is not a whole number of 3x32x32 images"
    return None


def _cifar10_class() -> type:
    """torchvision's CIFAR10 without its md5 checks: torchvision checks every file's md5 against the official
    archive (batches.meta too, in _load_meta); runner checks presence only and names a corrupt file itself,
    so CIFAR-format sets other than the official one (the tests' tiny ones) load too.

    Made on first use (torchvision costs ~1 s to import, which every process would pay) and kept as the
    module attribute ``runner.data._CIFAR10``, which is what pickle looks up: the dataset pickles into
    DataLoader workers started by spawn or forkserver, where ``__getattr__`` below makes it again."""
    if "_CIFAR10" in globals():
        return globals()["_CIFAR10"]
    from torchvision.datasets import CIFAR10

    class _CIFAR10(CIFAR10):
        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:
            with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    _CIFAR10.__qualname__ = "_CIFAR10"
    globals()["_CIFAR10"] = _CIFAR10
    return _CIFAR10


def __getattr__(name: str):
    """``runner.data._CIFAR10`` for pickle (PEP 562), made on first access."""
    if name == "_CIFAR10":
        return _cifar10_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cifar10(cfg: DictConfig, mean, std):
    """CIFAR-10 from ``<root>/cifar-10-batches-py`` (torchvision's layout, python pickles).

    Raises:
        ConfigError: the folder or one of its batch files is missing (names the path, ``data.root`` and
            ``data.download=true``), or a batch file is corrupt (names the file).
    """
    CIFAR10 = _cifar10_class()
    folder = Path(cfg.root) / CIFAR10.base_folder
    names = [name for name, _ in CIFAR10.train_list + CIFAR10.test_list] + [CIFAR10.meta["filename"]]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing and not cfg.download:
        what = f"{folder} does not exist" if not folder.is_dir() else f"{folder} lacks {', '.join(missing)}"
        raise ConfigError(
            f"CIFAR-10 not found: {what}. Set data.root to the folder that holds cifar-10-batches-py (or the "
            f"environment variable RUNNER_DATA_ROOT), or pass data.download=true to download it there."
        )
    datasets = []
    for train in (True, False):
        try:
            datasets.append(CIFAR10(cfg.root, train=train, download=cfg.download,
                                     transform=_transforms("cifar10", cfg, train, mean, std)))
        except Exception as e:  # noqa: BLE001 - unpickling garbage can raise almost anything
            if missing:  # data.download=true was asked to fetch the missing files and could not
                raise ConfigError(f"CIFAR-10 not found: {folder} lacks {', '.join(missing)} and downloading it "
                                  f"failed ({e!r}). Set data.root to the folder that holds cifar-10-batches-py "
                                  f"(or RUNNER_DATA_ROOT), or retry data.download=true with network access.") from e
            bad = next(((folder / n, why) for n in names if (why := _cifar_batch_problem(folder / n))), None)
            path, why = bad if bad else (folder, repr(e))
            raise ConfigError(f"corrupt dataset file {path}: {why}. Replace it with a fresh copy of "
                              f"cifar-10-batches-py (or delete {folder} and pass data.download=true).") from e
    train_ds, eval_ds = datasets
    return train_ds, eval_ds, lambda: ((images_as_tensor(train_ds.data), torch.as_tensor(train_ds.targets)),
                                       (images_as_tensor(eval_ds.data), torch.as_tensor(eval_ds.targets)))


def _imagefolder(cfg: DictConfig, mean, std):
    from torchvision.datasets import ImageFolder

    out = []
    for split, train in (("train", True), ("val", False)):
        path = Path(cfg.root) / split
        if not path.is_dir():
            raise ConfigError(f"image folder not found: {path} does not exist. data=imagefolder reads "
                              f"<data.root>/train/<class>/* and <data.root>/val/<class>/*; set data.root.")
        try:
            out.append(ImageFolder(str(path), transform=_transforms("imagefolder", cfg, train, mean, std)))
        except (FileNotFoundError, RuntimeError) as e:
            raise ConfigError(f"cannot read the image folder {path}: {e}") from e
    if out[0].classes != out[1].classes:
        raise ConfigError(f"{cfg.root}/train and {cfg.root}/val have different class folders; make them match")
    return out[0], out[1], None


def _synthetic(cfg: DictConfig, mean, std):
    if cfg.num_classes is None or cfg.num_classes < 1:
        raise ConfigError(f"data.num_classes={cfg.num_classes} must be >= 1 for data=synthetic (labels are drawn "
                          f"from 0 .. num_classes - 1)")
    if any(s <= 0 for s in cfg.shape) or len(cfg.shape) != 3:
        raise ConfigError(f"data.shape={list(cfg.shape)} must be three positive sizes [C, H, W]")
    g = torch.Generator().manual_seed(1234)
    mk = lambda n: (torch.randint(0, 256, (n, *cfg.shape), dtype=torch.uint8, generator=g),  # noqa: E731
                    torch.randint(0, cfg.num_classes, (n,), generator=g))
    (tx, ty), (ex, ey) = mk(cfg.train_size), mk(cfg.eval_size)
    return (UInt8ImageDataset(tx, ty, mean, std), UInt8ImageDataset(ex, ey, mean, std),
            lambda: ((tx, ty), (ex, ey)))


_DATASETS = {"mnist": _mnist, "cifar10": _cifar10, "imagefolder": _imagefolder, "synthetic": _synthetic}


@dataclass
class HostLoading:
    """How batches come from host memory: ``DataLoader`` arguments, copy mode and the techniques' statuses."""

    kwargs: dict  # num_workers, pin_memory, persistent_workers, prefetch_factor
    non_blocking: bool
    techniques: dict[str, str]


def host_loading(loader_cfg: DictConfig, device: torch.device) -> HostLoading:
    """Techniques 2 and 7 for a ``DataLoader``: worker processes, page-locked batches, non_blocking copies.

    Pinning and non_blocking only act with CUDA (PyTorch "pin_memory" tutorial,
    https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html); elsewhere they are recorded as skipped.

    Raises:
        ConfigError: ``num_workers`` < 0.
    """
    techniques: dict[str, str] = {}
    pin = bool(loader_cfg.pin_memory)
    if pin and device.type != "cuda":
        techniques["pin_memory"] = "skipped: page-locked memory only speeds up copies to a CUDA device"
        pin = False
    elif pin:
        techniques["pin_memory"] = "applied"
    workers = loader_cfg.num_workers
    if workers < 0:
        raise ConfigError(f"dataloader.num_workers={workers} must be >= 0")
    kwargs = dict(num_workers=workers, pin_memory=pin)
    if workers > 0:
        techniques["num_workers"] = "applied"
        kwargs |= dict(persistent_workers=loader_cfg.persistent_workers, prefetch_factor=loader_cfg.prefetch_factor)
        if loader_cfg.persistent_workers:
            techniques["persistent_workers"] = "applied"
        if loader_cfg.prefetch_factor:
            techniques["prefetch_factor"] = "applied"
    elif loader_cfg.persistent_workers or loader_cfg.prefetch_factor:
        techniques["persistent_workers"] = "skipped: needs dataloader.num_workers > 0"
    non_blocking = bool(loader_cfg.non_blocking)
    if non_blocking and not pin:
        techniques["non_blocking"] = "skipped: a non_blocking copy is only asynchronous from pinned memory"
        non_blocking = False
    elif non_blocking:
        techniques["non_blocking"] = "applied"
    return HostLoading(kwargs, non_blocking, techniques)


def host_loader(ds: Dataset, batch_size: int, train: bool, loading: HostLoading, env, seed: int, drop_last: bool,
                sampler=None) -> DataLoader:
    """A ``DataLoader`` for this rank: ``sampler`` if given, else a ``DistributedSampler`` share when there are
    several ranks (shuffled for training), else plain (shuffled for training) with a seeded generator.
    A training loader's sampler is a ``SkippableSampler``, so a resumed run continues mid-epoch."""
    if sampler is None and env.world_size > 1:
        sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=train, seed=seed,
                                     drop_last=train)
    g = torch.Generator().manual_seed(seed + env.rank)
    if train:
        sampler = SkippableSampler(sampler if sampler is not None else torch.utils.data.RandomSampler(ds, generator=g))
    return DataLoader(ds, batch_size=batch_size, sampler=sampler,
                      drop_last=train and drop_last, generator=g, **loading.kwargs)


def _text(cfg: DictConfig, loader_cfg: DictConfig, env, seed: int) -> Data:
    """``data=text``: character tokens of ``data.path`` (``runner.text``), windows of ``data.block_size``.

    Training: ``data.train_size`` random windows per epoch (null: train tokens // block_size, so an epoch
    sees about as many tokens as the split holds), each rank its own seeded draw. Evaluation: the
    consecutive windows that tile the validation split, the same every time, strided over the ranks.
    ``dataloader.on_device``: both splits on the device, one gather per batch (``text.OnDeviceWindows``);
    otherwise a ``DataLoader`` over ``text.TokenWindows`` with the host-loading techniques.
    ``data.normalize``/``augment`` are image techniques: the language-model task records them as skipped.
    """
    tokens, vocab = text.read_corpus(cfg.path)
    train_tokens, val_tokens = text.split(tokens, cfg.block_size, cfg.path)
    block, bs, device = cfg.block_size, loader_cfg.batch_size, env.device
    windows = cfg.train_size or len(train_tokens) // block
    per_rank = windows // env.world_size
    eval_windows = text.TokenWindows(val_tokens, block, stride=block)
    techniques: dict[str, str] = {}
    if loader_cfg.on_device:
        g = torch.Generator(device).manual_seed(seed + env.rank)
        starts = (torch.arange(len(eval_windows), device=device) * block)[env.rank::env.world_size]
        train = text.OnDeviceWindows(train_tokens.to(device), block, bs, num_batches=per_rank // bs, generator=g)
        evaluation = text.OnDeviceWindows(val_tokens.to(device), block, bs, starts=starts)
        techniques["on_device_data"] = "applied"
        non_blocking = False
    else:
        loading = host_loading(loader_cfg, device)
        techniques |= loading.techniques
        train_windows = text.TokenWindows(train_tokens, block)
        sampler = torch.utils.data.RandomSampler(train_windows, replacement=True, num_samples=per_rank,
                                                 generator=torch.Generator().manual_seed(seed + env.rank))
        train = host_loader(train_windows, bs, True, loading, env, seed, drop_last=True, sampler=sampler)
        evaluation = host_loader(eval_windows, bs, False, loading, env, seed, drop_last=False)
        non_blocking = loading.non_blocking
    if len(train) == 0:
        raise ConfigError(f"dataloader.batch_size={bs} is larger than this rank's {per_rank} training windows per "
                          f"epoch; lower it or raise data.train_size")
    example = tuple(torch.randint(0, len(vocab), (2, block), device=device) for _ in range(2))
    return Data(train=DeviceIterable(train, device, non_blocking, torch.contiguous_format),
                eval=DeviceIterable(evaluation, device, non_blocking, torch.contiguous_format),
                num_classes=None, in_channels=None, sample_shape=(block,), train_samples=windows,
                techniques=techniques, example=example, vocab=vocab)


# --------------------------------------------------------------------------------------------------
# data=custom: the user's function


#: ``data=custom`` keys that are runner's; every other key under ``data.`` is an argument of the function
#: (``num_classes`` is passed too, when set and the function has a parameter of that name).
CUSTOM_KEYS = ("name", "_target_", "num_classes", "normalize", "augment")


def _check_item(path: str, which: str, ds) -> tuple[torch.Tensor, object]:
    """Item 0 of ``ds`` as ``(input tensor, target)``, checked for a classification task.

    Raises:
        ConfigError: reading it raises, it is not an ``(input, target)`` pair, the input is not a tensor
            or numpy array with at least one dimension, or the target is not one int64 class index.
    """
    try:
        item = ds[0]
    except Exception as e:  # noqa: BLE001 - the user's __getitem__ can raise anything
        raise ConfigError(f"data._target_={path}: reading item 0 of the {which} set raised {type(e).__name__}: {e}") from e
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        what = f"a {type(item).__name__}" + (f" of {len(item)} elements" if isinstance(item, (tuple, list)) else "")
        raise ConfigError(f"data._target_={path}: items must be (input, target) pairs, but item 0 of the {which} set "
                          f"is {what}; return `x, y` from __getitem__ (a TensorDataset(inputs, targets) does)")
    x, y = item
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        what = "a 0-d tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ConfigError(f"data._target_={path}: the input of item 0 of the {which} set is {what}; it must be a "
                          f"tensor (or numpy array) with at least one dimension, e.g. shape (n_features,)")
    if isinstance(y, torch.Tensor):
        ok = y.dim() == 0 and y.dtype == torch.int64
        what = f"a {y.dtype} tensor of shape {tuple(y.shape)}"
    else:
        ok = isinstance(y, (int, np.int64)) and not isinstance(y, bool)
        what = f"a {type(y).__name__}" + (f" ({y.dtype})" if isinstance(y, np.generic) else "")
    if not ok:
        raise ConfigError(f"data._target_={path}: the target of item 0 of the {which} set is {what}; a classification "
                          f"target is one class index: a Python int or a 0-d int64 tensor (torch.long; e.g. "
                          f"TensorDataset(x, y.long()) with y of shape (N,))")
    return x, y


def _tensor_pair(ds) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``ds`` as ``(inputs, targets)`` tensors, for ``dataloader.on_device``, or the reason it cannot be.

    A ``TensorDataset`` of two tensors gives its own (no copy); a ``Subset`` of one gives the selected rows.
    """
    if isinstance(ds, TensorDataset):
        return tuple(ds.tensors) if len(ds.tensors) == 2 else f"its TensorDataset holds {len(ds.tensors)} tensors, not 2"
    if isinstance(ds, Subset):
        inner = _tensor_pair(ds.dataset)
        if isinstance(inner, str):
            return inner
        idx = torch.as_tensor(list(ds.indices), dtype=torch.long)
        return inner[0][idx], inner[1][idx]
    return (f"a {type(ds).__name__} cannot be held as whole tensors (only a TensorDataset or a Subset of one: its "
            f"__getitem__ may transform each item); batches come from the DataLoader instead")


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
    """The class count of the user's datasets, by the rule in the module docstring.

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
        raise ConfigError(f"data._target_={path}: cannot tell how many classes the data has: set data.num_classes=<C> "
                          f"(or give the dataset a num_classes or classes attribute, or targets runner can read "
                          f"without loading inputs: a TensorDataset or a `targets` attribute)")
    if seen:
        lo, hi = min(int(t.min()) for t in seen), max(int(t.max()) for t in seen)
        if lo < 0:
            raise ConfigError(f"data._target_={path}: a target is {lo}; class indices run from 0 to num_classes - 1")
        if hi >= count:
            raise ConfigError(f"data._target_={path}: a target is {hi} but the class count is {count} (from {source}); "
                              f"class indices run from 0 to num_classes - 1: set data.num_classes={hi + 1} or more")
    return count


def custom_datasets(cfg: DictConfig) -> tuple[Dataset, Dataset, int, torch.Tensor]:
    """Call ``data._target_`` and check what it returns: ``(train_dataset, eval_dataset, num_classes,
    first training input)``.

    Keyword arguments: every key under ``data.`` but ``CUSTOM_KEYS``, plus ``num_classes`` when set and
    the function has that parameter; lists and dicts arrive as plain Python, nested ``_target_`` nodes are
    instantiated (Hydra's ``instantiate``). The function runs on every rank: make it deterministic (seed
    any random generator) so every rank sees the same data.

    Raises:
        ConfigError: ``_target_`` unset, not importable or not callable; an argument its signature lacks
            (lists the valid names); the call raises; it does not return a pair of map-style datasets; an
            empty dataset; items that are not ``(input, target)`` pairs with an int64 class index;
            inputs of different shapes in the two sets; no class count (``class_count``).
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
        raise ConfigError(f"data._target_={path} returned a {what}; it must return a pair (train_dataset, "
                          f"eval_dataset), e.g. `return TensorDataset(x_train, y_train), TensorDataset(x_eval, y_eval)`")
    for which, ds in zip(("training", "evaluation"), out):
        if isinstance(ds, IterableDataset) or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(f"data._target_={path}: its {which} set is a {type(ds).__name__}, not a map-style "
                              f"Dataset (with __len__ and __getitem__, e.g. a TensorDataset)")
        if len(ds) == 0:
            raise ConfigError(f"data._target_={path}: its {which} set is empty (0 items); check the function's "
                              f"arguments ({', '.join(f'data.{k}={v!r}' for k, v in kwargs.items()) or 'none'})")
    train_ds, eval_ds = out
    x0, _ = _check_item(path, "training", train_ds)
    xe, _ = _check_item(path, "evaluation", eval_ds)
    if xe.shape != x0.shape:
        raise ConfigError(f"data._target_={path}: training inputs have shape {tuple(x0.shape)} but evaluation inputs "
                          f"{tuple(xe.shape)}; both sets must hold inputs of one shape")
    return train_ds, eval_ds, class_count(path, cfg.num_classes, train_ds, eval_ds), x0


def build(data_cfg: DictConfig, loader_cfg: DictConfig, env, *, seed: int = 0,
          memory_format: torch.memory_format = torch.contiguous_format) -> Data:
    """Build the train and eval iterables for this rank (``data=text``: ``runner.text.build``).

    ``data=custom`` goes through ``custom_datasets``; the loader techniques (DataLoader workers, pinned
    memory, non_blocking copies, DistributedSampler, ``on_device``) apply to it as to the built-in sets.
    Switches that cannot act on it are recorded as ``skipped: <reason>``: ``data.normalize`` and
    ``data.augment`` (image statistics and crops), ``on_device`` for a dataset that is not whole tensors,
    channels_last for inputs that are not ``(C, H, W)``.

    Raises:
        ConfigError: unknown ``data.name``, a missing or corrupt dataset, ``batch_size`` <= 0, a
            per-rank training set smaller than one batch, ``on_device`` with a built-in dataset that has no
            in-memory form (imagefolder), a ``data.num_classes`` that contradicts a built-in dataset, or
            bad custom data (``custom_datasets``).
    """
    name = data_cfg.name
    if loader_cfg.batch_size <= 0:
        raise ConfigError(f"dataloader.batch_size={loader_cfg.batch_size} must be a positive number of samples")
    check_choice("data.name", name)  # the built-ins of _DATASETS, text and custom
    if name == "text":
        return _text(data_cfg, loader_cfg, env, seed)
    techniques: dict[str, str] = {}
    if name == "custom":
        mean = std = None
        train_ds, eval_ds, num_classes, x0 = custom_datasets(data_cfg)
        in_memory = None  # on_device only: the tensors, or why there are none (a Subset's rows are copied)
        if loader_cfg.on_device:
            pair = _tensor_pair(train_ds), _tensor_pair(eval_ds)
            in_memory = next((p for p in pair if isinstance(p, str)), None) or (lambda: pair)
        why = "data=custom: your dataset function returns the inputs as the model sees them"
        if data_cfg.normalize:
            techniques["normalize"] = f"skipped: {why}; normalize them there (data.normalize knows only the " \
                                      f"built-in image sets' statistics)"
        if data_cfg.augment:
            techniques["augment"] = f"skipped: {why}; augment in its __getitem__ (data.augment is the built-in " \
                                    f"image sets' crop + flip)"
    else:
        mean, std = STATS["imagenet" if name == "imagefolder" else name] if data_cfg.normalize else (None, None)
        if data_cfg.normalize:
            techniques["normalize"] = "applied"
        train_ds, eval_ds, in_memory = _DATASETS[name](data_cfg, mean, std)
        if name == "synthetic":
            num_classes = data_cfg.num_classes
        else:
            num_classes = len(train_ds.classes)
            if data_cfg.num_classes is not None and data_cfg.num_classes != num_classes:
                raise ConfigError(f"data.num_classes={data_cfg.num_classes} but data={name} has {num_classes} classes; "
                                  f"leave data.num_classes unset (null) for a built-in dataset")
        x0, _ = train_ds[0]
    sample_shape = tuple(x0.shape)
    if memory_format == torch.channels_last and len(sample_shape) != 3:
        techniques["channels_last"] = f"skipped: inputs of shape {sample_shape} are not images (C, H, W)"
        memory_format = torch.contiguous_format
    device = env.device
    bs = loader_cfg.batch_size

    on_device = loader_cfg.on_device
    if on_device and isinstance(in_memory, str):
        techniques["on_device_data"] = f"skipped: {in_memory}"
        on_device = False
    if on_device:
        if in_memory is None:
            raise ConfigError(f"dataloader.on_device=true needs an in-memory dataset; data={name} is read from "
                              f"image files. Use dataloader=pinned instead.")
        (tx, ty), (ex, ey) = in_memory()
        if mean is not None and len(mean) != tx.shape[1]:
            mean, std = mean * tx.shape[1], std * tx.shape[1]
        common = dict(mean=mean, std=std, seed=seed, rank=env.rank, world_size=env.world_size,
                      as_images=name != "custom")
        train = OnDeviceLoader(tx.to(device), ty.to(device), bs, shuffle=True,
                               augment=data_cfg.augment and name != "custom", drop_last=loader_cfg.drop_last, **common)
        evaluation = OnDeviceLoader(ex.to(device), ey.to(device), bs, shuffle=False, augment=False,
                                    drop_last=False, **common)
        techniques["on_device_data"] = "applied"
        non_blocking = False
    else:
        loading = host_loading(loader_cfg, device)
        techniques |= loading.techniques
        train = host_loader(train_ds, bs, True, loading, env, seed, loader_cfg.drop_last)
        evaluation = host_loader(eval_ds, bs, False, loading, env, seed, loader_cfg.drop_last)
        non_blocking = loading.non_blocking

    if len(train) == 0:
        raise ConfigError(f"dataloader.batch_size={bs} is larger than this rank's training set "
                          f"({len(train_ds) // env.world_size} samples); lower it")
    example = (torch.randn(2, *sample_shape, device=device), torch.randint(0, num_classes, (2,), device=device))
    return Data(
        train=DeviceIterable(train, device, non_blocking, memory_format),
        eval=DeviceIterable(evaluation, device, non_blocking, memory_format),
        num_classes=num_classes,
        in_channels=sample_shape[0],
        sample_shape=sample_shape,
        train_samples=len(train_ds),
        techniques=techniques,
        example=example,
        item=x0,
    )
