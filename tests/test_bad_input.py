"""Bad input through the real CLI: non-zero exit, one message naming the key or path and the fix, no result.

Each case runs ``python -m runner`` in a fresh folder the way a user would (``HYDRA_FULL_ERROR`` unset),
then checks stderr and that no ``summary.json`` exists anywhere under ``outputs/``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, make_tiny_cifar, run_cli, run_here
from runner import REPO_ROOT

USER_ENV = {"HYDRA_FULL_ERROR": "0"}  # what a user sees: Hydra's compact messages, no stack trace


def run_bad(tmp_path: Path, *overrides: str):
    """Run the CLI with TINY + ``overrides`` in ``tmp_path/work``; assert the shared failure contract."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    proc = run_here(*TINY, *overrides, cwd=cwd, env=USER_ENV)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list((cwd / "outputs").rglob("summary.json")) == []
    if proc.returncode == 2:  # refused: no folder left behind
        assert not (cwd / "outputs").exists(), sorted(str(p) for p in (cwd / "outputs").rglob("*"))
    assert list(cwd.rglob("*.wandb")) == [] and not (cwd / "wandb").exists()
    return proc


def config_error(proc) -> str:
    """The single ``error: ...`` line a ConfigError prints (exit status 2)."""
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def only_line(proc) -> str:
    """stderr is exactly one ``error:`` line (exit status 2): no Hydra search path, no OmegaConf key dump."""
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    return config_error(proc)


def test_unknown_group_option_gets_did_you_mean(tmp_path):
    msg = only_line(run_bad(tmp_path, "model=resnet19"))
    assert msg.startswith("error: model=resnet19: no such option in group model; did you mean resnet18? (options: ")
    assert "mnist_cnn" in msg and "base_" not in msg


def test_lightning_s_precision_values_are_pointed_to_runner_s_options(tmp_path):
    msg = only_line(run_bad(tmp_path, "precision=16-mixed"))
    assert msg.startswith(
        "error: precision=16-mixed: no such option in group precision; Lightning's 16-mixed is "
        "runner's precision=amp (options: "
    ), msg


def test_unknown_option_of_an_added_group_names_what_was_typed(tmp_path):
    msg = only_line(run_bad(tmp_path, "+experiment=fsat"))
    assert msg.startswith("error: +experiment=fsat: no such option in group experiment; did you mean fast?")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimizer.lr=abc", "error: optimizer.lr=abc: expected a float (e.g. optimizer.lr=0.01)"),
        (
            "trainer.max_steps=ten",
            "error: trainer.max_steps=ten: expected an integer or null (e.g. trainer.max_steps=10)",
        ),
        (
            "dataloader.batch_size=abc",
            "error: dataloader.batch_size=abc: expected an integer (e.g. dataloader.batch_size=64)",
        ),
        (
            "trainer.deterministic=maybe",
            "error: trainer.deterministic=maybe: expected true or false (e.g. trainer.deterministic=false)",
        ),
        ("data.shape=abc", "error: data.shape=abc: expected a list of integers (e.g. data.shape=[3,32,32])"),
    ],
)
def test_wrong_value_type_is_one_line_with_the_type_and_an_example(tmp_path, override, expected):
    assert only_line(run_bad(tmp_path, override)) == expected


def test_misspelt_key(tmp_path):
    proc = run_bad(tmp_path, "trainer.max_step=3")  # runner's did-you-mean, not Hydra's "use +trainer.max_step"
    assert "error: trainer.max_step is not a setting runner reads" in proc.stderr and "+trainer" not in proc.stderr


def test_missing_cifar10_without_download(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = config_error(run_bad(tmp_path, "data=cifar10", f"data.root={empty}", "data.download=false"))
    assert str(empty / "cifar-10-batches-py") in msg
    assert "data.root" in msg and "data.download=true" in msg


def test_missing_mnist_without_download(tmp_path):
    msg = config_error(run_bad(tmp_path, "data=mnist", f"data.root={tmp_path / 'nowhere'}"))
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in msg
    assert "data.root" in msg and "data.download=true" in msg


def test_missing_imagefolder(tmp_path):
    msg = config_error(run_bad(tmp_path, "data=imagefolder", f"data.root={tmp_path / 'images'}"))
    assert str(tmp_path / "images" / "train") in msg and "data.root" in msg


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cifar10_batch(tmp_path, damage):
    root = make_tiny_cifar(tmp_path / "cifar")
    bad = root / "cifar-10-batches-py" / ("data_batch_3" if damage == "truncate" else "test_batch")
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:500])
    else:
        bad.write_bytes(b"this is not a pickle" * 10)
    msg = config_error(run_bad(tmp_path, "data=cifar10", f"data.root={root}"))
    assert f"corrupt dataset file {bad}:" in msg
    assert "fresh copy" in msg and "data.download=true" in msg


