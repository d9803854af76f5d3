"""The task contract (``runner.protocols.Task``) and the tracker's (``Tracker``), the data checks that ask the
task, ``task=regression`` (the worked example of adding a task) and ``trainer.stop_at_target``.

The regression runs train runner's MLP on ``tests/user_data.py``'s ``regression`` (float targets: a linear map of
8 inputs plus noise of std 0.1), through the real CLI once and in-process otherwise; a user's own task is
``user_data.OwnRegression``, a copy of ``runner.task.Regression`` that knows nothing of runner but the contract.
"""

from __future__ import annotations

import contextlib
import math
import os
import typing

import pytest
import torch

from conftest import TINY_LOOP, compose_cfg, job_dirs, metrics_rows, read_summary, run_cli, run_here
from runner import REPO_ROOT, data as data_mod, protocols, task as task_mod
from runner.distributed import Env, setup
from runner.engine.build import Parts
from runner.engine.train import train
from runner.errors import ConfigError
from runner.models import MLP
from runner.track import NullTracker, Tracker
from runner.tune.guard import LossRecorder
from runner.tune.lr import RangeRecorder

#: a regression on data=custom with runner's MLP, learnt well enough in 15-30 steps (eval_loss 1 -> below 0.1)
REGRESSION = [
    *TINY_LOOP,
    "task=regression",
    "data=custom",
    "data._target_=user_data.regression",
    "model=mlp",
    "model.hidden=16",
    "optimizer=adamw",
    "optimizer.lr=0.03",
    "trainer.eval_every=5",
    "trainer.eval_max_batches=null",
    "trainer.doctor=false",
]


def regression(*overrides: str):
    return compose_cfg(*REGRESSION, *overrides, tiny=False)


# ------------------------------------------------------------------------------ the contracts


def test_the_built_in_tasks_and_trackers_satisfy_the_protocols(tmp_path):
    tasks = [task_mod.Classification(), task_mod.LanguageModel(), task_mod.Regression()]
    tracker = Tracker(tmp_path, compose_cfg(), {}, 4, None)
    trackers = [tracker, NullTracker(), LossRecorder(), RangeRecorder(steps=3, beta=0.9, diverge_factor=4.0)]
    try:
        for obj, protocol in [(t, protocols.Task) for t in tasks] + [(t, protocols.Tracker) for t in trackers]:
            assert isinstance(obj, protocol), obj
            assert protocols.mismatches(obj, protocol) == [], obj  # every method takes the engine's arguments
    finally:
        tracker.abort()
    assert {
        "loss",
        "evaluate",
        "check_target",
        "model_kwargs",
        "check",
        "tokens_per_sample",
        "skipped",
        "finish",
        "metrics",
    } == set(protocols.members(protocols.Task))
    assert {"log", "note", "finish", "abort", "wandb_run_id", "mlflow_run_id"} == set(
        protocols.members(protocols.Tracker)
    )
    hints = typing.get_type_hints(Parts)
    assert (hints["task"], hints["tracker"]) == (protocols.Task, protocols.Tracker)


def test_a_signature_the_engine_cannot_call_is_a_mismatch():
    class Misfit:
        metrics = ("eval_loss",)

        def loss(self, model):  # no batch
            pass

        def evaluate(self, model, batches, autocast, max_batches, env, extra):  # an argument never passed
            pass

        def check_target(self, *args, **kwargs):  # takes anything
            pass

        finish = 3  # not a method

    found = protocols.mismatches(Misfit(), protocols.Task)
    assert "loss takes (model), not the argument 'batch' at position 2" in found
    assert "evaluate requires extra, which the engine never passes" in found
    assert (
        "lacks model_kwargs(data)" in found
        and "has finish = int, not a method(model, data, job_dir, env, seed)" in found
    )
    assert not any(f.startswith("check_target") for f in found)
    assert not isinstance(Misfit(), protocols.Task)

    class NoDefault(NullTracker):
        def abort(self, exit_code):  # the engine may call abort() alone
            pass

    assert protocols.mismatches(NoDefault(), protocols.Tracker) == [
        "abort has no default for 'exit_code' (the engine may leave it out)"
    ]


