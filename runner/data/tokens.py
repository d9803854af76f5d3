"""Tokenized corpora in nanoGPT's format (``data=tokens``): flat binary files of token ids, memory-mapped
(``TokenFile``) and sampled as ``data=text``'s characters (``runner.data.text.windows_source``); ``python -m
runner.data.tokens prepare`` writes them from a text file. The format (https://github.com/karpathy/nanoGPT's
``prepare.py``): docs/language-models.md, "Tokenized corpora".
"""

from __future__ import annotations

import argparse
import pickle
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from runner.data.source import Codec, Source
from runner.data.text import TRAIN_FRACTION, read_corpus, windows_source
from runner.errors import ConfigError
from runner.files import open_own, write_own

#: ``data.dtype`` -> the NumPy dtype of the ids in the files (nanoGPT writes uint16).
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
#: Tokens read at a time when a whole file is scanned (the id check) or loaded (``dataloader.on_device``):
#: 16 Mi tokens, 32 MiB of uint16, whatever the file's size.
CHUNK = 1 << 24
#: Seconds ``tiktoken.get_encoding`` may take (it downloads BPE files it has not cached; no network: no wait).
TOKENIZER_TIMEOUT_S = 20.0
PREPARE_HINT = "python -m runner.data.tokens prepare <text file> <out dir> writes train.bin and val.bin from a text"


class TokenFile:
    """A flat binary file of token ids (nanoGPT's ``.bin``), memory-mapped read-only (``memmap``, of ``dtype``).

    ``len(f)``: the number of tokens; ``f[a:b]``: a fresh int64 ``(b - a,)`` tensor. Pickled as its path and dtype.
    """

    def __init__(self, path: str | Path, dtype: str):
        self.path, self.dtype = str(path), str(dtype)
        self.memmap = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")

    def __len__(self) -> int:
        return len(self.memmap)

    def __getitem__(self, index: slice) -> torch.Tensor:
        return torch.from_numpy(self.memmap[index].astype(np.int64))

    def __getstate__(self) -> dict:
        return {"path": self.path, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["dtype"])

    def max(self) -> tuple[int, int]:
        """The largest id and the offset of its first occurrence, scanning ``CHUNK`` tokens at a time
        (host memory: one chunk)."""
        best, where = -1, 0
        for start in range(0, len(self.memmap), CHUNK):
            chunk = self.memmap[start : start + CHUNK]
            top = int(chunk.max())
            if top > best:
                best, where = top, start + int(np.argmax(chunk))
        return best, where

    def load(self) -> torch.Tensor:
        """The whole file as an int64 ``(N,)`` host tensor (8 bytes per token), converted ``CHUNK`` tokens at
        a time: what ``dataloader.on_device`` moves to the device."""
        out = torch.empty(len(self.memmap), dtype=torch.int64)
        for start in range(0, len(self.memmap), CHUNK):
            out[start : start + CHUNK] = torch.from_numpy(self.memmap[start : start + CHUNK].astype(np.int64))
        return out


def open_split(key: str, path: str | None, dtype: str, block_size: int, vocab_size: int) -> TokenFile:
    """Map ``path`` (the value of ``data.<key>``) after checking it is a usable split of ``dtype`` ids.

    Raises:
        ConfigError: naming ``data.<key>`` and the fix: the path unset, missing or not a file; a size that is
            not a multiple of the dtype's item size; fewer than ``block_size`` + 1 tokens (one window); an id
            >= ``vocab_size`` (the largest id, found by a chunked scan of the memmap).
    """
    if not path:
        raise ConfigError(
            f"data=tokens needs data.{key}=<a .bin of token ids> (nanoGPT's format: "
            f"train.bin/val.bin); {PREPARE_HINT} (or, with neither path, data.synthetic_tokens=<N> "
            f"trains on N random ids)"
        )
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"data.{key}={path} does not exist or is not a file; point it at a .bin of token ids ({PREPARE_HINT})"
        )
    size, item = file.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise ConfigError(
            f"data.{key}={path} holds {size} bytes, not a multiple of {item} (one id of "
            f"data.dtype={dtype}): it is not a file of {dtype} token ids or it was cut short; set "
            f"data.dtype to the dtype it was written with (nanoGPT writes uint16) or write it again"
        )
    count = size // item
    if count == 0:
        raise ConfigError(
            f"data.{key}={path} is empty (0 bytes): it holds no token ids; write it again ({PREPARE_HINT})"
        )
    if count < block_size + 1:
        raise ConfigError(
            f"data.{key}={path} holds {count} tokens and a window needs data.block_size + 1 = "
            f"{block_size + 1}; lower data.block_size below {count} or use a longer split"
        )
    tokens = TokenFile(file, dtype)
    _refuse_wider_ids(key, path, tokens, vocab_size)
    top, where = tokens.max()
    if top >= vocab_size:
        raise ConfigError(
            f"data.{key}={path} holds token id {top} (at token {where}), not below "
            f"data.vocab_size={vocab_size}; set data.vocab_size to the tokenizer's vocabulary size (at "
            f"least {top + 1}), or check data.dtype={dtype} is the dtype the file was written with"
        )
    return tokens


