"""Character-level text for language models (``data=text``): read, tokenize, split, cut into windows, as nanoGPT's
``data/shakespeare_char/prepare.py`` and ``train.py``'s ``get_batch`` (https://github.com/karpathy/nanoGPT;
docs/language-models.md). ``text_source`` returns a ``Source`` (``windows_source``, shared with ``data=tokens``);
``runner.data.loading`` assembles the loaders (``OnDeviceWindows`` on the device, ``TokenWindows`` on the host).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from runner.data.source import Source
from runner.errors import ConfigError
from runner.files import replace_own

TRAIN_FRACTION = 0.9


def read_corpus(path: str | None) -> tuple[torch.Tensor, list[str]]:
    """Read ``path`` as UTF-8 text; return its tokens (int64 ``(N,)``, one per character) and the vocabulary.

    Raises:
        ConfigError: ``data.path`` unset, missing, not a file, empty, not UTF-8, or binary (NUL bytes).
    """
    if not path:
        raise ConfigError(
            "data=text needs data.path=<a UTF-8 text file>, e.g. data/tinyshakespeare/input.txt "
            "in a checkout (+experiment=shakespeare_char reads it by default)"
        )
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"data.path={path} does not exist or is not a file; point data.path at a UTF-8 text file")
    raw = file.read_bytes()
    if not raw:
        raise ConfigError(f"data.path={path} is empty; a language model needs text to learn from")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.path={path} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            f"convert it (iconv -t UTF-8) or point data.path at a text file"
        ) from e
    if "\x00" in text:
        raise ConfigError(f"data.path={path} holds NUL bytes: a binary file, not text; point data.path at a text file")
    vocab = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([lookup[ch] for ch in text], dtype=torch.int64), vocab


def split(tokens: torch.Tensor, block_size: int, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 90 % of ``tokens`` for training, the rest for validation (views, no copy).

    Raises:
        ConfigError: ``block_size`` < 1, or a split too short for one window (``block_size`` + 1 tokens).
    """
    if block_size < 1:
        raise ConfigError(f"data.block_size={block_size} must be >= 1 (tokens per sample)")
    cut = int(TRAIN_FRACTION * len(tokens))
    train, val = tokens[:cut], tokens[cut:]
    shortest = min(len(train), len(val))
    if shortest < 2:  # no block_size fits: say the text is too short, not "lower it below 1"
        raise ConfigError(
            f"data.path={path} holds only {len(tokens)} characters: too few for a training and a "
            f"validation window (its last 10 % validate); use a longer text"
        )
    if block_size >= shortest:
        raise ConfigError(
            f"data.block_size={block_size} does not fit in the text: its validation split (the last "
            f"10 % of data.path={path}) has {len(val)} tokens and a window needs block_size + 1; "
            f"lower data.block_size below {shortest} or use a longer text"
        )
    return train, val


def save_vocab(vocab: list[str], job_dir: Path) -> Path:
    """Write ``vocab.json`` (a JSON list: token id i is the string at index i) so outputs can be decoded later."""
    path = job_dir / "vocab.json"
    replace_own(path, json.dumps(vocab, ensure_ascii=False) + "\n")
    return path


def check_vocab(vocab: list[str], path: str, meta: dict, checkpoint: Path) -> None:
    """Refuse to resume a language model on text whose vocabulary differs from the checkpoint's (``runner.json``
    ``vocab``, else its job folder's ``vocab.json``).

    Raises:
        ConfigError: naming ``data.path``, the saved vocabulary, the first difference and the fix.
    """
    where = checkpoint / "runner.json"
    saved = meta.get("vocab")
    if saved is None:
        where = checkpoint.parent.parent / "vocab.json"
        try:
            saved = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
    if list(saved) == list(vocab):
        return
    first = next((i for i, (a, b) in enumerate(zip(saved, vocab)) if a != b), min(len(saved), len(vocab)))
    at = (
        f"token {first} is {saved[first]!r} there and {vocab[first]!r} here"
        if first < min(len(saved), len(vocab))
        else "one is a prefix of the other"
    )
    raise ConfigError(
        f"data.path={path} has a vocabulary of {len(vocab)} characters that differs from the "
        f"{len(saved)} the checkpoint {checkpoint} was trained on (saved in {where}; {at}): its token "
        f"ids would mean other characters. Resume with the text it was trained on as data.path, or "
        f"train on this text from scratch in a new folder (drop hydra.run.dir, or "
        f"checkpoint.resume=never)"
    )