def test_corrupt_mnist_gz(tmp_path):
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"):  # the archives only, not extracted files
        shutil.copy(gz, raw)
    bad = raw / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:100])
    msg = config_error(run_bad(tmp_path, "data=mnist", f"data.root={tmp_path / 'mnist'}"))
    assert f"corrupt dataset file {bad}" in msg and "md5" in msg and "restore" in msg


def test_accumulate_steps_below_one(tmp_path):
    msg = config_error(run_bad(tmp_path, "memory=accumulate", "memory.accumulate_steps=0"))
    assert "memory.accumulate_steps=0" in msg and ">= 1" in msg


@pytest.mark.parametrize("size", ["0", "-8"])
def test_batch_size_not_positive(tmp_path, size):
    msg = config_error(run_bad(tmp_path, f"dataloader.batch_size={size}"))
    assert f"dataloader.batch_size={size}" in msg and ">= 1" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(tmp_path):
    msg = config_error(run_bad(tmp_path, "trainer.device=cuda"))
    assert "trainer.device=cuda" in msg and "trainer.device=auto" in msg and "trainer.device=cpu" in msg


def test_slurm_launcher_without_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"  # PATH with python only: no sbatch/srun, as on a laptop
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(Path(sys.executable))
    monkeypatch.setenv("PATH", str(bin_dir))
    msg = config_error(run_bad(tmp_path, "-m", "hydra/launcher=submitit_slurm"))
    assert "hydra/launcher=submitit_slurm" in msg and "sbatch" in msg and "drop hydra/launcher=submitit_slurm" in msg


# ------------------------------------------------------------------------------------------ the catalogue
# Each case: overrides (on TINY) -> the words its one message must contain. Run in-process (each case is a
# fresh train(); the CLI turns the same ConfigError into "error: ..." and exit 2, as the cases above show);
# nothing may be left in the job folder but what was there before.

CATALOGUE = {
    "added key nothing reads": (["+trainer.max_step=3"], ["trainer.max_step", "did you mean trainer.max_steps"]),
    "negative seed": (["trainer.seed=-1"], ["trainer.seed=-1", "2**32"]),
    "empty training set": (["data.train_size=0"], ["data.train_size=0", ">= 1"]),
    "no classes": (["data.num_classes=0"], ["data.num_classes=0", ">= 1"]),
    "empty evaluation": (["trainer.eval_max_batches=0"], ["trainer.eval_max_batches=0", "made-up"]),
    "unknown non-finite policy": (
        ["trainer.on_nonfinite=ignore"],
        ["trainer.on_nonfinite=ignore", "is not one of stop, skip"],
    ),
    "checkpoint every 0 steps": (["checkpoint.every_steps=0"], ["checkpoint.every_steps=0", ">= 1"]),
    "keep no checkpoint": (["checkpoint.keep_last=0"], ["checkpoint.keep_last=0", ">= 1"]),
    "negative minutes": (["checkpoint.every_minutes=-1"], ["checkpoint.every_minutes=-1", "> 0"]),
    "async not a boolean": (["checkpoint.async=maybe"], ["checkpoint.async='maybe'", "true or false"]),
    "unknown signal": (["checkpoint.signals=[SIGFOO]"], ["checkpoint.signals", "SIGFOO", "SIGTERM"]),
    "uncatchable signal": (["checkpoint.signals=[SIGKILL]"], ["SIGKILL", "can be caught"]),
    "unknown checkpoint key": (["+checkpoint.every_step=3"], ["checkpoint.every_step", "every_steps"]),
    "resume from nowhere": (["checkpoint.resume=/nowhere/step_00000001"], ["/nowhere/step_00000001", "does not exist"]),
    "a model that is no module": (
        ["model._target_=collections.OrderedDict"],
        ["model._target_", "not a torch nn.Module"],
    ),
    "input smaller than the model takes": (["data.shape=[1,1,1]"], ["does not take the data's inputs", "(1, 1, 1)"]),
    "negative workers": (["dataloader.num_workers=-1"], ["dataloader.num_workers=-1", ">= 0"]),
    "unknown device": (["trainer.device=tpu"], ["trainer.device=tpu", "is not one of auto, cpu, cuda"]),
    "no loss scale": (["precision=amp", "precision.init_scale=0"], ["precision.init_scale=0", "> 0"]),
    "warm-up longer than the run": (["scheduler=cosine", "scheduler.warmup_steps=10"], ["scheduler.warmup_steps=10"]),
    "checkpointing a class the model lacks": (
        ["memory=checkpointing", "memory.checkpoint_modules=[Foo]"],
        ["memory.checkpoint_modules", "Foo"],
    ),
    "nccl without CUDA": (
        ["distributed=ddp", "distributed.backend=nccl", "trainer.device=cpu"],
        ["distributed.backend=nccl", "gloo"],
    ),
    "unknown compile mode": (["compile.mode=fastest"], ["compile.mode", "fastest"]),
    "a text file that is not there": (
        ["data=text", "data.path=/nowhere.txt", "task=language_model", "model=gpt"],
        ["/nowhere.txt"],
    ),
    "language model on images": (["task=language_model"], ["task=language_model needs token data"]),
}


