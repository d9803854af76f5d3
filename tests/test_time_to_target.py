"""Time to target as a comparison metric: samples to target over seeds (runner/compare/convergence.py), its
combination with the interleaved throughput ratio, and the engine's ``steps_to_target`` / ``samples_to_target``.

The statistics run on synthetic seeds (milliseconds); one tiny real run checks the summary's figures.
"""

from __future__ import annotations

import json

from conftest import compose_cfg
from runner.state import SharedState, TrainState
from runner.train import train


def test_samples_to_target_survives_a_checkpoint():
    state = TrainState(time_to_target_s=1.5, steps_to_target=6, samples_to_target=96)
    restored = TrainState()
    SharedState(restored).load_state_dict(SharedState(state).state_dict())
    assert (restored.steps_to_target, restored.samples_to_target) == (6, 96)
    old = SharedState(state).state_dict()  # a checkpoint written before runner recorded them
    fields = json.loads(old["fields"])
    del fields["steps_to_target"], fields["samples_to_target"]
    SharedState(restored).load_state_dict({"fields": json.dumps(fields)})
    assert restored.samples_to_target is None and restored.time_to_target_s == 1.5


def test_summary_records_the_samples_at_the_target(tmp_path):
    reached = train(compose_cfg("trainer.eval_every=2", "trainer.target_loss=1000", "trainer.stop_at_target=true"),
                    job_dir=tmp_path / "reached")
    assert reached["steps_to_target"] == 2 and reached["steps"] == 2  # the first evaluation meets it, and stops
    assert reached["samples_to_target"] == reached["steps_to_target"] * reached["global_batch_size"] == 32
    missed = train(compose_cfg("trainer.eval_every=2", "trainer.target_loss=1e-9"), job_dir=tmp_path / "missed")
    assert missed["time_to_target_s"] is None
    assert missed["steps_to_target"] is None and missed["samples_to_target"] is None and missed["steps"] == 4
