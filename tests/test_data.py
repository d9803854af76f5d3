"""The real loaders on real formats: tiny CIFAR-format and ImageFolder sets written here, the embedded
MNIST (extracted into a temporary copy, with no network), and real CIFAR-10 from ``../shared/data``."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compose_cfg, job_dirs, read_summary, run_cli
from runner import REPO_ROOT, data as data_mod
from runner.config import CHOICES
from runner.data import tokens
from runner.distributed import setup
from runner.engine.train import train
from runner.errors import ConfigError


def build(*overrides: str):
    cfg = compose_cfg(*overrides)
    return data_mod.build(cfg.data, cfg.dataloader, setup(cfg.distributed, "cpu"), seed=cfg.trainer.seed)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to download fails loudly (torchvision downloads through urllib)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(urllib.request, "urlretrieve", refuse, raising=False)


# ------------------------------------------------------------------------------------------ CIFAR-10


def test_cifar_format_loads_with_standard_normalization(tiny_cifar, no_network):
    data = build("data=cifar10", f"data.root={tiny_cifar}", "data.augment=false", "dataloader.batch_size=8")
    assert (data.num_classes, data.in_channels, data.sample_shape, data.train_samples) == (10, 3, (3, 32, 32), 100)
    assert len(data.train) == 100 // 8 and len(data.eval) == 5  # drop_last on train only
    with open(tiny_cifar / "cifar-10-batches-py" / "test_batch", "rb") as f:
        raw = pickle.load(f)
    x, y = next(iter(data.eval))  # the evaluation set is not shuffled: its first 8 images
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in data_mod.STATS["cifar10"])
    expected = (torch.from_numpy(raw["data"][:8].reshape(8, 3, 32, 32)).float() / 255 - mean) / std
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    torch.testing.assert_close(x, expected)
    assert y.tolist() == raw["labels"][:8]
    xt, yt = next(iter(data.train))
    assert xt.shape == (8, 3, 32, 32) and yt.shape == (8,) and 0 <= int(yt.min()) and int(yt.max()) < 10


def per_sample_batches(dataset, batch_size: int) -> list:
    """The batches of a plain ``DataLoader`` over ``dataset``: each item through its torchvision transforms."""
    return list(torch.utils.data.DataLoader(dataset, batch_size=batch_size))


def test_cifar_on_device_matches_the_dataloader(tiny_cifar):
    """``dataloader=device`` trains on the host DataLoader's batches, in its order (augmentation off)."""
    common = ("data=cifar10", f"data.root={tiny_cifar}", "data.augment=false", "dataloader.batch_size=8")
    host, device = build(*common), build(*common, "dataloader=device", "dataloader.batch_size=8")
    assert device.techniques["on_device_data"] == "applied"
    assert len(device.train) == len(host.train)
    for data in (host, device):
        data.train.set_epoch(1)
    for (xh, yh), (xd, yd) in zip(host.train, device.train):
        torch.testing.assert_close(xd, xh)
        assert torch.equal(yd, yh)


@pytest.mark.parametrize("name", ["cifar10", "mnist"])
def test_the_evaluation_batches_are_the_per_sample_loaders_gathered_from_memory(name, tiny_cifar, no_network):
    """An image set held in memory is evaluated from its uint8 tensors a batch at a time (runner/data/loading.py
    ``_eval_from_memory``), whatever ``dataloader`` trains: the same images, normalized alike, labels and order as a
    plain DataLoader over the dataset's per-sample transforms."""
    overrides = ("data=cifar10", f"data.root={tiny_cifar}") if name == "cifar10" else ("data=mnist",)
    cfg = compose_cfg(*overrides, "dataloader.batch_size=50")
    data = build(*overrides, "dataloader.batch_size=50")
    assert type(data.eval.batches).__name__ == "OnDeviceLoader"  # gathered, not a DataLoader of items
    expected = per_sample_batches(data_mod.source_for(cfg.data).eval, 50)
    assert len(data.eval) == len(expected)
    for (x, y), (xe, ye) in zip(data.eval, expected):
        torch.testing.assert_close(x, xe, rtol=0, atol=1e-5)
        assert torch.equal(y, ye)