@pytest.mark.parametrize("case", list(CATALOGUE), ids=list(CATALOGUE))
def test_bad_input_catalogue(case, tmp_path):
    from conftest import compose_cfg
    from runner.engine.train import train
    from runner.errors import ConfigError

    overrides, words = CATALOGUE[case]
    job = tmp_path / "job"
    job.mkdir()
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg(*overrides), job_dir=job)
    message = str(caught.value)
    assert all(w in message for w in words), message
    assert "\n" not in message.strip()  # one message
    assert not (job / "summary.json").exists() and not list(job.rglob("*.partial"))


def _finished_job(tmp_path, *overrides: str):
    from conftest import compose_cfg
    from runner.engine.train import train

    job = tmp_path / "job"
    train(compose_cfg("trainer.max_steps=2", *overrides), job_dir=job)
    return job


@pytest.mark.parametrize("damage", ["garbage metadata", "truncated shard", "foreign model"])
def test_damaged_or_foreign_checkpoints_are_refused(tmp_path, damage):
    from conftest import compose_cfg
    from runner import checkpoint as ck
    from runner.engine.train import train
    from runner.errors import ConfigError

    job = _finished_job(tmp_path)
    (path,) = ck.complete_checkpoints(job / "checkpoints")
    overrides = [f"checkpoint.resume={path}", "trainer.max_steps=4"]
    if damage == "garbage metadata":
        (path / ".metadata").write_bytes(b"not a pickle")
    elif damage == "truncated shard":
        (shard,) = path.glob("*.distcp")
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        overrides.append("model=resnet18")
    with pytest.raises(ConfigError, match=f"cannot resume from {path}") as caught:
        train(compose_cfg(*overrides), job_dir=tmp_path / "other")
    assert "checkpoint.resume=never" in str(caught.value) or "model._target_" in str(caught.value)


def test_a_finished_folder_is_never_mixed_with_a_new_run(tmp_path):
    from conftest import compose_cfg
    from runner.engine.train import train
    from runner.errors import ConfigError

    job = _finished_job(tmp_path, "checkpoint.at_end=false")
    before = (job / "metrics.jsonl").read_text()
    for overrides, words in (
        (["checkpoint.resume=auto"], "holds a finished run"),
        (["checkpoint.resume=never"], "would mix a new run into it"),
    ):
        with pytest.raises(ConfigError, match=words):
            train(compose_cfg("trainer.max_steps=2", "checkpoint.at_end=false", *overrides), job_dir=job)
    assert (job / "metrics.jsonl").read_text() == before and (job / "summary.json").exists()


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model=hf_causal_lm"], "model=hf_causal_lm"),
        (
            ["model._target_=transformers.GPT2LMHeadModel", "model.config._target_=transformers.GPT2Config"],
            "model._target_='transformers.GPT2LMHeadModel'",
        ),
    ],
    ids=["hf_causal_lm", "_target_"],
)
def test_a_hugging_face_model_without_transformers(overrides, key, tiny_text, tmp_path, monkeypatch):
    from conftest import compose_cfg
    from runner.engine.train import train
    from runner.errors import ConfigError

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails, as when not installed
    cfg = compose_cfg("task=language_model", "data=text", f"data.path={tiny_text}", "data.block_size=16", *overrides)
    with pytest.raises(ConfigError) as caught:
        train(cfg, job_dir=tmp_path)
    message = str(caught.value)
    assert key in message and "needs the transformers package" in message and 'pip install -e ".[hf]"' in message
    assert not (tmp_path / "summary.json").exists()


