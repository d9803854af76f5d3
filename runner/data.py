"""Datasets and loaders: torchvision datasets behind a DataLoader, or the whole dataset on the device.

``build`` returns train/eval iterables that yield ``(x, y)`` already on the run's device: ``x`` is a
float32 batch of shape ``(B, C, H, W)`` (normalized when ``data.normalize``), ``y`` an int64 ``(B,)``.
The host->device copy happens inside the iterable, so the engine's data-wait figure includes it.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler

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
    """What the engine needs from the data: two iterables plus the shapes the model must fit."""

    train: "DeviceIterable"
    eval: "DeviceIterable"
    num_classes: int
    in_channels: int
    sample_shape: tuple[int, ...]  # (C, H, W)
    train_samples: int  # samples in the (per-rank) training set
    techniques: dict[str, str]


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

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (DistributedSampler.set_epoch / the on-device permutation)."""
        sampler = getattr(self.batches, "sampler", None)
        target = sampler if hasattr(sampler, "set_epoch") else self.batches
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.batches:
            x = x.to(self.device, non_blocking=self.non_blocking, memory_format=self.memory_format)
            yield x, y.to(self.device, non_blocking=self.non_blocking)


class OnDeviceLoader:
    """Technique 2b (airbench, hlb-CIFAR10): the dataset lives on the device as a uint8 tensor.

    Each epoch draws one permutation (same seed on every rank, then this rank's strided share, like
    DistributedSampler), and each batch is gathered, converted to float, augmented with a random crop
    (zero padding 4) and horizontal flip, and normalized, all on the device.

    Args:
        images: uint8 ``(N, C, H, W)``, on the device. labels: int64 ``(N,)``.
        mean, std: per-channel statistics in [0, 1] units, or None for no normalization.
    """

    def __init__(self, images, labels, batch_size, *, shuffle, augment, mean, std, drop_last, seed, rank, world_size):
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.augment, self.drop_last = batch_size, shuffle, augment, drop_last
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0
        dev = images.device
        self.mean = None if mean is None else torch.tensor(mean, device=dev).view(1, -1, 1, 1) * 255
        self.std = None if std is None else torch.tensor(std, device=dev).view(1, -1, 1, 1) * 255
        self.per_rank = len(labels) // world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

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
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
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