#: Tokens of a file's start looked at by ``_refuse_wider_ids``.
HALVES_SAMPLE = 1 << 16


def _refuse_wider_ids(key: str, path: str, tokens: TokenFile, vocab_size: int) -> None:
    """Refuse ids written wider than ``data.dtype`` (uint32/int64 read as uint16, ...), found in the first
    ``HALVES_SAMPLE`` tokens: high words all <= ``(vocab_size - 1) >> bits``, the low ones not.

    Raises:
        ConfigError: naming ``data.<key>``, ``data.dtype``, what the file holds and the fix.
    """
    bits = 8 * tokens.memmap.dtype.itemsize
    n = min(len(tokens), HALVES_SAMPLE) // 4 * 4
    if n < 64:
        return
    sample = np.asarray(tokens.memmap[:n], dtype=np.int64)
    high = (vocab_size - 1) >> bits

    def widened(words: int) -> bool:  # every id followed by words - 1 high words
        cols = sample.reshape(-1, words)
        return bool(cols[:, 0].any() and (cols[:, 1:] <= high).all() and not (cols[:, 1:] == cols[:, :1]).all())

    read = f"data.{key}={path} read as data.dtype={tokens.dtype}"
    if widened(4) and bits == 16 or widened(2) and bits == 32:
        raise ConfigError(
            f"{read} has every id followed by high words <= {high}: it holds 64-bit ids (int64), "
            f"which data=tokens does not read; write them as uint32 (ids.astype(np.uint32).tofile) or "
            f"uint16 for vocabularies under 65,536"
        )
    if bits == 16 and widened(2):
        raise ConfigError(
            f"{read} has every second id <= {high} (all {n // 2} in its first {n} tokens): it holds "
            f"uint32 ids, whose high halves those are; set data.dtype=uint32"
        )


