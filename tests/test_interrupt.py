"""Ctrl-C is a preemption: real ``python -m runner`` processes sent a real SIGINT.

The first Ctrl-C checkpoints at the step boundary (or, during an evaluation, at the next evaluation batch) and
exits with ``EXIT_PREEMPTED``, printing the exact command that resumes (the job folder named); running that
command ends exactly where the uninterrupted run ends, and so does the same command without it: it finds the
interrupted run of its config among the newest run folders and continues it (runner/engine/jobdir.py
``continue_interrupted``). A second Ctrl-C exits at once without a checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, job_dirs, live_metrics, run_cli
from runner import checkpoint as ck
from runner.checkpoint import resume
from runner.checkpoint.preempt import resume_command
from runner.engine import jobdir
from runner.errors import EXIT_PREEMPTED
from test_resume import JOB, _descendants, env, rows, run

STEPS = ["trainer.max_steps=120", "checkpoint.every_steps=null"]
#: a long evaluation (250 batches) after step 5, so a signal sent at step 5 lands inside it
LONG_EVAL = [
    "data.eval_size=4000",
    "trainer.eval_max_batches=null",
    "trainer.eval_every=5",
    "trainer.max_steps=10",
    "checkpoint.every_steps=null",
]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_row(proc: subprocess.Popen, cwd: Path, step: int, timeout: float = 240) -> Path:
    """The job folder under ``cwd/outputs`` once its metrics.jsonl has a row for ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        found = live_metrics(cwd)
        if found and f'"step": {step},' in found[0].read_text():
            return found[0].parent
        time.sleep(0.02)
    raise AssertionError(f"no row for step {step} within {timeout} s")


