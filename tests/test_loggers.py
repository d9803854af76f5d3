"""Loggers as a list: ``logger=tensorboard|mlflow|csv|wandb|none`` and several at once (``logger=[wandb,tensorboard]``),
each read back with its own library (TensorBoard's ``EventAccumulator``, MLflow's ``MlflowClient``, W&B's
transaction log) and checked against ``metrics.jsonl``; an MLflow run resumed from a checkpoint continues the same
run; an MLflow server that cannot be reached falls back to the local store; a missing package or an unknown logger
stops with one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, compose_cfg, job_dirs, metrics_rows, read_csv, read_summary, run_cli
from runner import REPO_ROOT
from runner.errors import ConfigError

#: TINY, 6 steps with a row every 2 (three timed rows after the 1-step warm-up) and an evaluation at the end
JOB = [*(o for o in TINY if o != "logger=none"), "trainer.max_steps=6", "trainer.doctor=false"]


def figures(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every metrics.jsonl row that holds ``key``."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard log folder, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def texts(log_dir: Path) -> dict[str, str]:
    """The text summaries of a TensorBoard log folder (tag -> the last text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto).item().decode()
        for tag in acc.Tags()["tensors"]
    }


def same(logged: list[tuple[int, float]], rows: list[tuple[int, float]]) -> bool:
    """The same steps and values, to float32 precision (TensorBoard stores float32)."""
    return len(logged) == len(rows) and all(
        s == t and v == pytest.approx(w, rel=1e-6) for (s, v), (t, w) in zip(logged, rows)
    )


def mlflow_client(job: Path):
    from mlflow.tracking import MlflowClient

    from runner.track.loggers import local_mlflow_uri

    return MlflowClient(tracking_uri=local_mlflow_uri(job))


def only_run(client, experiment: str = "runner"):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# --------------------------------------------------------------------------------- config shape, no training


def test_the_logger_list_composes_into_one_node_per_logger():
    from runner.config.logger import logger_names

    assert logger_names(compose_cfg("logger=wandb").logger) == ["wandb"]
    assert logger_names(compose_cfg("logger=none").logger) == []
    cfg = compose_cfg(
        "logger=[wandb,tensorboard,mlflow,csv]", "logger.mlflow.tracking_uri=http://x:5000", "logger.project=p"
    )
    assert logger_names(cfg.logger) == ["wandb", "tensorboard", "mlflow", "csv"]
    assert cfg.logger.mlflow.tracking_uri == "http://x:5000" and cfg.logger.project == "p"
    assert compose_cfg(tiny=False).logger.wandb is not None  # the default is still W&B alone


def test_the_csv_logger_widens_its_header_and_drops_rows_after_a_resumed_checkpoint(tmp_path):
    from runner.track.loggers import CSVLogger

    path = tmp_path / "metrics.csv"
    log = CSVLogger(path)
    log.log({"step": 1, "loss": 2.5, "samples_per_sec": None})
    log.log({"step": 2, "loss": 2.0, "samples_per_sec": 10.0})
    log.log({"step": 2, "eval_accuracy": 0.5})  # a new key: the file is rewritten with the wider header
    log.log({"step": 3, "loss": 1.5, "samples_per_sec": 11.0})
    assert path.read_text().splitlines()[0] == "step,loss,samples_per_sec,eval_accuracy"
    assert [r["eval_accuracy"] for r in read_csv(path)] == ["", "", "0.5", ""]
    assert not path.with_suffix(".csv.tmp").exists()
    CSVLogger(path, resume_step=2).log({"step": 3, "loss": 1.25})  # resumed from step 2: step 3 is logged again
    assert [(r["step"], r["loss"]) for r in read_csv(path)] == [("1", "2.5"), ("2", "2.0"), ("2", ""), ("3", "1.25")]


# ------------------------------------------------------------------------ one run, three loggers read back