def _load_tiktoken(name: str):
    """``(encoding, None)``, or ``(None, why)`` when tiktoken or the encoding's cached BPE files are missing.

    Raises:
        ConfigError: tiktoken is installed and knows no encoding called ``name``.
    """
    try:
        import tiktoken
    except ImportError:
        return None, f"data.tokenizer={name} needs the tiktoken package, which is not installed (pip install tiktoken)"
    names = tiktoken.list_encoding_names()
    if name not in names:
        raise ConfigError(
            f"data.tokenizer={name} is not a tiktoken encoding; use one of {', '.join(names)}, or null "
            f"(samples.txt then shows token ids)"
        )
    got: dict = {}

    def load():  # in a thread: without network, tiktoken's download of uncached files may hang, not fail
        try:
            got["encoding"] = tiktoken.get_encoding(name)
        except Exception as e:  # noqa: BLE001 -- any failure to load means: show ids instead
            got["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(TOKENIZER_TIMEOUT_S)
    if "encoding" in got:
        return got["encoding"], None
    why = got.get("error", f"no answer in {TOKENIZER_TIMEOUT_S:.0f} s")
    return None, (
        f"tiktoken could not load the {name} encoding offline ({why}); it downloads its BPE files on first "
        f"use and caches them (TIKTOKEN_CACHE_DIR): load it once with network, or copy that cache here"
    )


def _ids_codec(vocab_size: int, why: str) -> Codec:
    """Token ids as text: ``samples.txt`` is the ids separated by spaces; the prompt is ids separated by spaces
    (a prompt with none, such as the default newline, starts from id 0)."""

    def encode(prompt: str) -> list[int]:
        words = prompt.split()
        if not words:
            return [0]
        try:
            ids = [int(w) for w in words]
        except ValueError:
            raise ConfigError(
                f"task.sample_prompt={prompt!r} is text, but data=tokens has no tokenizer to encode it "
                f"({why}); give token ids separated by spaces (e.g. task.sample_prompt='0 12') or "
                f"set data.tokenizer to a tiktoken encoding"
            ) from None
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ConfigError(f"task.sample_prompt={prompt!r} holds ids outside [0, data.vocab_size={vocab_size})")
        return ids

    return Codec(
        vocab_size, encode, lambda ids: " ".join(map(str, ids)) + "\n", note=f"samples.txt will show token ids: {why}"
    )


def _tiktoken_codec(vocab_size: int, name: str, encoding) -> Codec:
    """Text through a tiktoken encoding; ids it cannot decode (a vocabulary padded past the tokenizer's, e.g.
    nanoGPT's 50304 for GPT-2's 50257) are written as ``<|id|>``."""

    def encode(prompt: str) -> list[int]:
        ids = encoding.encode_ordinary(prompt)
        if not ids or max(ids) >= vocab_size:
            raise ConfigError(
                f"task.sample_prompt={prompt!r} must be non-empty text whose {name} token ids are below "
                f"data.vocab_size={vocab_size} (these are: {ids})"
            )
        return ids

    def decode(ids: list[int]) -> str:
        parts, run = [], []
        for i in ids:
            if i < encoding.n_vocab:
                run.append(i)
                continue
            parts += [encoding.decode(run), f"<|{i}|>"]
            run = []
        return "".join([*parts, encoding.decode(run)])

    return Codec(vocab_size, encode, decode)


def codec(vocab_size: int, tokenizer: str | None) -> Codec:
    """The ``Codec`` of ``data=tokens``: decoded text when ``tokenizer`` names a tiktoken encoding that loads
    offline, else token ids (its ``note`` says why).

    Raises:
        ConfigError: tiktoken is installed and ``tokenizer`` names no encoding of it.
    """
    if not tokenizer:
        return _ids_codec(vocab_size, "data.tokenizer is null (a tiktoken encoding such as gpt2 decodes them)")
    encoding, why = _load_tiktoken(str(tokenizer))
    if encoding is None:
        return _ids_codec(vocab_size, why)
    return _tiktoken_codec(vocab_size, str(tokenizer), encoding)


#: The seed of ``data.synthetic_tokens``' ids: the same ids in every run and on every rank, whatever trainer.seed.
SYNTHETIC_SEED = 1234


def synthetic_splits(count: int, vocab_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``data.synthetic_tokens=count``: a training split of ``count`` ids and a validation split of ``count // 10``
    (at least one window), int64 ``(N,)`` uniform below ``vocab_size`` from ``SYNTHETIC_SEED``: a stand-in for
    tokens/s and MFU (https://github.com/karpathy/nanoGPT/blob/master/bench.py, ``real_data = False``).

    Raises:
        ConfigError: ``count`` smaller than one window (``block_size`` + 1).
    """
    if count < block_size + 1:
        raise ConfigError(
            f"data.synthetic_tokens={count} is below one window of data.block_size + 1 = "
            f"{block_size + 1} tokens; raise it (e.g. 1000000) or lower data.block_size"
        )
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)
    ids = torch.randint(0, vocab_size, (count + max(count // 10, block_size + 1),), generator=g)
    return ids[:count], ids[count:]


def tokens_source(cfg: DictConfig) -> Source:
    """``data=tokens``: ``data.train_path``/``data.val_path`` as ``TokenFile``s (or ``synthetic_splits``), windows
    of ``data.block_size`` sampled as ``data=text``'s (``runner.data.text.windows_source``).

    Raises:
        ConfigError: ``data.vocab_size`` unset or < 1, ``data.dtype`` not uint16/uint32, a bad split file
            (``open_split``), too few ``data.synthetic_tokens``, or a ``data.tokenizer`` tiktoken does not know
            (``codec``).
    """
    vocab_size, dtype = cfg.vocab_size, cfg.dtype
    if vocab_size is None or vocab_size < 1:
        raise ConfigError(
            f"data=tokens needs data.vocab_size=<the number of token ids> (got {vocab_size}): the "
            f"model's vocabulary, above every id in the files; nanoGPT's prepare.py prints it and saves "
            f"it in meta.pkl (65 for shakespeare_char; GPT-2's BPE: 50257)"
        )
    if dtype not in DTYPES:
        raise ConfigError(
            f"data.dtype={dtype} is not one of {', '.join(DTYPES)} (the dtype the ids were written "
            f"with; nanoGPT writes uint16)"
        )
    synthetic = cfg.get("synthetic_tokens")
    if synthetic is not None and not cfg.train_path and not cfg.val_path:
        train_ids, val_ids = synthetic_splits(int(synthetic), vocab_size, cfg.block_size)
        ids_codec = _ids_codec(vocab_size, f"data.synthetic_tokens={synthetic}: random ids, no text")
        return windows_source(
            "tokens",
            train_ids,
            val_ids,
            cfg.block_size,
            cfg.train_size,
            in_memory=lambda: (train_ids, val_ids),
            codec=ids_codec,
        )
    train = open_split("train_path", cfg.train_path, dtype, cfg.block_size, vocab_size)
    val = open_split("val_path", cfg.val_path, dtype, cfg.block_size, vocab_size)
    return windows_source(
        "tokens",
        train,
        val,
        cfg.block_size,
        cfg.train_size,
        in_memory=lambda: (train.load(), val.load()),
        codec=codec(vocab_size, cfg.tokenizer),
    )


def prepare(text_file: str | Path, out_dir: str | Path) -> dict:
    """Write ``train.bin``, ``val.bin`` (90 % / 10 %, uint16 ids, uint32 past 65,536 characters) and ``meta.pkl`` of
    ``text_file`` into ``out_dir``, as nanoGPT's ``data/shakespeare_char/prepare.py`` does.

    Returns:
        ``{"vocab_size", "dtype", "train_tokens", "val_tokens", "train_path", "val_path"}``.

    Raises:
        ConfigError: ``text_file`` is not readable UTF-8 text (``read_corpus``).
    """
    tokens, vocab = read_corpus(str(text_file))
    dtype = "uint16" if len(vocab) <= 1 << 16 else "uint32"
    ids = tokens.numpy().astype(DTYPES[dtype])
    cut = int(TRAIN_FRACTION * len(ids))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_own(out / "train.bin", ids[:cut].tobytes())
    write_own(out / "val.bin", ids[cut:].tobytes())
    with open_own(out / "meta.pkl", "wb") as f:
        pickle.dump(
            {"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": {ch: i for i, ch in enumerate(vocab)}}, f
        )
    return {
        "vocab_size": len(vocab),
        "dtype": dtype,
        "train_tokens": cut,
        "val_tokens": len(ids) - cut,
        "train_path": str(out / "train.bin"),
        "val_path": str(out / "val.bin"),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m runner.data.tokens prepare <text file> <out dir>``: ``prepare``, then the overrides that
    train on its output. A bad text file: one ``error:`` line, exit status 2 (as ``python -m runner``)."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.data.tokens",
        description="Write nanoGPT-format token files (train.bin, val.bin, meta.pkl).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="character-level ids of a UTF-8 text, as nanoGPT's shakespeare_char/prepare.py")
    p.add_argument("text_file")
    p.add_argument("out_dir")
    args = parser.parse_args(argv)
    try:
        r = prepare(args.text_file, args.out_dir)
    except ConfigError as e:
        message = str(e).replace(f"data.path={args.text_file}", args.text_file)
        print(f"error: {message.replace('data.path', 'the text file argument')}", file=sys.stderr)
        return 2
    print(
        f"wrote {r['train_path']} ({r['train_tokens']:,} tokens) and {r['val_path']} ({r['val_tokens']:,} tokens), "
        f"{r['dtype']}, vocab_size {r['vocab_size']}"
    )
    dtype = "" if r["dtype"] == "uint16" else f" data.dtype={r['dtype']}"
    print(
        f"train on them: python -m runner task=language_model model=gpt data=tokens "
        f"data.train_path={r['train_path']} data.val_path={r['val_path']} data.vocab_size={r['vocab_size']}{dtype}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
