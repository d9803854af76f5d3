"""The task contract (``runner.protocols.Task``) and the tracker's (``Tracker``): runner's own tasks and trackers
satisfy them, and a member the engine's call does not fit is found."""

from __future__ import annotations

import typing

from conftest import compose_cfg
from runner import protocols, task as task_mod
from runner.build import Parts
from runner.track import NullTracker, Tracker
from runner.tune.guard import LossRecorder
from runner.tune.lr import RangeRecorder

# ------------------------------------------------------------------------------ the contracts


def test_the_built_in_tasks_and_trackers_satisfy_the_protocols(tmp_path):
    tasks = [task_mod.Classification(), task_mod.LanguageModel()]
    tracker = Tracker(tmp_path, compose_cfg(), {}, 4, None)
    trackers = [tracker, NullTracker(), LossRecorder(), RangeRecorder(steps=3, beta=0.9, diverge_factor=4.0)]
    try:
        for obj, protocol in [(t, protocols.Task) for t in tasks] + [(t, protocols.Tracker) for t in trackers]:
            assert isinstance(obj, protocol), obj
            assert protocols.mismatches(obj, protocol) == [], obj  # every method takes the engine's arguments
    finally:
        tracker.abort()
    assert {"loss", "evaluate", "check_target", "model_kwargs", "check", "tokens_per_sample", "skipped", "finish",
            "metrics"} == set(protocols.members(protocols.Task))
    assert {"log", "note", "finish", "abort", "wandb_run_id", "mlflow_run_id"} == set(protocols.members(
        protocols.Tracker))
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
    assert "lacks model_kwargs(data)" in found and "has finish = int, not a method(model, data, job_dir, env, seed)" \
        in found
    assert not any(f.startswith("check_target") for f in found)
    assert not isinstance(Misfit(), protocols.Task)

    class NoDefault(NullTracker):
        def abort(self, exit_code):  # the engine may call abort() alone
            pass

    assert protocols.mismatches(NoDefault(), protocols.Tracker) == [
        "abort has no default for 'exit_code' (the engine may leave it out)"]
