"""Interleaved comparisons under torchrun: one conductor per rank; rank 0's decides, the others mirror it.

Rank 0's conductor broadcasts each op over the conductors' gloo group before acting on its own process of the job;
the others mirror it (why: docs/ablation.md, "DDP jobs under torchrun"). The ops:

- ``("spawn", job, port)``: fork this rank's process of the job with ``MASTER_PORT=port`` (the job's own
  rendezvous, hosted by its rank 0, not torchrun's agent store), then wait for its first message;
- ``("slice", job, steps)``: let it train ``steps`` steps and wait for its report;
- ``("finish", job)``: tell it to finish (final evaluation, ``summary.json`` from its rank 0) and wait for it;
- ``("end",)``: the sweep is over; finish what is still resident.

A job's figures are its rank 0's; inside each job, ``runner.engine.slice_gate`` broadcasts rank 0's command.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from runner import launch

#: The op that ends a follower's loop.
END = ("end",)
#: The op that kills a follower's jobs and ends its loop (Ctrl-C on rank 0).
KILL = ("kill", None)


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick for port 0): a job's own rendezvous port."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def job_env(port: int) -> dict[str, str]:
    """The environment that makes a forked job process rendezvous with its own ranks at ``port`` instead of
    joining torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``: its rank 0 hosts the store), and keeps
    its rank 0 from noting its folder for restarted workers (``TORCHELASTIC_RUN_ID``: a sweep's job is not the
    torchrun job, ``runner.launch.elastic_pointer``)."""
    return {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": ""}


@dataclass
class Ranks:
    """This conductor's place among the conductors of one sweep under torchrun. ``per_node``: processes of
    one job on this node (``LOCAL_WORLD_SIZE``), which multiplies a job's memory footprint at admission."""

    rank: int
    world_size: int
    per_node: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, timeout_s: float) -> "Ranks | None":
        """None with one process; under torchrun, join (or reuse) the default process group of the ranks
        (gloo, ``timeout_s`` per collective: a follower waits that long for rank 0's next op) and return
        this rank's place."""
        import os

        import torch.distributed as dist

        from runner import distributed

        layout = launch.discover()
        if layout.world_size == 1:
            return None
        if not dist.is_initialized():
            timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(
                "gloo",
                store=distributed.attempt_store(layout, timeout),
                rank=layout.rank,
                world_size=layout.world_size,
                timeout=timeout,
            )
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size // max(1, layout.nodes)))
        return cls(rank=layout.rank, world_size=layout.world_size, per_node=max(1, per_node))

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (what the leader measured or decided)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def tell(self, op: tuple) -> None:
        """Rank 0: send ``op`` to every follower. A no-op on the followers (they act on ops, never send)."""
        if self.leader:
            self.share(op)

    def hear(self) -> tuple:
        """A follower: wait for rank 0's next op."""
        return tuple(self.share(None))


def follow(conductor: Any) -> None:
    """A follower's loop (rank > 0): apply rank 0's ops to this rank's processes of the jobs until ``END``,
    then finish whatever is still resident. Writes nothing: the sweep's record is rank 0's."""
    ranks = conductor.ranks
    while (op := ranks.hear()) != END:
        if op == KILL:
            conductor.kill()
            return
        kind, name, *args = op
        job = conductor.jobs[name]
        if kind == "spawn":
            job.spawn(args[0])
        elif kind == "slice" and job.resident:
            job.slice(args[0])
        elif kind == "finish":
            job.finish()
    for job in conductor.jobs.values():
        job.finish()
