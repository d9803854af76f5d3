"""The compile cache that travels with the job (runner/techniques/compile_cache.py): a compiled job leaves
``compile_cache/`` in its folder, and a job resumed from it in a new process with an empty Inductor cache
(another node) loads it and compiles in a fraction of the first run's time; a planted or damaged cache is
never followed or trusted to load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY, read_summary
from runner.techniques import compile_cache


def test_no_cache_a_linked_or_a_damaged_one_leaves_the_compile_cold(tmp_path):
    assert compile_cache.load(tmp_path) == "cold"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "artifacts.bin").write_bytes(b"not a cache")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / compile_cache.FOLDER).symlink_to(outside)  # a link planted in a copied folder
    assert compile_cache.load(tmp_path / "job") == "cold"
    shutil.copytree(outside, tmp_path / "copy" / compile_cache.FOLDER)
    status = compile_cache.load(tmp_path / "copy")
    assert status.startswith("cold: ") and "did not load" in status


def test_nothing_compiled_writes_no_cache(tmp_path):
    compile_cache.save(tmp_path, is_main=False)
    assert not (tmp_path / compile_cache.FOLDER).exists()


def _job(folder, inductor, *overrides) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "runner", *TINY, "compile=default", "trainer.max_steps=6",
                           "trainer.eval_every=6", f"hydra.run.dir={folder}", *overrides], cwd=folder.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_summary(folder)


@pytest.mark.slow
def test_a_resume_on_a_fresh_node_loads_the_cache_from_the_job_folder(tmp_path):
    """The first run compiles cold (its own empty Inductor cache) and leaves compile_cache/; the resume, in a new
    process with another empty Inductor cache, loads it and compiles in under half the first run's seconds."""
    first = _job(tmp_path / "job", tmp_path / "inductor-a")
    assert first["one_time"]["compile_cache"] == "cold" and first["one_time"]["compile_s"] > 0
    assert (tmp_path / "job" / compile_cache.FOLDER / "artifacts.bin").stat().st_size > 0
    (checkpoint,) = (tmp_path / "job" / "checkpoints").glob("step_*")
    again = _job(tmp_path / "resumed", tmp_path / "inductor-b", "trainer.max_steps=9",
                 f"checkpoint.resume={checkpoint}")
    once = again["one_time"]
    assert once["compile_cache"].startswith("warm: loaded ") and again["steps"] == 9
    assert once["compile_s"] < 0.5 * first["one_time"]["compile_s"], (once, first["one_time"])