def test_a_task_missing_a_member_is_refused_naming_it(tmp_path):
    cfg = regression("task._target_=user_data.NoTargetCheck")
    with pytest.raises(
        ConfigError,
        match=r"task\._target_='user_data\.NoTargetCheck' is not a task: its "
        r"NoTargetCheck lacks check_target\(target\); give it every member of "
        r"runner\.protocols\.Task",
    ):
        train(cfg, job_dir=tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------ the data checks ask the task


def build_data(*overrides: str, task=None):
    cfg = regression(*overrides)
    return data_mod.build(cfg.data, cfg.dataloader, setup(cfg.distributed, "cpu"), seed=0, task=task)


def test_float_targets_pass_the_regression_task_and_are_refused_by_classification():
    data = build_data(task=task_mod.Regression())
    assert data.num_classes is None and data.target.dtype == torch.float32 and data.target.shape == ()
    x, y = data.example
    assert y.dtype == torch.float32 and y.shape == (2,)  # the example batch has the targets' shape and dtype
    two = build_data("data.n_targets=3", task=task_mod.Regression())
    assert two.target.shape == (3,) and two.example[1].shape == (2, 3)
    assert task_mod.Regression().model_kwargs(two) == {"num_outputs": 3}
    # the same data with the classification task (the default without one): today's message, word for word
    for task in (task_mod.Classification(), None):
        with pytest.raises(
            ConfigError,
            match=r"the target of item 0 of the training set is a torch\.float32 tensor "
            r"of shape \(\); a classification target is one class index: a Python "
            r"int or a 0-d int64 tensor",
        ):
            build_data(task=task)


@pytest.mark.parametrize(
    "target,overrides,message",
    [
        (
            "user_data.tabular",
            [],
            r"the target of item 0 of the training set is a torch\.int64 tensor of shape \(\); a "
            r"regression target is a float, or a float tensor of shape \(k,\)",
        ),
        (
            "user_data.regression",
            ["data.num_classes=3"],
            r"data\.num_classes=3 counts classes, but the targets are "
            r"floats .*; drop data\.num_classes",
        ),
    ],
)
def test_the_regression_task_refuses_targets_that_are_no_values(target, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_data(f"data._target_={target}", *overrides, task=task_mod.Regression())


def test_a_python_float_target_is_checked_as_a_batch_holds_it():
    """A dataset returning Python floats: collated to float64, accepted; the loss computes in float32."""
    from runner.data.custom import as_batched

    assert as_batched(1.5).dtype == torch.float64 and as_batched(3).dtype == torch.int64
    assert as_batched("a") == "a" and as_batched(torch.tensor([1.0, 2.0])).shape == (2,)
    assert task_mod.Regression().check_target(as_batched(1.5)) is None
    assert task_mod.Classification().check_target(as_batched(True)) is not None  # bool is no class index


def test_regression_on_class_indices_of_a_built_in_set_is_refused(tmp_path):
    cfg = compose_cfg("task=regression", "model=mlp")  # synthetic images, int64 labels
    with pytest.raises(
        ConfigError,
        match=r"task=regression needs float targets .* but this data yields class "
        r"indices; use task=classification",
    ):
        train(cfg, job_dir=tmp_path)


# ------------------------------------------------------------------------------ task=regression


def test_the_regression_loss_and_metrics_are_the_mse_and_its_root():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
        model.bias.zero_()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [3.0, 1.0]])
    y = torch.tensor([0.0, -1.0, 1.0, 2.0])  # predictions 1, -1, 0, 2: errors 1, 0, -1, 0
    task = task_mod.Regression()
    assert task.loss(model, (x, y)).item() == pytest.approx(0.5)
    env = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))
    figures = task.evaluate(model, [(x[:3], y[:3]), (x[3:], y[3:])], contextlib.nullcontext, None, env)
    assert figures == pytest.approx({"eval_loss": 0.5, "eval_rmse": math.sqrt(0.5)})
    assert task.evaluate(model, [(x, y)], contextlib.nullcontext, 0, env) == {"eval_loss": None, "eval_rmse": None}


def test_mlp_takes_num_outputs_and_keeps_its_arguments():
    assert MLP(8, 5).head.out_features == 5  # in_features, num_classes positionally, as before
    assert MLP(8, num_outputs=3).head.out_features == 3
    with pytest.raises(ValueError, match="outputs=0"):
        MLP(8, num_outputs=0)


def test_the_model_output_must_be_the_targets_size(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model\.num_outputs=2 cannot be set: the model's output size follows the "
        r"data \(1\)",
    ):
        train(regression("+model.num_outputs=2"), job_dir=tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"the model returns \(2, 3\) for a batch of 2, not \(2, 1\) predictions "
        r"for the targets' 1 values: give the model a num_outputs parameter",
    ):
        train(
            regression(
                "model._target_=torch.nn.Linear",
                "+model.out_features=3",
                "~model.hidden",
                "~model.depth",
                "~model.dropout",
            ),
            job_dir=tmp_path,
        )


