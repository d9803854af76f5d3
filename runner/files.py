"""Files runner writes into a job, sweep or tuner folder, and the scratch paths it makes: never through a link.

A folder copied from a colleague, or one someone else can write to, may hold a symbolic link where runner writes a
file (``metrics.jsonl`` pointing at ``~/.bashrc``). Every write goes through these helpers, which open the name with
``O_NOFOLLOW`` after removing a link planted there, so the text lands in the folder and the link's target is left
unchanged (tests/test_files.py plants a link at every write site, and fails on a raw ``open``/``write_text``).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_own(path: Path | str, mode: str = "w", **kwargs: Any):
    """``path`` opened for writing (``mode``: ``"w"``, ``"wb"``, ``"a"`` or ``"ab"``) as a file of its own: a link
    there is removed, never written through. Raises OSError as ``open`` does."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o644), mode, **kwargs)


def write_own(path: Path | str, data: str | bytes, encoding: str = "utf-8") -> None:
    """``data`` (text or bytes) written to ``path`` as a file of its own (``open_own``)."""
    if isinstance(data, bytes):
        with open_own(path, "wb") as f:
            f.write(data)
    else:
        with open_own(path, encoding=encoding) as f:
            f.write(data)


def replace_own(path: Path | str, data: str | bytes) -> None:
    """``data`` written to ``path`` atomically: to ``<path>.tmp`` (``write_own``), then ``os.replace``, so a crash or a
    full disk never leaves a half-written file under the final name, and a link at either name is replaced, never
    written through. Raises OSError (the temporary file removed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_own(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def own_folder(path: Path | str) -> Path:
    """``path`` as a folder of the job's own, made when missing (with its parents): a link there (a copied folder's
    ``checkpoints`` pointing elsewhere) is removed first, so what runner writes, renames and prunes inside stays in
    the job folder. Returns the path; raises OSError as ``mkdir`` does."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def private_dir(name: str) -> Path:
    """``<tmp>/<name>-<uid>``: a scratch folder of this user's own (mode 0700), made on first use. One that is a link,
    belongs to another user or is open to others is refused: someone else made it, to see or steer what is written
    there. Raises OSError naming the folder and the fix."""
    folder = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(
            f"{folder} is not a private folder of yours (a link, another user's, or open to others): "
            f"remove it and run again"
        )
    return folder
