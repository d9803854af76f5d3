"""One measured job: a resident process, forked from the job server, that trains when told and reports.

This module is the other end of runner/engine/slice_gate.py's pipe (its messages are listed there): ``Job.spawn``,
``Job.start`` (spawn and warm up), ``Job.slice``, ``Job.resumed_slice``, ``Job.finish`` and ``Job.kill``. Under
torchrun (runner/compare/ranks.py) rank 0's job tells the other ranks' conductors what it will do to its process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.compare import server
from runner.track import write_json_atomic

#: A job process's exit status after a CUDA out-of-memory error (the kernel's out-of-memory killer: -9, SIGKILL).
EXIT_OUT_OF_MEMORY = 4


#: Each job's console output, in its folder: the comparison's console carries the conductor's lines only.
LOG = "job.log"


def job_body(cfg: DictConfig, job_dir: str, connection: Any, start_method: str | None, env: dict[str, str]) -> None:
    """The body of a job process: leave the terminal's process group (a terminal's Ctrl-C reaches the conductor
    only), send its output to ``<job_dir>/job.log``, and train paused at a slice gate on its end of the pipe (with
    ``env`` added to the environment: under torchrun, the job's own rendezvous port, runner/compare/ranks.py). A
    CUDA out-of-memory error exits with ``EXIT_OUT_OF_MEMORY``; a conductor that is gone (its end of the pipe
    closed: it was killed) ends the job with one line in its log and exit status 1."""
    os.setsid()
    _output_to(Path(job_dir) / LOG)
    import torch

    from runner.engine.slice_gate import SliceGate

    try:
        server.train_in_child(cfg, job_dir, env, start_method, gate=SliceGate(connection))
    except torch.OutOfMemoryError:
        import traceback

        traceback.print_exc()
        sys.exit(EXIT_OUT_OF_MEMORY)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        print(
            "interleave: the conductor is gone (its end of the pipe closed); this job stops",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def _output_to(path: Path) -> None:
    """Point this process's stdout and stderr (the file descriptors, so native libraries' output follows) at
    ``path``, appended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def last_line(folder: Path) -> str:
    """The last non-empty line of a job's log (its error, when it failed), or ``""``."""
    try:
        lines = [x for x in (folder / LOG).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


@dataclass
class Job:
    """One process of a comparison: its name (folder relative to the comparison's folder), resolved config,
    folder, reference (the configuration it is compared with; None for a reference) and ``config``, the
    configuration it runs (the name of that configuration's first process; None: its own name). The rest is
    the process's state: ``status`` is ``pending``, ``resident``, ``measured``, ``failed (exit N)`` or ``ended
    early``; ``report`` the job's last message; ``group`` the group it was resident in (``"rounds"``: measured by
    the fallback); ``design`` ``interleaved`` or ``rounds``; ``ranks`` this conductor's place under torchrun."""

    name: str
    cfg: DictConfig
    folder: Path
    reference: str | None
    config: str | None = None
    process: Any = None
    connection: Any = None
    status: str = "pending"
    report: dict[str, Any] = field(default_factory=dict)
    group: int | str | None = None
    design: str = "interleaved"
    out_of_memory: bool = False  # it failed for want of memory (the fallback measures it again, in rounds)
    ranks: Any = None

    def __post_init__(self) -> None:
        self.config = self.config or self.name

    @property
    def resident(self) -> bool:
        return self.status == "resident"

    def fresh(self, folder: Path) -> "Job":
        """A new, not yet started process of this job's configuration writing into ``folder`` (the fallback's
        runs)."""
        return Job(
            self.name,
            self.cfg,
            folder,
            self.reference,
            self.config,
            group="rounds",
            design=self.design,
            ranks=self.ranks,
        )

    def start(self) -> bool:
        """Spawn the process (under torchrun: its own rendezvous, the same port on every rank), wait for its
        first message and train its warm-up (``trainer.warmup_steps``, at least one step); False when it
        failed on the way."""
        port = None
        if self.ranks is not None:
            from runner.compare.ranks import free_port

            port = free_port()
            self.ranks.tell(("spawn", self.name, port))
        warmup = max(int(self.cfg.trainer.warmup_steps), 1)
        return self.spawn(port) and self.slice(warmup) is not None

    def spawn(self, port: int | None = None) -> bool:
        """Fork the process from the job server (rendezvous at ``port`` under torchrun) and wait for its first
        message; writes ``job.json`` (its start and setup time, for the report); False when it ended on the way."""
        from runner.compare.ranks import job_env
        from runner.measure.hardware import SWEEP_ROOT_ENV  # the others on the GPU that are this comparison's own

        ctx = server.context()
        mine, theirs = ctx.Pipe()
        # the job starts its own processes (DataLoader workers) as python -m runner would: by this process's start
        # method (fork on Linux before Python 3.14), not the server's forkserver (a dataset that does not pickle)
        self.process = ctx.Process(
            target=job_body,
            name=f"interleave {self.name}",
            args=(
                self.cfg,
                str(self.folder),
                theirs,
                multiprocessing.get_start_method(),
                {**(job_env(port) if port is not None else {}), SWEEP_ROOT_ENV: str(os.getpid())},
            ),
        )
        started = time.time()
        self.process.start()
        theirs.close()
        self.connection, self.status = mine, "resident"
        if self._receive() is None:
            return False
        # its setup (fork, data, model, FLOP count: up to the first step's gate), for the report: the job's wall
        # time is its resident time, most of it waiting for its turn (runner/report/sweep.py job_times)
        if self.ranks is None or self.ranks.leader:
            write_json_atomic(
                self.folder / "job.json",
                {"started": started, "setup_s": time.time() - started, "design": "interleaved"},
            )
        return True

    def slice(self, steps: int) -> dict[str, Any] | None:
        """Let the job train ``steps`` steps; returns ``{"steps", "seconds", "samples_per_sec"}`` (the engine's
        training time of the slice), None if it ended."""
        if self.ranks is not None:
            self.ranks.tell(("slice", self.name, steps))
        before = self.report
        try:
            self.connection.send({"steps": steps})
        except (BrokenPipeError, OSError):
            self._ended()
            return None
        after = self._receive()
        if after is None:
            return None
        seconds = after["train_time_s"] - before["train_time_s"]
        done = after["step"] - before["step"]
        return {
            "steps": done,
            "seconds": seconds,
            "samples_per_sec": done * after["global_batch"] / seconds if seconds > 0 else None,
        }

    def resumed_slice(self, steps: int, resume_steps: int) -> dict[str, Any] | None:
        """A measured slice of ``steps``: ``resume_steps`` unmeasured steps first (a job that waited a whole pass
        runs slower for its first steps; the reference, which runs every third slice, would not), then the slice."""
        if resume_steps and self.slice(resume_steps) is None:
            return None
        figures = self.slice(steps)
        return figures and {**figures, "resume_steps": resume_steps}

    def finish(self) -> None:
        """Tell a resident job to finish (one last step, final evaluation, ``summary.json``) and wait for it."""
        if self.status != "resident":
            return
        if self.ranks is not None:
            self.ranks.tell(("finish", self.name))
        try:
            self.connection.send({"steps": 0})
        except (BrokenPipeError, OSError):
            pass
        self.process.join()
        if self.process.exitcode == 0:
            self.status = "measured"
        else:
            self._failed(self.process.exitcode)

    def kill(self) -> None:
        """Kill the process and its own processes (DataLoader workers: its session) if it is resident (Ctrl-C)."""
        if self.status == "resident" and self.process.is_alive():
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # the job called setsid: its pid is its group's
            except ProcessLookupError:
                pass
            self.process.join()
            self.status = "killed (Ctrl-C)"

    def _receive(self) -> dict[str, Any] | None:
        try:
            self.report = self.connection.recv()
            return self.report
        except (EOFError, OSError):
            self._ended()
            return None

    def _ended(self) -> None:
        """The pipe closed: the job crashed, or reached ``trainer.max_steps`` before being told to finish."""
        self.process.join()
        code = self.process.exitcode
        if code == 0:
            self.status = "ended early (trainer.max_steps reached: raise it for longer interleaving)"
        else:
            self._failed(code)

    def _failed(self, code: int | None) -> None:
        """Record a failure: the status, ``failed.json`` (what the reports list) and one console line with the last
        line of the job's log (its error)."""
        why = last_line(self.folder)
        print(
            f"interleave: {self.name} FAILED (exit status {code}){': ' + why if why else ''}; its output: "
            f"{self.folder / LOG}; the others go on",
            file=sys.stderr,
            flush=True,
        )
        self.status = f"failed (exit {code})"
        self.out_of_memory = code in (EXIT_OUT_OF_MEMORY, -signal.SIGKILL)
        a = self.cfg.get("ablation") or {}
        variant = {"variant": a.get("variant"), "repeat": a.get("repeat", 0)} if a.get("variant") else {}
        write_json_atomic(self.folder / "failed.json", {**variant, "returncode": code, "design": "interleaved"})
