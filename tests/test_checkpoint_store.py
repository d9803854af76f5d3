"""The checkpoint store on its own (runner/checkpoint/): what is saved comes back exactly, a partial write is
never chosen, old checkpoints are pruned, async writes publish, corrupt or foreign checkpoints are refused.

The engine-level behaviour (exact resume of a killed run, signals, SLURM) is tested in test_resume.py.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from runner import checkpoint as ck
from runner.errors import ConfigError


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state(model, opt, step=0):
    return {"app": ck.ModelAndOptimizer(model, opt), "rng": ck.RNGState(0), "train": {"step": step, "epoch": 0}}


def test_save_and_load_restore_model_optimizer_rng_and_plain_values(tmp_path):
    model, opt = trained(0)
    store = ck.Checkpointer(tmp_path / "checkpoints")
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    path = store.save(state(model, opt, step=3), step=3, meta={"config": {"a": 1}})
    expected = (random.random(), np.random.rand(), torch.rand(1))

    other, other_opt = trained(1)
    assert not torch.equal(other[0].weight, model[0].weight)
    restored = state(other, other_opt)
    store.load(restored, path)
    assert restored["train"] == {"step": 3, "epoch": 0}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    for (_, a), (_, b) in zip(opt.state_dict()["state"].items(), other_opt.state_dict()["state"].items()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected  # the RNG streams continue exactly
    assert ck.read_meta(path) == {"config": {"a": 1}, "step": 3}


def test_a_partial_checkpoint_is_never_chosen_and_keep_last_prunes(tmp_path):
    model, opt = trained()
    root = tmp_path / "checkpoints"
    store = ck.Checkpointer(root, keep_last=2)
    for step in (10, 20, 30):
        store.save(state(model, opt, step), step, meta={})
    assert [p.name for p in ck.complete_checkpoints(root)] == ["step_00000020", "step_00000030"]
    # a write killed half-way: DCP's files without the rename (and a folder with data but no .metadata)
    partial = root / ".step_00000040.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    fake = root / "step_00000050"
    fake.mkdir()
    (fake / ck.META_FILE).write_text(json.dumps({"step": 50}))  # no .metadata: DCP never finished
    assert ck.latest(root).name == "step_00000030"
    store.save(state(model, opt, 40), 40, meta={})  # the leftover partial folder of step 40 is replaced
    assert ck.latest(root).name == "step_00000040" and not partial.exists()


def test_async_save_publishes_when_finished(tmp_path):
    model, opt = trained()
    root = tmp_path / "checkpoints"
    store = ck.Checkpointer(root, async_save=True)
    final = store.save(state(model, opt, 5), 5, meta={})
    store.finish()
    assert ck.latest(root) == final and store.saves == 1 and store.time_s > 0
    restored_model, restored_opt = trained(3)
    store.load(state(restored_model, restored_opt), final)
    assert torch.equal(restored_model[2].bias, model[2].bias)


def test_corrupt_and_foreign_checkpoints_are_refused_with_the_path(tmp_path):
    model, opt = trained()
    store = ck.Checkpointer(tmp_path / "checkpoints")
    path = store.save(state(model, opt, 1), 1, meta={})
    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ConfigError, match=rf"cannot resume from {path}.*checkpoint.resume=never"):
        store.load(state(wider, torch.optim.AdamW(wider.parameters())), path)
    (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=rf"cannot resume from {path}"):
        store.load(state(model, opt), path)
    (path / ck.META_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=rf"corrupt checkpoint file {path / ck.META_FILE}"):
        ck.read_meta(path)
    with pytest.raises(ConfigError, match="does not exist"):
        ck.read_meta(tmp_path / "nowhere")


def garble(path, at: float = 0.5) -> None:
    """Flip one byte of ``path``, ``at`` its length: the file keeps its size and format, its numbers change."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_refuses_a_checkpoint_whose_files_changed_since_they_were_written(tmp_path):
    """Each published checkpoint gets sha256.json (written off the loop); resuming checks it first: one changed
    byte in the tensor data, which DCP itself would load without a word, is refused with the file named."""
    from runner.checkpoint.resume import find_resume_point

    model, opt = trained()
    job = tmp_path / "job"
    store = ck.Checkpointer(job / ck.FOLDER)
    path = store.save(state(model, opt, 2), 2, meta={"config": {"lr": 0.1}})
    store.finish()  # the checksums' thread is joined at the end of a run
    digests = json.loads((path / ck.DIGEST_FILE).read_text())
    assert set(digests) == {".metadata", ck.META_FILE, "__0_0.distcp"}
    assert find_resume_point("auto", job, {"lr": 0.1}, 10).path == path  # intact: resumes
    garble(path / "__0_0.distcp")
    with pytest.raises(
        ConfigError,
        match=rf"cannot resume from {path}: {path / '__0_0.distcp'} was modified or "
        rf"corrupted after the checkpoint was written",
    ):
        find_resume_point("auto", job, {"lr": 0.1}, 10)