@pytest.mark.cli
def test_regression_through_the_cli_reports_rmse_and_stops_at_the_target_loss(tmp_path):
    """Done-when: ``python -m runner task=regression data=custom data._target_=<float targets> model=mlp`` trains,
    reports RMSE in the summary and on the console, and stops at ``trainer.target_loss``."""
    path = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])
    proc = run_cli(
        *REGRESSION,
        "trainer.max_steps=200",
        "trainer.log_every=5",
        "trainer.progress=lines",
        "trainer.target_loss=0.1",
        "trainer.stop_at_target=true",
        cwd=tmp_path,
        env={"PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = job_dirs(tmp_path)
    s = read_summary(job)
    assert s["eval_rmse"] == pytest.approx(math.sqrt(s["eval_loss"])) and s["eval_loss"] <= 0.1
    assert s["steps"] < 200 and s["steps"] % 5 == 0  # ended at an evaluation, long before max_steps
    assert s["stopped_early"] == f"reached the targets: eval_loss {s['eval_loss']:.4g} <= trainer.target_loss=0.1"
    assert s["time_to_target_s"] is not None and s["config"]["task"]["_target_"] == "runner.task.Regression"
    evaluations = [r for r in metrics_rows(job) if "eval_loss" in r]
    assert [r["eval_loss"] <= 0.1 for r in evaluations] == [False] * (len(evaluations) - 1) + [True]
    assert f"| eval_rmse {s['eval_rmse']:,.4g}" in proc.stdout  # the evaluation's console line
    assert any(line.split()[:1] == ["eval_rmse"] for line in proc.stdout.splitlines())  # the summary table
    assert "stopping (trainer.stop_at_target): reached the targets" in proc.stdout


def test_a_users_own_task_trains_float_targets_the_same_way(tmp_path):
    s = train(
        regression(
            "task._target_=user_data.OwnRegression",
            "data.n_targets=2",
            "trainer.max_steps=200",
            "trainer.target_loss=0.1",
            "trainer.stop_at_target=true",
        ),
        job_dir=tmp_path,
    )
    assert s["eval_loss"] <= 0.1 and s["eval_rmse"] == pytest.approx(math.sqrt(s["eval_loss"]))
    assert s["steps"] < 200 and s["stopped_early"].startswith("reached the targets: eval_loss")


def test_a_tasks_own_arguments_and_metrics_reach_it_and_the_console(tmp_path):
    """A task's keys are its constructor arguments when the task is the user's own (the protocol says so), from a
    task config file of one's own (``--config-dir``) as from the command line (``+task.<key>``); its own metric
    (``eval_mae``) shows on the console's evaluation line beside ``eval_loss``; a wrong argument, in either place, is
    one line naming the target and the argument (the config file's used to be Hydra's raw error, exit 1)."""
    own = [
        *REGRESSION,
        "task._target_=user_data.WeightedRegression",
        "trainer.max_steps=10",
        "trainer.progress=lines",
        "logger=none",
    ]
    configs = tmp_path / "my-configs"
    (configs / "task").mkdir(parents=True)
    (configs / "task" / "weighted.yaml").write_text(
        "defaults: [base_task, _self_]\n_target_: user_data.WeightedRegression\nweight: 2\n"
    )
    from_file = ["--config-dir", str(configs), *(o for o in own if not o.startswith("task")), "task=weighted"]
    (tmp_path / "a").mkdir()
    proc = run_here(*from_file, cwd=tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [
        r
        for r in metrics_rows(next((tmp_path / "a").rglob("summary.json")).parent)
        if r["step"] == 10 and "eval_mae" in r
    ]
    assert (
        f"step 10/10 | epoch 0 | eval_loss {row['eval_loss']:.4g} | eval_rmse {row['eval_rmse']:.4g} | "
        f"eval_mae {row['eval_mae']:.4g}" in proc.stdout
    )
    (tmp_path / "b").mkdir()  # weight 1: AdamW's steps do not depend on the loss's scale, so the loss is halved
    assert run_here(*own, cwd=tmp_path / "b").returncode == 0
    weighted, plain = (
        [r["loss"] for r in metrics_rows(next((tmp_path / d).rglob("summary.json")).parent) if "loss" in r][-1]
        for d in "ab"
    )
    assert weighted / plain == pytest.approx(2, rel=0.05)
    (tmp_path / "c").mkdir()
    wrong = run_here(*own, "+task.weigth=2", cwd=tmp_path / "c")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "error: task._target_='user_data.WeightedRegression' raised TypeError: WeightedRegression.__init__() got an "
        "unexpected keyword argument 'weigth' (called with weigth=2)"
    ]
    (configs / "task" / "weighted.yaml").write_text(
        "defaults: [base_task, _self_]\n_target_: user_data.WeightedRegression\nweigth: 2\n"
    )
    wrong = run_here(*from_file, cwd=tmp_path / "c")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "error: task._target_='user_data.WeightedRegression' raised TypeError: WeightedRegression.__init__() got an "
        "unexpected keyword argument 'weigth' (called with weigth=2)"
    ]
    builtin = run_here(*REGRESSION, "+task.weight=2", cwd=tmp_path / "c")  # runner's own task: the schema decides
    assert builtin.returncode == 2 and "task.weight is not a setting runner reads" in builtin.stderr


# ------------------------------------------------------------------------------ trainer.stop_at_target


def test_stop_at_target_ends_a_classification_at_its_target_accuracy_and_is_off_by_default(tmp_path):
    common = [
        *TINY_LOOP,
        "data=custom",
        "data._target_=user_data.tabular",
        "model=mlp",
        "model.hidden=16",
        "optimizer=adamw",
        "optimizer.lr=0.01",
        "trainer.max_steps=40",
        "trainer.eval_every=2",
        "trainer.eval_max_batches=null",
        "trainer.target_accuracy=0.9",
        "trainer.doctor=false",
    ]
    stopped = train(compose_cfg(*common, "trainer.stop_at_target=true", tiny=False), job_dir=tmp_path / "on")
    assert stopped["steps"] < 40 and stopped["eval_accuracy"] >= 0.9
    assert stopped["stopped_early"].startswith("reached the targets: eval_accuracy ")
    full = train(compose_cfg(*common, tiny=False), job_dir=tmp_path / "off")  # today's behaviour: dated, not ended
    assert full["steps"] == 40 and full["stopped_early"] is None and full["time_to_target_s"] is not None
    reached = [r["step"] for r in metrics_rows(tmp_path / "off") if (r.get("eval_accuracy") or 0) >= 0.9]
    assert reached[0] == stopped["steps"]  # the same seed trains the same steps: it stopped at the first one


def test_stop_at_target_without_a_target_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"trainer\.stop_at_target=true stops at the first evaluation meeting the "
        r"targets: set trainer\.target_loss or trainer\.target_accuracy",
    ):
        train(regression("trainer.stop_at_target=true"), job_dir=tmp_path)


