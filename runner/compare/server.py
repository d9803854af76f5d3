"""The job server: every measured job is a process forked from one server that imported torch and runner once.

``multiprocessing``'s forkserver, started on first use, imports ``SERVER_PRELOAD`` and then only forks: no torch op
has run in it and no CUDA context exists, so each child starts as clean as ``python -m runner`` would. Why, and the
peak-RSS difference it leaves: docs/ablation.md, "One process per configuration, without paying the imports".
runner/compare/process.py forks each job from it (``context``); ``train_in_child`` is a job's body.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.errors import ConfigError

#: What the server imports once, before it forks any job (importing them runs no torch op and starts no thread).
#: torch._dynamo is imported lazily by the FLOP count of every job: ~2.5 s each on 2 cores.
SERVER_PRELOAD = ["torch._dynamo", "runner.engine.train", "runner.compare.process"]
#: The longest path a Unix socket may have on Linux (``sun_path`` holds 108 bytes with the final NUL)
UNIX_SOCKET_PATH_MAX = 107


def check_socket_dir() -> None:
    """Raise ConfigError when the server's socket would not fit in a Unix socket path.

    The server listens on ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX`` (``multiprocessing.util.get_temp_dir``
    under ``TMPDIR``); a longer path fails deep inside ``multiprocessing`` with "AF_UNIX path too long".
    """
    from multiprocessing import util

    socket = os.path.join(util.get_temp_dir(), "listener-XXXXXXXX")
    if len(os.fsencode(socket)) > UNIX_SOCKET_PATH_MAX:
        raise ConfigError(
            f"the job server's socket would be {socket!r} ({len(os.fsencode(socket))} bytes), longer than the "
            f"{UNIX_SOCKET_PATH_MAX} bytes a Unix socket path may hold: set TMPDIR to a shorter folder (e.g. "
            f"TMPDIR=/tmp)"
        )


def context() -> Any:
    """``multiprocessing``'s forkserver context, preloading ``SERVER_PRELOAD``.

    Raises:
        ConfigError: ``TMPDIR`` is too long for the server's socket (``check_socket_dir``).
    """
    import signal
    import threading
    from multiprocessing import forkserver

    check_socket_dir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(SERVER_PRELOAD)  # only read when the server starts
    if threading.current_thread() is threading.main_thread():
        # started with Ctrl-C ignored, which it inherits: a Ctrl-C meant for the conductor (the terminal signals the
        # whole group) must not kill the server in its imports; the jobs call setsid, so no Ctrl-C reaches them
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    return ctx


def _ready() -> None:
    """A child that does nothing: forking it waits until the server has imported ``SERVER_PRELOAD``."""


def start() -> float:
    """Start the server (a no-op when it runs) and wait until it can fork; returns the seconds taken. The server
    exits with this process."""
    started = time.perf_counter()
    child = context().Process(target=_ready, name="job server check")
    child.start()
    child.join()
    return time.perf_counter() - started


def _die_with_the_server() -> None:
    """Linux: this job is killed when its parent, the job server, ends (prctl(2) ``PR_SET_PDEATHSIG``), and the server
    ends with the process that started it: multiprocessing's forkserver exits on EOF of its "alive" pipe, whose write
    end every forked child inherits too (for forking children of its own), so the job closes its copy. So when a
    conductor dies (killed, its folder removed under it), no resident job trains on for nobody."""
    import ctypes
    import signal
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None and multiprocessing.get_start_method() != "forkserver":  # its loader workers fork
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF still stops a job at its next slice
        return
    if os.getppid() == 1:  # the server was gone before the call
        os._exit(1)


def train_in_child(
    cfg: DictConfig, job_dir: str, env: dict[str, str], start_method: str | None = None, gate: Any = None
) -> None:
    """The body of a forked job: train ``cfg`` into ``job_dir`` (paused at ``gate``, a
    ``runner.engine.slice_gate.SliceGate``, when given); bad input exits 2 and a loss that is not finite 3, each with
    its one ``error:`` line, like ``python -m runner``.

    ``start_method``: the parent's ``multiprocessing`` start method. A child of the forkserver would otherwise
    start its own processes (DataLoader workers) by forkserver too, unlike ``python -m runner`` (fork on Linux
    before Python 3.14): slower worker start-up, and a dataset that does not pickle fails."""
    os.environ.update(env)
    if start_method:
        multiprocessing.set_start_method(start_method, force=True)
    _die_with_the_server()
    from runner.engine.train import train
    from runner.errors import TrainingDiverged

    try:
        train(cfg, Path(job_dir), gate=gate)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
