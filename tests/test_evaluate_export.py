"""``python -m runner.evaluate`` and ``python -m runner.export`` on a real finished job, through their command lines
run in this process (``main(argv)``; the ONNX export and a shadowed package in processes of their own).

One tiny job (synthetic 3x16x16 images, the MNIST CNN, 4 steps, its final evaluation over 2 batches) is trained
once for the session by ``python -m runner`` in this process; the tests evaluate and export its folder (or a copy
they change: other weights, a damaged file, no final weights) and check the figures and files against the trained
model, computed here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY, job_dirs, make_tiny_cifar, read_summary, run_cli, run_here
from runner import REPO_ROOT


@pytest.fixture(scope="module")
def job(tmp_path_factory, worker_id) -> Path:
    """A finished tiny job's folder (summary.json, model.safetensors, .hydra/), trained once per session:
    pytest-xdist workers share it through the session's base folder, the first one trains under a file lock (the
    pattern of pytest-xdist's docs; its xdist_group marks do not keep a module on one worker here)."""
    from filelock import FileLock

    if worker_id == "master":
        root = tmp_path_factory.mktemp("job")
        train_job(root)
    else:
        root = tmp_path_factory.getbasetemp().parent / "evaluate_export_job"
        with FileLock(f"{root}.lock"):
            if not root.is_dir():
                train_job(root)
    [folder] = job_dirs(root)
    assert (folder / "model.safetensors").is_file()
    return folder


