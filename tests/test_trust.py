"""Nothing from disk runs code (docs/checkpointing.md, "What is safe to load").

Each test plants a payload the way an attacker would: a pickle whose ``__reduce__`` opens (creates) a file when
it is unpickled. runner must refuse it with a message naming the file, and the file must never appear:
DCP's ``.metadata``, a non-tensor item inside the ``.distcp`` data (where runner's own training state lives),
and a planted newest ``step_*`` folder that ``checkpoint.resume=auto`` would pick.
"""

from __future__ import annotations

import builtins
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import TINY, run_cli
from runner import checkpoint as ck, trust
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
    with pytest.raises(
        ConfigError,
        match=rf"refusing to load {path / '.metadata'}.*open is not part of a DCP "
        rf"checkpoint's metadata",
    ):
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
    """What runner saves of its own (``runner.engine.state``) loads through the safe planner: no pickle needed."""
    import math
    import random

    import numpy as np

    from runner.engine.state import PerRankState, SharedState, TrainState

    state = TrainState(
        step=7,
        eval={"eval_loss": 1.5, "eval_accuracy": None},
        loss_sum=torch.tensor(3.25),
        last_finite=(6, 0.5),
        train_loss=math.nan,
    )
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
    """A planted ``step_*`` folder newer than the job's own, without checksums, is what ``resume=auto`` picks: the
    run stops with the refusal (exit 2) before training, and the payload never runs."""
    folder = tmp_path / "job"
    job = [*TINY, "trainer.max_steps=4", "checkpoint.every_steps=2", "logger=none", f"hydra.run.dir={folder}"]
    first = run_cli(*job, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    own = ck.latest(folder / ck.FOLDER)
    planted = own.with_name(ck.step_name(99))
    shutil.copytree(own, planted)
    marker = tmp_path / "pwned-resume"
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    # a copied sha256.json no longer matches and is refused first (tests/test_checkpoint_store.py); a planter
    # leaves it out, and a folder without one loads unchecked (an older runner's): the metadata check must hold
    (planted / ck.DIGEST_FILE).unlink(missing_ok=True)
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
    import it, even with the module allowed (``--allow-target my_data``: the user trusts *their* my_data): it says
    where the job ran from, and its rerun fails without running the payload."""
    ran_in, elsewhere = tmp_path / "ran_in", tmp_path / "elsewhere"
    ran_in.mkdir(), elsewhere.mkdir()
    (ran_in / "my_data.py").write_text(MY_DATA)
    job = ran_in / "job"
    first = run_cli(
        "data=custom",
        "data._target_=my_data.blobs",
        "model=mlp",
        "trainer.max_steps=6",
        "trainer.warmup_steps=1",
        "dataloader.batch_size=8",
        "trainer.progress=off",
        "logger=none",
        "trainer.log_every=1",
        f"hydra.run.dir={job}",
        cwd=ran_in,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "pwned-doctor"
    (ran_in / "my_data.py").write_text(f"open({str(marker)!r}, 'w')\n" + MY_DATA)
    proc = run_cli(
        str(job),
        "--verify",
        "--repeats",
        "1",
        "--top",
        "1",
        "--allow-target",
        "my_data",
        cwd=elsewhere,
        module="runner.doctor",
        timeout=600,
    )
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


# ------------------------------------------------------------------------------ a job folder read back: data only
#
# python -m runner.evaluate / runner.export / runner.doctor --verify rebuild a job from the config its folder saved.
# Each route below is a folder someone else wrote, run from the folder's parent as a user would; each must be
# refused before its payload runs (one error line, exit 2), and run when the user says so (--trust, --allow-target).


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory) -> Path:
    """A finished tiny job's folder (TINY: MnistCNN on synthetic 3x16x16 images, 4 steps), trained once."""
    root = tmp_path_factory.mktemp("trained")
    proc = run_cli(*TINY, "trainer.doctor=false", f"hydra.run.dir={root / 'job'}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "job"


def planted(finished_job: Path, parent: Path, model: dict | None = None, files: dict | None = None) -> Path:
    """A copy of the finished job as ``<parent>/run`` whose saved ``model`` node is ``model``, with ``files``
    (name -> bytes or text) planted inside it."""
    from omegaconf import OmegaConf

    folder = parent / "run"
    shutil.copytree(finished_job, folder, ignore=shutil.ignore_patterns("checkpoints"))
    if model is not None:
        saved = OmegaConf.load(folder / ".hydra" / "config.yaml")
        saved.model = model
        OmegaConf.save(saved, folder / ".hydra" / "config.yaml")
    for name, content in (files or {}).items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def read_back(module: str, parent: Path, *args: str, env: dict | None = None):
    """``python -m <module> run ...`` from the job folder's parent, where the user stands."""
    extra = ("--format", "torch") if module == "runner.export" else ()
    return run_cli("run", *extra, *args, cwd=parent, module=module, env=env, timeout=300)


def one_error_line(proc, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    )
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]}"
    return lines[0]