def resume_hint(out: str) -> list[str]:
    """The command of the ``resume with:`` line, with ``python`` as this interpreter."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith("resume with: ")]
    cmd = shlex.split(line.removeprefix("resume with: "))
    assert cmd[:3] == ["python", "-m", "runner"], line
    return [sys.executable, *cmd[1:]]


def assert_same_run(straight: Path, resumed: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rows(straight) == rows(resumed)  # the same losses, every step logged once


@pytest.fixture(scope="module")
def straight(tmp_path_factory, worker_id) -> Path:
    """The job of the two Ctrl-C tests below, never stopped: run once per session, pytest-xdist's workers share it
    through the session's base folder (the first runs it under a file lock, as tests/test_evaluate_export.py's job)."""
    from filelock import FileLock

    if worker_id == "master":
        root = tmp_path_factory.mktemp("straight")
    else:
        root = tmp_path_factory.getbasetemp().parent / "ctrl_c_straight"
    folder = root / "job"
    with FileLock(f"{root}.lock"):
        if not (folder / "summary.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            run([sys.executable, "-m", "runner", *JOB, *STEPS, f"hydra.run.dir={folder}"], root)
    return folder


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_ctrl_c_checkpoints_and_the_printed_command_resumes_exactly(tmp_path, straight):
    work = tmp_path / "work"
    work.mkdir()
    proc = start([*JOB, *STEPS], work)  # no hydra.run.dir: a timestamped folder, as a user would run it
    folder = wait_for_row(proc, work, 5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    (path,) = ck.complete_checkpoints(folder / "checkpoints")
    lines = [ln for ln in out.splitlines() if ln.startswith(("stopped at step", "resume with:"))]
    assert len(lines) == 2 and f"for SIGINT: checkpoint {path}" in lines[0], out
    assert f"hydra.run.dir={folder.resolve()}" in lines[1]
    assert "Traceback" not in err
    resumed = run(resume_hint(out), work)  # the printed command, from the same folder
    assert f"resumed from {path}" in resumed.stdout
    assert len(list((work / "outputs").rglob("metrics.jsonl"))) == 1  # no second job folder
    assert_same_run(straight, folder)


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_ctrl_c_then_the_same_command_continues_that_run_exactly(tmp_path, straight):
    """Issue 38: after Ctrl-C, the command as first typed (no hydra.run.dir) continues the interrupted run in its
    folder from its checkpoint, says so in one line, and ends bit-identical to a run that was never stopped."""
    work = tmp_path / "work"
    work.mkdir()
    proc = start([*JOB, *STEPS], work)
    folder = wait_for_row(proc, work, 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    (path,) = ck.complete_checkpoints(folder / "checkpoints")
    step = ck.read_meta(path)["step"]
    again = run([sys.executable, "-m", "runner", *JOB, *STEPS], work)  # the same command
    assert (
        f"resuming the interrupted run in {folder.relative_to(work)} (step {step}); checkpoint.resume=never "
        f"starts fresh"
    ) in again.stdout.splitlines()
    assert f"resumed from {path}" in again.stdout
    assert len(list((work / "outputs").rglob("metrics.jsonl"))) == 1  # no second job folder
    assert_same_run(straight, folder)


@pytest.mark.cli
def test_the_same_command_continues_an_unfinished_run_and_resume_never_starts_fresh(tmp_path):
    """Through the CLI: a run whose folder holds a checkpoint and no summary (here: removed, as a run stopped
    after its last checkpoint leaves it) is continued by the same command in that folder, with the line saying
    so; checkpoint.resume=never starts a new folder."""
    job = [*TINY, "trainer.doctor=false"]
    first = run_cli(*job, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (folder,) = job_dirs(tmp_path)
    (folder / "summary.json").unlink()
    again = run_cli(*job, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[0] == (
        f"resuming the interrupted run in {folder.relative_to(tmp_path)} (step 4); checkpoint.resume=never starts fresh"
    )
    assert job_dirs(tmp_path) == [folder] and (folder / "summary.json").is_file()
    (folder / "summary.json").unlink()
    time.sleep(1.1)  # a new folder gets a new name (hydra.run.dir's pattern has seconds)
    fresh = run_cli(*job, "checkpoint.resume=never", cwd=tmp_path)  # (another config: the test below)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resuming" not in fresh.stdout and len(job_dirs(tmp_path)) == 2


def fake_run(folder: Path, config: dict, step: int = 5, world_size: int = 1, finished: bool = False) -> Path:
    """A job folder as an interrupted run leaves it: one complete checkpoint (runner.json + DCP's .metadata)."""
    path = folder / "checkpoints" / ck.step_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / ck.META_FILE).write_text(json.dumps({"step": step, "config": config, "world_size": world_size}))
    if finished:
        (folder / "summary.json").write_text("{}")
    return folder


CONFIG = {"optimizer": {"lr": 0.01}, "trainer": {"max_steps": 40, "max_epochs": 1, "log_every": 50}}