def _cifar10(cfg: DictConfig, mean, std):
    """CIFAR-10 from ``<root>/cifar-10-batches-py`` (torchvision's layout, python pickles).

    Raises:
        ConfigError: the folder or one of its batch files is missing (names the path, ``data.root`` and
            ``data.download=true``), or a batch file is corrupt (names the file).
    """
    from torchvision.datasets import CIFAR10

    folder = Path(cfg.root) / CIFAR10.base_folder

    class _CIFAR10(CIFAR10):
        # torchvision checks every file's md5 against the official archive (batches.meta too, in
        # _load_meta); we check presence only and name a corrupt file ourselves, so CIFAR-format sets
        # other than the official one (the tests' tiny ones) load too.
        def _check_integrity(self) -> bool:
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:
            with open(folder / self.meta["filename"], "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

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
            datasets.append(_CIFAR10(cfg.root, train=train, download=cfg.download,
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
    if any(s <= 0 for s in cfg.shape) or len(cfg.shape) != 3:
        raise ConfigError(f"data.shape={list(cfg.shape)} must be three positive sizes [C, H, W]")
    g = torch.Generator().manual_seed(1234)
    mk = lambda n: (torch.randint(0, 256, (n, *cfg.shape), dtype=torch.uint8, generator=g),  # noqa: E731
                    torch.randint(0, cfg.num_classes, (n,), generator=g))
    (tx, ty), (ex, ey) = mk(cfg.train_size), mk(cfg.eval_size)
    return (UInt8ImageDataset(tx, ty, mean, std), UInt8ImageDataset(ex, ey, mean, std),
            lambda: ((tx, ty), (ex, ey)))


_DATASETS = {"mnist": _mnist, "cifar10": _cifar10, "imagefolder": _imagefolder, "synthetic": _synthetic}


def build(data_cfg: DictConfig, loader_cfg: DictConfig, env, *, seed: int = 0,
          memory_format: torch.memory_format = torch.contiguous_format) -> Data:
    """Build the train and eval iterables for this rank.

    Raises:
        ConfigError: unknown ``data.name``, a missing or corrupt dataset, ``batch_size`` <= 0, a
            per-rank training set smaller than one batch, or ``on_device`` with a dataset that has no
            in-memory form (imagefolder).
    """
    name = data_cfg.name
    if name not in _DATASETS:
        raise ConfigError(f"data.name={name!r} is not one of {sorted(_DATASETS)}")
    if loader_cfg.batch_size <= 0:
        raise ConfigError(f"dataloader.batch_size={loader_cfg.batch_size} must be a positive number of samples")
    mean, std = STATS["imagenet" if name == "imagefolder" else name] if data_cfg.normalize else (None, None)
    techniques: dict[str, str] = {}
    if data_cfg.normalize:
        techniques["normalize"] = "applied"
    train_ds, eval_ds, in_memory = _DATASETS[name](data_cfg, mean, std)
    num_classes = data_cfg.num_classes if name == "synthetic" else len(train_ds.classes)
    x0, _ = train_ds[0]
    sample_shape = tuple(x0.shape)
    device = env.device
    bs = loader_cfg.batch_size

    if loader_cfg.on_device:
        if in_memory is None:
            raise ConfigError(f"dataloader.on_device=true needs an in-memory dataset; data={name} is read from "
                              f"image files. Use dataloader=pinned instead.")
        (tx, ty), (ex, ey) = in_memory()
        if mean is not None and len(mean) != tx.shape[1]:
            mean, std = mean * tx.shape[1], std * tx.shape[1]
        common = dict(mean=mean, std=std, seed=seed, rank=env.rank, world_size=env.world_size)
        train = OnDeviceLoader(tx.to(device), ty.to(device), bs, shuffle=True, augment=data_cfg.augment,
                               drop_last=loader_cfg.drop_last, **common)
        evaluation = OnDeviceLoader(ex.to(device), ey.to(device), bs, shuffle=False, augment=False,
                                    drop_last=False, **common)
        techniques["on_device_data"] = "applied"
        non_blocking = False
    else:
        pin = bool(loader_cfg.pin_memory)
        if pin and device.type != "cuda":
            techniques["pin_memory"] = "skipped: page-locked memory only speeds up copies to a CUDA device"
            pin = False
        elif pin:
            techniques["pin_memory"] = "applied"
        workers = loader_cfg.num_workers
        if workers < 0:
            raise ConfigError(f"dataloader.num_workers={workers} must be >= 0")
        if workers > 0:
            techniques["num_workers"] = f"applied"
        extra = {}
        if workers > 0:
            extra = dict(persistent_workers=loader_cfg.persistent_workers, prefetch_factor=loader_cfg.prefetch_factor)
            if loader_cfg.persistent_workers:
                techniques["persistent_workers"] = "applied"
            if loader_cfg.prefetch_factor:
                techniques["prefetch_factor"] = "applied"
        elif loader_cfg.persistent_workers or loader_cfg.prefetch_factor:
            techniques["persistent_workers"] = "skipped: needs dataloader.num_workers > 0"

        def loader(ds, train: bool):
            sampler = None
            if env.world_size > 1:
                sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=train,
                                             seed=seed, drop_last=train)
            g = torch.Generator().manual_seed(seed + env.rank)
            return DataLoader(ds, batch_size=bs, shuffle=train and sampler is None, sampler=sampler,
                              num_workers=workers, pin_memory=pin, drop_last=train and loader_cfg.drop_last,
                              generator=g, **extra)

        train, evaluation = loader(train_ds, True), loader(eval_ds, False)
        non_blocking = bool(loader_cfg.non_blocking)
        if non_blocking and not pin:
            techniques["non_blocking"] = "skipped: a non_blocking copy is only asynchronous from pinned memory"
            non_blocking = False
        elif non_blocking:
            techniques["non_blocking"] = "applied"

    if len(train) == 0:
        raise ConfigError(f"dataloader.batch_size={bs} is larger than this rank's training set "
                          f"({len(train_ds) // env.world_size} samples); lower it")
    return Data(
        train=DeviceIterable(train, device, non_blocking, memory_format),
        eval=DeviceIterable(evaluation, device, non_blocking, memory_format),
        num_classes=num_classes,
        in_channels=sample_shape[0],
        sample_shape=sample_shape,
        train_samples=len(train_ds),
        techniques=techniques,
    )