@pytest.fixture(scope="module")
def three_loggers(tmp_path_factory) -> Path:
    """A tiny job logged to TensorBoard, MLflow (local store) and metrics.csv at once."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("three")
    proc = run_cli(
        *JOB, "logger=[tensorboard,mlflow,csv]", "logger.tags=[smoke]", cwd=root, env={"MLFLOW_TRACKING_URI": ""}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "MLflow:" not in proc.stdout  # the local store needs no notice
    (job,) = job_dirs(root)
    return job


@pytest.mark.cli
def test_tensorboard_holds_every_metrics_row_the_config_and_the_summary(three_loggers):
    job, rows, summary = three_loggers, metrics_rows(three_loggers), read_summary(three_loggers)
    logged = scalars(job / "tensorboard")
    for key, tag in (
        ("samples_per_sec", "perf/samples_per_sec"),
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("eval_accuracy", "eval/accuracy"),
        ("eval_loss", "eval/loss"),
    ):
        assert len(figures(rows, key)) >= 1 and same(logged[tag], figures(rows, key)), tag
    assert len(figures(rows, "samples_per_sec")) >= 2  # two timed rows, against the optimizer step
    assert logged["summary/samples_per_sec"] == [(6, pytest.approx(summary["samples_per_sec"], rel=1e-6))]
    text = texts(job / "tensorboard")
    assert "max_steps: 6" in text["config/text_summary"] and "tensorboard: {}" in text["config/text_summary"]
    assert '"eval_accuracy"' in text["summary/text_summary"]


@pytest.mark.cli
def test_mlflow_holds_the_config_every_metrics_row_and_the_summary(three_loggers):
    job, rows, summary = three_loggers, metrics_rows(three_loggers), read_summary(three_loggers)
    assert (job / "mlruns" / "mlflow.db").is_file()
    client = mlflow_client(job)
    run = only_run(client)  # the experiment is the project
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.max_steps"] == "6" and run.data.params["data.name"] == "synthetic"
    assert run.data.params["logger.mlflow.tracking_uri"] == "None" and "smoke" in run.data.tags
    for key, tag in (
        ("samples_per_sec", "perf/samples_per_sec"),
        ("loss", "train/loss"),
        ("eval_accuracy", "eval/accuracy"),
        ("step_time_ms", "perf/step_time_ms"),
    ):
        assert history(client, run.info.run_id, tag) == figures(rows, key), tag
    for key in ("samples_per_sec", "eval_accuracy", "steps", "global_batch_size"):
        assert run.data.metrics[key] == pytest.approx(summary[key]), key
    stored = Path(client.download_artifacts(run.info.run_id, "summary.json", str(job.parent)))
    assert json.loads(stored.read_text())["techniques"] == summary["techniques"]


@pytest.mark.cli
def test_metrics_csv_has_every_metrics_row_under_the_union_of_their_keys(three_loggers):
    rows, lines = metrics_rows(three_loggers), read_csv(three_loggers / "metrics.csv")
    header = (three_loggers / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "step" and set(header) == {k for r in rows for k in r} and len(header) == len(set(header))
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows):
        assert {k: v for k, v in line.items() if v != ""} == {k: str(v) for k, v in row.items() if v is not None}


# ------------------------------------------------------------------------------- several loggers, W&B too


@pytest.mark.slow
def test_wandb_and_tensorboard_together(tmp_path):
    pytest.importorskip("tensorboard")
    from test_wandb import read_run, wandb_files

    proc = run_cli(*JOB, "logger=[wandb,tensorboard]", cwd=tmp_path)  # run_cli: WANDB_MODE=offline
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    (path,) = wandb_files(job / "wandb")
    rows, history_ = metrics_rows(job), read_run(path)["history"]
    wandb_loss = [(h["trainer/step"], h["train/loss"]) for h in history_ if "train/loss" in h]
    assert wandb_loss == figures(rows, "loss")
    assert same(scalars(job / "tensorboard")["train/loss"], figures(rows, "loss"))
    assert not (job / "metrics.csv").exists() and not (job / "mlruns").exists()


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_a_preempted_mlflow_run_ends_killed_and_the_resumed_job_continues_it(tmp_path):
    """SIGTERM checkpoints and stops (exit 75): the MLflow run ends KILLED; the same command resumes from the
    checkpoint into the same MLflow run (its id is kept in the checkpoint), which then ends FINISHED with the
    figures up to the last step. TensorBoard drops the events after the checkpoint (purge_step): no step twice."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    folder = tmp_path / "job"
    cmd = [
        sys.executable,
        "-m",
        "runner",
        *JOB,
        "trainer.max_steps=40",
        "trainer.log_every=1",
        "checkpoint.every_steps=null",
        "logger=[mlflow,tensorboard]",
        f"hydra.run.dir={folder}",
    ]
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"step": 3,' in metrics.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:] + err[-3000:]
    client = mlflow_client(folder)
    first = only_run(client)
    assert first.info.status == "KILLED"
    stopped_at = max(step for step, _ in history(client, first.info.run_id, "train/loss"))

    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    run = only_run(client)  # still one run: the same id
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    steps = [step for step, _ in history(client, run.info.run_id, "train/loss")]
    assert steps[-1] == 40 and set(steps) == set(range(1, 41)) and stopped_at < 40
    assert run.data.metrics["steps"] == 40 and read_summary(folder)["restarts"] == 1
    tb_steps = [step for step, _ in scalars(folder / "tensorboard")["train/loss"]]
    assert tb_steps == list(range(1, 41))


