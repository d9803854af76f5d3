"""What Lightning, timm and Hugging Face Trainer users reach for every week: an EMA of the weights
(``trainer.ema_decay``), early stopping (``trainer.early_stopping.*``) with the best checkpoint
(``checkpoint.keep_best``), the gradient norm in every log row, and deterministic runs
(``trainer.deterministic``). Exact resume with an EMA and best weights is in tests/test_resume.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import cuda_only, metrics_rows, read_summary, run_cli, run_tiny
from runner.engine.monitor import Watch
from runner.errors import ConfigError
from runner.techniques.ema import EMA

#: a tiny CPU job through the CLI: 12 steps, a row every 2 steps, an evaluation every 4 on the same 2 batches
JOB = [
    "data=synthetic",
    "data.shape=[3,16,16]",
    "data.train_size=256",
    "data.eval_size=64",
    "dataloader.batch_size=16",
    "trainer.max_steps=12",
    "trainer.warmup_steps=1",
    "trainer.log_every=2",
    "trainer.eval_every=4",
    "trainer.eval_max_batches=2",
    "trainer.progress=off",
    "trainer.device=cpu",
    "logger=none",
    "trainer.doctor=false",
]


def cli(tmp_path, name: str, *overrides: str):
    folder = tmp_path / name
    proc = run_cli(*JOB, *overrides, f"hydra.run.dir={folder}", cwd=tmp_path)
    return proc, folder


def test_the_ema_update_is_the_lerp_towards_the_weights_with_the_warmup_decay():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = EMA(model, decay=0.9, warmup=True)
    start = model[0].weight.detach().clone()
    expected = start.clone()
    for step in range(1, 4):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        decay = min(0.9, (1 + step - 1) / (10 + step - 1))  # 0.1, 0.1818, 0.25: the warm-up, below 0.9
        expected = decay * expected + (1 - decay) * model[0].weight.detach()
        ema.update(step)
    average = dict(zip(ema.names, ema.average))
    torch.testing.assert_close(average["0.weight"], expected)
    assert "1.running_mean" in average and "1.num_batches_tracked" not in average  # floats averaged, ints not
    trained = model[0].weight.detach().clone()
    with ema.swapped():
        torch.testing.assert_close(model[0].weight.detach(), expected)
    assert torch.equal(model[0].weight.detach(), trained)  # its own weights back


def test_ema_every_updates_only_every_nth_step():
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.5, every=3)
    for step in range(1, 7):
        ema.update(step)
    assert ema.updates == 2


@pytest.mark.cli
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])])
def test_ema_through_the_cli_evaluates_both_weights_and_writes_model_ema(tmp_path, device):
    proc, folder = cli(tmp_path, "ema", "trainer.ema_decay=0.5", f"trainer.device={device}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(folder)
    evals = [r for r in metrics_rows(folder) if "eval_loss" in r]
    assert len(evals) == 3 and all(r["eval_loss_ema"] is not None for r in evals)
    assert summary["eval_loss_ema"] == evals[-1]["eval_loss_ema"] and summary["techniques"]["ema"] == "applied"
    assert summary["ema_update_ms"] > 0
    raw, averaged = load_file(str(folder / "model.safetensors")), load_file(str(folder / "model_ema.safetensors"))
    assert raw.keys() == averaged.keys()
    assert any(not torch.equal(raw[k], averaged[k]) for k in raw if raw[k].is_floating_point())
    assert evals[-1]["eval_loss_ema"] != evals[-1]["eval_loss"]


@pytest.mark.cli
def test_every_log_row_has_the_gradient_norm_before_clipping(tmp_path):
    short = ["trainer.log_every=1", "trainer.max_steps=4"]
    proc, folder = cli(tmp_path, "clipped", "optimizer.clip_grad_norm=0.01", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, plain = cli(tmp_path, "plain", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for f in (folder, plain):
        norms = [r["grad_norm"] for r in metrics_rows(f) if "loss" in r]
        assert len(norms) == 4 and all(n > 0 for n in norms)
    # step 1's norm comes before any clipping changed the weights' path: the same in both runs, above the clip
    first = [next(r["grad_norm"] for r in metrics_rows(f) if "loss" in r) for f in (folder, plain)]
    assert first[0] > 0.01 and first[0] == pytest.approx(first[1], rel=1e-5)


@pytest.mark.cli
def test_early_stopping_stops_says_why_and_a_rerun_trains_no_further(tmp_path):
    # min_delta too large to ever count as an improvement: stop after the second evaluation (patience 1)
    stop = [
        "trainer.early_stopping.metric=eval_loss",
        "trainer.early_stopping.patience=1",
        "trainer.early_stopping.min_delta=1000",
        "trainer.max_steps=40",
    ]
    proc, folder = cli(tmp_path, "stopped", *stop)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(folder)
    assert summary["steps"] == 8
    assert "eval_loss did not improve by more than 1000" in summary["stopped_early"]
    assert "best" in summary["stopped_early"] and "step 4" in summary["stopped_early"]
    again = run_cli(*JOB, *stop, f"hydra.run.dir={folder}", cwd=tmp_path)  # resume=auto finds the last checkpoint
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_summary(folder)["steps"] == 8


@pytest.mark.cli
def test_keep_best_writes_the_best_weights_with_their_metric(tmp_path):
    proc, folder = cli(tmp_path, "best", "checkpoint.keep_best=true", "checkpoint.best_metric=eval_accuracy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in metrics_rows(folder) if "eval_accuracy" in r]
    best = max(evals, key=lambda r: (r["eval_accuracy"], -r["step"]))  # the first of equals is kept
    record = json.loads((folder / "best" / "best.json").read_text())
    assert record["metric"] == "eval_accuracy" and record["value"] == best["eval_accuracy"]
    assert record["step"] == best["step"]
    assert (folder / "best" / "model.safetensors").is_file()
    assert read_summary(folder)["best"]["best_step"] == best["step"]


def test_the_watch_improves_by_more_than_min_delta_in_either_direction():
    lower = Watch("eval_loss", "min", min_delta=0.1)
    assert lower.observe({"eval_loss": 1.0}, 1) and not lower.observe({"eval_loss": 0.95}, 2)
    assert lower.observe({"eval_loss": 0.8}, 3) and lower.since_best == 0
    assert not lower.observe({"eval_loss": float("nan")}, 4) and lower.since_best == 1
    higher = Watch("eval_accuracy", "max")
    assert higher.observe({"eval_accuracy": 0.5}, 1) and not higher.observe({"eval_accuracy": 0.5}, 2)


@pytest.mark.cli
def test_deterministic_runs_are_bit_identical_and_say_so(tmp_path):
    job = [
        "trainer.deterministic=true",
        "dataloader.num_workers=2",
        "data.augment=true",
        "cudnn_benchmark=true",
        "trainer.max_steps=4",
    ]
    folders = []
    for name in ("a", "b"):
        proc, folder = cli(tmp_path, name, *job)
        assert proc.returncode == 0, proc.stderr[-3000:]
        folders.append(folder)
    a, b = (load_file(str(f / "model.safetensors")) for f in folders)
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = read_summary(folders[0])
    assert summary["deterministic"] is True and summary["techniques"]["deterministic"] == "applied"
    assert summary["techniques"]["cudnn_benchmark"].startswith("skipped: trainer.deterministic=true")


@pytest.mark.parametrize("where", ["forward", "backward"])  # refused in the model's first check, or in the loop
def test_deterministic_with_an_operation_that_has_no_deterministic_kernel_names_it(tmp_path, where):
    says = "trainer.deterministic=true: this job's step runs put_, which has no deterministic kernel on this device"
    model = ["model._target_=user_data.ScatterNet", f"+model.where={where}"]
    try:
        with pytest.raises(ConfigError, match=re.escape(says)):
            run_tiny(tmp_path / "scatter", "trainer.deterministic=true", *model)
    finally:
        torch.use_deterministic_algorithms(False)  # the refused job stopped before a next job could reset it
    assert not (tmp_path / "scatter" / "summary.json").exists()
    assert run_tiny(tmp_path / "free", *model)["steps"] == 4  # the same job, not deterministic, runs


@pytest.mark.cli
def test_a_metric_the_task_does_not_report_stops_the_cli_with_one_message(tmp_path):
    proc, folder = cli(tmp_path, "bad", "trainer.early_stopping.metric=eval_bleu")
    assert proc.returncode == 2
    assert (
        "error: trainer.early_stopping.metric=eval_bleu: the task does not report it; it reports eval_accuracy, "
        "eval_loss" in proc.stderr
    ), proc.stderr[-2000:]
    assert not (folder / "summary.json").exists()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["trainer.early_stopping.metric=eval_loss_ema"],
            "trainer.early_stopping.metric=eval_loss_ema: the task does not",
        ),
        (["checkpoint.keep_best=true", "checkpoint.best_metric=accuracy"], "checkpoint.best_metric=accuracy"),
        (["trainer.ema_decay=1.5"], "trainer.ema_decay=1.5 must be in (0, 1)"),
        (["trainer.early_stopping.metric=eval_loss", "trainer.early_stopping.patience=0"], "patience=0 must be >= 1"),
        (
            ["trainer.early_stopping.metric=eval_loss", "trainer.early_stopping.min_delta=-1"],
            "min_delta=-1.0 must be >= 0",
        ),
    ],
)
def test_bad_settings_stop_before_training_naming_the_key(tmp_path, overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        run_tiny(tmp_path / "job", *overrides)
    assert not (tmp_path / "job" / "summary.json").exists()


@pytest.mark.cli
def test_an_unknown_early_stopping_mode_is_refused_before_training(tmp_path):
    proc, _ = cli(tmp_path, "bad", "trainer.early_stopping.mode=up")
    assert proc.returncode == 2 and "trainer.early_stopping.mode" in proc.stderr
