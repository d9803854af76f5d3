"""The console carries runner's lines, not other libraries' noise (runner.LIBRARY_NOISE), in real processes.

W&B's start-up lines are checked with the W&B run (tests/test_wandb.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from runner import REPO_ROOT

NOTE = "No CUDA runtime is found"


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.cli
@pytest.mark.skipif(
    torch.cuda.is_available() or not torch.version.cuda,
    reason="torch notes a missing CUDA runtime only with a CUDA build on a machine without a GPU",
)
def test_torchs_cuda_home_note_is_dropped_and_the_loggers_other_lines_kept(tmp_path):
    """``torch.utils.cpp_extension`` (imported whenever inductor compiles on a CPU) warns that it found no CUDA
    runtime when a CUDA toolkit folder exists; with runner imported, that line is gone and others still print."""
    env = {"CUDA_HOME": str(tmp_path)}  # a toolkit folder: the condition of torch's note
    plain = python("import torch.utils.cpp_extension", env)
    assert NOTE in plain.stderr, plain.stderr  # what a compiled CPU run printed before
    quiet = python(
        "import logging, runner, torch.utils.cpp_extension\n"
        "logging.getLogger('torch.utils.cpp_extension').warning('a line that stays')",
        env,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert NOTE not in quiet.stderr and "a line that stays" in quiet.stderr, quiet.stderr