def test_dcp_loads_the_metadata_runner_checked_and_never_unpickles_it_again(tmp_path, monkeypatch):
    """DCP's FileSystemReader unpickles .metadata with plain pickle; runner's reader hands DCP the metadata it read
    through the allowlist unpickler, so plain pickle is never asked (here it would raise)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    model, opt = trained()
    store = ck.Checkpointer(tmp_path / "checkpoints")
    path = store.save(state(model, opt, 1), 1, meta={})

    class NoPlainPickle:
        def __getattr__(self, name):
            raise AssertionError(f"DCP called pickle.{name} on the checkpoint")

    monkeypatch.setattr(dcp_fs, "pickle", NoPlainPickle())
    restored_model, restored_opt = trained(3)
    store.load(state(restored_model, restored_opt), path)
    assert torch.equal(restored_model[2].weight, model[2].weight)


def test_final_weights_are_a_plain_safetensors_state_dict(tmp_path):
    from safetensors.torch import load_file

    model, _ = trained()
    path = ck.save_weights(model, tmp_path / "model.safetensors", is_main=True)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh.load_state_dict(load_file(str(path)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_submitit_job_stops_on_submitits_signal_and_hands_it_back(monkeypatch):
    """Inside a submitit job the handlers catch submitit's time-limit signal (SIGUSR2, or SUBMITIT_PREEMPT_SIGNAL),
    leave SIGTERM to submitit (it ignores the SIGTERM that precedes a preemption's USR2) and hand submitit its own
    signal back whichever one stopped the run, so submitit requeues the job."""
    import os
    import signal

    from runner.checkpoint import preempt

    assert preempt.submitit_signal({}) is None
    assert preempt.submitit_signal({"SUBMITIT_EXECUTOR": "slurm"}) == "SIGUSR2"
    assert preempt.submitit_signal({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "SIGUSR1"}) == "SIGUSR1"
    assert preempt.Preemption(["SIGTERM", "SIGUSR1"], handoff="SIGUSR2").names == ["SIGUSR1", "SIGUSR2"]
    assert preempt.Preemption([], handoff="SIGUSR2").names == []  # checkpoint.signals=[]: no handlers at all
    handed = []
    previous = signal.signal(signal.SIGUSR2, lambda *_: handed.append("USR2"))
    try:
        with preempt.Preemption(["SIGUSR1"], handoff="SIGUSR2") as p:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert p.received == "SIGUSR1" and not handed  # recorded only; nothing stops mid-step
            p.resend()
        assert handed == ["USR2"]  # submitit's handler got its signal
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _full_disk(monkeypatch, error: BaseException) -> None:
    """Every DCP write fails the way a full disk makes it fail (DCP wraps it in its CheckpointException)."""
    from torch.distributed.checkpoint import filesystem

    def write_data(self, plan, planner):
        raise error

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize("error", ["enospc", "short zip write"])
def test_a_full_disk_says_so_removes_the_partial_folder_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, error):
    import errno

    from runner.checkpoint import write_failures

    model, opt = trained(0)
    store = ck.Checkpointer(tmp_path / "checkpoints")
    good = store.save(state(model, opt, step=3), step=3, meta={})
    if error == "enospc":
        _full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    else:  # what PyTorch's zip writer raises on a short write, without errno; the disk is nearly full
        _full_disk(monkeypatch, RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 704 vs 598"))
        monkeypatch.setattr(write_failures, "free_bytes", lambda path: 4096)
    with pytest.raises(ConfigError) as caught:
        store.save(state(model, opt, step=6), step=6, meta={})
    message = str(caught.value)
    assert "disk full" in message and str(tmp_path / "checkpoints") in message and str(good) in message
    assert "\n" not in message
    assert ck.complete_checkpoints(tmp_path / "checkpoints") == [good]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]  # no .partial left


def test_an_unrelated_write_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    model, opt = trained(0)
    store = ck.Checkpointer(tmp_path / "checkpoints")
    _full_disk(monkeypatch, RuntimeError("unexpected pos 704 vs 598"))  # the disk has room: not "disk full"
    with pytest.raises(BaseException) as caught:
        store.save(state(model, opt, step=3), step=3, meta={})
    assert not isinstance(caught.value, ConfigError)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_final_checkpoint_on_a_full_disk_keeps_the_trained_weights(tmp_path, monkeypatch):
    import errno

    from safetensors.torch import load_file

    from conftest import compose_cfg
    from runner.engine.train import train

    _full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    job = tmp_path / "job"
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg("trainer.max_steps=2"), job_dir=job)
    assert "disk full" in str(caught.value) and "model.safetensors" in str(caught.value)
    assert load_file(str(job / "model.safetensors"))  # the trained model survived the failed checkpoint
    assert not list((job / "checkpoints").iterdir())


def test_an_async_write_on_a_full_disk_fails_when_it_is_waited_for(tmp_path, monkeypatch):
    import errno

    model, opt = trained(0)
    store = ck.Checkpointer(tmp_path / "checkpoints", async_save=True)
    store.save(state(model, opt, step=3), step=3, meta={})
    store.finish()
    _full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    store.save(state(model, opt, step=6), step=6, meta={})  # staged; the write fails in its thread
    with pytest.raises(ConfigError, match="disk full"):
        store.finish()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]


def test_a_checkpoint_every_30_minutes_is_the_default_and_a_short_run_writes_none_before_its_end(tmp_path):
    from conftest import compose_cfg
    from runner.checkpoint import resume
    from runner.engine.train import train

    settings = resume.settings(compose_cfg(tiny=False).checkpoint)
    assert settings["every_minutes"] == 30 and "SIGINT" in settings["signals"]
    store = ck.Checkpointer(tmp_path / "c", every_minutes=settings["every_minutes"])
    start = store._last_save
    # (float sums: not exactly 30)
    assert not store.due(7, now=start + 29 * 60) and store.due(7, now=start + 30 * 60 + 0.01)
    train(compose_cfg("trainer.max_steps=4", "trainer.log_every=1"), job_dir=tmp_path / "job")
    assert [p.name for p in ck.complete_checkpoints(tmp_path / "job" / "checkpoints")] == ["step_00000004"]


def test_the_weights_get_a_new_files_usual_mode_and_never_write_through_a_link(tmp_path):
    """safetensors creates its file 0600: runner's ``model.safetensors`` gets what the umask gives any new file
    (a team reads a shared run's weights); a link planted at the temporary name is replaced, its target untouched."""
    import os
    import stat

    from runner import checkpoint

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "model.partial").symlink_to(outside)
    mask = os.umask(0o022)
    try:
        path = checkpoint.save_weights(torch.nn.Linear(2, 2), tmp_path / "model.safetensors", True)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and outside.read_text() == "keep"
