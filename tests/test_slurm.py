"""SLURM end to end on a real cluster: ``sbatch scripts/multinode.sh``, ``srun python -m runner``, submitit sweeps.

Needs a SLURM cluster with at least two idle nodes answering ``sinfo`` (CI: ``../shared/tools/local-slurm.sh
up``, two slurmd daemons on this machine, brought up by ``.ci/run``); skipped otherwise. Every job gets a
unique name and is cancelled if the test runs out of time, so a pending job never outlives its test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import TINY, job_dirs, read_summary
from runner import REPO_ROOT


def _idle_nodes() -> int:
    if shutil.which("sinfo") is None:
        return -1
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return 0
    return (
        sum(state.strip().rstrip("*") in ("idle", "mixed") for state in out.stdout.split())
        if out.returncode == 0
        else 0
    )


_NODES = _idle_nodes()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm"),  # one pytest-xdist worker runs them in turn: each job takes both nodes
    pytest.mark.waits,  # sbatch, the scheduler's polls and requeues: most of the wall time waits
    pytest.mark.skipif(_NODES < 0, reason="no SLURM here (sinfo is not on PATH)"),
    pytest.mark.skipif(0 <= _NODES < 2, reason="the SLURM cluster does not answer or has fewer than 2 idle nodes"),
]


def slurm_env(root: Path) -> dict[str, str]:
    """What sbatch/srun pass on to the job: this interpreter's scripts (torchrun, python) first on PATH, and a
    TMPDIR of the test's own (Python falls back to /tmp on a node where it does not exist)."""
    (root / "tmp").mkdir(exist_ok=True)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "1",
        "TMPDIR": str(root / "tmp"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def run_job(cmd: list[str], root: Path, name: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``root``; on timeout cancel every job called ``name`` and fail with the logs."""
    try:
        return subprocess.run(cmd, cwd=root, env=slurm_env(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], timeout=30)
        logs = "\n".join(p.read_text()[-3000:] for p in root.glob("slurm-*.out"))
        pytest.fail(f"{' '.join(cmd[:3])} ... did not finish within {timeout:.0f} s (jobs cancelled)\n{logs}")


def test_srun_python_finds_its_rank_from_slurm(tmp_path):
    """No torchrun: ``srun -N2 -n2 python -m runner`` ranks come from SLURM_PROCID, the master from the node list."""
    name = f"runner-test-{uuid.uuid4().hex[:8]}"
    proc = run_job(
        [
            "srun",
            "--nodes=2",
            "--ntasks=2",
            f"--job-name={name}",
            "--kill-on-bad-exit=1",
            sys.executable,
            "-m",
            "runner",
            "distributed=ddp",
            *TINY,
            "trainer.max_steps=20",
        ],
        tmp_path,
        name,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    dirs = job_dirs(tmp_path)
    assert len(dirs) == 1, dirs
    summary = read_summary(dirs[0])
    assert summary["world_size"] == 2 and summary["nodes"] == 2
    assert summary["parameters"]["identical_across_ranks"] is True


def test_signalled_job_checkpoints_requeues_and_resumes_to_the_same_parameters(tmp_path):
    """``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@<s>`` does before a time limit): multinode.sh
    forwards the signal, the ranks checkpoint at the next log step, rank 0 requeues the job, and the requeued
    job (same id, same folder ``outputs/slurm-<id>``) resumes and ends where an uninterrupted run ends."""
    import json
    import time

    import torch
    from safetensors.torch import load_file

    script = str(REPO_ROOT / "scripts" / "multinode.sh")
    job = [*TINY, "trainer.max_steps=300", "trainer.log_every=1"]
    name = f"runner-test-{uuid.uuid4().hex[:8]}"
    straight = run_job(
        ["sbatch", "--wait", f"--job-name={name}", script, *job, "hydra.run.dir=outputs/straight"],
        tmp_path,
        name,
        timeout=240,
    )
    straight_logs = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert straight.returncode == 0, straight.stderr + straight_logs[-5000:]
    # sbatch scripts/multinode.sh: one job folder for both nodes' ranks, identical replicas
    assert [d.name for d in job_dirs(tmp_path)] == ["straight"] and "2 node(s) x 1 process(es)" in straight_logs
    first = read_summary(tmp_path / "outputs" / "straight")
    assert first["world_size"] == 2 and first["nodes"] == 2 and first["parameters"]["identical_across_ranks"] is True
    submitted = run_job(["sbatch", "--parsable", f"--job-name={name}", script, *job], tmp_path, name, timeout=60)
    job_id = submitted.stdout.strip().split(";")[0]
    folder = tmp_path / "outputs" / f"slurm-{job_id}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metrics = folder / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
                break
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        while time.monotonic() < deadline + 180 and not (folder / "summary.json").exists():
            time.sleep(1)
    finally:
        subprocess.run(["scancel", "--name", name], timeout=30)
    summary = read_summary(folder)
    assert summary["restarts"] == 1 and summary["steps"] == 300 and summary["world_size"] == 2
    steps = [
        json.loads(line)["step"]
        for line in (folder / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert steps == list(range(1, 301))  # every step once: the requeued job continued, it did not start over
    a = load_file(str(tmp_path / "outputs" / "straight" / "model.safetensors"))
    b = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_submitit_sweep_job_that_times_out_checkpoints_requeues_and_resumes(tmp_path):
    """A submitit sweep job gets submitit's time-limit signal (``scancel --signal=USR2``: what
    ``hydra.launcher.signal_delay_s`` makes SLURM send, sent now the way submitit's own ``_interrupt(timeout=True)``
    sends it). runner checkpoints at the next step boundary and hands the signal to submitit, which counts a
    timeout and requeues the job; the requeued job resumes in the same job folder, and the sweep ends with the
    parameters of an uninterrupted run."""
    import json
    import time

    import torch
    from safetensors.torch import load_file

    job = [*TINY, "trainer.max_steps=300", "trainer.log_every=1"]
    straight = run_job(
        [sys.executable, "-m", "runner", *job, "hydra.run.dir=outputs/straight"], tmp_path, "-", timeout=240
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    name = f"runner-test-{uuid.uuid4().hex[:8]}"
    sweep = tmp_path / "outputs" / "sweep"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            "hydra/launcher=submitit_slurm",
            f"hydra.launcher.name={name}",
            "hydra.launcher.timeout_min=5",
            "hydra.launcher.cpus_per_task=1",
            f"hydra.sweep.dir={sweep}",
            *job,
            "trainer.seed=0",
        ],
        cwd=tmp_path,
        env=slurm_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = sweep / "0"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            metrics = folder / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
                break
            time.sleep(0.5)
        job_id = subprocess.run(
            ["squeue", "-h", f"--name={name}", "-o", "%i"], capture_output=True, text=True, timeout=30
        ).stdout.split()[0]
        subprocess.run(["scancel", job_id, "--signal=USR2"], check=True, timeout=30)
        out, err = launcher.communicate(timeout=300)
    finally:
        subprocess.run(["scancel", "--name", name], timeout=30)
        launcher.kill()
    assert launcher.returncode == 0, out[-2000:] + err[-4000:]
    assert len(list(sweep.rglob(".submitit/*/*_result.pkl"))) == 1  # submitit ran it, not a local launcher
    logs = "\n".join(p.read_text() for p in sweep.rglob(".submitit/*/*_log.err"))
    assert "this job is timed-out" in logs and "DUE TO JOB REQUEUE" in logs, logs[-3000:]
    summary = read_summary(folder)
    assert summary["restarts"] == 1 and summary["steps"] == 300
    steps = [
        json.loads(line)["step"]
        for line in (folder / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert steps == list(range(1, 301))  # the requeued job continued from its checkpoint, it did not start over
    a = load_file(str(tmp_path / "outputs" / "straight" / "model.safetensors"))
    b = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_search_s_n_jobs_trials_run_at_the_same_time_as_slurm_jobs_without_a_barrier(tmp_path):
    """``hydra.sweeper.n_jobs=2`` with ``hydra/launcher=submitit_slurm``: each trial is a SLURM job of its own, two
    run at the same time on the two nodes (their job folders' lives overlap), and the third is submitted as soon
    as the short one ends, while the long one still runs (a job array of two held its slot until the long one
    ended)."""
    pytest.importorskip("optuna")
    name = f"runner-test-{uuid.uuid4().hex[:8]}"
    sweep = tmp_path / "outputs" / "search"
    job = [o for o in TINY if not o.startswith("trainer.max_steps=")]  # the searched key
    proc = run_job(
        [
            sys.executable,
            "-m",
            "runner",
            "-m",
            "hydra/sweeper=search",
            "hydra.sweeper.n_trials=3",
            "trainer.doctor=false",
            *job,
            "+hydra.sweeper.params={trainer.max_steps: 'choice(4000, 3, 4)'}",
            "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler",
            "hydra.sweeper.sampler.seed=5",
            "hydra/launcher=submitit_slurm",
            f"hydra.launcher.name={name}",
            "hydra.launcher.timeout_min=5",
            "hydra.launcher.cpus_per_task=1",
            "optimized_metric=eval_loss",
            "hydra.sweeper.verify_seeds=0",
            "hydra.sweeper.n_jobs=2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
        name,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lives = {
        n: (
            (sweep / str(n) / ".hydra" / "config.yaml").stat().st_mtime,
            (sweep / str(n) / "summary.json").stat().st_mtime,
        )
        for n in range(3)
    }
    steps = {n: read_summary(sweep / str(n))["steps"] for n in range(3)}
    assert steps[0] == 4000 and steps[1] < 10, steps  # the seed asks the long trial first
    assert lives[0][0] < lives[1][1] and lives[1][0] < lives[0][1], lives  # each started before the other ended
    assert lives[1][1] <= lives[2][0] < lives[0][1], lives  # the third ran in the slot the short one freed
    assert len({p.parent.name for p in sweep.rglob(".submitit/*/*_result.pkl")}) == 3