def train_job(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    proc = run_here(*TINY, "trainer.doctor=false", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]


def copy_job(job: Path, dest: Path) -> Path:
    """The job folder's files that evaluate/export read (.hydra/, summary.json, weights) in ``dest``."""
    shutil.copytree(
        job, dest, ignore=shutil.ignore_patterns("checkpoints", "eval-*.json", "model.pt2", "model.onnx*", ".export-*")
    )
    return dest


def trained_model(folder: Path, weights: str = "model.safetensors") -> torch.nn.Module:
    """The job's model built here (TINY: MnistCNN, 3 channels, 10 classes) with its weights, in eval mode."""
    from runner.models import MnistCNN, load_weights

    return load_weights(MnistCNN(num_classes=10, in_channels=3), folder / weights).eval()


def written(folder: Path) -> set[str]:
    """Every file and folder under ``folder``, relative (what a failed command must leave unchanged)."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# ------------------------------------------------------------------------------ evaluate


def test_evaluate_reproduces_the_jobs_final_evaluation(job):
    """The same batches (trainer.eval_max_batches=2, the job's) give the figures summary.json holds."""
    proc = run_here(str(job), "trainer.eval_max_batches=2", cwd=job, module="runner.evaluate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((job / "eval-final.json").read_text())
    summary = read_summary(job)
    assert record["batches"] == 2 and record["weights"] == "final" and record["weights_file"] == "model.safetensors"
    digest = hashlib.sha256((job / "model.safetensors").read_bytes()).hexdigest()  # the run recorded what it wrote
    assert summary["weights_sha256"] == {"model.safetensors": digest} and record["weights_verified"] is True
    assert "unchecked" not in proc.stderr
    assert record["overrides"] == ["trainer.eval_max_batches=2"] and record["data"]["name"] == "synthetic"
    for key in ("eval_accuracy", "eval_loss"):
        assert record["metrics"][key] == pytest.approx(summary[key], rel=1e-6, abs=1e-7), key
        assert key in proc.stdout
    assert f"wrote {job / 'eval-final.json'}" in proc.stdout


def test_evaluate_other_weights_give_other_figures(job, tmp_path):
    """The check above can fail: the same evaluation of other weights (``--weights ema``: here the trained weights
    scaled by 0.5, in the file the EMA feature writes) does not reproduce the summary."""
    from safetensors.torch import load_file, save_file

    folder = copy_job(job, tmp_path / "job")
    state = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v * 0.5 if v.is_floating_point() else v for k, v in state.items()}, str(folder / "model_ema.safetensors")
    )
    proc = run_here(
        str(folder), "--weights", "ema", "trainer.eval_max_batches=2", cwd=tmp_path, module="runner.evaluate"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((folder / "eval-ema.json").read_text())
    assert record["weights_file"] == "model_ema.safetensors" and record["weights_verified"] is False
    assert "model_ema.safetensors has no SHA-256" in proc.stderr and "loaded unchecked" in proc.stderr  # said, once
    assert record["metrics"]["eval_loss"] != pytest.approx(read_summary(job)["eval_loss"], rel=1e-3)


def test_evaluate_on_another_dataset(job, tmp_path):
    """``data=cifar10 data.root=...``: the job's model on a CIFAR-10-format set (40 test images, batches of 16),
    whole (eval_max_batches defaults to null), the record in ``--out``."""
    cifar = make_tiny_cifar(tmp_path / "cifar")
    out = tmp_path / "cifar-eval.json"
    proc = run_here(
        str(job), "data=cifar10", f"data.root={cifar}", "--out", str(out), cwd=tmp_path, module="runner.evaluate"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["data"]["name"] == "cifar10" and record["data"]["root"] == str(cifar)
    assert record["batches"] == 3 and record["eval_max_batches"] is None and record["batch_size"] == 16
    assert 0 <= record["metrics"]["eval_accuracy"] <= 1 and record["metrics"]["eval_loss"] > 0
    assert "data=cifar10" in proc.stdout


# ------------------------------------------------------------------------------ export


def test_export_torch_runs_as_the_trained_model(job):
    proc = run_here(str(job), "--format", "torch", cwd=job, module="runner.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: torch.export.load" in proc.stdout and "batch dimension dynamic" in proc.stdout
    exported = torch.export.load(str(job / "model.pt2")).module()
    x = torch.randn(5, 3, 16, 16)  # another batch size than the example's 2: the batch dimension is dynamic
    with torch.no_grad():
        torch.testing.assert_close(exported(x), trained_model(job)(x), rtol=1e-5, atol=1e-6)
    assert not list(job.glob(".export-*/model.pt2"))  # the temporary folder is gone


@pytest.mark.slow  # the ONNX exporter and onnxruntime: ~15 s on 2 cores (`pytest -m slow` runs it)
def test_export_onnx_runs_in_onnxruntime(job):
    ort = pytest.importorskip("onnxruntime")
    proc = run_cli(str(job), "--format", "onnx", cwd=job, module="runner.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: onnxruntime (CPU) matches" in proc.stdout
    session = ort.InferenceSession(str(job / "model.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 16, 16)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), trained_model(job)(x), rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------ bad input


def _no_final_weights(job: Path, folder: Path) -> list[str]:
    """A job run with checkpoint.at_end=false: no model.safetensors, the setting in its config."""
    copy_job(job, folder)
    (folder / "model.safetensors").unlink()
    config = folder / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("at_end: true", "at_end: false"))
    return [str(folder)]


def _corrupt_weights(job: Path, folder: Path) -> list[str]:
    copy_job(job, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # a write cut short
    return [str(folder)]


def _garbled_weights(job: Path, folder: Path) -> list[str]:
    """One byte of a tensor changed in model.safetensors: the file still loads (format and size intact; without the
    checksum it evaluated with exit 0 and eval_loss 1e36), its numbers do not match what the run wrote."""
    copy_job(job, folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x7F  # inside the last tensor's data, past the JSON header
    weights.write_bytes(bytes(data))
    return [str(folder)]


BAD = {  # name: (module, arguments (job folder given), words the one error line must hold)
    "not a job folder": ("runner.evaluate", lambda job, f: [str(f.parents[1])], ["has no .hydra/config.yaml"]),
    "not a job folder (export)": (
        "runner.export",
        lambda job, f: [str(f.parents[1]), "--format", "torch"],
        ["has no .hydra/config.yaml"],
    ),
    "no final weights": (
        "runner.evaluate",
        _no_final_weights,
        ["model.safetensors does not exist", "checkpoint.at_end=false", "checkpoint.at_end=true"],
    ),
    "no ema weights": (
        "runner.evaluate",
        lambda job, f: [str(copy_job(job, f)), "--weights", "ema"],
        ["model_ema.safetensors does not exist", "trainer.ema_decay", "--weights final"],
    ),
    "unknown weights": (
        "runner.evaluate",
        lambda job, f: [str(copy_job(job, f)), "--weights", "last"],
        ["--weights last", "final, ema, best"],
    ),
    "corrupt weights": ("runner.evaluate", _corrupt_weights, ["cannot read", "model.safetensors", "corrupt"]),
    "garbled weights": (
        "runner.evaluate",
        _garbled_weights,
        ["model.safetensors", "modified or corrupted", "summary.json"],
    ),
    "garbled weights (export)": (
        "runner.export",
        lambda job, f: [*_garbled_weights(job, f), "--format", "torch"],
        ["model.safetensors", "modified or corrupted", "summary.json"],
    ),
    "unknown key": (
        "runner.evaluate",
        lambda job, f: [str(copy_job(job, f)), "trainer.eval_max_batchs=3"],
        ["trainer.eval_max_batchs", "did you mean trainer.eval_max_batches"],
    ),
    "unwritable --out": (
        "runner.evaluate",
        lambda job, f: [str(copy_job(job, f)), "--out", "/proc/x/eval.json"],
        ["--out /proc/x/eval.json: cannot write into /proc/x"],
    ),
    "unknown format": (
        "runner.export",
        lambda job, f: [str(copy_job(job, f)), "--format", "tflite"],
        ["--format tflite", "torch", "onnx"],
    ),
    "onnx extra missing": (
        "runner.export",
        lambda job, f: [str(copy_job(job, f)), "--format", "onnx"],
        ["pip install 'runner[onnx]'", "onnxscript"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line_and_writes_nothing(job, tmp_path, case):
    module, make, words = BAD[case]
    folder = tmp_path / "case" / "job"
    args = make(job, folder)
    env = None
    if case == "onnx extra missing":  # an onnxscript that cannot be imported, first on the path
        shadow = tmp_path / "shadow" / "onnxscript"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text("raise ImportError('onnxscript is not installed (simulated)')\n")
        env = {"PYTHONPATH": f"{shadow.parent}:{REPO_ROOT}"}
    before = written(folder) if folder.exists() else set()
    proc = (run_cli if env else run_here)(*args, cwd=tmp_path, module=module, env=env)
    assert proc.returncode == 2, f"{case}: exit {proc.returncode}\n{proc.stdout}{proc.stderr[-2000:]}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {proc.stderr[-2000:]}"
    for w in words:
        assert w in lines[0], f"{case}: {w!r} not in {lines[0]}"
    if folder.exists():
        assert written(folder) == before, f"{case}: files written: {written(folder) - before}"
