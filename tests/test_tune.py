"""The tuners (``python -m runner.tune batch_size|lr|dataloader``) on a tiny job: each runs end to end and its
recommendation is checked against the measurements it wrote (never against a speed: the machine is shared).

One run goes through the real CLI, one through torchrun with 2 processes; the rest run in-process
(``runner.tune.run``, what the CLI calls after Hydra composed the config).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from conftest import TINY, compose_cfg, read_csv, run_cli
from runner import tune
from runner.errors import ConfigError
from runner.models import MnistCNN
from runner.tune import harness
from test_distributed import TORCHRUN, child_env

#: each configuration: 1 warm-up + 2 measured steps of TINY's job (synthetic 3x16x16, mnist_cnn)
QUICK = ["tune.warmup_steps=1", "tune.measure_steps=2"]


class OOMAbove(MnistCNN):
    """``MnistCNN`` whose training forward raises CUDA's out-of-memory error for batches above ``limit``
    samples: the tuner's recovery path, on a machine without a GPU."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, limit: int = 16):
        super().__init__(num_classes, in_channels)
        self.limit = limit

    def forward(self, x):
        if self.training and x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated: batch {x.shape[0]} > {self.limit})")
        return super().forward(x)


def number(cell: str) -> float | None:
    return float(cell) if cell not in ("", None) else None


def fastest_within_limit(rows: list[dict], limit_mb: float) -> int:
    """The batch size the spec recommends, from the written rows: the fastest that fits the memory limit."""
    fits = [r for r in rows if r["status"] == "ok" and number(r["peak_memory_mb"]) <= limit_mb]
    return int(max(fits, key=lambda r: number(r["samples_per_sec"]))["batch_size"])


def test_batch_size_through_the_cli(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        "batch_size",
        "--out",
        str(out),
        *TINY,
        *QUICK,
        "tune.start_batch_size=4",
        "tune.max_batch_size=16",
        "tune.search_steps=1",
        cwd=tmp_path,
        module="runner.tune",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_csv(out / "batch_size.csv")
    result = json.loads((out / "batch_size.json").read_text())
    grown = [int(r["batch_size"]) for r in rows if r["phase"] == "grow"]
    assert grown == [4 * 2**i for i in range(len(grown))] and grown[-1] <= 16  # powers of two from the start
    assert all(number(r["samples_per_sec"]) > 0 and number(r["peak_memory_mb"]) > 0 for r in rows)
    best = fastest_within_limit(rows, result["memory_limit_mb"])
    assert result["recommended"]["batch_size"] == best
    assert proc.stdout.strip().splitlines()[-1] == f"override: dataloader.batch_size={best}"
    assert "samples/s" in proc.stdout and "| **<- recommended** |" in proc.stdout  # the printed table
    assert (out / "batch_size.png").stat().st_size > 0 and (out / "batch_size.md").is_file()
    assert "shape:\n  - 3\n  - 16\n  - 16" in (out / ".hydra" / "config.yaml").read_text()  # composed as runner does


def test_batch_size_recovers_from_out_of_memory(tmp_path, capsys):
    cfg = compose_cfg(
        *QUICK,
        f"model._target_={__name__}.OOMAbove",
        "model.limit=16",
        "tune.start_batch_size=16",
        "tune.max_batch_size=64",
        "tune.search_steps=1",
    )
    result = tune.run("batch_size", cfg, tmp_path)
    status = [(r["batch_size"], r["phase"], r["status"]) for r in result["rows"]]
    assert status == [(16, "grow", "ok"), (32, "grow", "oom"), (24, "search", "oom")]  # stops at the OOM, bisects
    assert result["recommended"]["batch_size"] == 16 and result["override"] == "dataloader.batch_size=16"
    assert [r["status"] for r in read_csv(tmp_path / "batch_size.csv")] == ["ok", "oom", "oom"]


@pytest.mark.cli
def test_batch_size_trials_on_a_busy_machine_say_so(tmp_path, capsys):
    """Busy loops on every core while the tuner measures: each trial records the machine-load warnings a
    run's summary would, and the tuner warns (console, notes) instead of recommending silently."""
    from runner.measure import hardware

    if hardware.thread_schedule_ns() is None:
        pytest.skip("no /proc/self/task/*/schedstat: run-queue wait is Linux-only")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hardware.cpu_cores())]
    try:
        time.sleep(0.3)  # let them take the cores
        result = tune.run(
            "batch_size",
            compose_cfg(
                "tune.warmup_steps=1",
                "tune.measure_steps=6",
                "tune.start_batch_size=16",
                "tune.max_batch_size=32",
                "tune.search_steps=0",
            ),
            tmp_path,
        )
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    assert any(r["load_warnings"] for r in result["rows"]), result["rows"]
    assert result["notes"][0].startswith("warning: ") and "measured trials ran on a busy machine" in result["notes"][0]
    out = capsys.readouterr().out
    assert "\nwarning: " in out and "note: warning" not in out
    assert any(r["load_warnings"] for r in read_csv(tmp_path / "batch_size.csv"))
    assert "- warning: " in (tmp_path / "batch_size.md").read_text()


