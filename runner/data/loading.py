"""Loader assembly (``assemble``): the one place that turns a source's datasets and facts into the engine's
``Data``, on the device or through host ``DataLoader``s, each path ending in a ``DeviceIterable``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from runner.data.batches import DeviceIterable, OnDeviceLoader, SkippableSampler
from runner.data.source import Codec, Source, character_codec
from runner.data.text import OnDeviceWindows
from runner.errors import ConfigError
from runner.techniques import TECHNIQUES, Job


@dataclass
class Data:
    """What the engine needs from the data: two iterables plus what the model must fit.

    ``example`` is one batch of 2 samples on the device (inputs, targets), the shape and dtype of real
    batches, for counting FLOPs. ``vocab`` (character data only) maps token id -> text; ``codec`` (every token
    data) holds the vocabulary size and reads ids as text (a ``vocab`` alone gives its ``character_codec``).
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
    codec: Codec | None = None  # token data: vocabulary size, ids <-> text
    # data=custom: the first training target as a batch holds it (CPU; float for a regression); else None (class
    # indices of the built-in images, token windows)
    target: torch.Tensor | None = None

    def __post_init__(self):
        if self.codec is None and self.vocab is not None:
            self.codec = character_codec(self.vocab)

    @property
    def model_kwargs(self) -> dict[str, int]:
        """The constructor arguments the data dictates: ``vocab_size`` for token data, else ``num_classes``."""
        return {"vocab_size": self.codec.vocab_size} if self.codec is not None else {"num_classes": self.num_classes}


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
    if pin and (why_not := TECHNIQUES["pinned_memory"].why_not(Job(None, cuda=device.type == "cuda"))):
        techniques["pin_memory"] = f"skipped: {why_not}"
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


def host_loader(
    ds: Dataset, batch_size: int, train: bool, loading: HostLoading, env, seed: int, drop_last: bool, sampler=None
) -> DataLoader:
    """A ``DataLoader`` for this rank: ``sampler`` if given, else a ``DistributedSampler`` share when there are
    several ranks (shuffled for training), else plain (shuffled for training) with a seeded generator.
    A training loader's sampler is a ``SkippableSampler``, so a resumed run continues mid-epoch."""
    if sampler is None and env.world_size > 1:
        sampler = DistributedSampler(
            ds, num_replicas=env.world_size, rank=env.rank, shuffle=train, seed=seed, drop_last=train
        )
    g = torch.Generator().manual_seed(seed + env.rank)
    if train:
        sampler = SkippableSampler(sampler if sampler is not None else torch.utils.data.RandomSampler(ds, generator=g))
    return DataLoader(
        ds, batch_size=batch_size, sampler=sampler, drop_last=train and drop_last, generator=g, **loading.kwargs
    )


