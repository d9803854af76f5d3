"""One run per job folder: an OS file lock, held for the run's life, and the folder's paths checked before anything
is built.

Two runs started into one ``hydra.run.dir`` would both write the folder's files, and a run with another config
rewrites ``.hydra/config.yaml`` (which evaluate, export and the doctor rebuild from) before the engine refuses it.
So a run takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<job>/.runner.lock`` (https://man7.org/linux/man-pages/man2/flock.2.html)
and writes its holder there (pid, host, start time, command); a second run into the folder is refused with the
holder named, having written nothing (the lock file exists already: opening it changes nothing). The kernel drops
the lock when the holder's last descriptor closes -- on any exit, a crash or SIGKILL included -- so a lock left by
a dead run is stale and harmless: the file stays, the next run takes the lock and resumes (``checkpoint.resume``).
Children forked by the holder (DataLoader workers) close their copy at once (``os.register_at_fork``), so they
never keep a dead run's folder locked.

Where it is taken:

- ``python -m runner`` (one run): ``JobLock.on_run_start``, a Hydra callback (``conf/config.yaml``), before Hydra
  creates the folder and writes ``.hydra/`` (``hydra.core.utils.run_job``), with ``hydra.run.dir`` resolved on the
  very config Hydra then uses (``${now:...}`` is cached there, so it is the same folder);
- a multirun: ``JobLock.on_multirun_start`` locks the sweep folder for the sweep's life (a second sweep into it is
  refused before it writes anything), and each job's folder is locked when its training starts (``train``: after
  Hydra wrote that job's ``.hydra/``, which is the sweep's own);
- every ``runner.train.train`` call (forked ablation and doctor runs, interleaved jobs): ``claim``, which is a
  no-op where this process holds the lock already.

Only rank 0 takes it (under torchrun and srun the other ranks write no job folder: ``runner.launch``), so a job
spread over nodes locks its folder once, on rank 0's node. ``flock`` works across machines on NFS (Linux emulates it
with byte-range locks) and on Lustre mounted with ``-o flock``; where the file system refuses locks, the run says
so in one line and goes on unlocked.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from runner.errors import ConfigError

LOCK_FILE = ".runner.lock"

#: resolved job folder -> the descriptor holding its lock, in this process
_held: dict[str, int] = {}


def _forget_in_child() -> None:
    """In a forked child: close the inherited descriptors (the parent keeps its lock; flock's lock belongs to the
    open file, and closing a duplicate does not release it) so the child never holds a dead parent's folder."""
    for fd in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _command() -> str:
    """This process's command line as typed (``python -m runner ...``), cut at 200 characters."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):  # python -m <package>
        argv[:1] = ["-m", Path(argv[0]).parent.name]
    text = shlex.join(["python", *argv])
    return text if len(text) <= 200 else text[:197] + "..."


def holder(folder: Path) -> str:
    """Who holds (or last held) ``folder``'s lock, as written in its lock file: ``pid 123 on host, started ...``."""
    try:
        info = json.loads((Path(folder) / LOCK_FILE).read_text())
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}"
                + (f" ({info['command']})" if info.get("command") else ""))
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def acquire(folder: Path) -> bool:
    """Lock job ``folder`` for this process (creating the folder). True when taken now; False when this process
    holds it already, or the file system does not support locks (said in one line).

    Raises:
        ConfigError: another process holds it (names the holder: pid, host, start time, command) and the fix; the
            folder or its lock file cannot be made or opened for writing.
    """
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # an existing file is not changed
    except OSError as e:
        raise ConfigError(f"cannot open the job folder's lock {folder / LOCK_FILE} ({e.strerror or e}): the job "
                          f"folder must be a folder you can write; run into another one (hydra.run.dir)") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # ENOLCK, EOPNOTSUPP: no locks here
            print(f"note: cannot lock the job folder {folder} ({e.strerror}): this file system does not support "
                  f"locks, so runs into it are not kept apart", file=sys.stderr, flush=True)
            return False
        raise ConfigError(f"the job folder {folder} is in use by another run: {holder(folder)}; wait for it to end, "
                          f"or run into another folder (drop hydra.run.dir for a new one). Nothing was written "
                          f"there") from e
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": _command()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[key] = fd
    return True


def release(folder: Path, taken: bool = True) -> None:
    """Drop this process's lock on ``folder`` (the file stays: removing it would race a run opening it); nothing
    when ``taken`` is False (the caller did not take it) or this process does not hold it."""
    if not taken:
        return
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is not None:
        os.close(fd)


def check_outputs(folder: Path, cfg: Any) -> None:
    """Before anything is built: the folders runner creates in the job folder must be folders where they exist
    (a *file* named ``tensorboard`` would stop the run after the model is built, with a traceback).

    Raises:
        ConfigError: naming the path, the setting that writes it and the fix.
    """
    from runner.config import logger_names

    wanted = {"checkpoints": "checkpoints (checkpoint.*)"}
    names = logger_names(cfg.logger)
    if "tensorboard" in names:
        wanted["tensorboard"] = "TensorBoard's event files (logger=tensorboard)"
    if "mlflow" in names:
        wanted["mlruns"] = "the local MLflow store (logger=mlflow)"
    if "wandb" in names:
        wanted["wandb"] = "the W&B run (logger=wandb)"
    for name, what in wanted.items():
        path = Path(folder) / name
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, but the run writes {what} into a folder of that name; move or "
                              f"delete the file, or run into another folder (drop hydra.run.dir)")


def claim(folder: Path, cfg: Any) -> bool:
    """``acquire`` ``folder`` and ``check_outputs`` (rank 0 of a training run: ``runner.train.train``). True when the
    lock was taken here (release it at the end); a refusal of the outputs releases it.

    Raises:
        ConfigError: from ``acquire`` or ``check_outputs``.
    """
    taken = acquire(folder)
    try:
        check_outputs(folder, cfg)
    except ConfigError:
        if taken:
            release(folder)
        raise
    return taken


def _refuse(e: ConfigError) -> None:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra < 1.1 has no callbacks; train() still locks
    Callback = object  # type: ignore[assignment,misc]


class JobLock(Callback):  # type: ignore[misc,valid-type]
    """Hydra callback (``hydra.callbacks.job_lock`` in ``conf/config.yaml``): lock the run's folder before Hydra
    makes it (``on_run_start``), the sweep's folder before a multirun writes anything (``on_multirun_start``); rank 0
    only. A refusal is one ``error:`` line and exit status 2."""

    def _lock(self, config: Any, key: str) -> None:
        from omegaconf import OmegaConf

        from runner.launch import discover

        if discover().rank != 0:  # the other ranks run in scratch folders (runner.launch.hydra_overrides)
            return
        try:
            folder = OmegaConf.select(config, key, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 - a folder Hydra resolves later (${hydra:...}): train() locks it then
            return
        if folder:
            try:
                acquire(Path(str(folder)))
            except ConfigError as e:
                _refuse(e)

    def on_run_start(self, config: Any, **kwargs: Any) -> None:  # noqa: D102 - the class says it
        self._lock(config, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:  # noqa: D102
        self._lock(config, "hydra.sweep.dir")