@pytest.mark.parametrize(
    "overrides, words",
    [
        ([f"model._target_={__name__}.OOMAbove", "model.limit=3"], ["dataloader.batch_size=4", "ran out of memory"]),
        (["tune.max_memory_fraction=1e-9"], ["dataloader.batch_size=4", "over the limit", "tune.max_memory_fraction"]),
    ],
    ids=["out of memory", "over the memory limit"],
)
def test_batch_size_refuses_a_job_that_does_not_fit_at_the_smallest_size(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as caught:
        tune.run("batch_size", compose_cfg(*QUICK, "tune.start_batch_size=4", *overrides), tmp_path)
    assert all(w in str(caught.value) for w in words) and "tune.start_batch_size" in str(caught.value)
    assert not list(tmp_path.glob("batch_size.*"))  # no half-written result


def test_lr_range_test_restores_the_weights(tmp_path):
    from runner import distributed
    from runner.engine import train as engine

    cfg = compose_cfg()
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    parts, _ = engine.build(cfg, env, tmp_path)
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    lr_before = [g["lr"] for g in parts.optimizer.param_groups]
    result = tune.lr_range_test(parts, min_lr=1e-5, max_lr=1.0, steps=12)
    after = parts.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the range test left the weights changed"
    assert [g["lr"] for g in parts.optimizer.param_groups] == lr_before and not parts.optimizer.state
    losses = [p["loss"] for p in result.points]
    assert len(set(losses)) > 1  # it did train (so restoring was needed)
    lrs = [p["lr"] for p in result.points]
    assert lrs[0] == pytest.approx(1e-5) and all(b > a for a, b in zip(lrs, lrs[1:]))  # exponential ramp
    if len(lrs) == 12:
        assert lrs[-1] == pytest.approx(1.0)
    parts.tracker.abort()


def test_lr_suggestion_is_the_steepest_descent_of_the_recorded_curve(tmp_path):
    cfg = compose_cfg("tune.min_lr=1e-5", "tune.max_lr=1", "tune.steps=20")
    result = tune.run("lr", cfg, tmp_path)
    rows = read_csv(tmp_path / "lr.csv")
    used = [r for r in rows if r["used"] == "True"]
    lrs, smoothed = [float(r["lr"]) for r in used], [float(r["smoothed_loss"]) for r in used]
    slopes = [(smoothed[i + 1] - smoothed[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i])) for i in range(len(lrs) - 1)]
    steepest = lrs[slopes.index(min(slopes))]
    assert result["recommended"]["lr"] == pytest.approx(steepest, rel=1e-9)
    assert 1e-5 <= steepest <= 1.0 and len(used) >= 3
    assert result["override"] == f"optimizer.lr={steepest:.3g}"  # lr_scaling=none: optimizer.lr is the LR used
    # the smoothing is fastai's bias-corrected EMA (beta 0.98) of the raw losses
    avg = 0.0
    for n, r in enumerate(rows[: len(used)], start=1):
        avg = 0.98 * avg + 0.02 * float(r["loss"])
        assert float(r["smoothed_loss"]) == pytest.approx(avg / (1 - 0.98**n), rel=1e-6)
    assert (tmp_path / "lr.png").stat().st_size > 0


@pytest.mark.cli
def test_dataloader_picks_the_fewest_workers_within_tolerance(tmp_path):
    cfg = compose_cfg(*QUICK, "tune.workers=[0,1]", "tune.loader_batches=5")
    result = tune.run("dataloader", cfg, tmp_path)
    rows = read_csv(tmp_path / "dataloader.csv")
    assert [int(r["num_workers"]) for r in rows] == [0, 1]
    assert all(number(r["loader_batches_per_sec"]) > 0 and 0 <= number(r["data_wait_fraction"]) <= 1 for r in rows)
    best = max(number(r["samples_per_sec"]) for r in rows)
    pick = min(int(r["num_workers"]) for r in rows if number(r["samples_per_sec"]) >= 0.95 * best)
    assert result["recommended"]["num_workers"] == pick
    assert result["override"].startswith(f"dataloader.num_workers={pick} dataloader.pin_memory=false")