def test_cifar_trains_through_the_engine(tiny_cifar, tmp_path):
    summary = train(
        compose_cfg("data=cifar10", f"data.root={tiny_cifar}", "dataloader.batch_size=10"), job_dir=tmp_path
    )
    assert summary["steps"] == 4 and summary["config"]["data"]["root"] == str(tiny_cifar)
    assert summary["samples_per_sec"] > 0 and 0 <= summary["eval_accuracy"] <= 1


# --------------------------------------------------------------------------------------- ImageFolder


def test_imagefolder_loads_classes_and_size(tiny_imagefolder, tmp_path):
    data = build("data=imagefolder", f"data.root={tiny_imagefolder}", "data.image_size=16", "dataloader.batch_size=4")
    assert (data.num_classes, data.sample_shape, data.train_samples) == (3, (3, 16, 16), 24)
    x, y = next(iter(data.eval))
    assert x.shape == (4, 3, 16, 16) and set(y.tolist()) <= {0, 1, 2}
    assert sorted(int(v) for _, yb in data.eval for v in yb) == [c for c in range(3) for _ in range(8)]
    summary = train(
        compose_cfg(
            "data=imagefolder", f"data.root={tiny_imagefolder}", "data.image_size=16", "dataloader.batch_size=4"
        ),
        job_dir=tmp_path,
    )
    assert summary["steps"] == 4 and summary["flops_per_sample"] > 0


def test_imagefolder_with_different_class_folders_is_refused(tiny_imagefolder):
    shutil.rmtree(tiny_imagefolder / "val" / "fish")
    with pytest.raises(ConfigError, match="different class folders"):
        build("data=imagefolder", f"data.root={tiny_imagefolder}", "data.image_size=16")


def test_imagefolder_cannot_live_on_the_device(tiny_imagefolder):
    with pytest.raises(ConfigError, match="dataloader.on_device=true"):
        build("data=imagefolder", f"data.root={tiny_imagefolder}", "data.image_size=16", "dataloader=device")


# ------------------------------------------------------------------------------------------- MNIST