def assemble(
    source: Source,
    loader_cfg: DictConfig,
    env,
    *,
    seed: int = 0,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> Data:
    """Build this rank's train and eval iterables from ``source`` (every data source goes through here).

    ``dataloader.on_device`` with an in-memory form: the splits move to ``env.device`` once (``_on_device``); a
    reason instead of a form records ``on_device_data`` as skipped and falls back to the host ``DataLoader``s, whose
    training sampler (this rank's share, or ``source.draws_per_epoch`` random windows with replacement) is a
    ``SkippableSampler``. channels_last is recorded as skipped for inputs that are not ``(C, H, W)`` (token data: by
    the language-model task). ``Data.example``: 2 random samples of the batches' shape and dtype, on the device.

    Raises:
        ConfigError: ``on_device`` for data with no in-memory form (read from image files), or a training
            loader with no batch (``batch_size`` larger than this rank's share), or ``num_workers`` < 0.
    """
    techniques = dict(source.techniques)
    shape, device, bs = source.sample_shape, env.device, loader_cfg.batch_size
    tokens = source.layout == "tokens"
    if tokens:
        memory_format = torch.contiguous_format
    elif memory_format == torch.channels_last and len(shape) != 3:
        techniques["channels_last"] = f"skipped: inputs of shape {shape} are not images (C, H, W)"
        memory_format = torch.contiguous_format
    per_rank = None if source.draws_per_epoch is None else source.draws_per_epoch // env.world_size

    memory = None
    if loader_cfg.on_device:
        if source.in_memory is None:
            raise ConfigError(
                f"dataloader.on_device=true needs an in-memory dataset; data={source.name} is read from "
                f"image files. Use dataloader=pinned instead."
            )
        memory = source.in_memory()
        if isinstance(memory, str):
            techniques["on_device_data"] = f"skipped: {memory}"
            memory = None
    if memory is not None:
        train, evaluation = _on_device(source, memory, loader_cfg, env, seed, per_rank)
        techniques["on_device_data"] = "applied"
        non_blocking = False
    else:
        loading = host_loading(loader_cfg, device)
        techniques |= loading.techniques
        sampler, drop_last = None, loader_cfg.drop_last
        if per_rank is not None:
            sampler = RandomSampler(
                source.train,
                replacement=True,
                num_samples=per_rank,
                generator=torch.Generator().manual_seed(seed + env.rank),
            )
            drop_last = True
        train = host_loader(source.train, bs, True, loading, env, seed, drop_last, sampler=sampler)
        evaluation = _eval_from_memory(source, bs, env, seed) or host_loader(
            source.eval, bs, False, loading, env, seed, drop_last=False
        )
        non_blocking = loading.non_blocking

    if len(train) == 0:
        if per_rank is not None:
            raise ConfigError(
                f"dataloader.batch_size={bs} is larger than this rank's {per_rank} training windows per "
                f"epoch; lower it or raise data.train_size"
            )
        raise ConfigError(
            f"dataloader.batch_size={bs} is larger than this rank's training set "
            f"({len(source.train) // env.world_size} samples); lower it"
        )
    return Data(
        train=DeviceIterable(train, device, non_blocking, memory_format),
        eval=DeviceIterable(evaluation, device, non_blocking, memory_format),
        num_classes=source.num_classes,
        in_channels=None if tokens else shape[0],
        sample_shape=shape,
        train_samples=source.train_samples,
        techniques=techniques,
        example=_example(source, device),
        vocab=source.vocab,
        item=source.item,
        codec=source.codec,
        target=source.target,
    )


def _on_device(source: Source, memory, loader_cfg: DictConfig, env, seed: int, per_rank: int | None) -> tuple:
    """The train and eval iterables gathered on ``env.device`` from ``memory``, the source's in-memory form:
    token windows (``OnDeviceWindows``: ``per_rank`` random windows per epoch) or whole tensors
    (``OnDeviceLoader``: shuffled, augmented on the device, this rank's share)."""
    device, bs, shape = env.device, loader_cfg.batch_size, source.sample_shape
    if source.layout == "tokens":
        (train_tokens, eval_tokens), block = memory, shape[0]
        g = torch.Generator(device).manual_seed(seed + env.rank)
        starts = (torch.arange(len(source.eval), device=device) * block)[env.rank :: env.world_size]
        return (
            OnDeviceWindows(train_tokens.to(device), block, bs, num_batches=per_rank // bs, generator=g),
            OnDeviceWindows(eval_tokens.to(device), block, bs, starts=starts),
        )
    (tx, ty), (ex, ey) = memory
    common = _gathering(source, tx.shape[1], env, seed)
    return (
        OnDeviceLoader(
            tx.to(device),
            ty.to(device),
            bs,
            shuffle=True,
            augment=source.augment,
            drop_last=loader_cfg.drop_last,
            **common,
        ),
        OnDeviceLoader(ex.to(device), ey.to(device), bs, shuffle=False, augment=False, drop_last=False, **common),
    )


def _gathering(source: Source, channels: int, env, seed: int) -> dict:
    """``OnDeviceLoader``'s arguments shared by both splits: the source's normalization (one statistic given for
    every channel of synthetic images is repeated ``channels`` times), this rank's share, the sample layout."""
    mean, std = source.mean, source.std
    if mean is not None and len(mean) != channels:
        mean, std = mean * channels, std * channels
    return dict(
        mean=mean, std=std, seed=seed, rank=env.rank, world_size=env.world_size, as_images=source.layout == "images"
    )


def _eval_from_memory(source: Source, bs: int, env, seed: int) -> OnDeviceLoader | None:
    """The evaluation batches of an image set held in memory (MNIST, CIFAR-10, synthetic), gathered batch by batch
    from its uint8 ``(N, C, H, W)`` tensors on the host as float32 ``(B, C, H, W)`` inputs and int64 ``(B,)`` labels,
    this rank's share in order; or None (image files, custom data, tokens). They hold the same images, normalized
    alike, as the host ``DataLoader``'s, without its per-sample ``__getitem__`` and collation (MNIST's 10,000 test
    images at batch 32 on one thread: x0.56 the time, interleaved; docs/benchmarks/eval-loading-cpu-2026-12-07.md).
    Evaluations are outside the timed steps: no speed figure changes, only the wall time a run spends evaluating."""
    if source.in_memory is None or source.layout != "images":
        return None
    memory = source.in_memory()
    if isinstance(memory, str):
        return None
    _, (ex, ey) = memory
    return OnDeviceLoader(
        ex, ey, bs, shuffle=False, augment=False, drop_last=False, **_gathering(source, ex.shape[1], env, seed)
    )


def _example(source: Source, device: torch.device) -> tuple:
    """2 random samples of the batches' shape and dtype on ``device`` (token data: int64 ids and targets; float
    targets: standard normal values of their shape and dtype; else class indices below ``num_classes``)."""
    shape, target = source.sample_shape, source.target
    if source.layout == "tokens":
        return tuple(torch.randint(0, source.codec.vocab_size, (2, *shape), device=device) for _ in range(2))
    if target is not None and target.is_floating_point():
        return torch.randn(2, *shape, device=device), torch.randn(2, *target.shape, dtype=target.dtype, device=device)
    return torch.randn(2, *shape, device=device), torch.randint(0, source.num_classes, (2,), device=device)