def test_only_an_unfinished_free_run_of_the_same_config_and_world_is_continued(tmp_path):
    changed = {**CONFIG, "optimizer": {"lr": 0.1}}
    longer = {**CONFIG, "trainer": {**CONFIG["trainer"], "max_steps": 80}}
    logs_more = {**CONFIG, "trainer": {**CONFIG["trainer"], "log_every": 1}}  # bookkeeping may change (MAY_CHANGE)
    folders = [
        fake_run(tmp_path / "finished", CONFIG, finished=True),
        fake_run(tmp_path / "lr", changed),
        fake_run(tmp_path / "longer", longer),
        fake_run(tmp_path / "ddp", CONFIG, world_size=2),
        fake_run(tmp_path / "live", CONFIG),
        fake_run(tmp_path / "mine", logs_more, step=7),
        fake_run(tmp_path / "older", CONFIG),
    ]
    live = os.open(tmp_path / "live" / jobdir.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(live, fcntl.LOCK_EX)  # a run still training holds its folder: it is not interrupted
    try:
        found = resume.interrupted_run(folders, CONFIG, 1, jobdir.claim_if_free)
        assert found == (tmp_path / "mine", 7)
        assert resume.interrupted_run(folders[:5], CONFIG, 1, jobdir.claim_if_free) is None
    finally:
        os.close(live)
        jobdir.release(tmp_path / "mine")


def test_the_newest_run_folders_of_the_pattern_are_looked_at_and_no_more(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = [
        "outputs/2026-11-20/09-00-00",
        "outputs/2026-11-24/10-00-00",
        "outputs/2026-11-25/10-00-00",
        "outputs/2026-11-25/11-00-00",
        "outputs/2026-11-26/08-00-00",
        "outputs/2026-11-26/09-00-00",
    ]
    others = ["outputs/multirun/2026-11-26", "outputs/2026-11-26/notes", "outputs/2026-11-26/a-b-c"]  # not its names
    for rel in runs + others:
        Path(rel).mkdir(parents=True)
    for i, rel in enumerate(
        runs
        + others
        + ["outputs/2026-11-20", "outputs/2026-11-24", "outputs/2026-11-25", "outputs/2026-11-26", "outputs/multirun"]
    ):
        os.utime(rel, (1_000_000 + i, 1_000_000 + i))  # modified in this order, the newest last
    pattern = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    assert jobdir.recent_run_folders(pattern, parents=2, runs=3) == [
        Path("outputs/2026-11-26/09-00-00"),
        Path("outputs/2026-11-26/08-00-00"),
        Path("outputs/2026-11-25/11-00-00"),
    ]
    assert len(jobdir.recent_run_folders(pattern)) == 5  # the three newest dates of four, all their run folders
    assert jobdir.recent_run_folders("outputs/fixed") == []  # one folder: checkpoint.resume=auto's already
    assert jobdir.recent_run_folders("outputs/${oc.env:X,${now:%H}}") == []  # nested: not read here


@pytest.mark.slow
def test_ctrl_c_during_evaluation_stops_at_a_batch_and_the_resume_redoes_it(tmp_path):
    run([sys.executable, "-m", "runner", *JOB, *LONG_EVAL, f"hydra.run.dir={tmp_path / 'straight'}"], tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    proc = start([*JOB, *LONG_EVAL], work)
    folder = wait_for_row(proc, work, 5)  # the training row of step 5 is logged, then its evaluation starts
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    (path,) = ck.complete_checkpoints(folder / "checkpoints")
    assert ck.read_meta(path)["step"] == 5, out
    assert [r for r in rows(folder) if r[2] is not None] == []  # the cut evaluation logged nothing
    run(resume_hint(out), work)
    assert_same_run(tmp_path / "straight", folder)  # the step-5 evaluation row is there once


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker processes through /proc")
def test_a_signal_to_one_rank_during_evaluation_stops_every_rank_at_one_batch(tmp_path):
    """Under torchrun the ranks agree before each evaluation batch: SIGTERM to rank 1 alone mid-evaluation stops
    both at the same batch (no hang in a collective), both checkpoint step 5 and exit 75 (``runner.torchrun``),
    the cut evaluation logs nothing, and the same command resumes and ends where a straight run ends."""
    job = [*JOB, *LONG_EVAL, "distributed=ddp", "dataloader.batch_size=8"]
    launcher = [sys.executable, "-m", "runner.torchrun", "--standalone", "--nproc-per-node=2", "-m", "runner"]
    run([*launcher, *job, f"hydra.run.dir={tmp_path / 'straight'}"], tmp_path)
    folder = tmp_path / "job"
    proc = subprocess.Popen(
        [*launcher, *job, f"hydra.run.dir={folder}"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and '"step": 5,' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    time.sleep(0.3)  # inside the step-5 evaluation (125 batches per rank)
    workers = {
        pid: Path(f"/proc/{pid}/environ").read_bytes()
        for pid in _descendants(proc.pid)
        if " -m runner " in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") + " "
    }
    (rank1,) = [pid for pid, environ in workers.items() if b"\0RANK=1\0" in b"\0" + environ]
    os.kill(rank1, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    (path,) = ck.complete_checkpoints(folder / "checkpoints")
    assert ck.read_meta(path)["step"] == 5, out[-3000:]
    assert [r for r in rows(folder) if r[2] is not None] == []  # the cut evaluation logged nothing
    resumed = run([*launcher, *job, f"hydra.run.dir={folder}"], tmp_path)
    assert f"resumed from {path}" in resumed.stdout
    assert rows(tmp_path / "straight") == rows(folder)  # the step-5 evaluation row is there once, same figures


SLOW_DATA = """
import time

import pytest
import torch
from torch.utils.data import Dataset


class Slow(Dataset):
    classes = ["a", "b", "c"]

    def __init__(self, n):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
        self.y = torch.arange(n) % 3

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(0.05)  # a step takes >= 0.8 s: the second Ctrl-C always lands before the step boundary
        return self.x[i], int(self.y[i])


def slow():
    return Slow(256), Slow(32)
"""


def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(tmp_path):
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    job = [
        "data=custom",
        "data._target_=slow_data.slow",
        "model=mlp",
        "dataloader.batch_size=16",
        "trainer.max_steps=40",
        "trainer.warmup_steps=1",
        "trainer.log_every=1",
        "trainer.eval_max_batches=1",
        "trainer.progress=off",
        "trainer.device=cpu",
        "logger=none",
        "checkpoint.every_steps=null",
    ]
    proc = start(job, tmp_path)
    folder = wait_for_row(proc, tmp_path, 3)
    proc.send_signal(signal.SIGINT)  # the first asks for a checkpoint at the next step boundary, >= 0.8 s away
    time.sleep(0.1)  # two signals at once would arrive as one
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "error: interrupted: stopped at once" in err and f"hydra.run.dir={folder.resolve()}" in err
    assert "Traceback" not in err
    assert not (folder / "summary.json").exists()
    assert not list(folder.glob("checkpoints/step_*"))


def test_the_resume_command_names_the_folder():
    argv = ["model=resnet18", "hydra.run.dir=outputs/x", "data.shape=[3,16,16]"]
    assert (
        resume_command(argv, Path("/j/a b"))
        == "python -m runner model=resnet18 'data.shape=[3,16,16]' 'hydra.run.dir=/j/a b'"
    )
    sweep = resume_command(["-m", "optimizer.lr=0.1,0.2"], Path("/s/1"), sweep_dir=Path("/s"))
    assert sweep == "python -m runner -m optimizer.lr=0.1,0.2 hydra.sweep.dir=/s"
    assert resume_command([], Path("/j"), launcher="torchrun") == "the same torchrun command with hydra.run.dir=/j"


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_an_interrupted_sweep_rerun_skips_finished_jobs_resumes_the_stopped_one_and_runs_the_rest(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *JOB, "trainer.max_steps=40", "trainer.seed=1,2,3", f"hydra.sweep.dir={sweep}"]
    proc = start(args, tmp_path)
    deadline = time.monotonic() + 240
    while not (
        (sweep / "1" / "metrics.jsonl").exists() and '"step": 5,' in (sweep / "1" / "metrics.jsonl").read_text()
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert (sweep / "0" / "summary.json").exists() and not (sweep / "1" / "summary.json").exists()
    assert not (sweep / "2").exists()
    cmd = resume_hint(out)
    assert cmd[3] == "-m" and cmd[-1] == f"hydra.sweep.dir={sweep.resolve()}"
    rerun = run(cmd, tmp_path)  # the printed command: the same sweep into the same folder
    assert f"{sweep / '0'}: finished already" in rerun.stdout and "resumed from" in rerun.stdout
    summaries = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(3)]
    assert [s["config"]["trainer"]["seed"] for s in summaries] == [1, 2, 3]
    assert [s["steps"] for s in summaries] == [40, 40, 40] and [s["restarts"] for s in summaries] == [0, 1, 0]
    assert [r[0] for r in rows(sweep / "1") if r[1] is not None] == list(range(1, 41))  # every step once