PAYLOAD_MODULE = """
import torch
open({marker!r}, "w").close()  # top-level code: runs when the module is imported


class Net(torch.nn.Module):
    def __init__(self, num_classes=10, in_channels=3):
        super().__init__()
        self.head = torch.nn.Linear(in_channels * 16 * 16, num_classes)

    def forward(self, x):
        return self.head(x.flatten(1))


def blobs(n=32):
    raise ValueError("the payload ran")
"""


@pytest.mark.cli
@pytest.mark.parametrize("module", ["runner.evaluate", "runner.export"])
@pytest.mark.parametrize("trusted", [False, True], ids=["refused", "trusted"])
def test_numpy_load_of_a_pickle_in_the_folder(finished_job, tmp_path, module, trusted):
    """``model._target_: numpy.load`` with ``allow_pickle`` on a pickle planted in the folder, its path through
    ``${oc.env:PWD}``: the target is refused before numpy is asked to load anything."""
    marker = tmp_path / "pwned-numpy"
    planted(
        finished_job,
        tmp_path,
        model={"_target_": "numpy.load", "file": "${oc.env:PWD}/run/w.npy", "allow_pickle": True},
        files={"w.npy": pickle.dumps(Payload(marker))},
    )
    proc = read_back(module, tmp_path, *(["--trust"] if trusted else []), env={"PWD": str(tmp_path)})
    if trusted:
        assert marker.exists(), proc.stderr[-3000:]  # the user trusted the folder: its config ran as written
        return
    assert not marker.exists(), "the pickle's payload ran"
    one_error_line(proc, "model._target_='numpy.load'", "--allow-target numpy.load", "--trust")


@pytest.mark.cli
@pytest.mark.parametrize(
    "allow", [[], ["--allow-target", "run.payload"], ["--trust"]], ids=["refused", "allowed", "trusted"]
)
def test_a_module_planted_in_the_folder_is_never_imported(finished_job, tmp_path, allow):
    """``model._target_: run.payload.Net`` with ``payload.py`` in the folder: from its parent, Python would import
    the folder as a namespace package and run the module's top-level code. Refused before any import."""
    marker = tmp_path / "pwned-module"
    planted(
        finished_job,
        tmp_path,
        model={"_target_": "run.payload.Net"},
        files={"payload.py": PAYLOAD_MODULE.format(marker=str(marker))},
    )
    proc = read_back("runner.evaluate", tmp_path, *allow)
    if allow:
        assert marker.exists(), proc.stderr[-3000:]
        return
    assert not marker.exists(), "the planted module was imported"
    one_error_line(proc, "model._target_='run.payload.Net'", ".hydra/config.yaml", "--allow-target run.payload")


@pytest.mark.cli
@pytest.mark.parametrize("trusted", [False, True], ids=["refused", "trusted"])
def test_builtins_open_never_truncates_a_file(finished_job, tmp_path, trusted):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    planted(finished_job, tmp_path, model={"_target_": "builtins.open", "file": str(victim), "mode": "w"})
    proc = read_back("runner.evaluate", tmp_path, *(["--trust"] if trusted else []))
    if trusted:
        assert victim.read_text() == "", proc.stderr[-3000:]
        return
    assert victim.read_text() == "precious\n", "the file was truncated"
    one_error_line(proc, "model._target_='builtins.open'")