@pytest.mark.parametrize("which, value", [("training", float("nan")), ("evaluation", float("inf"))])
def test_non_finite_regression_targets_are_one_error_before_training(which, value, tmp_path):
    """A NaN or infinite target stopped the run with exit 3 blaming the learning rate (in training) or lost its
    summary (in evaluation): it is refused before anything is built, naming the set and the first item."""
    from runner.engine.train import train

    cfg = compose_cfg(
        "task=regression",
        "data=custom",
        "data._target_=user_data.regression_with_a_bad_target",
        f"+data.which={which}",
        f"+data.value={value}",
        "model=mlp",
    )
    with pytest.raises(ConfigError, match=rf"1 target\(s\) of the {which} set are NaN or infinite \(item 5 first\)"):
        train(cfg, job_dir=tmp_path)
    assert not (tmp_path / "summary.json").exists()


def test_a_nan_met_only_in_evaluation_names_the_evaluation_set_not_the_learning_rate(tmp_path):
    """A dataset that is not tensors is not scanned before training: the NaN shows in the first evaluation. The
    training loss is finite then, so the error names the evaluation set (exit 2), not divergence and the LR."""
    from runner.engine.train import train

    cfg = compose_cfg(
        "task=regression",
        "data=custom",
        "data._target_=user_data.regression_with_a_nan_evaluation_row",
        "model=mlp",
        "trainer.max_steps=6",
        "trainer.eval_every=3",
    )
    with pytest.raises(
        ConfigError,
        match=r"step 3 gave eval_loss=nan.* while the training loss is finite.*"
        r"evaluation set holds NaN or inf",
    ):
        train(cfg, job_dir=tmp_path)
