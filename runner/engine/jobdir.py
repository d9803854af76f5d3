"""One run per job folder: an OS file lock, held for the run's life, and the folder's paths checked before anything
is built.

Why, what the user sees, and file systems without locks: docs/checkpointing.md, "Resume". Rank 0 takes
``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<job>/.runner.lock`` (https://man7.org/linux/man-pages/man2/flock.2.html)
and writes its holder there; forked children close their copy at once (``os.register_at_fork``). Where it is taken:

- ``python -m runner`` (one run): ``JobLock.on_run_start``, a Hydra callback (``conf/config.yaml``), before Hydra
  creates the folder and writes ``.hydra/`` (``hydra.core.utils.run_job``), with ``hydra.run.dir`` resolved on the
  very config Hydra then uses (``${now:...}`` is cached there, so it is the same folder); an interrupted run of the
  same composed config found among the newest run folders (``continue_interrupted``) is locked and set as
  ``hydra.run.dir`` there instead;
- a multirun: ``JobLock.on_multirun_start`` locks the sweep folder for the sweep's life, and each job's folder is
  locked when its training starts (after Hydra wrote that job's ``.hydra/``, which is the sweep's own);
- every ``runner.engine.train.train`` call (forked ablation and doctor runs, interleaved jobs): ``claim``, a no-op
  where this process holds the lock already.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import itertools
import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from runner.errors import ConfigError
from runner.files import replace_own

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
        return f"pid {info['pid']} on {info['host']}, started {info['started']}" + (
            f" ({info['command']})" if info.get("command") else ""
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def acquire(folder: Path, typed: str | None = None) -> bool:
    """Lock job ``folder`` for this process (creating the folder). True when taken now; False when this process
    holds it already, or the file system does not support locks (said in one line). ``typed``: the command line's
    override that named the folder (``hydra.run.dir=...``), which the refusal names.

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
        if (folder / LOCK_FILE).is_symlink():  # runner's lock is a file: a link (a copied folder's) is never followed
            (folder / LOCK_FILE).unlink()
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise ConfigError(
            f"cannot open the job folder's lock {folder / LOCK_FILE} ({e.strerror or e}): the job "
            f"folder must be a folder you can write; run into another one (hydra.run.dir)"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # ENOLCK, EOPNOTSUPP: no locks here
            print(
                f"note: cannot lock the job folder {folder} ({e.strerror}): this file system does not support "
                f"locks, so runs into it are not kept apart",
                file=sys.stderr,
                flush=True,
            )
            return False
        fix = f"drop {typed} for a new one" if typed else "hydra.run.dir=<another folder>"
        raise ConfigError(
            f"the job folder {folder} is in use by another run: {holder(folder)}; wait for it to end, "
            f"or run into another folder ({fix}). Nothing was written there"
        ) from e
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": _command(),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError as e:  # a full disk: the lock opens, but its line does not fit
        os.close(fd)
        raise ConfigError(
            f"cannot write the job folder's lock {folder / LOCK_FILE} ({e.strerror or e}): free space "
            f"there, or run into another folder (hydra.run.dir)"
        ) from e
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
    from runner.config.logger import logger_names

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
            raise ConfigError(
                f"{path} is a file, but the run writes {what} into a folder of that name; move or "
                f"delete the file, or run into another folder (drop hydra.run.dir)"
            )


def claim(folder: Path, cfg: Any) -> bool:
    """``acquire`` ``folder`` and ``check_outputs`` (rank 0 of a training run: ``runner.engine.train.train``). True when
    the lock was taken here (release it at the end); a refusal of the outputs releases it.

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


#: ``python -m runner``'s folder as it was before Hydra wrote into it (``JobLock.on_run_start``, rank 0): the folder,
#: whether it existed, its ``.hydra/`` files and the size and time of everything else in it
_before: dict[str, Any] = {}
#: what Hydra and runner write into a run's folder before training starts
_STARTED = {".hydra", "runner.log", LOCK_FILE}


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.iterdir() if p.name not in _STARTED}


def _remember(folder: Path) -> None:
    hydra = folder / ".hydra"
    files = (
        {p.name: p.read_bytes() for p in hydra.iterdir() if p.is_file() and not p.is_symlink()}
        if hydra.is_dir() and not hydra.is_symlink()
        else {}
    )
    made = [folder, *[p for p in folder.absolute().parents if not p.exists()]]  # this run makes these folders
    log = folder / "runner.log"
    _before.update(
        folder=folder,
        existed=folder.is_dir(),
        files=files,
        made=made,
        listing=_listing(folder) if folder.is_dir() else {},
        log_size=log.lstat().st_size if log.is_file() and not log.is_symlink() else None,
    )


def started_folder() -> Path | None:
    """The folder of the single run this process started (``python -m runner``, rank 0), once Hydra's run of it
    ended (``HydraConfig`` is reset then); None otherwise."""
    return _before.get("folder")


def undo_refused_run() -> None:
    """After ``python -m runner`` refused its config (a ``ConfigError`` before the run wrote anything of its own):
    leave the folder as it was. A folder this run created is removed; in one it found (a finished run's), the
    ``.hydra/`` that Hydra rewrote gets its files back byte for byte and ``runner.log`` its length. Nothing when the
    run wrote anything besides ``.hydra/``, ``runner.log`` and the lock, or when no single run was started in this
    process."""
    import shutil

    folder = _before.pop("folder", None)
    if folder is None or not folder.is_dir() or folder.is_symlink() or _listing(folder) != _before["listing"]:
        return
    release(folder)
    if not _before["existed"]:
        shutil.rmtree(folder, ignore_errors=True)
        for parent in _before["made"][1:]:  # outputs/<date>/ too, when this run made it and it stayed empty
            try:
                parent.rmdir()
            except OSError:
                break
        return
    hydra = folder / ".hydra"
    if hydra.is_dir() and not hydra.is_symlink():
        for p in hydra.iterdir():
            if p.name not in _before["files"] and p.is_file():
                p.unlink()
        for name, data in _before["files"].items():
            replace_own(hydra / name, data)
    log = folder / "runner.log"  # the refused run's lines (Hydra's log, the console) go; the earlier run's stay
    if log.is_file() and not log.is_symlink():
        if _before["log_size"] is None:
            log.unlink()
        else:
            fd = os.open(log, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.ftruncate(fd, min(_before["log_size"], os.fstat(fd).st_size))
            finally:
                os.close(fd)


def _refuse(e: ConfigError) -> None:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


#: How deep under a run or sweep folder Hydra writes a job's files (``<sweep>/<subdir>/<seed>/.hydra/config.yaml``)
PLANTED_DEPTH = 4


def drop_planted_links(folder: Path) -> None:
    """Remove the links a copied folder may hold where Hydra writes each job's files -- ``.hydra/``, its YAML files,
    the job log (``*.log``) -- in ``folder`` and the job folders under it. Hydra opens them through a link
    (``hydra.core.utils._save_config``, ``logging.FileHandler``), so this runs first, when the folder is locked."""
    top = len(folder.parts)
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        for name in [*dirs, *files]:
            path = here / name
            if path.is_symlink() and (
                name == ".hydra" or name.endswith(".log") or (here.name == ".hydra" and name.endswith(".yaml"))
            ):
                path.unlink()
        if len(here.parts) - top >= PLANTED_DEPTH:
            dirs.clear()


def _new_folder(folder: Path, remember: bool) -> Path:
    """``folder`` (Hydra's dated run or sweep folder, not one the user named), or the first of ``folder-2``,
    ``folder-3``, ... that this process creates: ``mkdir`` is the claim, so two runs started in the same second from
    one folder get a folder each. ``remember``: ``_remember`` it first (a refused run removes it again)."""
    for n in itertools.count(1):
        candidate = folder if n == 1 else folder.with_name(f"{folder.name}-{n}")
        if candidate.exists() or candidate.is_symlink():
            continue
        if remember:
            _remember(candidate)
        candidate.parent.mkdir(parents=True, exist_ok=True)
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


class JobLock(Callback):
    """Hydra callback (``hydra.callbacks.job_lock`` in ``conf/config.yaml``; the module docstring): lock the run's
    folder, or the sweep's, before Hydra writes into it; rank 0 only. A refusal is one ``error:`` line, status 2."""

    def _lock(self, config: Any, key: str) -> None:
        from omegaconf import OmegaConf, read_write

        from runner.launch import discover

        if discover().rank != 0:  # the other ranks run in scratch folders (runner.launch.hydra_overrides)
            return
        try:
            folder = OmegaConf.select(config, key, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 - a folder Hydra resolves later (${hydra:...}): train() locks it then
            return
        if folder:
            typed = [o for o in OmegaConf.select(config, "hydra.overrides.hydra") or [] if o.startswith(f"{key}=")]
            if not typed:
                folder = _new_folder(Path(str(folder)), remember=key == "hydra.run.dir")  # Hydra's dated name
                with read_write(config.hydra):
                    OmegaConf.update(config, key, str(folder))
            elif key == "hydra.run.dir":
                _remember(Path(str(folder)))
            try:
                acquire(Path(str(folder)), typed[0] if typed else None)
            except ConfigError as e:
                _refuse(e)
            drop_planted_links(Path(str(folder)))

    def on_run_start(self, config: Any, **kwargs: Any) -> None:  # noqa: D102 - the class says it
        from omegaconf import read_write

        from runner.launch import discover

        found = continue_interrupted(config) if discover().rank == 0 else None
        if found is None:
            self._lock(config, "hydra.run.dir")
            return
        folder, step = found  # its lock is taken; Hydra makes no new folder, run_job reads hydra.run.dir next
        drop_planted_links(folder)
        _remember(folder)
        with read_write(config.hydra.run):
            config.hydra.run.dir = str(folder)
        print(
            f"resuming the interrupted run in {folder} (step {step}); checkpoint.resume=never starts fresh", flush=True
        )

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:  # noqa: D102
        self._lock(config, "hydra.sweep.dir")


# --------------------------------------------------------------------- the interrupted run of the same command
#: How far ``python -m runner`` looks for an interrupted run of the same command (``recent_run_folders``): at each
#: level of ``hydra.run.dir``'s pattern above the run folders (the dates of ``outputs/<date>/<time>``) the newest
#: ``RECENT_PARENTS`` folders, and in them the newest ``RECENT_RUNS`` run folders (by modification time).
RECENT_PARENTS = 3
RECENT_RUNS = 10
#: strftime directives -> what they write, for the folder names ``${now:...}`` makes
_STRFTIME = {
    "Y": r"\d{4}",
    "y": r"\d{2}",
    "m": r"\d{2}",
    "d": r"\d{2}",
    "H": r"\d{2}",
    "M": r"\d{2}",
    "S": r"\d{2}",
    "f": r"\d{6}",
    "j": r"\d{3}",
    "%": "%",
}


def _name_pattern(part: str) -> re.Pattern | None:
    """A regex for the folder names one part of a ``hydra.run.dir`` pattern makes: ``${now:%H-%M-%S}`` two digits,
    a dash, ...; any other interpolation any name. None for a part whose interpolations nest (not read here)."""
    out, pos = [], 0
    for m in re.finditer(r"\$\{([^{}]*)\}", part):
        out.append(re.escape(part[pos : m.start()]))
        if m[1].startswith("now:"):
            out += [
                _STRFTIME.get(t[1], ".+") if t.startswith("%") and len(t) == 2 else re.escape(t)
                for t in re.findall(r"%.|[^%]+", m[1][4:])
            ]
        else:
            out.append(".+")
        pos = m.end()
    out.append(re.escape(part[pos:]))
    literal = re.sub(r"\$\{[^{}]*\}", "", part)
    return None if "${" in literal or "}" in literal else re.compile("".join(out))


def recent_run_folders(pattern: str, parents: int = RECENT_PARENTS, runs: int = RECENT_RUNS) -> list[Path]:
    """The run folders ``hydra.run.dir``'s ``pattern`` (unresolved: ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}``)
    made most recently, newest first: below its fixed part (``outputs``), the newest ``parents`` folders whose
    names the pattern makes at each level, then the newest ``runs`` at the last. [] for a pattern without an
    interpolation (one fixed folder: ``checkpoint.resume=auto`` continues its run already) or one not read here."""
    parts = Path(pattern).parts
    first = next((i for i, p in enumerate(parts) if "${" in p), None)
    names = [_name_pattern(p) for p in parts[first:]] if first is not None else []
    if not names or any(n is None for n in names):
        return []
    level = [Path(*parts[:first])] if first else [Path()]
    for depth, name in enumerate(names):
        found: list[tuple[float, Path]] = []
        for folder in level:
            try:
                with os.scandir(folder) as entries:
                    found += [
                        (e.stat().st_mtime, folder / e.name) for e in entries if name.fullmatch(e.name) and e.is_dir()
                    ]
            except OSError:  # gone, or not a folder one may list
                continue
        found.sort(key=lambda item: item[0], reverse=True)
        level = [path for _, path in found[: runs if depth == len(names) - 1 else parents]]
    return level


def continue_interrupted(config: Any) -> tuple[Path, int] | None:
    """The folder and step of an interrupted run that ``python -m runner`` continues instead of starting a new
    folder: the same composed config (``runner.checkpoint.resume.interrupted_run``) with a checkpoint and no summary,
    among ``recent_run_folders``; its lock is taken for this process. None -- a new folder as before -- when
    ``checkpoint.resume`` is not ``auto``, ``hydra.run.dir`` was given on the command line, or no such run is
    found (one a live run holds is not interrupted)."""
    from omegaconf import OmegaConf

    try:
        if OmegaConf.select(config, "checkpoint.resume") != "auto" or any(
            str(o).startswith("hydra.run.dir=") for o in config.hydra.overrides.hydra
        ):
            return None
        pattern = OmegaConf.to_container(config.hydra.run, resolve=False).get("dir")
    except Exception:  # noqa: BLE001 - a config this does not read: a new folder, as before
        return None
    try:
        folders = [
            f
            for f in recent_run_folders(str(pattern))
            if not (f / "summary.json").exists() and any((f / "checkpoints").glob("step_*"))
        ]
    except OSError:  # a folder one may not read: not one to continue
        return None
    if not folders:
        return None
    from runner.checkpoint.resume import interrupted_run  # imports torch: only when a folder may hold such a run
    from runner.launch import discover

    try:
        resolved = _task_config(config)
    except Exception:  # noqa: BLE001 - an interpolation only the job can resolve (${hydra:...}): a new folder
        return None
    try:
        return interrupted_run(folders, resolved, discover().world_size, claim_if_free)
    except OSError:  # a checkpoint folder that cannot be listed: a new folder, as before
        return None


def _task_config(config: Any) -> dict[str, Any]:
    """The job's config as ``runner.engine.train`` records it (Hydra's node removed, resolved)."""
    import copy

    from omegaconf import OmegaConf, open_dict, read_write

    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return OmegaConf.to_container(task, resolve=True)


def claim_if_free(folder: Path) -> bool:
    """Take ``folder``'s lock; False when a live run holds it."""
    try:
        acquire(folder)
    except ConfigError:
        return False
    return True
