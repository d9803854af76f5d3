"""Who am I, before Hydra and torch start: the process layout from torchrun or ``srun``.

Imports neither torch nor Hydra (a fast ``--help``). Why: docs/scaling.md, "What runner does for you".

Sources: torchrun's worker environment (https://pytorch.org/docs/stable/elastic/run.html#environment-variables),
SLURM's task environment (https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import re
import shutil
import signal
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from runner.errors import EXIT_PREEMPTED, ConfigError
from runner.files import private_dir


@dataclass(frozen=True)
class Layout:
    """The process layout: global ``rank``, ``local_rank`` (the GPU index), ``nodes``, ``launcher`` (``"single"``,
    ``"torchrun"``, ``"srun"``); ``master_addr``/``master_port``: where rank 0 listens (srun only)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    nodes: int = 1
    launcher: str = "single"
    master_addr: str | None = None
    master_port: int | None = None


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError as e:
        raise ConfigError(f"environment variable {key}={env[key]!r} is not an integer") from e


def discover(env: Mapping[str, str] | None = None) -> Layout:
    """Read the layout from the environment (``os.environ`` by default): torchrun's ``RANK``/``WORLD_SIZE``/...,
    else an srun step's ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``/... (rank 0 on the node list's first host, port
    ``MASTER_PORT`` or ``master_port_for_job``), else one process (an sbatch batch script included).

    Raises:
        ConfigError: a launcher variable that is not an integer, or a rank outside the world.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        if "GROUP_WORLD_SIZE" in env:
            nodes = _int(env, "GROUP_WORLD_SIZE")
        elif "LOCAL_WORLD_SIZE" in env:
            nodes = max(1, world // max(1, _int(env, "LOCAL_WORLD_SIZE")))
        else:
            nodes = 1
        layout = Layout(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=world,
            nodes=nodes,
            launcher="torchrun",
        )
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env and _int(env, "SLURM_STEP_NUM_TASKS") > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else master_port_for_job(env.get("SLURM_JOB_ID", "0"))
        layout = Layout(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=_int(env, "SLURM_STEP_NUM_TASKS"),
            nodes=_int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else 1,
            launcher="srun",
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            master_port=port,
        )
    else:
        return Layout()
    if not 0 <= layout.rank < layout.world_size:
        raise ConfigError(
            f"rank {layout.rank} is outside the world of {layout.world_size} processes "
            f"({layout.launcher} environment); check the launcher's variables"
        )
    return layout


def master_port_for_job(job_id: str) -> int:
    """A rendezvous port every task of a SLURM job derives alike: 20000 + job id mod 20000."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits) % 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names: ``"n[1-3,7],gpu-a[08-09]"`` -> ``n1 n2 n3 n7 gpu-a08 gpu-a09``.

    The syntax ``scontrol show hostnames`` expands (one bracket group per name, zero padding kept).

    Raises:
        ConfigError: unbalanced brackets or a malformed range.
    """
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise ConfigError(f"cannot read the SLURM node list {nodelist!r} (at {part!r})")
            names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigError(f"cannot read the SLURM node list {nodelist!r} (range {item!r})")
            width = len(lo)
            names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi or lo) + 1)]
    return names


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` when available, else ``expand_nodelist``."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ConfigError(f"the SLURM node list {nodelist!r} names no host")
    return hosts[0]


#: this process's scratch job folder (ranks > 0 under ``python -m runner``), removed once rank 0's is known
SCRATCH: str | None = None


def drop_scratch(job_dir: object) -> None:
    """Remove ``job_dir`` if it is this rank's scratch folder (once rank 0's folder is known)."""
    if SCRATCH is not None and str(job_dir) == SCRATCH:
        shutil.rmtree(SCRATCH, ignore_errors=True)


def elastic_pointer(env: Mapping[str, str] | None = None) -> Path | None:
    """Where rank 0 of a torchrun job notes its job folder for restarted workers (a file keyed by
    ``TORCHELASTIC_RUN_ID`` in a temp folder of this user's own: another user's file there would choose the folder a
    restart resumes in), or None outside torchrun.

    Raises:
        ConfigError: that folder is not private (``runner.files.private_dir``)."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id or "RANK" not in env:
        return None
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
    try:
        return private_dir("runner-elastic") / f"{safe}.jobdir"
    except OSError as e:
        raise ConfigError(str(e)) from e


