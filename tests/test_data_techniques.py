"""Data techniques: 2 (workers + pinned memory), 2b (dataset on the device), 7 (non_blocking copies),
12 (tensors that share the numpy arrays' memory) and 17 (normalized inputs)."""

from __future__ import annotations

import gc
import multiprocessing

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import compose_cfg, cuda_only, run_tiny
from runner import data as data_mod
from runner.distributed import Env

CPU = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))


def build(*overrides, env=CPU) -> data_mod.Data:
    cfg = compose_cfg(*overrides)
    return data_mod.build(cfg.data, cfg.dataloader, env, seed=0)


# ------------------------------------------------------------------------- 2: workers + pinning


def test_pinned_preset_builds_a_worker_dataloader():
    data = build("dataloader=pinned")
    loader = data.train.batches
    assert isinstance(loader, DataLoader)
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 4)
    assert loader.pin_memory is False  # nothing to pin for on a CPU
    assert data.techniques["num_workers"] == "applied"
    assert data.techniques["persistent_workers"] == "applied"
    assert data.techniques["prefetch_factor"] == "applied"
    assert data.techniques["pin_memory"].startswith("skipped: page-locked memory only speeds up copies to a CUDA")
    assert data.techniques["non_blocking"].startswith("skipped: a non_blocking copy is only asynchronous from pinned")
    assert data.train.non_blocking is False
    batches = iter(loader)
    x, y = next(batches)
    workers = multiprocessing.active_children()
    assert len(workers) == 2 and x.shape == (16, 3, 16, 16) and y.shape == (16,)  # loaded by worker processes
    del batches, loader, data
    gc.collect()
    for w in workers:  # persistent workers end with their loader
        w.join(timeout=10)
        assert not w.is_alive()


def test_default_loader_loads_in_the_main_process():
    data = build()
    loader = data.train.batches
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (0, False, False)
    assert data.techniques == {}


def test_worker_options_without_workers_are_recorded_as_skipped():
    data = build("dataloader.persistent_workers=true", "dataloader.prefetch_factor=2")
    assert data.techniques["persistent_workers"] == "skipped: needs dataloader.num_workers > 0"


def test_pinned_preset_in_the_engine(tmp_path, spy):
    summary = run_tiny(tmp_path, "dataloader=pinned", "trainer.max_steps=2")
    assert summary["steps"] == 2 and summary["techniques"]["num_workers"] == "applied"
    assert spy.datas[-1].train.batches.num_workers == 2


@pytest.mark.parametrize("persistent", [True, False])
def test_a_run_stops_its_loader_workers_when_it_ends_even_by_an_error(tmp_path, monkeypatch, persistent):
    """The workers end with ``train``, not when the garbage collector reaches the loader: a run that raised keeps
    its frames (and a pass's iterator) alive in the traceback, a persistent iterator lives in its DataLoader."""
    from runner.engine import train as train_mod

    def broken_log(state, parts, lr):
        raise RuntimeError("a bug at the first log")

    before = set(multiprocessing.active_children())
    workers = ["dataloader.num_workers=2", f"dataloader.persistent_workers={str(persistent).lower()}"]
    summary = run_tiny(tmp_path / "done", *workers, "trainer.max_steps=2")
    assert summary["steps"] == 2 and set(multiprocessing.active_children()) == before
    monkeypatch.setattr(train_mod, "log", broken_log)
    with pytest.raises(RuntimeError, match="a bug at the first log") as raised:
        run_tiny(tmp_path / "raised", *workers, "trainer.max_steps=4", "trainer.log_every=2")
    assert raised.traceback and set(multiprocessing.active_children()) == before  # the traceback is still held


@pytest.mark.gpu
@cuda_only
def test_pin_memory_and_non_blocking_on_cuda(tmp_path, spy):
    cuda = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cuda", 0))
    data = build("dataloader=pinned", env=cuda)
    assert data.train.batches.pin_memory is True and data.train.non_blocking is True
    assert data.techniques["pin_memory"] == "applied" and data.techniques["non_blocking"] == "applied"
    x, y = next(iter(data.train))
    assert x.is_cuda and y.is_cuda
    summary = run_tiny(tmp_path, "dataloader=pinned", "trainer.device=cuda", "trainer.max_steps=2")
    assert summary["techniques"]["pin_memory"] == "applied"


# --------------------------------------------------------------------- 2b: the dataset on the device


def test_device_loader_keeps_the_dataset_as_device_tensors(tmp_path, spy, monkeypatch):
    augmented = []
    crop_flip = data_mod.random_crop_flip
    monkeypatch.setattr(
        data_mod.batches,
        "random_crop_flip",  # where OnDeviceLoader looks it up
        lambda x, **kw: augmented.append(x.shape) or crop_flip(x, **kw),
    )
    summary = run_tiny(tmp_path, "dataloader=device", "data.augment=true")
    assert summary["techniques"]["on_device_data"] == "applied"
    train_loader, eval_loader = spy.datas[-1].train.batches, spy.datas[-1].eval.batches
    assert isinstance(train_loader, data_mod.OnDeviceLoader) and not isinstance(train_loader, DataLoader)
    assert train_loader.images.device == spy.datas[-1].train.device  # the run's device, all of it
    assert train_loader.images.dtype == torch.uint8 and train_loader.images.shape == (256, 3, 16, 16)
    assert train_loader.labels.shape == (256,)
    # one batched augmentation call per training batch (4 steps); none for evaluation
    assert augmented == [(16, 3, 16, 16)] * 4
    assert eval_loader.augment is False


