"""``trainer.host_allocator``: glibc's malloc keeps freed memory (runner/prepare.py), and the page faults the
engine records per step (summary.json ``machine_load.minor_page_faults_per_step``)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from conftest import run_tiny
from runner import prepare
from runner.errors import ConfigError

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

#: Buffers of 1, 2, ..., 12 MiB, each freed before the next: glibc's default maps each one afresh (every size
#: exceeds the threshold the last freed mapping raised it to), so each faults all its pages in; with ``reuse``
#: they come from the heap, which grows by the difference and keeps what was freed.
FAULTS = """
import json, resource, sys, torch
from runner import prepare
status, faults = prepare.apply_host_allocator(sys.argv[1]), []
for mib in range(1, 13):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(mib * 2**18).fill_(1)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([status, faults]))
"""


def page_faults(allocator: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", FAULTS, allocator], capture_output=True, text=True, check=True)
    status, faults = json.loads(out.stdout)
    return status, faults


@glibc_only
def test_reuse_serves_freed_memory_again_instead_of_fresh_pages():
    system_status, system = page_faults("system")
    reuse_status, reuse = page_faults("reuse")
    assert (system_status, reuse_status) == ("system", "reuse")
    pages = [mib * 256 for mib in range(1, 13)]  # 4 KiB pages per buffer
    # glibc's default: every buffer from the 4th on is faulted in whole (a fresh mapping)
    assert all(f >= p for f, p in zip(system[3:], pages[3:])), system
    # reuse: at most the heap's growth (1 MiB = 256 pages per buffer, in steps), never a whole buffer again
    assert sum(reuse[3:]) < sum(system[3:]) / 2 and max(reuse[3:]) <= 1100, reuse


def test_the_engine_records_its_allocator_and_page_faults_per_step(tmp_path):
    summary = run_tiny(tmp_path / "run")
    expected = "reuse" if platform.libc_ver()[0] == "glibc" and platform.system() == "Linux" else "system (reuse"
    assert summary["technique_details"]["host_allocator"].startswith(expected)
    faults = summary["machine_load"]["minor_page_faults_per_step"]
    assert faults is not None and faults >= 0


@glibc_only
def test_system_cannot_undo_reuse_in_the_same_process():
    prepare.apply_host_allocator("reuse")
    with pytest.raises(ConfigError, match=r"trainer.host_allocator=system: .*fresh process"):
        prepare.apply_host_allocator("system")
    with pytest.raises(ConfigError, match=r"trainer.host_allocator=heap is not one of reuse, system"):
        prepare.apply_host_allocator("heap")