@pytest.mark.cli
@pytest.mark.parametrize("trusted", [False, True], ids=["refused", "trusted"])
def test_pathlib_write_text_never_writes_a_file(finished_job, tmp_path, trusted):
    """``pathlib.Path.write_text`` on a ``pathlib.Path`` built by a nested ``_target_``: through export."""
    victim = tmp_path / "written.txt"
    planted(
        finished_job,
        tmp_path,
        model={
            "_target_": "pathlib.Path.write_text",
            "self": {"_target_": "pathlib.Path", "_args_": [str(victim)]},
            "data": "pwned",
        },
    )
    proc = read_back("runner.export", tmp_path, *(["--trust"] if trusted else []))
    if trusted:
        assert victim.read_text() == "pwned", proc.stderr[-3000:]
        return
    assert not victim.exists(), "the file was written"
    one_error_line(proc, "model._target_='pathlib.Path.write_text'")


@pytest.mark.cli
@pytest.mark.parametrize("trusted", [False, True], ids=["refused", "trusted"])
def test_the_doctor_never_imports_a_data_module_planted_in_the_folder(finished_job, tmp_path, trusted):
    """``doctor --verify`` reruns the job from its ``overrides.yaml``: ``data._target_=run.payload.blobs`` names a
    module inside the folder. Refused before anything is composed or run."""
    marker = tmp_path / "pwned-doctor-data"
    folder = planted(finished_job, tmp_path, files={"payload.py": PAYLOAD_MODULE.format(marker=str(marker))})
    overrides = folder / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text() + "- data=custom\n- data._target_=run.payload.blobs\n- model=mlp\n")
    proc = read_back(
        "runner.doctor",
        tmp_path,
        "--verify",
        "--repeats",
        "1",
        "--top",
        "1",
        "--steps",
        "2",
        *(["--trust"] if trusted else []),
    )
    if trusted:
        assert marker.exists(), proc.stderr[-3000:]
        return
    assert not marker.exists(), "the planted module was imported"
    one_error_line(proc, "data._target_='run.payload.blobs'", "overrides.yaml", "--allow-target run.payload")
    assert not (folder / "doctor-verify").exists()  # nothing ran, nothing was written


def test_the_policy_admits_runners_own_targets_and_no_path_around_them():
    """What runner's configs name passes; a path that leaves the allowed modules through an attribute, a method,
    an interpolation that reads the environment, a pkg:// search path or a hydra override does not."""
    from runner import trust

    policy = trust.Policy.make(environ={})
    for target in (
        "runner.models.MnistCNN",
        "runner.models.MLP",
        "runner.models.gpt.GPT",
        "runner.models.hf.causal_lm",
        "runner.task.Classification",
        "torchvision.models.resnet18",
        "torch.optim.SGD",
        "torch.nn.Linear",
        "timm.optim.Lamb",
        "transformers.GPT2LMHeadModel",
        "transformers.GPT2Config",
    ):
        trust.check_target("model._target_", target, policy, "config.yaml")
    for target, words in {
        "runner.models.torch.load": "defined in torch",
        "torchvision.models._api.load_state_dict_from_url": "defined in torch.hub",
        "transformers.AutoModelForCausalLM.from_pretrained": "not a transformers model or config",
        "torch.nn.Module.load_state_dict": "not a class",
        "torch.load": "not one of runner's own targets",
    }.items():
        with pytest.raises(ConfigError, match=re.escape(words)):
            trust.check_target("model._target_", target, policy, "config.yaml")
    with pytest.raises(ConfigError, match=r"model\.config\._target_='numpy\.load'"):  # nested targets count too
        trust.check_config(
            {"model": {"_target_": "runner.models.MLP", "config": {"_target_": "numpy.load"}}}, policy, "config.yaml"
        )
    allowed = trust.Policy.make(allow=["numpy"], environ={trust.ALLOW_ENV: "pathlib.Path"})
    for target in ("numpy.load", "pathlib.Path"):
        trust.check_target("model._target_", target, allowed, "config.yaml")
    trust.check_target("model._target_", "numpy.load", policy.naming(["numpy.load"]), "config.yaml")
    trust.check_interpolations(
        {
            "data": {
                "path": "${oc.env:RUNNER_DATA_ROOT,${runner_root:}/../shared}/t.txt",
                "block": "${oc.select:data.block_size,256}",
            }
        },
        policy,
        "config.yaml",
    )
    with pytest.raises(
        ConfigError, match=r"data\.root='\$\{oc\.env:HOME\}/x' in config\.yaml uses the resolver oc\.env:HOME"
    ):
        trust.check_interpolations({"data": {"root": "${oc.env:HOME}/x"}}, policy, "config.yaml")
    with pytest.raises(ConfigError, match="pkg://"):
        trust.check_searchpath(["pkg://run.payload"], policy, "hydra.yaml")
    with pytest.raises(ConfigError, match="Hydra's own settings"):
        trust.check_overrides(["hydra.searchpath=[pkg://run.payload]"], policy, "overrides.yaml")
    for call in (
        lambda: trust.check_target("model._target_", "torch.load", trust.Policy(trust=True), "c"),
        lambda: trust.check_interpolations({"a": "${oc.env:HOME}"}, trust.Policy(trust=True), "c"),
    ):
        call()  # --trust: as python -m runner