@pytest.mark.parametrize(
    "kind, overrides, words",
    [
        ("lr", ["tune.min_lr=1", "tune.max_lr=0.1"], ["tune.max_lr=0.1", "tune.min_lr=1"]),
        ("dataloader", ["tune.workers=[]"], ["tune.workers=[]", "non-empty"]),
        ("dataloader", ["dataloader=device"], ["dataloader.on_device=true", "no DataLoader to tune"]),
        ("batch", [], ["unknown tuner 'batch'", "batch_size, lr, dataloader"]),
    ],
)
def test_bad_tune_settings_are_refused(tmp_path, kind, overrides, words):
    with pytest.raises(ConfigError) as caught:
        tune.run(kind, compose_cfg(*overrides), tmp_path)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_bad_input_through_the_cli(tmp_path):
    env = {"HYDRA_FULL_ERROR": "0"}
    proc = run_cli("batchsize", *TINY, cwd=tmp_path, module="runner.tune", env=env, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "batch_size, lr, dataloader" in errors[0], proc.stderr
    proc = run_cli("lr", *TINY, "tune.steps=abc", cwd=tmp_path, module="runner.tune", env=env, timeout=60)
    assert proc.returncode != 0 and "tune.steps" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.csv"))


@pytest.mark.slow
def test_batch_size_under_torchrun_every_rank_recommends_the_same(tmp_path):
    out = tmp_path / "out"
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "runner.tune",
        "batch_size",
        "--out",
        str(out),
        "distributed=ddp",
        *TINY,
        *QUICK,
        "tune.start_batch_size=4",
        "tune.max_batch_size=8",
        "tune.search_steps=0",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "batch_size.json").read_text())
    assert result["world_size"] == 2 and len(result["ranks"]) == 2
    assert result["ranks"][0] == result["ranks"][1] == result["recommended"]  # each rank computed it itself
    rows = read_csv(out / "batch_size.csv")
    assert [int(r["global_batch_size"]) for r in rows] == [8, 16]  # micro-batch x 2 ranks
    assert result["recommended"]["batch_size"] == fastest_within_limit(rows, result["memory_limit_mb"])
    assert proc.stdout.count("override: dataloader.batch_size=") == 1  # rank 0 prints


def test_lr_suggestions_come_from_the_falling_side_of_the_curve():
    """A loss that spikes and then recovers (BatchNorm networks do, resnet18 on CIFAR-10 in
    docs/benchmarks/tuning.md) must not have its recovery taken for the steepest descent: suggestions stop at
    the lowest smoothed loss."""
    from runner.tune import steepest, suggestion_range

    smoothed = [2.4] * 10 + [2.4 - 0.05 * i for i in range(10)] + [2.0, 3.0, 6.0, 5.0, 3.5, 3.4] + [3.4] * 5
    points = [{"step": i + 1, "lr": 1e-4 * 1.3**i, "smoothed_loss": v} for i, v in enumerate(smoothed)]
    used = suggestion_range(points, steps=len(points))
    assert used[-1]["smoothed_loss"] == min(p["smoothed_loss"] for p in used) == 1.95
    pick = used[steepest([p["lr"] for p in used], [p["smoothed_loss"] for p in used])]
    assert pick["step"] < 21  # on the descent, not on the recovery from 6.0 to 3.5


def test_a_new_tuner_is_one_registry_entry(tmp_path, monkeypatch, capsys):
    """The harness and the CLI know a tuner only through ``TUNERS``: a registered ``Tuner`` gets the table (its
    columns, its pick marked), the four outputs, the override line and a line in ``--help``."""
    from runner.tune.__main__ import usage

    def tune_fake(cfg, env, job_dir):
        rows = [{"x": 1, "speed": 2.0}, {"x": 2, "speed": 3.0}]
        return {"recommended": {"x": 2}, "override": "fake.x=2", "rows": rows, "notes": ["a note"]}

    def plot_fake(result):
        fig, ax = harness.pyplot().subplots()
        ax.plot([r["x"] for r in result["rows"]], [r["speed"] for r in result["rows"]])
        return fig

    fake = tune.Tuner(
        name="fake",
        help="a tuner for this test",
        tune=tune_fake,
        plot=plot_fake,
        columns=[("x", "x", ""), ("speed", "speed", ".1f")],
        is_pick=lambda r, rec: r["x"] == rec["x"],
    )
    monkeypatch.setitem(tune.TUNERS, "fake", fake)
    result = tune.run("fake", compose_cfg(), tmp_path)
    assert result["ranks"] == [{"x": 2}] and result["world_size"] == 1
    assert "| 2 | 3.0 | **<- recommended** |" in (tmp_path / "fake.md").read_text()
    assert sorted(p.name for p in tmp_path.glob("fake.*")) == ["fake.csv", "fake.json", "fake.md", "fake.png"]
    assert capsys.readouterr().out.strip().endswith("override: fake.x=2")
    assert "  fake         a tuner for this test" in usage() and "{batch_size,lr,dataloader,speed,fake}" in usage()


def test_a_tuner_named_after_its_options_is_refused_with_the_command_in_order():
    """``python -m runner.tune --config-dir my-configs speed ...`` (the tuner after an option): one line that says the
    tuner comes first and gives the command reordered, not "unknown tuner '--config-dir'"."""
    from runner.tune.__main__ import parse_args

    with pytest.raises(ConfigError) as caught:
        parse_args(["--config-dir", "my configs", "speed", "+experiment=tab"])
    assert str(caught.value) == (
        "the tuner's name comes first, before --config-dir and every override: "
        "python -m runner.tune speed --config-dir 'my configs' +experiment=tab"
    )
    assert parse_args(["speed", "--config-dir", "c", "x=1"]) == ("speed", None, ["--config-dir", "c", "x=1"])