# ----------------------------------------------------------------------------- divergence hidden by skipping
def one_nan_item(n_features: int = 8, nan_at: int = 5):
    """``data=custom``: 256 clean two-class rows but row ``nan_at``, whose features are NaN (one bad step)."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x, x_eval = torch.randn(256, n_features, generator=g), torch.randn(64, n_features, generator=g)
    x[nan_at] = float("nan")
    return TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(x_eval, (x_eval[:, 0] > 0).long())


def test_skip_stops_a_run_whose_steps_are_mostly_skipped(tmp_path):
    from conftest import compose_cfg
    from runner.engine.train import train
    from runner.errors import TrainingDiverged

    with pytest.raises(TrainingDiverged) as caught:
        train(
            compose_cfg(
                "optimizer.lr=1e10",
                "trainer.on_nonfinite=skip",
                "trainer.log_every=2",
                "trainer.max_steps=8",
                "checkpoint.at_end=false",
            ),
            job_dir=tmp_path,
        )
    message = str(caught.value)
    assert "were skipped (more than trainer.max_skipped_fraction=0.5" in message, message
    assert not (tmp_path / "summary.json").exists()


def test_skip_tolerates_a_rare_bad_step_and_shows_the_count(tmp_path, capsys):
    from conftest import TINY_LOOP, compose_cfg, read_summary
    from runner.engine.train import train

    cfg = compose_cfg(
        *TINY_LOOP,
        "data=custom",
        "data._target_=test_bad_input.one_nan_item",
        "model=mlp",
        "model.hidden=16",
        "trainer.on_nonfinite=skip",
        "trainer.log_every=8",
        "trainer.max_steps=16",
        "trainer.progress=lines",
        tiny=False,
    )
    train(cfg, job_dir=tmp_path)
    assert read_summary(tmp_path)["skipped_steps"] == 1
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("skipped_steps")]
    assert line.split()[-1] == "1"


# ----------------------------------------------------------------------------- resuming text on another file
@pytest.mark.parametrize("other", ["same size", "another size"])
def test_resuming_a_language_model_on_other_text_is_refused_naming_the_vocabulary(tmp_path, other):
    from conftest import TEXT, TINY_GPT, compose_cfg
    from runner.engine.train import train
    from runner.errors import ConfigError

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(TEXT * 20, encoding="utf-8")
    # the same number of distinct characters, but 'Q' instead of 'a' (ids shift); or one more character
    second.write_text((TEXT.replace("a", "Q") if other == "same size" else TEXT + "~") * 20, encoding="utf-8")
    sizes = len(set(first.read_text())), len(set(second.read_text()))
    assert (sizes[0] == sizes[1]) == (other == "same size")
    job = tmp_path / "job"
    train(compose_cfg(*TINY_GPT, f"data.path={first}", "trainer.max_steps=2", "checkpoint.every_steps=1"), job_dir=job)
    saved = (job / "vocab.json").read_text()
    (job / "summary.json").unlink()  # as if the run had been stopped after its checkpoint
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg(*TINY_GPT, f"data.path={second}", "trainer.max_steps=4"), job_dir=job)
    message = str(caught.value)
    assert f"data.path={second}" in message and "vocabulary" in message and "runner.json" in message
    assert "corrupt" not in message and "data.path" in message.split("Resume with", 1)[1]
    assert (job / "vocab.json").read_text() == saved  # not overwritten with the other text's


# ----------------------------------------------------------------------------- a misspelt key on the command line
@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.max_step=3", ["trainer.max_step is not a setting", "did you mean trainer.max_steps?"]),
        ("checkpoint.every_minute=3", ["did you mean checkpoint.every_minutes?"]),
        ("trainr.max_steps=3", ["trainr is not a setting", "did you mean trainer?"]),
        # Lightning's and the Hugging Face Trainer's names are pointed to runner's
        (
            "trainer.gradient_clip_val=1.0",
            ["trainer.gradient_clip_val", "runner's setting for it is optimizer.clip_grad_norm"],
        ),
        ("trainer.accumulate_grad_batches=4", ["runner's setting for it is memory.accumulate_steps"]),
        ("trainer.devices=2", ["torchrun --nproc-per-node=<N> -m runner distributed=ddp"]),
    ],
)
def test_a_misspelt_key_gets_runners_did_you_mean_not_hydras_plus_advice(tmp_path, override, words):
    proc = run_cli(*TINY, override, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(w in line for w in words), line
    assert "+" not in line and "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()


# ----------------------------------------------------------------------------- bad data found mid-training
class Rows(torch.utils.data.Dataset):
    """256 two-class rows of 8 features, made on demand; item ``bad`` is broken the way ``kind`` says."""

    num_classes = 2

    def __init__(self, n: int, bad: int | None = None, kind: str | None = None):
        self.n, self.bad, self.kind = n, bad, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        y = int(x[0] > 0)
        if i == self.bad:
            if self.kind == "label":
                return x, 7
            if self.kind == "shape":
                return torch.zeros(5), y
            raise OSError(f"cannot identify image file 'rows/{i}.png'")
        return x, y


def rows_with_a_bad_item(kind: str, bad: int = 200):
    """``data=custom``: a training set with one bad item deep in it, a clean evaluation set."""
    return Rows(256, bad, kind), Rows(64)


class TupleMLP(torch.nn.Module):
    """Returns ``(logits, features)``: not what a model may return."""

    def __init__(self, in_features: int = 8, num_classes: int = 2):
        super().__init__()
        self.fc = torch.nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.fc(x), x


@pytest.mark.parametrize(
    "kind, words",
    [
        ("label", ["training item 200", "class index 7", "data.num_classes"]),
        ("shape", ["training item 200", "shape (5,)", "(8,)"]),
        ("unreadable", ["training item 200", "cannot be loaded", "rows/200.png"]),
        ("tuple", ["not a logits tensor", "return the logits alone"]),
    ],
)
def test_bad_data_mid_training_is_one_message_naming_the_item(tmp_path, kind, words):
    from conftest import TINY_LOOP, compose_cfg
    from runner.engine.train import train
    from runner.errors import ConfigError

    model = ["model._target_=test_bad_input.TupleMLP"] if kind == "tuple" else ["model=mlp", "model.hidden=16"]
    cfg = compose_cfg(
        *TINY_LOOP,
        "data=custom",
        "data._target_=test_bad_input.rows_with_a_bad_item",
        f"data.kind={'label' if kind == 'tuple' else kind}",
        f"data.bad={-1 if kind == 'tuple' else 200}",
        *model,
        "trainer.max_steps=16",
        tiny=False,
    )
    with pytest.raises(ConfigError) as caught:
        train(cfg, job_dir=tmp_path)
    message = str(caught.value)
    assert all(w in message for w in words), message
    assert "\n" not in message and not (tmp_path / "summary.json").exists()


# ----------------------------------------------------------------------------- runner.log holds the run's log
@pytest.mark.slow
def test_runner_log_holds_the_console_the_summary_and_the_doctor_and_a_refused_run_leaves_no_folder(tmp_path):
    from conftest import job_dirs

    (tmp_path / "ok").mkdir()
    ok = run_cli(*TINY, "trainer.progress=lines", "trainer.max_steps=8", cwd=tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr[-2000:]
    (job,) = job_dirs(tmp_path / "ok")
    log = (job / "runner.log").read_text()
    assert "step 8/8" in log and f"summary ({job / 'summary.json'})" in log and "speed doctor" in log
    assert all(line in log for line in ok.stdout.splitlines() if line.strip())  # everything runner printed

    (tmp_path / "bad").mkdir()  # a refused run leaves no folder: its one line is on the console
    bad = run_cli(*TINY, "trainer.max_steps=0", cwd=tmp_path / "bad")
    assert bad.returncode == 2 and "error: trainer.max_steps=0 must be >= 1" in bad.stderr
    assert list((tmp_path / "bad").iterdir()) == []


@pytest.mark.parametrize("choice", ["optimizer=base_optimizer", "task=base_task", "scheduler=base_scheduler"])
@pytest.mark.slow  # CI budget (durations on 2 cores): `pytest -m slow` runs it
def test_a_schema_typed_as_an_option_is_one_error_line(choice, tmp_path):
    """Every ``base_<name>`` schema (not only the model's) typed as a group option stops before anything runs,
    with one error line naming it, instead of a MissingMandatoryValue traceback."""
    proc = run_cli(choice, "trainer.max_steps=2", "logger=none", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"error: {choice} is the schema" in proc.stderr, proc.stderr[-2000:]
