"""Built-in image datasets: MNIST, CIFAR-10, an image folder and synthetic images, as ``Source``s.

Each entry of ``IMAGE_DATASETS`` is a function ``(data_cfg) -> ImageSets`` (adding one: docs/design.md, "Adding an
image dataset"); ``image_source`` makes it a ``Source``: float32 ``(C, H, W)`` items in [0, 1], int labels.
"""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from runner.data.source import Source
from runner.errors import ConfigError
from runner.files import open_own

# Per-channel statistics of the training sets (the values torchvision's references use).
STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # imagefolder default
    "synthetic": ((0.5,), (0.2898,)),  # uniform bytes 0..255 / 255: mean 0.5, std sqrt((256**2-1)/12)/255
}


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


def images_as_tensor(array) -> torch.Tensor:
    """View a uint8 image array as an ``(N, C, H, W)`` tensor without copying (technique 12).

    ``array``: numpy ``(N, H, W, C)`` (CIFAR), numpy/tensor ``(N, H, W)`` (MNIST) or tensor NCHW
    (https://pytorch.org/docs/stable/generated/torch.from_numpy.html; the ``permute`` is a view too).
    """
    t = torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.as_tensor(array)
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.shape[-1] in (1, 3) and t.shape[1] not in (1, 3):
        return t.permute(0, 3, 1, 2)
    return t


@dataclass
class ImageSets:
    """What an ``IMAGE_DATASETS`` function returns.

    ``train``/``eval``: datasets of ``(float32 (C, H, W), int)`` items, normalized with ``mean``/``std`` (per
    channel, [0, 1] units) when set. ``in_memory``: a callable giving ``((train_images, train_labels), (eval_images,
    eval_labels))``, uint8 ``(N, C, H, W)`` / int64 ``(N,)``, or None for files. ``num_classes``: None = the classes.
    """

    train: Dataset
    eval: Dataset
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    in_memory: Callable[[], tuple] | None = None
    num_classes: int | None = None


def normalization(cfg: DictConfig, stats: tuple[tuple[float, ...], tuple[float, ...]]):
    """``(mean, std)``: ``stats`` when ``data.normalize`` (technique 17), else ``(None, None)``."""
    return stats if cfg.normalize else (None, None)


def transforms(cfg: DictConfig, train: bool, mean, std, *, crop: int | None = None, resize: int | None = None):
    """torchvision transforms of one split: PIL image -> float32 ``(C, H, W)`` in [0, 1], then normalized.

    ``crop`` (px): RandomCrop(padding 4) + flip when augmented (https://github.com/kuangliu/pytorch-cifar);
    ``resize`` (px, square): RandomResizedCrop + flip, else Resize + CenterCrop
    (https://github.com/pytorch/vision/tree/main/references/classification).
    """
    from torchvision import transforms as T

    steps = []
    if resize is not None:
        steps += (
            [T.RandomResizedCrop(resize), T.RandomHorizontalFlip()]
            if train and cfg.augment
            else [
                T.Resize(int(resize * 256 / 224)),
                T.CenterCrop(resize),
            ]
        )
    elif train and cfg.augment:
        steps += [T.RandomCrop(crop, padding=4), T.RandomHorizontalFlip()]
    steps.append(T.ToTensor())
    if mean is not None:
        steps.append(T.Normalize(mean, std))
    return T.Compose(steps)


def mnist(cfg: DictConfig) -> ImageSets:
    """MNIST from ``<root>/MNIST/raw``: each ``.gz`` is md5-checked and extracted next to itself, once.

    An installed package's copy is extracted into ``runner.cache_dir()``; each file is written then renamed.

    Raises:
        ConfigError: a ``.gz`` is missing (names it, ``data.root`` and ``data.download=true``), corrupt
            (md5 mismatch), cannot be extracted, the download failed, or an extracted file is unreadable.
    """
    from torchvision.datasets import MNIST
    from torchvision.datasets.utils import check_integrity

    from runner import PACKAGE_DIR, cache_dir

    mean, std = normalization(cfg, STATS["mnist"])
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
            raise ConfigError(
                f"corrupt dataset file {gz}: its md5 is not {md5}. Delete it and restore it "
                f"(copy it again, or data.download=true)."
            )
        try:
            out.mkdir(parents=True, exist_ok=True)
            partial = extracted.with_name(f"{extracted.name}.{os.getpid()}.partial")
            with gzip.open(gz) as src, open_own(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, extracted)
        except OSError as e:
            raise ConfigError(
                f"cannot extract {gz} into {out} ({e}); make {out} writable or copy the data elsewhere "
                f"and set data.root"
            ) from e
    try:
        mk = lambda train: MNIST(
            root,
            train=train,
            download=cfg.download,
            transform=transforms(cfg, train, mean, std, crop=28),
        )
        train_ds, eval_ds = mk(True), mk(False)
    except (RuntimeError, AssertionError, ValueError) as e:
        if downloading:
            raise ConfigError(
                f"MNIST not found under {raw} and downloading it failed ({e}). Set data.root to a "
                f"folder holding MNIST/raw/*.gz (or RUNNER_DATA_ROOT), or retry data.download=true "
                f"with network access."
            ) from e
        raise ConfigError(
            f"cannot read MNIST under {out} ({e}); delete the extracted *-ubyte files there and run again"
        ) from e
    return ImageSets(
        train_ds,
        eval_ds,
        mean,
        std,
        lambda: (
            (images_as_tensor(train_ds.data), train_ds.targets),
            (images_as_tensor(eval_ds.data), eval_ds.targets),
        ),
    )


class ArrayUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 batch file admitting only numpy arrays and dtypes besides plain data; anything else
    raises ``pickle.UnpicklingError`` before it runs (as ``torch.load(weights_only=True)``)."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not plain array data (CIFAR-10 batches hold only numpy arrays, lists and strings)"
        )


def load_array_pickle(f, encoding: str = "ASCII"):
    """``pickle.load`` through ``ArrayUnpickler``: what torchvision's CIFAR10 reads its batch files with here."""
    return ArrayUnpickler(f, encoding=encoding).load()


def _cifar_batch_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable CIFAR-10 batch (a dict with ``data`` (N, 3072) uint8 and
    ``labels``/``label_names``, read through ``ArrayUnpickler``), or None when it is."""
    try:
        with open(path, "rb") as f:
            entry = load_array_pickle(f, encoding="latin1")
    except pickle.UnpicklingError as e:
        return f"refusing to unpickle it: {e}"
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


class _ArrayPickleModule:
    """Stands in for the ``pickle`` module inside ``torchvision.datasets.cifar`` while a CIFAR-10 set loads."""

    load = staticmethod(load_array_pickle)


def cifar10_class() -> type:
    """torchvision's CIFAR10 without its md5 checks (CIFAR-format sets other than the official one load too), every
    batch unpickled through ``ArrayUnpickler``; made on first use and kept as ``_CIFAR10`` (``__getattr__``)."""
    if "_CIFAR10" in globals():
        return globals()["_CIFAR10"]
    import torchvision.datasets.cifar as torchvision_cifar
    from torchvision.datasets import CIFAR10

    class _CIFAR10(CIFAR10):
        def __init__(self, *args, **kwargs):
            real, torchvision_cifar.pickle = torchvision_cifar.pickle, _ArrayPickleModule
            try:
                super().__init__(*args, **kwargs)
            finally:
                torchvision_cifar.pickle = real

        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:
            with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
                self.classes = load_array_pickle(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    _CIFAR10.__qualname__ = "_CIFAR10"
    globals()["_CIFAR10"] = _CIFAR10
    return _CIFAR10


def __getattr__(name: str):
    """``runner.data.images._CIFAR10`` for pickle (PEP 562), made on first access."""
    if name == "_CIFAR10":
        return cifar10_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cifar10(cfg: DictConfig) -> ImageSets:
    """CIFAR-10 from ``<root>/cifar-10-batches-py`` (torchvision's layout, python pickles).

    Raises:
        ConfigError: the folder or one of its batch files is missing (names the path, ``data.root`` and
            ``data.download=true``), or a batch file is corrupt (names the file).
    """
    CIFAR10 = cifar10_class()
    mean, std = normalization(cfg, STATS["cifar10"])
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
            datasets.append(
                CIFAR10(
                    cfg.root, train=train, download=cfg.download, transform=transforms(cfg, train, mean, std, crop=32)
                )
            )
        except Exception as e:  # noqa: BLE001 - unpickling garbage can raise almost anything
            if missing:  # data.download=true was asked to fetch the missing files and could not
                raise ConfigError(
                    f"CIFAR-10 not found: {folder} lacks {', '.join(missing)} and downloading it "
                    f"failed ({e!r}). Set data.root to the folder that holds cifar-10-batches-py "
                    f"(or RUNNER_DATA_ROOT), or retry data.download=true with network access."
                ) from e
            bad = next(((folder / n, why) for n in names if (why := _cifar_batch_problem(folder / n))), None)
            path, why = bad if bad else (folder, repr(e))
            raise ConfigError(
                f"corrupt dataset file {path}: {why}. Replace it with a fresh copy of "
                f"cifar-10-batches-py (or delete {folder} and pass data.download=true)."
            ) from e
    train_ds, eval_ds = datasets
    return ImageSets(
        train_ds,
        eval_ds,
        mean,
        std,
        lambda: (
            (images_as_tensor(train_ds.data), torch.as_tensor(train_ds.targets)),
            (images_as_tensor(eval_ds.data), torch.as_tensor(eval_ds.targets)),
        ),
    )


def imagefolder(cfg: DictConfig) -> ImageSets:
    """torchvision's ``ImageFolder`` on ``<root>/train/<class>/*`` and ``<root>/val/<class>/*``, images made
    ``data.image_size`` px square, normalized with ImageNet's statistics; read from files, so no in-memory form.

    Raises:
        ConfigError: a split folder is missing or unreadable, or the two splits have different class folders.
    """
    from torchvision.datasets import ImageFolder

    mean, std = normalization(cfg, STATS["imagenet"])

    out = []
    for split, train in (("train", True), ("val", False)):
        path = Path(cfg.root) / split
        if not path.is_dir():
            raise ConfigError(
                f"image folder not found: {path} does not exist. data=imagefolder reads "
                f"<data.root>/train/<class>/* and <data.root>/val/<class>/*; set data.root."
            )
        try:
            out.append(ImageFolder(str(path), transform=transforms(cfg, train, mean, std, resize=cfg.image_size)))
        except (FileNotFoundError, RuntimeError) as e:
            raise ConfigError(f"cannot read the image folder {path}: {e}") from e
    if out[0].classes != out[1].classes:
        raise ConfigError(f"{cfg.root}/train and {cfg.root}/val have different class folders; make them match")
    return ImageSets(out[0], out[1], mean, std)


def synthetic(cfg: DictConfig) -> ImageSets:
    """Random uint8 images of ``data.shape`` ``[C, H, W]`` and labels in 0 .. ``data.num_classes`` - 1, made
    once from a fixed seed (the same every run), ``data.train_size``/``data.eval_size`` of them; in memory.

    Raises:
        ConfigError: ``data.num_classes`` unset or < 1, or ``data.shape`` not three positive sizes.
    """
    if cfg.num_classes is None or cfg.num_classes < 1:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes} must be >= 1 for data=synthetic (labels are drawn "
            f"from 0 .. num_classes - 1)"
        )
    if any(s <= 0 for s in cfg.shape) or len(cfg.shape) != 3:
        raise ConfigError(f"data.shape={list(cfg.shape)} must be three positive sizes [C, H, W]")
    mean, std = normalization(cfg, STATS["synthetic"])
    g = torch.Generator().manual_seed(1234)
    mk = lambda n: (
        torch.randint(0, 256, (n, *cfg.shape), dtype=torch.uint8, generator=g),  # noqa: E731
        torch.randint(0, cfg.num_classes, (n,), generator=g),
    )
    (tx, ty), (ex, ey) = mk(cfg.train_size), mk(cfg.eval_size)
    return ImageSets(
        UInt8ImageDataset(tx, ty, mean, std),
        UInt8ImageDataset(ex, ey, mean, std),
        mean,
        std,
        lambda: ((tx, ty), (ex, ey)),
        num_classes=cfg.num_classes,
    )


#: The built-in image datasets by ``data.name``: one function each, ``(data_cfg) -> ImageSets``.
IMAGE_DATASETS: dict[str, Callable[[DictConfig], ImageSets]] = {
    "mnist": mnist,
    "cifar10": cifar10,
    "imagefolder": imagefolder,
    "synthetic": synthetic,
}


def image_source(cfg: DictConfig) -> Source:
    """``data=<a key of IMAGE_DATASETS>`` as a ``Source`` of layout ``images`` (first training image ``(C, H, W)``).

    Raises:
        ConfigError: whatever the dataset function raises (missing or corrupt files, bad sizes), or a
            ``data.num_classes`` that contradicts the dataset's classes.
    """
    name = cfg.name
    techniques = {"normalize": "applied"} if cfg.normalize else {}
    sets = IMAGE_DATASETS[name](cfg)
    num_classes = sets.num_classes
    if num_classes is None:
        num_classes = len(sets.train.classes)
        if cfg.num_classes is not None and cfg.num_classes != num_classes:
            raise ConfigError(
                f"data.num_classes={cfg.num_classes} but data={name} has {num_classes} classes; "
                f"leave data.num_classes unset (null) for a built-in dataset"
            )
    x0, _ = sets.train[0]
    return Source(
        name=name,
        train=sets.train,
        eval=sets.eval,
        sample_shape=tuple(x0.shape),
        layout="images",
        in_memory=sets.in_memory,
        num_classes=num_classes,
        item=x0,
        mean=sets.mean,
        std=sets.std,
        augment=bool(cfg.augment),
        techniques=techniques,
    )
