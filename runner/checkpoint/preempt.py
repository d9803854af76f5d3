"""Preemption: a signal (Ctrl-C too) only sets a flag; the loop checkpoints at the next step boundary and exits.

A second Ctrl-C exits at once; the stop message gives the command that resumes (``resume_command``). Why only at
step boundaries (Lightning issue #21406), Ctrl-C and SLURM's requeue: docs/checkpointing.md, "Ctrl-C",
"Preemption and requeue on SLURM".

Sources: SLURM sbatch ``--signal`` and ``--requeue``; Lightning's ``SLURMEnvironment(auto_requeue=True)``;
submitit's checkpoint/requeue protocol.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path
from types import FrameType

from runner.errors import ConfigError


class Preemption:
    """Installs handlers for ``signals`` (names such as ``"SIGTERM"``, ``"SIGUSR1"``) that record the signal.

    ``handoff``: the signal of a job manager that requeues the job itself (``submitit_signal()``: submitit's
    ``SIGUSR2``, which it receives before a time limit and, after a ``SIGTERM`` it ignores, on preemption).
    It is then caught too, ``SIGTERM`` is left to the manager, and ``resend`` delivers the hand-off signal
    whichever one stopped the run, so the manager's handler requeues the job after runner's checkpoint.

    Use as a context manager: the previous handlers come back on exit. ``received`` is the signal's name (None
    until one arrives), read at step boundaries by ``runner.engine.loop_guards``.

    Raises:
        ConfigError: a name that is not a catchable signal of this platform.
    """

    def __init__(self, signals: list[str], handoff: str | None = None):
        self.handoff = handoff
        self.names = list(dict.fromkeys(str(n).upper() for n in signals))
        if handoff and self.names:  # a submitit job: its signal stops the run; SIGTERM stays submitit's
            self.names = [n for n in self.names if n != "SIGTERM"] + [handoff] * (handoff not in self.names)
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._signums = []
        for name in self.names:
            signum = getattr(signal, str(name).upper(), None)
            if not isinstance(signum, signal.Signals) or signum in (signal.SIGKILL, signal.SIGSTOP):
                raise ConfigError(
                    f"checkpoint.signals: {name!r} is not a signal that can be caught here; use names "
                    f"such as SIGTERM, SIGUSR1 (or [] to ignore signals)"
                )
            self._signums.append(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received is not None:  # a second Ctrl-C: stop now, no checkpoint
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "Preemption":
        for signum in self._signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python
        self._previous.clear()

    def resend(self) -> None:
        """Put the previous handlers back and deliver the received signal to them (submitit's own handler
        requeues its job; a default SIGTERM ends the process)."""
        received = self.handoff or self.received
        self.__exit__()
        signum = getattr(signal, received, None) if received else None
        if isinstance(signum, signal.Signals):
            os.kill(os.getpid(), signum)


def submitit_signal(env: dict[str, str] | None = None) -> str | None:
    """The signal submitit's job handler checkpoints and requeues on (``SIGUSR2`` unless
    ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise), inside a submitit job (``SUBMITIT_EXECUTOR`` set); else None.
    Source: submitit ``JobEnvironment._handle_signals`` and ``SlurmJob._interrupt``."""
    env = os.environ if env is None else env
    if not env.get("SUBMITIT_EXECUTOR"):
        return None
    return "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")


def requeue_slurm_job() -> str | None:
    """Requeue this SLURM batch job (``scontrol requeue $SLURM_JOB_ID``) so it restarts with the same job id.

    Not for submitit's jobs (``SUBMITIT_EXECUTOR`` set): submitit requeues its own jobs on the signal it
    handles. Returns what was done, for the log; None outside SLURM.
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not requeue SLURM job {job}: {e}"
    if done.returncode != 0:
        return f"scontrol requeue {job} failed: {done.stderr.strip()}"
    return f"requeued SLURM job {job}"


def resume_command(argv: list[str], job_dir: Path, sweep_dir: Path | None = None, launcher: str = "single") -> str:
    """The command that resumes this run: ``python -m runner`` with ``argv`` (the arguments after
    ``-m runner``) and ``hydra.run.dir=<job_dir>`` -- or, for a multirun (``sweep_dir`` given),
    ``hydra.sweep.dir=<sweep_dir>`` -- replacing any such argument already there. Under torchrun/srun
    (``launcher``) the launcher's own options are not known here: the same command with that argument."""
    key, folder = ("hydra.sweep.dir", sweep_dir) if sweep_dir is not None else ("hydra.run.dir", job_dir)
    args = [a for a in argv if not a.startswith(key + "=")] + [f"{key}={folder}"]
    if launcher != "single":
        return f"the same {launcher} command with {shlex.quote(f'{key}={folder}')}"
    return shlex.join(["python", "-m", "runner", *args])