def forget_elastic_pointer(env: Mapping[str, str] | None = None) -> None:
    """Remove the ``elastic_pointer`` file once the job has finished (rank 0); a no-op outside torchrun."""
    pointer = elastic_pointer(env)
    if pointer is not None:
        pointer.unlink(missing_ok=True)


def restart_overrides(layout: Layout, env: Mapping[str, str] | None = None) -> list[str]:
    """``hydra.run.dir=<the first attempt's job folder>`` for rank 0 of a restarted torchrun worker group
    (``TORCHELASTIC_RESTART_COUNT`` > 0), so it resumes there; else ``[]`` (docs/checkpointing.md, "Elastic restarts").
    """
    env = os.environ if env is None else env
    pointer = elastic_pointer(env)
    if layout.rank != 0 or pointer is None or int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return []
    if not pointer.is_file():
        return []
    return [f"hydra.run.dir={pointer.read_text().strip()}"]


def hydra_overrides(layout: Layout) -> list[str]:
    """Overrides that keep a rank other than 0 out of ``outputs/`` (Hydra issue #2070): a scratch folder in the temp
    directory, removed at exit, and no ``.hydra/``. Returns ``[]`` on rank 0.
    """
    global SCRATCH
    if layout.rank == 0:
        return []
    scratch = tempfile.mkdtemp(prefix=f"runner-rank{layout.rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # if the rank fails before it learns rank 0's
    SCRATCH = scratch
    return [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]


def prepare_process(argv: list[str], env: Mapping[str, str] | None = None) -> Layout:
    """Get this process ready before Hydra starts; called by ``python -m runner`` only.

    More than one process: ``HYDRA_FULL_ERROR=1``, ``faulthandler``, ``hydra_overrides`` (docs/scaling.md, "What
    runner does for you"; https://docs.python.org/3/library/faulthandler.html). Silences Hydra's submitit_slurm note.
    """
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated against ConfigStore")
    argv[1:] = options_first(argv[1:])
    check_launcher(argv)
    layout = discover(env)
    if layout.world_size > 1:
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
        faulthandler.enable(all_threads=True)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        argv += hydra_overrides(layout)
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            argv += restart_overrides(layout)
    return layout


#: Hydra's command-line options that take a value (the next argument)
VALUE_OPTIONS = (
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--shell-completion",
    "-sc",
    "--experimental-rerun",
)


def options_first(args: list[str]) -> list[str]:
    """``args`` with Hydra's options (and the values of ``VALUE_OPTIONS``) before the overrides, which argparse
    takes in one run."""
    options, overrides, i = [], [], 0
    while i < len(args):
        takes_value = args[i] in VALUE_OPTIONS and i + 1 < len(args)
        (options if args[i].startswith("-") else overrides).extend(args[i : i + 1 + takes_value])
        i += 1 + takes_value
    return options + overrides


def check_launcher(argv: list[str]) -> None:
    """Refuse ``hydra/launcher=submitit_slurm`` on a machine without SLURM's commands, before Hydra starts.

    Raises:
        ConfigError: naming the missing command and the fix.
    """
    if not any(a.split("=", 1) == ["hydra/launcher", "submitit_slurm"] for a in argv):
        return
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"hydra/launcher=submitit_slurm submits the sweep's jobs to SLURM, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH here; run it "
            f"on a SLURM login node, or drop hydra/launcher=submitit_slurm to run the sweep on this "
            f"machine"
        )


def record_if_elastic(fn: Callable) -> Callable:
    """``torch.distributed.elastic.multiprocessing.errors.record`` under torchrun, else ``fn``
    (https://pytorch.org/docs/stable/elastic/errors.html)."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def torchrun(argv: list[str]) -> int:
    """``torchrun`` (``torch.distributed.run``) with ``argv``, returning runner's exit status for a preemption.

    75 (``EXIT_PREEMPTED``) when the failed ranks exited with it or by the agent's signal (``runner.torchrun``).

    Raises:
        ChildFailedError: a worker failed other than by a preemption (torchrun's own report and status 1).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if EXIT_PREEMPTED in codes and all(c == EXIT_PREEMPTED or c < 0 for c in codes):
            print(
                f"torchrun: the workers stopped for a preemption (exit status {EXIT_PREEMPTED}, checkpoint written)",
                flush=True,
            )
            return EXIT_PREEMPTED
        raise
    return 0