# ------------------------------------------------------------------------------------ tracking servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_unreachable_mlflow_server_falls_back_to_the_local_store(tmp_path):
    pytest.importorskip("mlflow")
    proc = run_cli(*JOB, "logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    notice = [line for line in proc.stdout.splitlines() if line.startswith("MLflow:")]
    assert notice == [
        f"MLflow: http://127.0.0.1:9 cannot be reached, logging to the local store sqlite:///"
        f"{job.resolve()}/mlruns/mlflow.db instead"
    ], proc.stdout
    assert only_run(mlflow_client(job)).info.status == "FINISHED"


@pytest.mark.slow
def test_a_real_mlflow_server_gets_the_run(tmp_path):
    """``MLFLOW_TRACKING_URI`` pointing at an ``mlflow server`` on a free local port (skipped when one does not
    start within 90 s): the run, its metrics and its summary artifact are read back from the server."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from runner.track import reachable

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not reachable(uri, timeout_s=1) and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.5)
        if not reachable(uri, timeout_s=1):
            pytest.skip(f"mlflow server did not start on port {port} within 90 s")
        proc = run_cli(*JOB, "logger=mlflow", "logger.project=served", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": uri})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "MLflow:" not in proc.stdout, proc.stdout
        (job,) = job_dirs(tmp_path)
        assert not (job / "mlruns").exists()
        client = MlflowClient(tracking_uri=uri)
        run = only_run(client, "served")
        assert run.info.status == "FINISHED"
        assert history(client, run.info.run_id, "train/loss") == figures(metrics_rows(job), "loss")
        assert run.data.metrics["samples_per_sec"] == pytest.approx(read_summary(job)["samples_per_sec"])
        assert [f.path for f in client.list_artifacts(run.info.run_id)] == ["summary.json"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers
        server.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("logger,module", [("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_logger_whose_package_is_missing_stops_before_training(tmp_path, logger, module):
    """The package made unimportable (``sys.modules[name] = None`` in a sitecustomize): one error line naming
    the logger and the pip command, exit status 2, no training."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    proc = run_cli(*JOB, f"logger=[csv,{logger}]", cwd=tmp_path, env={"PYTHONPATH": f"{site}{os.pathsep}{REPO_ROOT}"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: logger={logger} needs the {module} package, which is not installed: pip install "
        f'{module} (or pip install -e ".[{module}]"); or drop {logger} from logger='
    ], proc.stderr
    assert "step 1" not in proc.stdout and not (tmp_path / "outputs").exists()  # refused: no folder left


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "logger=foo",
            "error: logger=foo is not a logger; pick one of wandb, tensorboard, mlflow, csv "
            "(logger=tensorboard), several as a list (logger=[wandb,tensorboard]) or logger=none",
        ),
        ("logger=[wandb,foo]", "error: logger=foo is not a logger;"),
        (
            "logger.mlflow.tracking_uri=http://x:5000",
            "error: logger.mlflow.tracking_uri is a setting of logger=mlflow, "
            "which this run does not pick; add mlflow to the loggers",
        ),
    ],
)
def test_an_unknown_logger_is_one_error_line(tmp_path, override, message):
    proc = run_cli(*JOB, override, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "0"}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_file_where_the_run_writes_a_folder_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """``logger=tensorboard`` with a *file* named tensorboard in the job folder: one line, before the data and
    the model are built (it was a FileExistsError traceback after the model)."""
    from runner import models
    from runner.engine.train import train

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "tensorboard").write_text("not a folder\n")
    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(
        ConfigError,
        match=rf"{folder / 'tensorboard'} is a file, but the run writes TensorBoard's "
        rf"event files \(logger=tensorboard\) into a folder of that name",
    ):
        train(compose_cfg("logger=tensorboard"), job_dir=folder)
