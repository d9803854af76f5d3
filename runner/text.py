"""``data=text``'s parts under their old name: they live in ``runner.data.text`` now (corpus, vocabulary,
``TokenWindows``, the on-device ``OnDeviceWindows``, ``text_source``); this module re-exports them so
``from runner import text`` keeps working. New code imports ``runner.data.text``."""

from __future__ import annotations

from runner.data.text import (
    TRAIN_FRACTION,
    OnDeviceWindows,
    TokenWindows,
    decode,
    encode,
    read_corpus,
    save_vocab,
    split,
    text_source,
)

__all__ = ["TRAIN_FRACTION", "OnDeviceWindows", "TokenWindows", "decode", "encode", "read_corpus", "save_vocab",
           "split", "text_source"]
