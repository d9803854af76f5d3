"""What a data source hands the loader assembly: datasets and facts, never loaders.

Every source (``runner.data.images``, ``runner.data.text``, ``runner.data.tokens``, ``runner.data.custom``)
returns a ``Source``; ``runner.data.loading.assemble`` alone turns one into the engine's train/eval iterables.
Token data also hands a ``Codec``: how its ids read as text (the language model's prompt and ``samples.txt``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import Dataset

from runner.errors import ConfigError

#: How a source's inputs are laid out, which decides what the on-device path does with its in-memory form:
#: ``images``: uint8 ``(N, C, H, W)`` made float, cropped/flipped and normalized on the device;
#: ``tensors``: any ``(N, *S)`` gathered and served as stored (``data=custom``);
#: ``tokens``: one int64 token stream per split, cut into windows of ``sample_shape[0]`` tokens.
LAYOUTS = ("images", "tensors", "tokens")


@dataclass(frozen=True)
class Codec:
    """How a language model's token ids read as text: ``task.sample_prompt`` in, ``samples.txt`` out.

    ``vocab_size``: the number of token ids (the model's embedding rows; every id of the data is below it).
    ``encode(prompt)`` -> the prompt's ids (a non-empty ``list[int]``, each < ``vocab_size``); raises
    ``ConfigError`` naming ``task.sample_prompt`` when the prompt cannot be encoded. ``decode(ids)`` -> the
    text written to ``samples.txt``. ``note``: one line said once when a run starts (``data=tokens``
    without a usable tokenizer: that ``samples.txt`` shows token ids, and why), or None.
    """

    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    note: str | None = None


def character_codec(vocab: list[str]) -> Codec:
    """The ``Codec`` of a character vocabulary (``data=text``): token id i is the string ``vocab[i]``.

    Its ``encode`` raises ``ConfigError`` for an empty prompt or one with characters outside ``vocab``.
    """
    lookup = {ch: i for i, ch in enumerate(vocab)}

    def encode(prompt: str) -> list[int]:
        unknown = sorted(set(prompt) - set(lookup))
        if not prompt or unknown:
            raise ConfigError(
                f"task.sample_prompt={prompt!r} must be non-empty text made of characters of data.path "
                f"(these are not: {unknown!r})"
            )
        return [lookup[ch] for ch in prompt]

    return Codec(len(vocab), encode, lambda ids: "".join(vocab[i] for i in ids))


@dataclass
class Source:
    """One dataset's two splits and the facts the loaders and the model need.

    ``train``/``eval`` are map-style datasets of ``(input, target)`` items (token data: ``TokenWindows``, items
    int64 ``(block_size,)`` pairs). ``in_memory`` is what ``dataloader.on_device`` puts on the device: a
    callable returning the whole splits as host tensors -- ``images``/``tensors``: ``((train_inputs (N, *S),
    train_targets (N, *T)), (eval_inputs, eval_targets))`` (class indices: int64 ``(N,)``); ``tokens``:
    ``(train_tokens int64 (N,), eval_tokens int64 (M,))`` -- or a reason string when this data has none after all
    (``on_device_data`` is then recorded as skipped); ``None``: no in-memory form at all (``on_device`` is a
    ConfigError).
    """

    name: str  # data.name, for messages
    train: Dataset
    eval: Dataset
    sample_shape: tuple[int, ...]  # one input: images (C, H, W); custom (*S); tokens (block_size,)
    layout: str  # one of LAYOUTS
    in_memory: Callable[[], tuple | str] | None = None
    num_classes: int | None = None  # classification: classes; token data: None (see vocab)
    item: torch.Tensor | None = None  # the first training input as the dataset returns it (CPU); tokens: None
    # data=custom: the first training target as a batch holds it (CPU; shape T, e.g. () or (k,)); else None
    target: torch.Tensor | None = None
    mean: tuple[float, ...] | None = None  # per-channel statistics in [0, 1] units the on-device path
    std: tuple[float, ...] | None = None  # normalizes with (host items arrive normalized already), or None
    augment: bool = False  # random crop + flip on the device (built-in images with data.augment)
    # token data: training draws this many random windows per epoch (with replacement, split over the ranks)
    # instead of one shuffled pass over ``train``
    draws_per_epoch: int | None = None
    vocab: list[str] | None = None  # character data: token id -> text (data=tokens: None, see codec)
    techniques: dict[str, str] = field(default_factory=dict)  # statuses the source decided (normalize, augment)
    codec: Codec | None = None  # token data: ids <-> text; None with a vocab: that vocab's character_codec

    def __post_init__(self):
        if self.codec is None and self.vocab is not None:
            self.codec = character_codec(self.vocab)

    @property
    def train_samples(self) -> int:
        """Samples in one training epoch: ``draws_per_epoch`` for token data, else the training set's size."""
        return self.draws_per_epoch if self.draws_per_epoch is not None else len(self.train)
