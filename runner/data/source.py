"""What a data source hands the loader assembly: datasets and facts, never loaders.

Every source (``runner.data.images``, ``runner.data.text``, ``runner.data.custom``) returns a ``Source``;
``runner.data.loading.assemble`` alone turns one into the engine's train/eval iterables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import Dataset

#: How a source's inputs are laid out, which decides what the on-device path does with its in-memory form:
#: ``images``: uint8 ``(N, C, H, W)`` made float, cropped/flipped and normalized on the device;
#: ``tensors``: any ``(N, *S)`` gathered and served as stored (``data=custom``);
#: ``tokens``: one int64 token stream per split, cut into windows of ``sample_shape[0]`` tokens.
LAYOUTS = ("images", "tensors", "tokens")


@dataclass
class Source:
    """One dataset's two splits and the facts the loaders and the model need.

    ``train``/``eval`` are map-style datasets of ``(input, target)`` items (token data: ``TokenWindows``, items
    int64 ``(block_size,)`` pairs). ``in_memory`` is what ``dataloader.on_device`` puts on the device: a
    callable returning the whole splits as host tensors -- ``images``/``tensors``: ``((train_inputs (N, *S),
    train_targets int64 (N,)), (eval_inputs, eval_targets))``; ``tokens``: ``(train_tokens int64 (N,),
    eval_tokens int64 (M,))`` -- or a reason string when this data has none after all (``on_device_data`` is then
    recorded as skipped); ``None``: no in-memory form at all (``on_device`` is a ConfigError).
    """

    name: str  # data.name, for messages
    train: Dataset
    eval: Dataset
    sample_shape: tuple[int, ...]  # one input: images (C, H, W); custom (*S); tokens (block_size,)
    layout: str  # one of LAYOUTS
    in_memory: Callable[[], tuple | str] | None = None
    num_classes: int | None = None  # classification: classes; token data: None (see vocab)
    item: torch.Tensor | None = None  # the first training input as the dataset returns it (CPU); tokens: None
    mean: tuple[float, ...] | None = None  # per-channel statistics in [0, 1] units the on-device path
    std: tuple[float, ...] | None = None  # normalizes with (host items arrive normalized already), or None
    augment: bool = False  # random crop + flip on the device (built-in images with data.augment)
    # token data: training draws this many random windows per epoch (with replacement, split over the ranks)
    # instead of one shuffled pass over ``train``
    draws_per_epoch: int | None = None
    vocab: list[str] | None = None  # token data: token id -> text
    techniques: dict[str, str] = field(default_factory=dict)  # statuses the source decided (normalize, augment)

    @property
    def train_samples(self) -> int:
        """Samples in one training epoch: ``draws_per_epoch`` for token data, else the training set's size."""
        return self.draws_per_epoch if self.draws_per_epoch is not None else len(self.train)
