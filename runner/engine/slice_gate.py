"""The pause point between optimizer steps that the interleaved launcher drives (runner/compare/; the method:
docs/ablation.md, "Interleaved measurement"; sources: Abedi & Brecht, ICPE 2017; Bulej et al., ICPE 2020).

Before each step the engine asks this gate whether a slice has ended (``due``); ``wait`` then reports it and blocks
in ``recv`` on its ``multiprocessing`` pipe (no core used, no GPU work launched) until the launcher's next command.
The messages (plain dicts, pickled by ``Connection.send``):

- job -> launcher: ``{"step", "train_time_s", "global_batch", "footprint_mb", "available_mb"}`` at every wait:
  the steps done so far, ``TrainState.train_time_s`` (the steps' wall time, the device's queue drained first;
  evaluations and checkpoints excluded), the samples per step, ``footprint_mb`` and ``available_mb`` (below).
- launcher -> job: ``{"steps": n}`` (train n more steps, then wait again) or ``{"steps": 0}`` (finish:
  one last step, the final evaluation and ``summary.json``, as if ``trainer.max_steps`` were reached).

Under torchrun each rank talks to its own rank's conductor (runner/compare/ranks.py) and rank 0's command is also
broadcast over the job's process group, so the job's ranks train the same steps. Only a comparison's job process
(runner/compare/process.py) passes a ``SliceGate`` to ``runner.engine.train.train``.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from runner import distributed


def footprint_mb(device: torch.device) -> float:
    """This process's memory footprint in MiB: on CUDA the caching allocator's peak reserved memory, else the
    peak resident set size (``getrusage``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def available_mb(device: torch.device) -> float | None:
    """Memory still free for another job in MiB: the GPU's free memory on CUDA (``cudaMemGetInfo``), else the
    host's ``MemAvailable`` (proc(5)); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**20
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class SliceGate:
    """The job's side of the pipe (see the module docstring). ``due(step)`` is True when the current slice
    has ended (at step 0: before the first step, so the launcher decides when a job starts training)."""

    def __init__(self, connection: Any):
        self.connection = connection
        self.next_wait = 0  # the step at which the current slice ends

    def due(self, step: int) -> bool:
        """Whether the current slice has ended once ``step`` optimizer steps are done (one int comparison)."""
        return step >= self.next_wait

    def wait(self, step: int, train_time_s: float, global_batch: int, env: distributed.Env) -> bool:
        """Report the slice that ended at ``step`` and block until the launcher's next command. Returns True
        to go on (the next slice's steps are set), False when the job should finish.

        Raises:
            EOFError: the launcher is gone (its end of the pipe closed): the job stops instead of training on
                alone.
        """
        self.connection.send(
            {
                "step": step,
                "train_time_s": train_time_s,
                "global_batch": global_batch,
                "footprint_mb": footprint_mb(env.device),
                "available_mb": available_mb(env.device),
            }
        )
        steps = int(self.connection.recv()["steps"])
        if env.distributed:
            steps = distributed.broadcast_object(steps, env)
        self.next_wait = step + steps
        return steps > 0