def encode(text: str, vocab: list[str]) -> list[int]:
    """Token ids of ``text`` (every character must be in ``vocab``: KeyError otherwise)."""
    lookup = {ch: i for i, ch in enumerate(vocab)}
    return [lookup[ch] for ch in text]


def decode(ids: list[int], vocab: list[str]) -> str:
    """The text of token ids ``ids``."""
    return "".join(vocab[i] for i in ids)


class TokenWindows(Dataset):
    """Windows of a 1-D token sequence: item i = ``(tokens[s : s+block], tokens[s+1 : s+block+1])``, s = i x stride.

    ``tokens``: int64 ``(N,)``, or a ``TokenFile``. ``stride=1``: training; ``stride=block_size``: evaluation.
    Items are int64 ``(block_size,)``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int = 1):
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        window = self.tokens[s : s + self.block_size + 1]
        return window[:-1], window[1:]


class OnDeviceWindows:
    """Technique 2b for text: the split lives on the device; each batch is one gather there.

    nanoGPT's ``get_batch`` (https://github.com/karpathy/nanoGPT/blob/master/train.py) on the device: random or
    fixed ``starts``, one gather of ``(B, block_size + 1)``; ``x``, ``y``: int64 ``(B, block_size)`` views.

    Args:
        tokens: int64 ``(N,)`` on the device. num_batches: batches per epoch (random windows only).
        starts: int64 window offsets on the device (fixed windows), or None for random ones.
        generator: the device generator for the random offsets (seeded per rank by the caller).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        *,
        num_batches: int | None = None,
        starts: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ):
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.starts, self.generator = starts, generator
        self.num_batches = num_batches if starts is None else -(-len(starts) // batch_size)
        self.span = torch.arange(block_size + 1, device=tokens.device)

    def __len__(self) -> int:
        return self.num_batches

    def skip_next(self, batches: int) -> None:
        """Start the next pass at batch ``batches`` (a resumed run): the random offsets of the skipped batches
        are drawn and dropped, so the generator continues where an uninterrupted run's would be."""
        self._skip = batches

    def __iter__(self):
        high = len(self.tokens) - self.block_size
        skip, self._skip = getattr(self, "_skip", 0), 0
        for _ in range(skip if self.starts is None else 0):
            torch.randint(high, (self.batch_size,), device=self.tokens.device, generator=self.generator)
        for i in range(skip, self.num_batches):
            if self.starts is None:
                s = torch.randint(high, (self.batch_size,), device=self.tokens.device, generator=self.generator)
            else:
                s = self.starts[i * self.batch_size : (i + 1) * self.batch_size]
            window = self.tokens[s[:, None] + self.span]
            yield window[:, :-1], window[:, 1:]


def windows_source(
    name: str,
    train_tokens,
    val_tokens,
    block_size: int,
    train_size: int | None,
    *,
    in_memory,
    vocab: list[str] | None = None,
    codec=None,
) -> Source:
    """The ``Source`` of a token corpus, shared by ``data=text`` and ``data=tokens``: nanoGPT's sampling.

    Training: ``train_size`` random windows per epoch (null: train tokens // block_size); evaluation: the windows
    that tile ``val_tokens``. Both ``TokenWindows`` (int64 ``(N,)`` tensors or ``TokenFile``s).

    Args:
        in_memory: ``Source.in_memory`` for ``dataloader.on_device``: a callable returning
            ``(train int64 (N,), val int64 (M,))`` host tensors.
        vocab: characters (``data=text``); codec: a ``Codec`` (``data=tokens``). One of the two.
    """
    return Source(
        name=name,
        train=TokenWindows(train_tokens, block_size),
        eval=TokenWindows(val_tokens, block_size, stride=block_size),
        sample_shape=(block_size,),
        layout="tokens",
        in_memory=in_memory,
        draws_per_epoch=train_size or len(train_tokens) // block_size,
        vocab=vocab,
        codec=codec,
    )


def text_source(cfg: DictConfig) -> Source:
    """``data=text``: character tokens of ``data.path`` (``read_corpus``), windows of ``data.block_size`` sampled by
    ``windows_source``; ``dataloader.on_device``: both splits on the device (``OnDeviceWindows``).

    Raises:
        ConfigError: a bad ``data.path`` (``read_corpus``) or ``data.block_size`` (``split``).
    """
    tokens, vocab = read_corpus(cfg.path)
    train_tokens, val_tokens = split(tokens, cfg.block_size, cfg.path)
    return windows_source(
        "text",
        train_tokens,
        val_tokens,
        cfg.block_size,
        cfg.train_size,
        in_memory=lambda: (train_tokens, val_tokens),
        vocab=vocab,
    )