def test_links_planted_in_a_job_folder_are_replaced_never_written_through(tmp_path):
    """A copied job or sweep folder may hold links to files outside it: the summary's temporary file (the writer of
    summary.json and eval-*.json), the report's files and the job folder's lock are written as files of their own,
    and the files the links pointed at are left as they were."""
    from runner.engine import jobdir
    from runner.files import write_own
    from runner.report.write import write_csv
    from runner.track.records import write_json_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "job"
    folder.mkdir()
    for name in ("summary.json.tmp", "eval-final.json", "report.md", "report.csv", jobdir.LOCK_FILE):
        (folder / name).symlink_to(victim)
    write_json_atomic(folder / "summary.json", {"steps": 4})
    write_json_atomic(folder / "eval-final.json", {"eval_loss": 1.0})
    write_own(folder / "report.md", "# report\n")
    write_csv([], folder / "report.csv")
    assert jobdir.acquire(folder)
    jobdir.release(folder, taken=True)
    assert victim.read_text() == "precious\n"
    for name in ("summary.json", "eval-final.json", "report.md", "report.csv", jobdir.LOCK_FILE):
        assert (folder / name).is_file() and not (folder / name).is_symlink(), name
    assert not (folder / "summary.json.tmp").exists()


def test_a_folder_from_before_the_package_folders_names_the_same_objects():
    """Job folders and checkpoints written before runner's modules moved into their layer folders name the old
    paths (``runner.gpt.GPT``): reading them back renames them, so a resume or an evaluation accepts them as
    the same job; a path that only starts like one is left alone."""
    from omegaconf import OmegaConf

    from runner.checkpoint import resume

    old = {
        "model": {"_target_": "runner.gpt.GPT"},
        "callbacks": [{"_target_": "runner.jobdir.JobLock"}],
        "other": {"_target_": "runner.gptx.Model"},
    }
    assert trust.moved(OmegaConf.create(old)) == {
        "model": {"_target_": "runner.models.gpt.GPT"},
        "callbacks": [{"_target_": "runner.engine.jobdir.JobLock"}],
        "other": {"_target_": "runner.gptx.Model"},
    }
    assert old["model"]["_target_"] == "runner.gpt.GPT"  # a DictConfig copy was renamed, not this dict
    now = {"model": {"_target_": "runner.models.hf.causal_lm"}}
    assert resume.config_differences({"model": {"_target_": "runner.hf.causal_lm"}}, now) == []
    assert resume.config_differences({"model": {"_target_": "runner.models.MLP"}}, now)
