"""``python -m runner.report`` on a plain multirun (runner/report/sweep.py): a real 2x2 grid of tiny jobs
through the CLI, a sweep whose second job fails, and the pieces on synthetic job folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, read_csv, run_cli
from runner import REPO_ROOT
from runner.report.sweep import PLAIN_COLUMNS, SweepError, job_times, load_sweep, swept_keys, write_plain_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"PYTHONPATH": str(REPO_ROOT)}  # the subprocesses import this checkout's runner


def report(sweep: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner.report", str(sweep)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **ENV},
    )


def only_sweep(root: Path) -> Path:
    sweeps = list((root / "outputs" / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps
    return sweeps[0]


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_plain_2x2_sweep_through_the_cli(tmp_path):
    tiny = [o for o in TINY if not o.startswith("dataloader.batch_size")]
    proc = run_cli("-m", *tiny, "dataloader.batch_size=16,32", "optimizer.lr=0.05,0.1", cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = only_sweep(tmp_path)
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    assert {Path(line.split()[-1]).name for line in done.stdout.splitlines()} == {
        "report.md",
        "report.csv",
        "sweep.png",
    }
    rows = read_csv(sweep / "report.csv")
    assert list(rows[0]) == ["dataloader.batch_size", "optimizer.lr"] + PLAIN_COLUMNS
    assert sorted((r["dataloader.batch_size"], r["optimizer.lr"]) for r in rows) == [
        ("16", "0.05"),
        ("16", "0.1"),
        ("32", "0.05"),
        ("32", "0.1"),
    ]
    speeds = [float(r["samples_per_sec"]) for r in rows]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    for r in rows:
        s = json.loads((sweep / r["job"] / "summary.json").read_text())
        assert float(r["samples_per_sec"]) == pytest.approx(s["samples_per_sec"], rel=1e-5)
        assert float(r["step_time_ms_median"]) == pytest.approx(s["step_time_ms_median"], rel=1e-5)
        assert float(r["eval_loss"]) == pytest.approx(s["eval_loss"], rel=1e-5) and r["status"] == "ok"
        assert r["data_wait_fraction"] and r["peak_memory_mb"] and r["train_loss"] and r["eval_accuracy"]
        assert float(r["setup_s"]) >= 0 and f"dataloader.batch_size={r['dataloader.batch_size']}" in r["overrides"]
    md = (sweep / "report.md").read_text()
    assert "| swept keys | `dataloader.batch_size`, `optimizer.lr` |" in md and "`trainer.max_steps=4`" in md
    assert "samples/s against dataloader.batch_size, one line per optimizer.lr" in md
    assert "## Where the sweep's time went" in md and "| measured steps |" in md
    assert (sweep / "sweep.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.cli
def test_plain_sweep_with_a_failed_job(tmp_path):
    tiny = [o for o in TINY if not o.startswith("dataloader.batch_size")]
    # batch 1024 > the 256 training samples: the second job stops with exit status 2, and so does the sweep
    proc = run_cli("-m", *tiny, "dataloader.batch_size=16,1024", cwd=tmp_path, env=ENV)
    assert proc.returncode == 2 and "dataloader.batch_size=1024" in proc.stderr
    sweep = only_sweep(tmp_path)
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    rows = read_csv(sweep / "report.csv")
    assert [r["dataloader.batch_size"] for r in rows] == ["16", "1024"]  # the job without figures last
    assert rows[0]["status"] == "ok" and rows[1]["samples_per_sec"] == ""
    assert rows[1]["status"].startswith("failed or unfinished: no summary.json")
    md = (sweep / "report.md").read_text()
    assert "| jobs | 2 (1 with a summary, 1 without) |" in md
    assert "## Jobs without figures" in md and "(dataloader.batch_size=1024): failed or unfinished" in md


def job(sweep: Path, n: int, overrides: list[str], sps: float | None, step: int | None = None) -> Path:
    d = sweep / str(n)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (d / ".hydra" / "config.yaml").write_text("{}\n")
    if sps is not None:
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "samples_per_sec": sps,
                    "step_time_ms_median": 10.0,
                    "data_wait_fraction": 0.1,
                    "peak_memory_mb": 500.0,
                    "train_loss": 1.0,
                    "eval_loss": 1.1,
                    "eval_accuracy": 0.5,
                    "train_time_s": 0.0,
                    "eval_time_s": 0.0,
                    "measured_time_s": 0.0,
                    "warmup_steps": 1,
                }
            )
        )
    elif step is not None:
        (d / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 1.0}) + "\n")
    return d


def test_swept_keys_one_key_plot_and_a_job_that_stopped_midway(tmp_path):
    sweep = tmp_path / "sweep"
    for n, (bs, sps) in enumerate([(64, 100.0), (128, 180.0), (256, 150.0)]):
        job(sweep, n, ["model=mnist_cnn", f"dataloader.batch_size={bs}"], sps)
    job(sweep, 3, ["model=mnist_cnn", "dataloader.batch_size=512"], None, step=20)
    jobs = load_sweep(sweep)
    assert swept_keys(jobs) == ["dataloader.batch_size"]
    assert "stopped after step 20" in next(j.problem for j in jobs if j.summary is None)
    write_plain_report(sweep)
    rows = read_csv(sweep / "report.csv")
    assert [r["dataloader.batch_size"] for r in rows] == ["128", "256", "64", "512"]
    assert "samples/s against dataloader.batch_size:" in (sweep / "report.md").read_text()


@pytest.mark.cli
def test_jobs_measured_on_a_busy_machine_are_flagged_in_the_report_and_on_the_console(tmp_path):
    sweep = tmp_path / "sweep"
    for n, bs in enumerate((64, 128)):
        job(sweep, n, [f"dataloader.batch_size={bs}"], 100.0 + n)
    quiet = report(sweep)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr + quiet.stdout
    assert "**Warning:**" not in (sweep / "report.md").read_text()
    summary = sweep / "1" / "summary.json"  # as runner.measure.machine_load.load_warnings words it
    busy = "runner's threads waited for a CPU 40% of their run time (other processes competed for the cores)"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | {"warnings": [busy]}))
    done = report(sweep)
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("warning: 1 of 2 measured jobs ran on a busy machine (e.g. 1: runner's threads waited")
    assert (
        f"**Warning:** 1 of 2 measured jobs ran on a busy machine (e.g. 1: {busy})" in (sweep / "report.md").read_text()
    )
    assert all(x.startswith("wrote ") for x in done.stdout.splitlines())


def test_three_swept_keys_give_one_bar_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    n = 0
    for a in (1, 2):
        for b in ("x", "y"):
            job(sweep, n, [f"a={a}", f"b={b}", f"c={n}"], 10.0 + n)
            n += 1
    write_plain_report(sweep)
    assert "samples/s of each job (3 swept keys)" in (sweep / "report.md").read_text()


def test_job_times_from_the_folder(tmp_path):
    d = job(tmp_path, 0, ["a=1"], 10.0)
    s = json.loads((d / "summary.json").read_text()) | {"train_time_s": 2.0, "eval_time_s": 0.5}
    (d / "summary.json").write_text(json.dumps(s))
    written = (d / "summary.json").stat().st_mtime
    (d / "job.json").write_text(json.dumps({"started": written - 4.0, "finished": written + 1.0}))
    t = job_times(d, s)
    assert (t["setup_s"], t["teardown_s"], t["wall_s"]) == (pytest.approx(1.5), pytest.approx(1.0), pytest.approx(5.0))
    assert job_times(tmp_path / "none", None)["setup_s"] is None


def test_not_a_sweep_is_one_clear_error(tmp_path):
    with pytest.raises(SweepError, match="holds no job folder"):
        load_sweep(tmp_path)
    done = report(tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