def test_random_crop_flip_is_a_padded_crop_and_maybe_a_flip():
    torch.manual_seed(0)
    x = torch.arange(32 * 2 * 8 * 8, dtype=torch.float32).view(32, 2, 8, 8) + 1  # no zeros: padding shows
    out = data_mod.random_crop_flip(x, padding=4)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (4,) * 4)
    flips = []
    for b in range(32):
        matches = [
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if torch.equal(out[b], (lambda c: c.flip(2) if flip else c)(padded[b, :, dy : dy + 8, dx : dx + 8]))
        ]
        assert matches, f"sample {b} is not a crop of the padded image"
        flips.append(matches[0][2])
    assert any(flips) and not all(flips)  # random flips, per sample
    assert not torch.equal(out, x)


def _loader(n=20, **kw) -> data_mod.OnDeviceLoader:
    images = torch.zeros(n, 1, 4, 4, dtype=torch.uint8)
    labels = torch.arange(n)  # the label is the sample's index
    args = dict(shuffle=True, augment=False, mean=None, std=None, drop_last=False, seed=0, rank=0, world_size=1)
    return data_mod.OnDeviceLoader(images, labels, 5, **{**args, **kw})


def _order(loader) -> list[int]:
    return torch.cat([y for _, y in loader]).tolist()


def test_device_loader_reshuffles_every_epoch():
    loader = _loader()
    first = _order(loader)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert _order(loader) == first  # same epoch, same order
    loader.set_epoch(1)
    second = _order(loader)
    assert sorted(second) == list(range(20)) and second != first


def test_device_loader_shards_by_rank():
    shards = [_order(_loader(rank=r, world_size=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 10
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(20))


def test_device_loader_on_an_image_folder_is_a_config_error(tiny_imagefolder):
    from runner.errors import ConfigError

    with pytest.raises(ConfigError, match="dataloader.on_device=true"):
        build("data=imagefolder", f"data.root={tiny_imagefolder}", "dataloader=device")


# ----------------------------------------------------------------------------- 7: non_blocking


def test_non_blocking_is_skipped_without_pinned_memory(tmp_path):
    summary = run_tiny(tmp_path, "dataloader.non_blocking=true")
    assert summary["techniques"]["non_blocking"].startswith("skipped: ")


# --------------------------------------------------------------------- 12: from_numpy, no copies


def test_in_memory_cifar_shares_the_numpy_arrays(tiny_cifar, monkeypatch):
    datasets = []
    orig = data_mod.IMAGE_DATASETS["cifar10"]

    def cifar(*a):
        out = orig(*a)
        datasets.append(out)
        return out

    monkeypatch.setitem(data_mod.IMAGE_DATASETS, "cifar10", cifar)
    data = build("data=cifar10", f"data.root={tiny_cifar}", "dataloader=device", "dataloader.batch_size=10")
    train_ds, eval_ds = datasets[0].train, datasets[0].eval
    images = data.train.batches.images
    assert isinstance(train_ds.data, np.ndarray) and train_ds.data.shape == (100, 32, 32, 3)
    assert images.shape == (100, 3, 32, 32)  # NCHW view of the NHWC array
    assert np.shares_memory(images.numpy(), train_ds.data)
    assert images.data_ptr() == train_ds.data.ctypes.data
    assert np.shares_memory(data.eval.batches.images.numpy(), eval_ds.data)


def test_images_as_tensor_does_not_copy():
    array = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    t = data_mod.images_as_tensor(array)
    assert t.shape == (4, 3, 8, 8) and np.shares_memory(t.numpy(), array)
    array[0, 0, 0, 0] = 7
    t_value = int(t[0, 0, 0, 0])
    assert t_value == 7  # a write through the array shows in the tensor
    gray = torch.zeros(4, 8, 8, dtype=torch.uint8)
    assert data_mod.images_as_tensor(gray).data_ptr() == gray.data_ptr()


# ------------------------------------------------------------------------ 17: normalized inputs


@pytest.mark.parametrize("loader", ["default", "device"])
@pytest.mark.parametrize("normalize", [True, False])
def test_normalize_gives_zero_mean_unit_std_batches(loader, normalize):
    data = build(f"dataloader={loader}", f"data.normalize={str(normalize).lower()}", "dataloader.batch_size=64")
    x = torch.cat([x for x, _ in data.train])
    mean, std = x.mean().item(), x.std().item()
    if normalize:
        assert abs(mean) < 0.02 and abs(std - 1) < 0.02
        assert data.techniques["normalize"] == "applied"
    else:
        assert abs(mean - 0.5) < 0.01 and abs(std - 0.29) < 0.01 and x.min() >= 0 and x.max() <= 1
        assert "normalize" not in data.techniques
