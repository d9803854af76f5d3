"""The batch iterables the engine sees (``DeviceIterable``, with ``SkippableSampler`` for mid-epoch resumes) and
the on-device loader of image/tensor data (``OnDeviceLoader``); ``runner.data.loading`` picks among them.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader

#: epoch e's generators are seeded with first seed + this x e (``DeviceIterable.set_epoch``, ``OnDeviceLoader``)
EPOCH_SEED_STRIDE = 1_000_003


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
        self._live = None  # the iterator of the current pass (its worker processes: ``close``)
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
            g.manual_seed(first_seed + EPOCH_SEED_STRIDE * epoch)
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
        self._live = live = iter(batches)
        for i, (x, y) in enumerate(live):
            if i < skip:
                continue  # a loader that cannot skip by index: draw and drop
            x = x.to(self.device, non_blocking=self.non_blocking, memory_format=self.memory_format)
            yield x, y.to(self.device, non_blocking=self.non_blocking)

    def close(self) -> None:
        """Stop the loader's worker processes now (a pass left unfinished, a persistent iterator), not whenever the
        garbage collector reaches the iterator: a run that raised keeps its frames, and with them its workers,
        alive in the traceback (``DataLoader`` joins each worker up to 5 s when it shuts them down)."""
        persistent = getattr(self.batches, "_iterator", None)
        for it in (self._live, persistent):
            if hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        if persistent is not None:
            self.batches._iterator = None  # a later pass starts workers of its own
        self._live = None


def _generators_of(batches) -> list[torch.Generator]:
    found = []
    for obj in (
        batches,
        getattr(batches, "sampler", None),
        getattr(getattr(batches, "sampler", None), "sampler", None),
    ):
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

    Each epoch draws one permutation: in one process the host DataLoader's (the same batches as without
    ``on_device``), over several ranks DistributedSampler's (same seed on every rank, then this rank's strided
    share), and each batch is gathered, converted to float, augmented with a random crop
    (zero padding 4) and horizontal flip, and normalized, all on the device. With ``as_images=False``
    (``data=custom``) batches are gathered and yielded as they are stored.

    Args:
        images: uint8 ``(N, C, H, W)``, on the device (``as_images=False``: any ``(N, *S)`` tensor).
        labels: int64 ``(N,)``.
        mean, std: per-channel statistics in [0, 1] units, or None for no normalization.
    """

    def __init__(
        self,
        images,
        labels,
        batch_size,
        *,
        shuffle,
        augment,
        mean,
        std,
        drop_last,
        seed,
        rank,
        world_size,
        as_images: bool = True,
    ):
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
        if self.shuffle and self.world_size == 1:
            # the host loader's order (runner/data/loading.py host_loader), so moving the data to the device
            # changes no batch: its generator, reseeded per epoch as DeviceIterable.set_epoch does, gives the
            # DataLoader its workers' base seed, then RandomSampler the epoch's permutation
            g = torch.Generator().manual_seed(self.seed + EPOCH_SEED_STRIDE * self.epoch)
            torch.empty((), dtype=torch.int64).random_(generator=g)
            order = torch.randperm(n, generator=g)
        elif self.shuffle:  # DistributedSampler's order: one permutation per epoch, seeded with seed + epoch
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
    """Batched RandomCrop(padding, fill 0) + RandomHorizontalFlip on ``x`` of shape ``(B, C, H, W)``: one gather for
    the crop, one ``where`` for the flip, no Python loop over samples (the airbench recipe)."""
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
