"""``trainer.host_allocator``: glibc's malloc keeps freed memory (runner/techniques/prepare.py), and the page faults the
engine records per step (summary.json ``machine_load.minor_page_faults_per_step``)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from conftest import run_tiny
from runner.errors import ConfigError
from runner.techniques import prepare

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

#: Buffers of 1, 2, ..., 12 MiB, each freed before the next. glibc's default serves each one from a fresh
#: mapping (every size exceeds the threshold the last freed mapping raised it to); with ``reuse`` they come from
#: the heap. What is asserted is where glibc put each buffer (``mallinfo2``'s ``hblkhd``: bytes in mmapped
#: chunks, read while the buffer lives, less before it), not a page-fault count, which the kernel does not
#: promise (transparent huge pages and fault-around map many pages per fault).
MAPPED = """
import ctypes, json, sys, torch
from runner.techniques import prepare

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
status, mapped = prepare.apply_host_allocator(sys.argv[1]), []
for mib in range(1, 13):
    before = libc.mallinfo2().hblkhd
    buffer = torch.empty(mib * 2**18).fill_(1)
    mapped.append(libc.mallinfo2().hblkhd - before)
    del buffer
print(json.dumps([status, mapped]))
"""


def mapped_bytes(allocator: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", MAPPED, allocator], capture_output=True, text=True, check=True)
    status, mapped = json.loads(out.stdout)
    return status, mapped


def has_mallinfo2() -> bool:
    import ctypes

    return platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc >= 2.33


@pytest.mark.cli
@pytest.mark.skipif(not has_mallinfo2(), reason="mallinfo2 is glibc's (2.33 and newer)")
def test_reuse_serves_freed_memory_from_the_heap_instead_of_fresh_mappings():
    system_status, system = mapped_bytes("system")
    reuse_status, reuse = mapped_bytes("reuse")
    assert (system_status, reuse_status) == ("system", "reuse")
    sizes = [mib * 2**20 for mib in range(1, 13)]
    # glibc's default: every buffer from the 4th on is a mapping of its own, at least its size (the first few may
    # fit under a threshold that imports already raised)
    assert all(m >= size for m, size in zip(system[3:], sizes[3:])), system
    # reuse: none is (the buffers come from the heap, which keeps what was freed)
    assert reuse == [0] * 12, reuse


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
