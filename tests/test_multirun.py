"""Multirun: ``python -m runner -m dataloader.batch_size=32,64 optimizer.lr=0.01,0.1`` runs 4 jobs, each
in its own folder with ``summary.json`` and its own W&B run, grouped by the sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, job_dirs, read_summary, run_cli
from runner import REPO_ROOT
from test_wandb import read_run, wandb_files


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_two_by_two_sweep_writes_four_jobs_with_their_own_runs(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # no WANDB_MODE and no API key: offline, and the notice comes once for the whole sweep
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(home)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)  # this checkout
    tiny = [*TINY, "logger=wandb", "trainer.max_steps=2", "trainer.log_every=1"]  # sweep keys last: they win
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "-m", *tiny, "dataloader.batch_size=32,64", "optimizer.lr=0.01,0.1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_dirs(tmp_path)
    assert len(jobs) == 4
    (sweep,) = {job.parent for job in jobs}
    assert sweep.relative_to(tmp_path).parts[:2] == ("outputs", "multirun")
    assert sorted(job.name for job in jobs) == ["0", "1", "2", "3"]

    combos, run_ids = set(), set()
    for job in jobs:
        summary = read_summary(job)
        combos.add((summary["config"]["dataloader"]["batch_size"], summary["config"]["optimizer"]["lr"]))
        assert summary["global_batch_size"] == summary["config"]["dataloader"]["batch_size"]
        assert summary["steps"] == 2 and summary["samples_per_sec"] > 0
        (path,) = wandb_files(job)  # each job its own run, inside its own folder
        run = read_run(path)
        run_ids.add(run["run"].run_id)
        assert run["run"].run_group == f"{sweep.parent.name}_{sweep.name}"
        assert run["config"]["optimizer"]["lr"] == summary["config"]["optimizer"]["lr"]
        assert run["summary"]["samples_per_sec"] == summary["samples_per_sec"]
        assert run["exit"] is not None and run["exit"].exit_code == 0  # finished before the next started
    assert combos == {(32, 0.01), (32, 0.1), (64, 0.01), (64, 0.1)}
    assert len(run_ids) == 4
    assert (proc.stdout + proc.stderr).count("wandb sync") == 1
    assert f"wandb sync {sweep}/*/wandb/offline-run-*" in proc.stdout
    assert not list(Path(tmp_path).glob("wandb"))


def test_a_plain_multirun_prints_a_line_per_job_and_ends_with_its_table_and_the_report_command(tmp_path):
    """Each job of a basic-launcher sweep prints one line, not the summary table; the sweep ends with its jobs'
    table, fastest first (report.md's), and the command that writes the report again (runner/report/end.py)."""
    job = [*TINY, "trainer.max_steps=2", "trainer.progress=lines", "trainer.doctor=false"]
    proc = run_cli("-m", *job, "dataloader.batch_size=16,32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = {j.parent for j in job_dirs(tmp_path)}
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("job ")] == [
        f"job {sweep / '0'}",
        f"job {sweep / '1'}",
    ]
    assert "summary (" not in proc.stdout  # the per-job table is gone
    start = lines.index(f"sweep {sweep.relative_to(tmp_path)}, jobs fastest first:")
    header, rule, *rows = lines[start + 1 : start + 5]
    assert header.startswith("| `dataloader.batch_size` | samples/s |") and rule.startswith("|---|---:|")
    assert sorted(row.split("|")[1].strip() for row in rows) == ["16", "32"]
    assert lines[-1] == f"the report again (and after more jobs): python -m runner.report {sweep.relative_to(tmp_path)}"
    assert (sweep / "report.md").is_file() and (sweep / "report.csv").is_file()