@pytest.fixture(scope="module")
def mnist_copy(tmp_path_factory) -> Path:
    """The repository's four MNIST archives (and nothing extracted) in a temporary ``<root>/MNIST/raw``."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    archives = sorted((REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"))
    assert [a.name for a in archives] == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
    ]
    for gz in archives:
        shutil.copy(gz, raw)
    return root


def test_embedded_mnist_loads_without_network(mnist_copy, no_network, monkeypatch):
    repo_data = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "data").rglob("*"))
    monkeypatch.setenv("RUNNER_DATA_ROOT", str(mnist_copy))
    data = build("data=mnist", "dataloader.batch_size=100")  # root from RUNNER_DATA_ROOT
    assert (data.num_classes, data.sample_shape, data.train_samples) == (10, (1, 28, 28), 60000)
    assert len(data.eval) == 100
    x, y = next(iter(data.eval))
    assert y[:5].tolist() == [7, 2, 1, 0, 4]  # the first MNIST test digits
    mean, std = data_mod.STATS["mnist"]
    # normalized with MNIST's statistics: black (0) and white (255) pixels land here
    assert float(x.min()) == pytest.approx(-mean[0] / std[0], abs=1e-5)
    assert float(x.max()) == pytest.approx((1 - mean[0]) / std[0], abs=1e-5)
    extracted = sorted(p.name for p in (mnist_copy / "MNIST" / "raw").iterdir() if not p.name.endswith(".gz"))
    assert extracted == [
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
    ]
    assert sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "data").rglob("*")) == repo_data


def test_installed_copy_is_extracted_into_the_user_cache(monkeypatch, tmp_path, no_network):
    """A regular install's MNIST (inside the package, maybe read-only) is only read: the archives are
    extracted into ``$XDG_CACHE_HOME/runner``, and the package folder gets no file."""
    import runner

    package = tmp_path / "site-packages" / "runner"
    raw = package / "embedded_data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    monkeypatch.setattr(runner, "PACKAGE_DIR", package)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = build("data=mnist", f"data.root={package / 'embedded_data'}", "dataloader.batch_size=100")
    assert data.train_samples == 60000 and next(iter(data.eval))[1][:3].tolist() == [7, 2, 1]
    assert sorted(p.name for p in package.rglob("*") if p.is_file()) == sorted(p.name for p in raw.glob("*.gz"))
    cached = tmp_path / "cache" / "runner" / "MNIST" / "raw"
    assert sorted(p.name for p in cached.iterdir()) == sorted(p.name.removesuffix(".gz") for p in raw.glob("*.gz"))


def test_data_root_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("RUNNER_DATA_ROOT", raising=False)
    assert compose_cfg("data=mnist", tiny=False).data.root == str(REPO_ROOT / "data")
    monkeypatch.setenv("RUNNER_DATA_ROOT", str(tmp_path))
    assert compose_cfg("data=cifar10", tiny=False).data.root == str(tmp_path)
    assert compose_cfg("data=cifar10", "data.root=/elsewhere", tiny=False).data.root == "/elsewhere"


def test_extracted_files_are_git_ignored():
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = [
        "data/MNIST/raw/train-images-idx3-ubyte",
        "data/MNIST/processed/training.pt",
        "data/cifar-10-batches-py/data_batch_1",
    ]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=REPO_ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == paths
    tracked = subprocess.run(["git", "ls-files", "data/MNIST/raw"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert all(name.endswith(".gz") for name in tracked.stdout.split())


# ------------------------------------------------------------------------------------------ synthetic


def test_synthetic_is_made_once_and_reproducible():
    a = build("data.normalize=false")
    b = build("data.normalize=false")
    xa, ya = next(iter(a.eval))
    xb, yb = next(iter(b.eval))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert (a.sample_shape, a.num_classes, a.train_samples) == ((3, 16, 16), 10, 256)
    assert 0.0 <= float(xa.min()) and float(xa.max()) <= 1.0


# ------------------------------------------------------------------------------- in-memory forms


def test_the_in_memory_list_is_what_the_sources_give(tiny_cifar, tiny_imagefolder, tiny_text, mnist_copy):
    """``IN_MEMORY_DATA`` (read by the ``${runner_in_memory:}`` resolver of the presets) names exactly the data
    whose source has an in-memory form, so ``dataloader=device`` can act on it."""
    bins = tokens.prepare(tiny_text, tiny_text.parent / "bins")
    overrides = {
        "mnist": [f"data.root={mnist_copy}"],
        "cifar10": [f"data.root={tiny_cifar}"],
        "imagefolder": [f"data.root={tiny_imagefolder}", "data.image_size=16"],
        "synthetic": [],
        "text": [f"data.path={tiny_text}", "data.block_size=16"],
        "tokens": [
            f"data.train_path={bins['train_path']}",
            f"data.val_path={bins['val_path']}",
            f"data.vocab_size={bins['vocab_size']}",
            "data.block_size=16",
        ],
        "custom": ["data._target_=user_data.tabular"],
    }
    assert set(overrides) == set(CHOICES["data.name"]) and set(data_mod.IN_MEMORY_DATA) <= set(overrides)
    for name, more in overrides.items():
        cfg = compose_cfg(f"data={name}", *more)
        assert (data_mod.source_for(cfg.data).in_memory is not None) == (name in data_mod.IN_MEMORY_DATA), name


# --------------------------------------------------------------------- real CIFAR-10 (../shared/data)


@pytest.mark.slow
def test_real_cifar10_resnet18_cli(shared_data, tmp_path):
    """Done-when: ``python -m runner data=cifar10 data.root=<shared> model=resnet18 model.cifar_stem=true``."""
    proc = run_cli(
        "data=cifar10",
        f"data.root={shared_data}",
        "model=resnet18",
        "model.cifar_stem=true",
        "trainer.max_steps=4",
        "trainer.warmup_steps=1",
        "trainer.log_every=2",
        "trainer.eval_max_batches=2",
        "dataloader.batch_size=16",
        "logger=none",
        "trainer.device=cpu",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    summary = read_summary(job)
    assert summary["steps"] == 4 and summary["samples_per_sec"] > 0
    assert summary["flops_per_sample"] > 1e9  # ResNet-18 with a CIFAR stem: ~1.7 GFLOPs fwd+bwd per image
    assert summary["techniques"]["normalize"] == "applied"
    assert np.isfinite(summary["train_loss"]) and 0 <= summary["eval_accuracy"] <= 1
    assert not any(shared_data.rglob("*.tmp"))  # read-only use
