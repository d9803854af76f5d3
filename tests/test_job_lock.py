"""One run per job folder (runner/engine/jobdir.py): a second run into a running job's folder is refused with the holder
named and writes nothing there, ``.hydra/`` included; a lock left by a killed run never blocks the rerun that
resumes it; every train() call locks its folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, compose_cfg, run_cli
from runner import REPO_ROOT
from runner.engine import jobdir
from runner.errors import ConfigError


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """``python -m runner <args>`` in the background, as conftest.run_cli runs it."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        "WANDB_MODE": "offline",
        "HYDRA_FULL_ERROR": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    """Poll ``condition`` until it holds (a generous bound, not a timing assertion); fail if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the first run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.2)


def test_a_second_run_into_a_running_jobs_folder_is_refused_and_writes_nothing(tmp_path):
    folder = tmp_path / "job"
    common = [*TINY, "trainer.doctor=false", f"hydra.run.dir={folder}"]
    first = start(*common, "trainer.max_steps=100000", "trainer.log_every=50", cwd=tmp_path)
    try:
        wait_for(lambda: (folder / "metrics.jsonl").is_file(), first, "training")  # .hydra/ written, loop running
        hydra_files = {p.name: p.read_bytes() for p in (folder / ".hydra").iterdir()}
        lock = (folder / jobdir.LOCK_FILE).read_text()
        assert json.loads(lock)["pid"] == first.pid
        second = run_cli(*common, "trainer.max_steps=4", "optimizer.lr=0.05", cwd=tmp_path)  # another config
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert lines[0].startswith(f"error: the job folder {folder} is in use by another run: pid {first.pid} on ")
        assert "started 20" in lines[0] and "python -m runner" in lines[0]
        assert f"(drop hydra.run.dir={folder} for a new one)" in lines[0]  # what the user typed
        assert first.poll() is None  # the first run was running all along
        assert {p.name: p.read_bytes() for p in (folder / ".hydra").iterdir()} == hydra_files  # lr 0.01 still
        assert (folder / jobdir.LOCK_FILE).read_text() == lock
    finally:
        first.kill()
        first.communicate()


@pytest.mark.cli
def test_a_lock_left_by_a_killed_run_does_not_block_the_rerun_that_resumes_it(tmp_path):
    """SIGKILL skips every clean-up; the kernel drops the lock with the process. Its DataLoader workers (forked,
    so holding a copy of the lock's descriptor) may outlive it for seconds: they close their copy when forked."""
    folder = tmp_path / "job"
    common = [
        *TINY,
        "trainer.doctor=false",
        f"hydra.run.dir={folder}",
        "checkpoint.every_steps=2",
        "dataloader.num_workers=2",
        "dataloader.persistent_workers=true",
    ]
    first = start(*common, "trainer.max_steps=100000", cwd=tmp_path)
    try:
        wait_for(lambda: any((folder / "checkpoints").glob("step_*")), first, "a checkpoint")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    again = run_cli(*common, "trainer.max_steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout


def test_train_refuses_a_folder_another_process_holds(tmp_path):
    """Every train() call locks its folder (a multirun's jobs, forked ablation and doctor runs): here another
    process holds it, and the run stops before building anything."""
    folder = tmp_path / "job"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from runner.engine import jobdir; jobdir.acquire({str(folder)!r}); print('held', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        from runner.engine.train import train

        with pytest.raises(ConfigError, match=rf"the job folder {folder} is in use by another run: pid {holder.pid} "):
            train(compose_cfg(), job_dir=folder)
        assert sorted(p.name for p in folder.iterdir()) == [jobdir.LOCK_FILE]
    finally:
        holder.kill()
        holder.communicate()
    assert jobdir.acquire(folder) and not jobdir.acquire(folder)  # free now; held here, taken once
    jobdir.release(folder)
