"""Nothing from disk runs code (docs/checkpointing.md, "What is safe to load").

Each test plants a payload the way an attacker would: a pickle whose ``__reduce__`` opens (creates) a file when
it is unpickled. runner must refuse it with a message naming the file, and the file must never appear:
DCP's ``.metadata``, a non-tensor item inside the ``.distcp`` data (where runner's own training state lives),
and a planted newest ``step_*`` folder that ``checkpoint.resume=auto`` would pick.
"""

from __future__ import annotations

import builtins
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import TINY, run_cli
from runner import checkpoint as ck
from runner.errors import ConfigError


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_pickle_planted_in_dcp_metadata_is_refused_and_never_runs(tmp_path):
    model, opt = model_and_optimizer()
    store = ck.Checkpointer(tmp_path / "checkpoints")
    path = store.save({"app": ck.ModelAndOptimizer(model, opt)}, 1, meta={})
    marker = tmp_path / "pwned-metadata"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ConfigError, match=rf"refusing to load {path / '.metadata'}.*open is not part of a DCP checkpoint's metadata"):
        store.load({"app": ck.ModelAndOptimizer(model, opt)}, path)
    assert not marker.exists()


def test_a_pickle_planted_as_a_state_item_is_refused_and_never_runs(tmp_path):
    """runner's own training state is a JSON string and tensors; an item that unpickles to anything else (here
    written by a tampered runner: DCP pickles non-tensor items with torch.save) is refused before DCP loads it."""
    model, opt = model_and_optimizer()
    store = ck.Checkpointer(tmp_path / "checkpoints")
    marker = tmp_path / "pwned-item"
    path = store.save({"app": ck.ModelAndOptimizer(model, opt), "train": {"fields": Payload(marker)}}, 1, meta={})
    assert not marker.exists()  # saving pickles the payload; only unpickling would run it
    with pytest.raises(ConfigError, match=rf"refusing to load {path}: an item .* is not plain tensors"):
        store.load({"app": ck.ModelAndOptimizer(model, opt), "train": {"fields": ""}}, path)
    assert not marker.exists()


def test_the_training_state_round_trips_as_json_and_tensors(tmp_path):
    """What runner saves of its own (``runner.state``) loads through the safe planner: no pickle needed."""
    import math
    import random

    import numpy as np

    from runner.state import PerRankState, SharedState, TrainState

    state = TrainState(step=7, eval={"eval_loss": 1.5, "eval_accuracy": None}, loss_sum=torch.tensor(3.25),
                       last_finite=(6, 0.5), train_loss=math.nan)
    state.timings.step_time_ms[:] = [1.0, 2.0]
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    store = ck.Checkpointer(tmp_path / "checkpoints")
    path = store.save({"train": SharedState(state), "rank": PerRankState(state, 0)}, 7, meta={})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    back = TrainState(loss_sum=torch.zeros(()))
    store.load({"train": SharedState(back), "rank": PerRankState(back, 0)}, path)
    assert (back.step, back.eval, back.last_finite, back.timings.step_time_ms) == (7, state.eval, (6, 0.5), [1.0, 2.0])
    assert math.isnan(back.train_loss) and back.loss_sum.item() == 3.25
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_resume_auto_refuses_a_planted_newest_checkpoint_and_runs_nothing(tmp_path):
    """A planted ``step_*`` folder newer than the job's own is what ``resume=auto`` picks: the run stops with
    the refusal (exit 2) before training, and the payload never runs."""
    folder = tmp_path / "job"
    job = [*TINY, "trainer.max_steps=4", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={folder}"]
    first = run_cli(*job, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    own = ck.latest(folder / ck.FOLDER)
    planted = own.with_name(ck.step_name(99))
    shutil.copytree(own, planted)
    marker = tmp_path / "pwned-resume"
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    again = run_cli(*job, "trainer.max_steps=8", cwd=tmp_path)
    assert again.returncode == 2, again.stderr[-3000:]
    assert f"refusing to load {planted / '.metadata'}" in again.stderr
    assert not marker.exists()


MY_DATA = """
import torch
from torch.utils.data import TensorDataset


def blobs(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:16], y[:16])
"""


@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_the_doctor_never_imports_from_a_job_folder_it_was_not_started_in(tmp_path):
    """``--verify`` reruns a job. A job on the user's own dataset module (``data._target_=my_data.blobs``) ran
    from ``ran_in``; someone replaces ``ran_in/my_data.py`` with a payload. The doctor started elsewhere must not
    import it: it says where the job ran from, and its rerun fails without running the payload."""
    ran_in, elsewhere = tmp_path / "ran_in", tmp_path / "elsewhere"
    ran_in.mkdir(), elsewhere.mkdir()
    (ran_in / "my_data.py").write_text(MY_DATA)
    job = ran_in / "job"
    first = run_cli("data=custom", "data._target_=my_data.blobs", "model=mlp", "trainer.max_steps=6",
                    "trainer.warmup_steps=1", "dataloader.batch_size=8", "trainer.progress=off", "logger=none",
                    "trainer.log_every=1", f"hydra.run.dir={job}", cwd=ran_in)
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "pwned-doctor"
    (ran_in / "my_data.py").write_text(f"open({str(marker)!r}, 'w')\n" + MY_DATA)
    proc = run_cli(str(job), "--verify", "--repeats", "1", "--top", "1", cwd=elsewhere, module="runner.doctor",
                   timeout=600)
    assert not marker.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"cd {ran_in}" in proc.stdout + proc.stderr


def test_a_pickle_planted_in_a_cifar10_batch_is_refused_and_never_runs(tmp_path):
    """CIFAR-10 ships as python pickles; a batch file under ``data.root`` that holds anything but arrays, lists
    and strings stops the run with the file named, and its payload never runs (neither in torchvision's load
    nor in runner's own check of which file is bad)."""
    from conftest import compose_cfg, make_tiny_cifar
    from runner import data as data_mod
    from runner.distributed import Env

    root = tmp_path / "data"
    make_tiny_cifar(root)
    marker = tmp_path / "pwned-cifar"
    batch = root / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(pickle.dumps({"data": Payload(marker), "labels": [0]}))
    cfg = compose_cfg("data=cifar10", f"data.root={root}")
    cpu = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=rf"corrupt dataset file {batch}: refusing to unpickle it: .*open"):
        data_mod.build(cfg.data, cfg.dataloader, cpu, seed=0)
    assert not marker.exists()
