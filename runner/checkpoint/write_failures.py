"""What went wrong when a file could not be written: a full disk, said as such.

A full disk rarely says so by the time the error reaches runner: ``torch.distributed.checkpoint`` wraps every
rank's exception in a ``CheckpointException`` (a ``BaseException``, its causes in ``.failures``), and PyTorch's
zip writer reports the short write of a full disk as ``RuntimeError: ... unexpected pos 704 vs 598`` or
``file write failed``, without ``errno``. ``causes`` unwraps both; ``disk_full`` recognises ``ENOSPC``/``EDQUOT``
and the zip writer's messages (the latter only when the file system is indeed nearly full).

Sources: ``torch/distributed/checkpoint/api.py`` (``CheckpointException.failures``); PyTorch's
``caffe2/serialize/inline_container.cc`` (the ``unexpected pos`` check after each write).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

#: errno values of a file system with no room left: no space, or the user's quota
FULL = (errno.ENOSPC, errno.EDQUOT)
#: what PyTorch's zip writer says when a write came up short
SHORT_WRITE = ("unexpected pos", "file write failed", "No space left on device")
#: free space (bytes) below which a short write is taken for a full disk
NEARLY_FULL = 256 * 2**20


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and everything behind it: ``__cause__``/``__context__`` chains and, for a DCP
    ``CheckpointException``, every rank's wrapped exception (recursively)."""
    found: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
    return found


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (or its nearest existing parent); None when unknown."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def disk_full(exc: BaseException, where: Path) -> bool:
    """Whether ``exc`` (anything behind it) is a write that failed for lack of space at ``where``."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in FULL:
            return True
        if isinstance(e, RuntimeError) and any(s in str(e) for s in SHORT_WRITE):
            free = free_bytes(where)
            if free is None or free < NEARLY_FULL:
                return True
    return False


#: errno -> what it says of an output that cannot be written; and what a library's message says for it (safetensors'
#: Rust errors carry "(os error 28)", not an OSError)
UNWRITABLE = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
UNWRITABLE_TEXT = {f"(os error {n})": why for n, why in UNWRITABLE.items()}


def unwritable(exc: BaseException, where: Path) -> tuple[str, str | None] | None:
    """Why ``exc`` (anything behind it) is an output that could not be written -- ``"disk full"``, ``"read-only file
    system"``, ... -- and the file it names (None when unknown); None for any other failure."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in UNWRITABLE:
            return UNWRITABLE[e.errno], (str(e.filename) if e.filename else None)
        for text, why in UNWRITABLE_TEXT.items():
            if text in str(e):
                return why, None
    return ("disk full", None) if disk_full(exc, where) else None


def interrupted(exc: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` (a second Ctrl-C) is behind ``exc`` (DCP wraps it too)."""
    return any(isinstance(e, KeyboardInterrupt) for e in causes(exc))


def describe_free(where: Path) -> str:
    """``"<n> MiB free"`` on the file system of ``where``, or ``"free space unknown"``."""
    free = free_bytes(where)
    return "free space unknown" if free is None else f"{free / 2**20:,.0f} MiB free"
